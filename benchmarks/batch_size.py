"""Overhead of a tier for several `stats_batch_mb` values, measured in one process.

The monitor collects every other step; the collected steps cycle through the batch sizes, so every size
meets the same process, allocator and machine state, and each is compared with the idle steps between
them (medians after warm-up). Separate processes differ by more than the effect being measured.

    python benchmarks/batch_size.py --tier wg+xy --sizes 0,16,32,64,256 --rounds 10
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

from overhead import OPS, TIERS


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tier", default="wg+xy", choices=[t for t, c in TIERS.items() if c])
    parser.add_argument("--sizes", default="0,16,32,64,256", help="comma-separated stats_batch_mb values")
    parser.add_argument("--rounds", type=int, default=10, help="collected steps per size")
    parser.add_argument("--warmup", type=int, default=6)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]

    import torch

    from trainmon import TrainerMon
    from trainmon.demo import TinyGPT, lm_loss, synthetic_batch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = TinyGPT(vocab=1024, hidden=256, layers=4, heads=4, seq=128)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1)
    out_dir = tempfile.mkdtemp(prefix="trainmon_bench_")
    os.environ["MONITOR_OUTPUT_DIR"] = out_dir
    config = os.path.join(out_dir, "config.json")
    with open(config, "w") as f:
        json.dump({"targets": {}, "ops": OPS, "format": ["csv"], **TIERS[args.tier], "step_interval": 2}, f)
    monitor = TrainerMon(config)
    monitor.set_monitor(model, optimizer=optimizer)
    collector = monitor._state.collector

    def train_step() -> float:
        tokens, labels = synthetic_batch(gen, 8, 128, 1024)
        start = time.thread_time()
        lm_loss(model, tokens, labels).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.thread_time() - start

    for _ in range(args.warmup):
        train_step()
    collected = {size: [] for size in sizes}
    idle = []
    for _ in range(args.rounds):
        for size in sizes:
            for _ in range(2):  # one collected step (even), one idle step
                is_collected = monitor.step % 2 == 0
                collector.batch_bytes = size << 20
                (collected[size] if is_collected else idle).append(train_step())
    monitor.stop()
    base = statistics.median(idle)
    print(f"tier {args.tier}; idle step {base * 1e3:.1f} ms (median of {len(idle)})")
    print("stats_batch_mb  collected step  ratio to idle")
    for size, times in collected.items():
        print(f"{size:>14}  {statistics.median(times) * 1e3:>11.1f} ms  {statistics.median(times) / base:>13.3f}")


if __name__ == "__main__":
    main()
