"""Overhead of trainmon under `torch.compile` (inductor, CPU), next to the same tiers in eager mode.

Model and method as `overhead.py`: the benchmark model (4 layers, hidden 256, seq 128, batch 8, vocab 1024,
AdamW, fp32, one thread), each (tier, mode) in its own process, the median per-step process CPU time after
warm-up (the compile happens in the warm-up steps). A tier's ratio is over the unmonitored run of the same
mode: monitored-compiled / unmonitored-compiled next to monitored-eager / unmonitored-eager. Each compiled
run also reports the graph breaks and graphs Dynamo made.

    python benchmarks/compiled.py --steps 20 --warmup 4
    python benchmarks/compiled.py --modes compiled,blocks --tiers none,sentinel
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from overhead import attach_monitor, tier_config

MODES = ("eager", "compiled", "blocks")  # blocks: each transformer block compiled on its own (torchtitan)


def run_child(tier: str, mode: str, steps: int, warmup: int) -> dict:
    import torch
    from torch._dynamo.utils import counters

    from trainmon.demo import TinyGPT, lm_loss, synthetic_batch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = TinyGPT(vocab=1024, hidden=256, layers=4, heads=4, seq=128)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    run_model = model
    if mode == "compiled":
        run_model = torch.compile(model)
    elif mode == "blocks":
        for i, block in enumerate(model.layers):
            model.layers[i] = torch.compile(block)
    gen = torch.Generator().manual_seed(1)
    out_dir = tempfile.mkdtemp(prefix="trainmon_bench_")
    os.environ["MONITOR_OUTPUT_DIR"] = out_dir
    monitor = attach_monitor(tier_config(tier, ["csv"]), out_dir, run_model, optimizer)
    cpu = []
    for _ in range(warmup + steps):
        tokens, labels = synthetic_batch(gen, 8, 128, 1024)
        start = time.process_time()
        lm_loss(run_model, tokens, labels).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        cpu.append(time.process_time() - start)
    if monitor is not None:
        monitor.stop()
    return {"tier": tier, "mode": mode, "cpu_s": statistics.median(cpu[warmup:]),
            "graph_breaks": sum(counters["graph_break"].values()), "graphs": counters["stats"]["unique_graphs"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiers", default="none,sentinel,wg,wg+xy,full")
    parser.add_argument("--modes", default="eager,compiled")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        tier, mode = args.child.split(":")
        print(json.dumps(run_child(tier, mode, args.steps, args.warmup)))
        return 0
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    tiers, modes = args.tiers.split(","), args.modes.split(",")
    results = {}
    for tier in tiers:
        for mode in modes:
            out = subprocess.run([sys.executable, __file__, "--child", f"{tier}:{mode}", "--steps", str(args.steps),
                                  "--warmup", str(args.warmup)], check=True, capture_output=True, text=True, env=env)
            results[tier, mode] = json.loads(out.stdout.strip().splitlines()[-1])
    print("| tier | " + " | ".join(f"{m} cpu/step | {m}× | {m} breaks/graphs" for m in modes) + " |")
    print("| --- |" + " --- | --- | --- |" * len(modes))
    for tier in tiers:
        cells = []
        for mode in modes:
            r, base = results[tier, mode], results.get(("none", mode))
            ratio = f"{r['cpu_s'] / base['cpu_s']:.3f}" if base else "-"
            graphs = f"{r['graph_breaks']}/{r['graphs']}" if mode != "eager" else "-"
            cells += [f"{r['cpu_s'] * 1e3:.1f} ms", ratio, graphs]
        print(f"| {tier} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
