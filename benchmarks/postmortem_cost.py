"""The post-mortem's cost per rank, its main process's cost at many ranks, and the command's, on a run of
generate_run.py.

Per rank (CPU, one process, every rank of the run): nan-analyze's per-rank summary, `anomalies --top 10`'s
per-rank read, and one database's 41-step `family()` window. Then the main process of nan-analyze at
`--world` ranks: the run's real rank summaries repeated with new rank numbers (the all_reduce's group
renamed to all of them), pickled as the workers send them, unpickled and merged as `analyze` does.

    python benchmarks/postmortem_cost.py /tmp/r8 --first-step 700 --world 1024

`--repeat N` times `trainmon nan-analyze RUN --json` instead, N times (each after dropping the run from the page
cache with `--cold`): wall and CPU time (with its worker processes), peak memory, the machine's load average
at each start, and the answer, which every run must give alike.

    python benchmarks/postmortem_cost.py /tmp/r256 --repeat 3 --cold
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pickle
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from trainmon.analysis import nan_analyze
from trainmon.analysis.rank_summary import summarize_rank_dir
from trainmon.commands.anomalies import rank_top
from trainmon.read.layout import find_run
from trainmon.read.run import _db_columns

sys.path.insert(0, str(Path(__file__).resolve().parent))
from page_cache import evict  # noqa: E402


def per_rank(ranks, first_step: int) -> None:
    for name, work in [("nan-analyze summary", summarize_rank_dir),
                       ("anomalies --top 10", lambda d: rank_top((d, 10, None))),
                       ("family(), 41 steps", lambda d: _db_columns((d.db, "grad_reduced", first_step, first_step + 40)))]:
        work(ranks[0])  # warm: the page cache, the imports
        started = time.process_time()
        for rank_dir in ranks:
            work(rank_dir)
        print(f"{name}: {(time.process_time() - started) / len(ranks) * 1e3:.0f} ms CPU per rank ({len(ranks)} ranks)")


def main_process(path: str, ranks, world: int) -> None:
    base = [summarize_rank_dir(d) for d in ranks]
    group = f"[0-{len(base) - 1}]"

    def renamed(summary, rank):
        fix = lambda e: dataclasses.replace(e, rank=rank, module=e.module.replace(group, f"[0-{world - 1}]"))
        return dataclasses.replace(summary, rank=rank, firsts=[fix(e) for e in summary.firsts],
                                   comm=[fix(e) for e in summary.comm])

    # the origin rank stays the only one: the other copies are of a rank that received the Inf
    origin = next(s for s in base if s.firsts and s.firsts[0].phase == "forward")
    plain = next(s for s in base if s is not origin)
    blob = pickle.dumps([renamed(origin if r == origin.rank else plain, r) for r in range(world)])
    started = time.process_time()
    summaries = pickle.loads(blob)
    unpickled = time.process_time()
    nan_analyze._summaries = lambda *_: (path, {str(s.rank): s.sources for s in summaries}, [], summaries, None)
    result = nan_analyze.analyze(path)
    print(f"main process at {world} ranks: unpickling the summaries {unpickled - started:.1f} s, merging "
          f"{time.process_time() - unpickled:.1f} s CPU ({len(blob) / 1e6:.0f} MB pickled), peak RSS "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3:.0f} MB; first: rank {result['first']['rank']} "
          f"step {result['first']['step']} {result['first']['module']}, {len(result['chain'])} chain places, "
          f"{result['nonfinite_records']} non-finite records")


def command(path: str, repeat: int, cold: bool) -> dict:
    walls, cpus, loads, answers = [], [], [], set()
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / "report.json"
        for _ in range(repeat):
            if cold:
                evict(Path(path))
            loads.append(os.getloadavg()[0])
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            started = time.perf_counter()
            done = subprocess.run([sys.executable, "-m", "trainmon.cli", "nan-analyze", path, "--json", "--quiet",
                                   "-o", str(report)], capture_output=True, text=True)
            walls.append(time.perf_counter() - started)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            assert done.returncode in (0, 1), done.stderr  # 1: non-finite values found
            cpus.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
            answers.add(report.read_text())
    assert len(answers) == 1, "the runs gave different answers"
    result = json.loads(answers.pop())
    first = result["first"]
    return {"ranks": len(result["ranks"]), "cold": cold, "wall_s": round(statistics.median(walls), 1),
            "wall_s_each": [round(w, 1) for w in walls], "cpu_s": round(statistics.median(cpus), 1),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024),
            "load_average_at_starts": loads, "nonfinite_records": result["nonfinite_records"],
            "first": f"rank {first['rank']} step {first['step']} {first['module']} {first['phase']} {first['tensor']}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", help="a run of generate_run.py")
    parser.add_argument("--first-step", type=int, default=700, help="the family() window's first step")
    parser.add_argument("--world", type=int, default=1024, help="ranks of the main process's merge")
    parser.add_argument("--repeat", type=int, default=0, metavar="N", help="time the command N times instead")
    parser.add_argument("--cold", action="store_true", help="with --repeat: drop the run from the page cache first")
    args = parser.parse_args()
    if args.repeat:
        print(json.dumps(command(args.run, args.repeat, args.cold)))
        return
    ranks = find_run(args.run).ranks
    per_rank(ranks, args.first_step)
    main_process(args.run, ranks, args.world)


if __name__ == "__main__":
    main()
