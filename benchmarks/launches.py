"""Kernel launches a monitored step adds, counted on the CPU: the top-level aten ops of one training step of
TinyGPT (bf16) per tier, less those of the same step unmonitored, by op. On an accelerator each such op is a
launch, and each costs host time that the GPU waits for once the host is the bottleneck (benchmarks/README.md,
"Current figures"). The statistics engine takes the accelerators' path (`stats_fused.cpu_as_accelerator`): each
record folded into a slot table by a Triton kernel, whose launches are counted as `triton::fold_one`,
`triton::fold_many` and `triton::merge_row` (counted, not run: the host path up to each launch runs as on an
accelerator). Without Triton installed, the torch kernels fold, and their ops are counted as they run.

    python benchmarks/launches.py --tiers wg,full --batch-mb 0    # a call per activation, as at GPU size
    python benchmarks/launches.py --tiers full --batch-mb 0 --compile aot_eager   # as gpu.py's compiled mode,
                                                                  # the model's graph run op by op
    python benchmarks/launches.py --tiers full --batch-mb 0 --compile inductor --layers 2   # its fused kernels
                                                                  # counted as `inductor::kernel`

With `--host-steps N`, the training thread's CPU time a step (median of N steps after the counted one) against
`none`'s, too: at a model small enough that its own compute is cheap (`--hidden 64 --batch 2`), what a tier adds
is the host work that sets a GPU step's pace once the host is the bottleneck (benchmarks/README.md, "Current figures").
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

from gpu import GPU_TIERS
from overhead import attach_monitor, tier_config

# ops that launch nothing: views, allocations, metadata
NO_LAUNCH = {"aten::view", "aten::_unsafe_view", "aten::narrow", "aten::select", "aten::slice", "aten::unbind",
             "aten::detach", "aten::detach_", "aten::alias", "aten::as_strided", "aten::expand", "aten::t",
             "aten::unsqueeze", "aten::squeeze", "aten::_reshape_alias", "aten::lift_fresh", "aten::transpose",
             "aten::reshape", "aten::resolve_conj", "aten::resolve_neg", "aten::empty", "aten::empty_strided",
             "aten::empty_like", "aten::result_type"}


def step_ops(tier: str, args) -> tuple[collections.Counter, float]:
    """The top-level aten ops of one step after warm-up (an op called by another launches through it), and the
    training thread's median CPU ms a step over `args.host_steps` steps after it (0 without them)."""
    from trainmon.demo import TinyGPT, lm_loss, synthetic_batch

    torch.manual_seed(0)
    model = TinyGPT(vocab=512, hidden=args.hidden, layers=args.layers, heads=8, seq=args.seq).to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    out = tempfile.mkdtemp(prefix="trainmon_launches_")
    os.environ["MONITOR_OUTPUT_DIR"] = out
    config = tier_config(tier, ["db"], tiers=GPU_TIERS)
    if config is not None:
        config["stats_batch_mb"] = args.batch_mb
    run_model = model if args.compile is None else torch.compile(model, backend=args.compile)
    monitor = attach_monitor(config, out, run_model, optimizer)
    gen = torch.Generator().manual_seed(1)
    batches = [synthetic_batch(gen, args.batch, args.seq, 512) for _ in range(2)]

    def step(i: int) -> None:
        tokens, labels = batches[i % 2]
        lm_loss(run_model, tokens, labels).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    for i in range(4):
        step(i)
    step(0)
    kernel_calls.clear()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step(1)
    kernel_calls_of_step = collections.Counter(kernel_calls)
    host_ms = []
    for i in range(args.host_steps):
        start = time.thread_time()
        step(i)
        host_ms.append((time.thread_time() - start) * 1e3)
    if monitor is not None:
        monitor.stop()
    return kernel_calls_of_step + collections.Counter(
        _launch_name(e.name) for e in prof.events() if _launch_name(e.name) and
        (e.cpu_parent is None or not _launch_name(e.cpu_parent.name))), statistics.median(host_ms or [0.0])


kernel_calls: collections.Counter = collections.Counter()   # Triton launches, by kernel


class _CountedKernel:
    """A Triton kernel whose launches `kernel[grid](...)` are counted instead of run."""

    def __init__(self, name: str):
        self.name = name

    def __getitem__(self, grid):
        return lambda *args, **kwargs: kernel_calls.update([f"triton::{self.name}"])


def _counting_folder(device, eps, fields):
    """The Triton folder with its kernels counted, not run; the torch kernels' folder where Triton is missing."""
    import importlib.util
    import types

    from trainmon.engine import folding

    if importlib.util.find_spec("triton") is None:
        return folding.TorchFolder(device, eps, fields)
    from trainmon.engine import fold_kernels

    counted = types.SimpleNamespace(**vars(fold_kernels))
    for name in ("fold_one", "fold_many", "merge_row"):
        setattr(counted, f"{name}_kernel", _CountedKernel(name))
    return folding.TritonFolder(device, eps, fields, kernels=counted)


def _launch_name(event: str):
    """An aten op's name, "inductor::kernel" for a kernel inductor generated (`--compile inductor`), else None."""
    if event.startswith("aten::"):
        return event
    return "inductor::kernel" if "cpp_fused" in event else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiers", default="wg,wg+xy,full", help="tiers of gpu.py, comma-separated")
    ap.add_argument("--batch-mb", type=int, default=32, help="stats_batch_mb (0: a call per activation)")
    ap.add_argument("--hidden", type=int, default=512, help="hidden size (8 heads)")
    ap.add_argument("--layers", type=int, default=12, help="transformer layers")
    ap.add_argument("--seq", type=int, default=32, help="sequence length")
    ap.add_argument("--batch", type=int, default=8, help="sequences a step")
    ap.add_argument("--compile", metavar="BACKEND", help="torch.compile the model with this backend (aot_eager: "
                    "the graph's ops are counted as eager ones are)")
    ap.add_argument("--host-steps", type=int, default=0, help="steps timed for the host's CPU time a step")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch._inductor.config.cpp.enable_kernel_profile = True   # each generated kernel's call in the profile
    from trainmon.engine import folding, stats_fused
    stats_fused.cpu_as_accelerator = True
    folding.folder_for = _counting_folder
    base, base_ms = step_ops("none", args)
    compiled = "" if args.compile is None else f", compiled with {args.compile}"
    host = f", host {base_ms:.1f} ms a step" if args.host_steps else ""
    print(f"TinyGPT bf16{compiled}, {args.layers} layers, hidden {args.hidden}, batch {args.batch} x seq {args.seq}, "
          f"stats_batch_mb {args.batch_mb}; none: {sum(n for op, n in base.items() if op not in NO_LAUNCH)} "
          f"launches a step{host}")
    for tier in args.tiers.split(","):
        ops, ms = step_ops(tier, args)
        extra = {op: ops[op] - base[op] for op in set(ops) | set(base) if op not in NO_LAUNCH}
        top = ", ".join(f"{op.split('::')[-1]} {n}"
                        for op, n in sorted(extra.items(), key=lambda kv: -kv[1])[:10] if n)
        host = f", host +{ms - base_ms:.1f} ms a step ({ms / base_ms:.2f}x)" if args.host_steps else ""
        print(f"  {tier:8s} +{sum(extra.values())} launches a step{host} ({top})")


if __name__ == "__main__":
    main()
