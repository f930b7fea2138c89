"""The cost of the `sat` op in `stats.tensor_records` (not a test).

    python benchmarks/sat_cost.py [--rounds 15]

Hook-sized tensors (24 x [8, 128, 256], 8 x [8, 128, 1024], 8 x [1024, 256], 16 x [256]; 16.8M elements),
fp32 and bf16, one thread; ops min, max, norm, zeros, nans, mean without sat, with sat, and with sat
at a threshold of 0.5 that every tensor reaches (so every tensor takes the counting pass, as on an
accelerator), interleaved round by round in one process; the best round of each is printed (the machine is shared: the minimum
is the figure least disturbed by other load). Run it with PYTHONPATH pointing at two checkouts to
compare them without sat.
"""
from __future__ import annotations

import argparse
import time

import torch

from trainmon.engine import stats
from trainmon.engine.stats import OPS

SHAPES = [(8, 128, 256)] * 24 + [(8, 128, 1024)] * 8 + [(1024, 256)] * 8 + [(256,)] * 16
BASE = ["min", "max", "norm", "zeros", "nans", "mean"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    configs = {"without sat": (BASE, None)}
    if "sat" in OPS:
        configs |= {"with sat": (BASE + ["sat"], None), "sat counted": (BASE + ["sat"], 0.5)}
    for dtype in (torch.float32, torch.bfloat16):
        tensors = [torch.randn(*s, generator=gen).to(dtype) for s in SHAPES]
        elements = sum(t.numel() for t in tensors)
        best = {name: float("inf") for name in configs}
        for _ in range(args.rounds):
            for name, (ops, threshold) in configs.items():
                fields = stats.fields_for_ops(ops, threshold) if threshold else stats.fields_for_ops(ops)
                start = time.perf_counter()
                stats.tensor_records(tensors, 1e-8, fields)
                best[name] = min(best[name], time.perf_counter() - start)
        for name, seconds in best.items():
            print(f"{str(dtype):15} {name:12} {elements / 1e6:.1f}M elements: {1e3 * seconds:6.1f} ms "
                  f"({1e9 * seconds / elements:.2f} ns/element)")


if __name__ == "__main__":
    main()
