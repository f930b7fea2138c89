"""Costs of `trainmon watch`: `--once` over a generated run, and a live run of ranks committing steps.

    python benchmarks/watch.py once OUT --ranks 16 --steps 1000       # writes OUT with generate_run.py first
    python benchmarks/watch.py once RUN --repeat 3 [--cold]             # an existing run (generate_run.py's)
    python benchmarks/watch.py live OUT --ranks 8 --steps 120 --step-seconds 0.5 --interval 1
    python benchmarks/watch.py live OUT --ranks 8 --records-from RUN/rank_0/monitor.db   # a model's records

`once`: wall and CPU time, peak memory of `trainmon watch RUN --once` (which draws the heatmaps once, at the end);
the median of `--repeat` runs, each after dropping the run from the page cache with `--cold`.
`live`: N writer processes commit generate_run.py's 66 records per step (or the records of one step of a
real run, `--records-from`: e.g. the 498 of the benchmark model's full tier, written by
`overhead.py --tiers full --format db`) to their monitor.db every `--step-seconds`; the daemon follows them. Reported: its lag behind the newest committed step (in
steps and in intervals, sampled every 0.1 s), its CPU time per step while it follows them (its main
process), and its CPU time in all (start, export, heatmaps drawn in its worker process, the last round).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from page_cache import evict  # noqa: E402

ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def once(args) -> dict:
    run = Path(args.out)
    if not run.exists():
        started = time.perf_counter()
        subprocess.run([sys.executable, str(HERE / "generate_run.py"), str(run), "--ranks", str(args.ranks),
                        "--steps", str(args.steps)], check=True, env=ENV)
        print(f"generated in {time.perf_counter() - started:.0f} s", flush=True)
    logdir = run.parent / f"{run.name}-watch"
    walls, cpus, loads = [], [], []
    for _ in range(args.repeat):
        subprocess.run(["rm", "-rf", str(logdir)], check=True)
        if args.cold:
            evict(run)
        loads.append(os.getloadavg()[0])
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "trainmon.cli", "watch", str(run), "--once", "--logdir",
                               str(logdir)], env=ENV, capture_output=True, text=True)
        walls.append(time.perf_counter() - started)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        assert done.returncode == 0, done.stderr
        cpus.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
    events = sum(p.stat().st_size for p in logdir.rglob("events.out.tfevents.*"))
    return {"ranks": len(list(run.glob("rank_*"))), "cold": args.cold, "wall_s": round(statistics.median(walls), 1),
            "wall_s_each": [round(w, 1) for w in walls], "cpu_s": round(statistics.median(cpus), 1),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024),
            "events_mb": round(events / 2 ** 20, 1), "load_average_at_starts": loads}


def _recorded_step(path: str) -> tuple:
    """(keys, ops, values) of the last step of a rank's monitor.db, e.g. one `overhead.py --format db` wrote."""
    import numpy as np

    from trainmon.core.records import RecordKey
    from trainmon.read.database import DbRankReader
    from trainmon.read.db_columns import RAW_PREFIX
    from trainmon.writers import db_schema
    reader = DbRankReader(Path(path))
    try:
        last = max(reader.steps())
        columns = reader.columns(None, last, last)
    finally:
        reader.close()
    rows = columns.rows
    keys = [RecordKey(*columns.tags[tag][:3], None if micro == db_schema.NO_MICRO_STEP else int(micro), int(call),
                      tuple(columns.tag_info[tag][0]), columns.tag_info[tag][1])
            for tag, micro, call in zip(columns.tag_at.tolist(), rows["micro_step"].tolist(),
                                        rows["call_index"].tolist())]
    values = np.stack([rows[RAW_PREFIX + f] for f in db_schema.FIELDS], axis=1)
    return keys, reader.ops, values


def _writer(job) -> None:
    run, rank, world, steps, pause, records_from = job
    import numpy as np

    from generate_run import SHAPE, _keys
    from trainmon.core.layout import DB_NAME, WRITER_REPORT
    from trainmon.writers import db_schema
    from trainmon.writers.db_sink import MonitorDb
    rank_dir = Path(run) / f"rank_{rank}"
    rank_dir.mkdir(parents=True, exist_ok=True)
    (rank_dir / "run.json").write_text(json.dumps({"rank": rank, "pp_stage": 0}))
    if records_from:
        keys, ops, values = _recorded_step(records_from)
    else:
        keys, ops = _keys(world), ["min", "max", "norm", "mean", "nans", "infs"]
        base = {"count": float(np.prod(SHAPE)), "sumsq": float(np.prod(SHAPE)), "min": -1.0, "max": 1.0}
        values = np.tile([base.get(f, 0.0) for f in db_schema.FIELDS], (len(keys), 1))
    db = MonitorDb(rank_dir / DB_NAME)
    db.set_meta({"schema_version": db_schema.SCHEMA_VERSION, "rank": rank, "ops": ops,
                 "fields": list(db_schema.FIELDS)})
    rng = np.random.default_rng(rank)
    start = time.monotonic()
    for step in range(steps):
        values[:, db_schema.FIELDS.index("sum")] = rng.normal(size=len(keys))
        db.add_step(step, 0, keys, values, {"loss": 1.0})
        (rank_dir / "committed").write_text(str(step))
        time.sleep(max(0.0, start + (step + 1) * pause - time.monotonic()))
    db.close()
    meta = json.loads((rank_dir / "run.json").read_text())
    (rank_dir / "run.json").write_text(json.dumps({**meta, WRITER_REPORT: {"written_steps": steps}}))


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def live(args) -> dict:
    run = Path(args.out)
    subprocess.run(["rm", "-rf", str(run)], check=True)
    run.mkdir(parents=True)
    for rank in range(args.ranks):
        (run / f"rank_{rank}").mkdir()
    daemon = subprocess.Popen([sys.executable, "-m", "trainmon.cli", "watch", str(run), "--interval",
                               str(args.interval), "--heatmap-every", str(args.heatmap_every), "--until-done"],
                              env=ENV, stderr=subprocess.DEVNULL)
    time.sleep(5)  # the daemon's start (imports), so the lag figures are those of a running daemon
    cpu_start = _cpu_s(daemon.pid)
    jobs = [(str(run), rank, args.ranks, args.steps, args.step_seconds, args.records_from) for rank in range(args.ranks)]
    pool = multiprocessing.get_context("fork").Pool(args.ranks)
    pending = pool.map_async(_writer, jobs)
    state = run / "watch" / "watch_state.json"
    lags = []
    while not pending.ready():
        time.sleep(0.1)
        try:
            newest = min(int((run / f"rank_{r}" / "committed").read_text()) for r in range(args.ranks))
            exported = json.loads(state.read_text())["exported"]
        except (OSError, ValueError):
            continue
        lags.append(newest - exported)
    pending.get()
    pool.close()
    pool.join()
    cpu_end = _cpu_s(daemon.pid)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    daemon.wait(timeout=600)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # the daemon's whole life, its painter process too
    steady = lags[len(lags) // 5:]  # after the first fifth: the daemon has caught up with its start
    step_lag = sorted(steady)
    return {"ranks": args.ranks, "records": args.records_from or "generate_run.py", "steps": args.steps,
            "step_s": args.step_seconds, "interval_s": args.interval,
            "lag_steps_median": step_lag[len(step_lag) // 2], "lag_steps_p95": step_lag[len(step_lag) * 95 // 100],
            "lag_steps_max": step_lag[-1],
            "lag_intervals_max": round(step_lag[-1] * args.step_seconds / args.interval, 2),
            "daemon_cpu_ms_per_step": round(1000 * (cpu_end - cpu_start) / args.steps, 1),
            "daemon_total_cpu_s": round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["once", "live"])
    parser.add_argument("out", help="the run directory (generated when missing, for once; rewritten, for live)")
    parser.add_argument("--ranks", type=int, default=16)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=1, help="once: times to run it (the median is reported)")
    parser.add_argument("--cold", action="store_true", help="once: drop the run from the page cache before each")
    parser.add_argument("--step-seconds", type=float, default=0.5, help="live: a rank commits a step this often")
    parser.add_argument("--interval", type=float, default=1.0, help="live: the daemon's --interval")
    parser.add_argument("--heatmap-every", type=int, default=50, help="live: the daemon's --heatmap-every")
    parser.add_argument("--records-from", metavar="DB",
                        help="live: every rank commits the records of this monitor.db's last step (default: "
                             "generate_run.py's 66 records)")
    args = parser.parse_args()
    print(json.dumps(once(args) if args.mode == "once" else live(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
