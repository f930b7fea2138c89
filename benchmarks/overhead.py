"""Overhead of trainmon on the benchmark model, as ratios against the same run without monitoring.

Model: 4-layer causal LM, hidden 256, seq 128, batch 8, vocab 1024, AdamW, fp32, one thread.
Each tier runs in its own process (so peak RSS is its own); per-step process CPU time (all threads,
the writer's included) and wall time are medians over the steps after warm-up.

    python benchmarks/overhead.py                      # all tiers, csv
    python benchmarks/overhead.py --tiers none,full --format csv,api --steps 30
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
TIERS = {
    "none": None,
    "wg": {"wg_distribution": True},
    "wg+xy": {"wg_distribution": True, "xy_distribution": True, "all_xy": True},
    "full": {"wg_distribution": True, "xy_distribution": True, "all_xy": True, "mv_distribution": True,
             "param_distribution": True},
}


def run_tier(tier: str, formats: list[str], steps: int, warmup: int, extra: dict) -> dict:
    """Trains in this process and returns the medians (the child side)."""
    import torch

    from trainmon import TrainerMon
    from trainmon.demo import TinyGPT, lm_loss, synthetic_batch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = TinyGPT(vocab=1024, hidden=256, layers=4, heads=4, seq=128)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1)
    monitor = None
    out_dir = tempfile.mkdtemp(prefix="trainmon_bench_")
    os.environ["MONITOR_OUTPUT_DIR"] = out_dir
    if TIERS[tier] is not None or extra:
        config = {"targets": {}, "ops": OPS, "format": formats, **(TIERS[tier] or {}), **extra}
        path = os.path.join(out_dir, "config.json")
        with open(path, "w") as f:
            json.dump(config, f)
        monitor = TrainerMon(path)
        monitor.set_monitor(model, optimizer=optimizer)
    cpu, wall = [], []
    for _ in range(warmup + steps):
        tokens, labels = synthetic_batch(gen, 8, 128, 1024)
        c0, w0 = time.process_time(), time.perf_counter()
        lm_loss(model, tokens, labels).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
    flush_start = time.perf_counter()
    if monitor is not None:
        monitor.stop()
    flush = time.perf_counter() - flush_start
    disk = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(out_dir) for f in fs)
    return {"tier": tier, "formats": formats, "cpu_s": statistics.median(cpu[warmup:]),
            "wall_s": statistics.median(wall[warmup:]), "peak_rss_mb": resource.getrusage(
                resource.RUSAGE_SELF).ru_maxrss / 1024, "flush_at_stop_s": flush,
            "disk_bytes_per_step": disk / (warmup + steps)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiers", default=",".join(TIERS))
    parser.add_argument("--format", default="csv", help="comma-separated formats for the monitored tiers")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--extra", default="{}", help="JSON merged into every monitored config")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    formats = args.format.split(",")
    if args.child:
        print(json.dumps(run_tier(args.child, formats, args.steps, args.warmup, json.loads(args.extra))))
        return 0
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    results = []
    for tier in args.tiers.split(","):
        out = subprocess.run([sys.executable, __file__, "--child", tier, "--format", args.format,
                              "--steps", str(args.steps), "--warmup", str(args.warmup), "--extra", args.extra],
                             check=True, capture_output=True, text=True, env=env)
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    base = next((r for r in results if r["tier"] == "none"), None)
    print(f"{'tier':8} {'cpu/step':>9} {'wall/step':>9} {'cpu×':>6} {'wall×':>6} {'rss MB':>7} {'disk/step':>10}")
    for r in results:
        cpu_ratio = r["cpu_s"] / base["cpu_s"] if base else float("nan")
        wall_ratio = r["wall_s"] / base["wall_s"] if base else float("nan")
        print(f"{r['tier']:8} {r['cpu_s']*1e3:8.1f}ms {r['wall_s']*1e3:8.1f}ms {cpu_ratio:6.3f} {wall_ratio:6.3f} "
              f"{r['peak_rss_mb']:7.0f} {r['disk_bytes_per_step']/1024:8.1f}KB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
