"""CPU cost of the NaN sentinel on the benchmark model, measured A/B in one process.

`overhead.py --tiers none,sentinel` compares separate processes, which on a busy machine differ by more
than the sentinel costs. Here the sentinel's hooks are installed on every other step of the same run
(same model, same data stream, same process), so both halves see the same machine; the figure is the
training thread's: hooks, probes, closing the step and its one host copy.

    python benchmarks/sentinel_ab.py --steps 64
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from trainmon.demo import TinyGPT, lm_loss, synthetic_batch
from trainmon.engine import stats
from trainmon.hooks.collector import StepCollector
from trainmon.hooks.sentinel import nan_sentinel
from trainmon.hooks.state import HookState


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = TinyGPT(vocab=1024, hidden=256, layers=4, heads=4, seq=128)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1)
    state = HookState(StepCollector(1e-8, stats.fields_for_ops(["norm"]), rank=0), grad_acc_steps=1, strict=True)
    sentinel = nan_sentinel(state, [model], squash_name=False, rename=lambda vpp, name: name)
    timings: dict[bool, list[float]] = {True: [], False: []}
    for step in range(args.warmup + args.steps):
        watched = step % 2 == 0
        if watched:
            sentinel.install()
        tokens, labels = synthetic_batch(gen, 8, 128, 1024)
        start = time.process_time()
        lm_loss(model, tokens, labels).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if watched:
            sentinel.step_finished(collected=True)
            state.collector.finish_step().wait()
        elapsed = time.process_time() - start
        if watched:
            sentinel.remove()
        if step >= args.warmup:
            timings[watched].append(elapsed)
    on, off = statistics.median(timings[True]), statistics.median(timings[False])
    print(f"cpu/step without {off * 1e3:.1f} ms, with the sentinel {on * 1e3:.1f} ms: {on / off:.3f}x")


if __name__ == "__main__":
    main()
