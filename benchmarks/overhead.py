"""Overhead of trainmon on the benchmark model, as ratios against the same run without monitoring.

Model: 4-layer causal LM, hidden 256, seq 128, batch 8, vocab 1024, AdamW, fp32, one thread. `--model small`:
hidden 64, seq 64, batch 4, 4 micro-batches per step, the shape of the small framework jobs
(`frameworks.py`'s `-small` jobs) without a framework: a hooked call is cheap for the model there.
Each tier runs in its own process (so peak RSS is its own); per-step process CPU time (all threads,
the writer's included) and wall time are medians over the steps after warm-up, once the statistic kernels
have compiled (a few seconds into a run). `stats` is the median training-thread CPU time per collected
step spent in the statistic engine (`stats.tensor_records`).

    python benchmarks/overhead.py                      # all tiers, csv
    python benchmarks/overhead.py --tiers none,full --format csv,api --steps 30
    python benchmarks/overhead.py --tiers none,full --sinks "api;csv;tensorboard;db;csv,tensorboard,db"
    python benchmarks/overhead.py --model small --tiers none,full --format api --steps 60 --interleave 2

`--sinks` runs the tiers once per format set and compares each with the `api` set (in-memory only):
the cost of a sink is the writer thread's CPU time plus any wait when its queue is full. Disk per
step is split by sink (CSV files, event files, monitor.db with its WAL).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

OPS = ["min", "max", "norm", "zeros", "nans", "mean"]
# TinyGPT's shape, the batch of a micro-batch, and the micro-batches per optimizer step
MODELS = {"benchmark": {"hidden": 256, "seq": 128, "batch": 8, "micro_batches": 1},
          "small": {"hidden": 64, "seq": 64, "batch": 4, "micro_batches": 4}}
TIERS = {
    "none": None,
    "wg": {"wg_distribution": True},
    "wg+xy": {"wg_distribution": True, "xy_distribution": True, "all_xy": True},
    "full": {"wg_distribution": True, "xy_distribution": True, "all_xy": True, "mv_distribution": True,
             "param_distribution": True},
    # the NaN sentinel alone: probes on every module output/grad, weight grad and update; no statistics
    "sentinel": {"sentinel": True},
}


def tier_config(tier: str, formats: list[str], extra: dict | None = None, interleave: int = 1,
                tiers: dict | None = None) -> dict | None:
    """The trainmon config of a tier of `tiers` (default TIERS), None for `none` with no extra keys.

    Every benchmark builds its configs here, so a tier means the same thing in all of them.
    """
    keys = (tiers or TIERS)[tier]
    if keys is None and not extra:
        return None
    return {"targets": {}, "ops": OPS, "format": formats, **(keys or {}), **(extra or {}), "step_interval": interleave}


def attach_monitor(config: dict | None, out_dir: str, model, optimizer):
    """A TrainerMon with `config` (written to `out_dir`) on `model` and `optimizer`; None when config is None."""
    from trainmon import TrainerMon

    if config is None:
        return None
    path = os.path.join(out_dir, "config.json")
    with open(path, "w") as f:
        json.dump(config, f)
    return TrainerMon(path).set_monitor(model, optimizer=optimizer)


def run_tier(tier: str, formats: list[str], steps: int, warmup: int, extra: dict, interleave: int = 1,
             model_name: str = "benchmark") -> dict:
    """Trains in this process and returns the medians (the child side).

    With `interleave` k > 1 the monitor collects every k-th step only, and the collected steps are
    compared with the idle ones of the same process: a ratio free of the drift between processes.
    """
    import torch

    from trainmon.demo import TinyGPT, lm_loss, synthetic_batch
    from trainmon.core.layout import WRITER_REPORT
    from trainmon.engine import stat_kernels

    torch.set_num_threads(1)
    torch.manual_seed(0)
    shape = MODELS[model_name]
    micro_batches = shape["micro_batches"]
    model = TinyGPT(vocab=1024, hidden=shape["hidden"], layers=4, heads=4, seq=shape["seq"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1)
    out_dir = tempfile.mkdtemp(prefix="trainmon_bench_")
    os.environ["MONITOR_OUTPUT_DIR"] = out_dir
    monitor = attach_monitor(tier_config(tier, formats, extra, interleave), out_dir, model, optimizer)
    sink_cpu = time_sinks(monitor) if monitor is not None else {}
    in_stats = time_statistics()
    cpu, wall, train_cpu, stats_cpu = [], [], [], []
    for i in range(warmup + steps * interleave):
        if i == warmup:
            stat_kernels.settle()            # no compile for later runs competes with the timed steps
        batches = [synthetic_batch(gen, shape["batch"], shape["seq"], 1024) for _ in range(micro_batches)]
        c0, w0, t0, s0 = time.process_time(), time.perf_counter(), time.thread_time(), in_stats[0]
        for tokens, labels in batches:
            (lm_loss(model, tokens, labels) / micro_batches).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
        train_cpu.append(time.thread_time() - t0)
        stats_cpu.append(in_stats[0] - s0)
    flush_start = time.perf_counter()
    if monitor is not None:
        monitor.stop()
    flush = time.perf_counter() - flush_start
    disk = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(out_dir) for f in fs)
    writer = {}
    if monitor is not None:
        with open(monitor.output_dir / "run.json") as f:
            writer = json.load(f).get(WRITER_REPORT, {})
    collected_steps = [i for i in range(warmup, len(cpu)) if i % interleave == 0]
    collected = [cpu[i] for i in collected_steps]
    idle = [c for i, c in enumerate(cpu) if i >= warmup and i % interleave != 0]
    return {"tier": tier, "formats": formats, "cpu_s": statistics.median(collected),
            "idle_cpu_s": statistics.median(idle) if idle else None,
            "train_thread_cpu_s": statistics.median(train_cpu[i] for i in collected_steps),
            "stats_cpu_s": statistics.median(stats_cpu[i] for i in collected_steps),
            "sink_cpu_s": {name: sum(t) / len(t) for name, t in sink_cpu.items() if t},
            "disk_by_sink": {sink: size / (warmup + steps) for sink, size in disk_by_sink(out_dir).items()},
            "blocked_s": writer.get("blocked_seconds", 0.0),
            "wall_s": statistics.median(wall[i] for i in collected_steps), "peak_rss_mb": resource.getrusage(
                resource.RUSAGE_SELF).ru_maxrss / 1024, "flush_at_stop_s": flush,
            "disk_bytes_per_step": disk / (warmup + steps)}


def time_statistics() -> list:
    """Wraps the statistic engine: its training-thread CPU time adds up in the returned one-item list."""
    from trainmon.engine import stats

    spent = [0.0]
    engine = stats.tensor_records

    def timed(*args, **kwargs):
        start = time.thread_time()
        try:
            return engine(*args, **kwargs)
        finally:
            spent[0] += time.thread_time() - start
    stats.tensor_records = timed
    return spent


def time_sinks(monitor) -> dict:
    """{sink: [writer-thread CPU seconds of each write]}: the cost of a sink, unaffected by other processes."""
    spent: dict = {}
    for sink in monitor._writer.sink.sinks:
        def timed(batch, write=sink.write, times=spent.setdefault(sink.name, [])):
            start = time.thread_time()
            write(batch)
            times.append(time.thread_time() - start)
        sink.write = timed
    return spent


def disk_by_sink(out_dir: str) -> dict:
    """Bytes on disk per sink, told apart by file name."""
    sizes = {"csv": 0, "tensorboard": 0, "db": 0}
    for d, _, files in os.walk(out_dir):
        for name in files:
            sink = ("csv" if name.endswith(".csv") else "tensorboard" if name.startswith("events.out.tfevents")
                    else "db" if name.startswith("monitor.db") or name == "records.stream" else None)
            if sink:
                sizes[sink] += os.path.getsize(os.path.join(d, name))
    return {sink: size for sink, size in sizes.items() if size}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiers", default=",".join(TIERS))
    parser.add_argument("--model", choices=sorted(MODELS), default="benchmark")
    parser.add_argument("--format", default="csv", help="comma-separated formats for the monitored tiers")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--extra", default="{}", help="JSON merged into every monitored config")
    parser.add_argument("--sinks", help='format sets to compare, ";"-separated, e.g. "api;csv;db" (overrides --format)')
    parser.add_argument("--interleave", type=int, default=1,
                        help="collect every k-th step and also report collected/idle steps of the same process")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    formats = args.format.split(",")
    if args.child:
        print(json.dumps(run_tier(args.child, formats, args.steps, args.warmup, json.loads(args.extra),
                                  args.interleave, args.model)))
        return 0
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    format_sets = args.sinks.split(";") if args.sinks else [args.format]
    runs = [(tier, fmt) for tier in args.tiers.split(",")
            for fmt in (format_sets[:1] if tier == "none" else format_sets)]
    results = []
    for tier, fmt in runs:
        out = subprocess.run([sys.executable, __file__, "--child", tier, "--format", fmt,
                              "--steps", str(args.steps), "--warmup", str(args.warmup), "--extra", args.extra,
                              "--interleave", str(args.interleave), "--model", args.model],
                             check=True, capture_output=True, text=True, env=env)
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    if args.sinks:
        print_sink_table(results)
        return 0
    base = next((r for r in results if r["tier"] == "none"), None)
    print(f"{'tier':8} {'cpu/step':>9} {'wall/step':>9} {'cpu×':>6} {'wall×':>6} {'in-run×':>7} {'stats':>8} "
          f"{'rss MB':>7} {'disk/step':>10}")
    for r in results:
        cpu_ratio = r["cpu_s"] / base["cpu_s"] if base else float("nan")
        wall_ratio = r["wall_s"] / base["wall_s"] if base else float("nan")
        in_run = f"{r['cpu_s'] / r['idle_cpu_s']:7.3f}" if r.get("idle_cpu_s") else f"{'-':>7}"
        print(f"{r['tier']:8} {r['cpu_s']*1e3:8.1f}ms {r['wall_s']*1e3:8.1f}ms {cpu_ratio:6.3f} {wall_ratio:6.3f} "
              f"{in_run} {r['stats_cpu_s']*1e3:6.1f}ms {r['peak_rss_mb']:7.0f} {r['disk_bytes_per_step']/1024:8.1f}KB")
    return 0


def print_sink_table(results: list[dict]) -> None:
    """One line per (tier, format set): step times, ratios against the same tier with `api`, disk by sink."""
    api = {r["tier"]: r for r in results if r["formats"] == ["api"]}
    print(f"{'tier':6} {'format':22} {'cpu/step':>9} {'train':>8} {'wall/step':>9} {'cpu/api':>7} {'wall/api':>8} "
          f"{'blocked':>8}  writer CPU and disk per step, by sink")
    for r in results:
        ref = api.get(r["tier"])
        ratio = (lambda key: f"{r[key] / ref[key]:.3f}") if ref else (lambda key: "-")
        disk = ", ".join(f"{sink} {r['sink_cpu_s'].get(sink, 0) * 1e3:.1f}ms {size / 1024:.1f}KB"
                         for sink, size in r["disk_by_sink"].items()) or "-"
        formats = "-" if r["tier"] == "none" else ",".join(r["formats"])
        print(f"{r['tier']:6} {formats:22} {r['cpu_s']*1e3:8.1f}ms {r['train_thread_cpu_s']*1e3:6.1f}ms "
              f"{r['wall_s']*1e3:8.1f}ms "
              f"{ratio('cpu_s'):>7} {ratio('wall_s'):>8} {r['blocked_s']:7.2f}s {disk}")


if __name__ == "__main__":
    sys.exit(main())
