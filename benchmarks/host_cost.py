"""Host work per record: the CPU time a tier adds to a step, divided by the records it writes a step.

The model is a chain of tiny blocks (`Linear(16, 16)` + GELU, batch 2) whose own compute is near zero, so what a
tier adds is the host work of its hooks, keys, reads and writer: on an accelerator that work, not the kernels,
sets a step's pace once the host is the bottleneck. Each tier trains in its own process; the figure is the
process's CPU time a step (training thread and writer thread, from the first timed step to the end of
`monitor.stop()`, which writes what the writer had left), and the training thread's alone (the hooks up to the
kernels' launches: what sets an accelerator step's pace), each less `none`'s and divided by the rows of a step in
`monitor.db`; and of the training thread's, the forward pass's share (where the activations are recorded and the
hooks for their grads registered). Each tier's figure is the median over `--repeats` processes. Python's garbage
collector is timed apart (`gc.callbacks`): its CPU ms a step in those steps, on either thread, and how many full
collections it made there, with the longest (a full collection scans the whole heap: a pause of the training
thread that grows with the process, where a tier keeps many objects alive from step to step).

    python benchmarks/host_cost.py                                  # the CPU path (the native read)
    python benchmarks/host_cost.py --accelerator-path --no-launch   # the accelerators' path up to the launch
    python benchmarks/host_cost.py --blocks 64 --steps 60 --tiers none,xy,all --repeats 3
    python benchmarks/host_cost.py --compiled                       # the chain under torch.compile (inductor)
    python benchmarks/host_cost.py --tiers none,xy --extra '{"dump": {"steps": [100000]}}'   # a key added

With `--compiled` every tier, `none` included, trains the chain through `torch.compile`: a hooked call's host work
is then its `trainmon::observe` ops' (the eager hooks run from the compiled graph), next to the same tier's eager
figure from a run without the flag.

With `--alternate` each process trains the chain both ways, eagerly and through `torch.compile`, ten steps of one
then ten of the other: the two modes' figures come from the same minutes of the same process, where figures of
separate processes differ by a fifth on a shared machine. It prints the training thread's median step and forward
pass per mode, µs a record against `none` in the same mode, and compiled over eager.

    python benchmarks/host_cost.py --alternate --accelerator-path --no-launch --blocks 16 --tiers none,xy,all
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIERS = {
    "none": None,
    "xy": {"xy_distribution": True, "all_xy": True},
    "all": {"xy_distribution": True, "all_xy": True, "wg_distribution": True, "mv_distribution": True,
            "param_distribution": True},
}
OPS = ["min", "max", "norm", "zeros", "nans", "mean"]


class NoLaunch:
    """A folder that launches nothing: the accelerators' path's host work up to its kernel launches, whose own
    cost is measured on the device (`gpu.py --kernels`)."""

    def __init__(self, *args):
        pass

    def fold(self, table, slots, tensors) -> None:
        pass

    def merge_row(self, table, source, target) -> None:
        pass


def _setup(tier: str, blocks: int, accelerator_path: bool, no_launch: bool, extra: dict) -> tuple:
    """(the chain, its optimizer, its batch, `tier`'s monitor on it or None) in this process."""
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    if accelerator_path:
        from trainmon.engine import folding, stats_fused

        stats_fused.cpu_as_accelerator = True
        if no_launch:
            folding.folder_for = NoLaunch
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU())
                                  for _ in range(blocks)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(2, 16)
    out_dir = tempfile.mkdtemp(prefix="trainmon_host_cost_")
    os.environ["MONITOR_OUTPUT_DIR"] = out_dir
    monitor = None
    if TIERS[tier] is not None:
        from trainmon import TrainerMon

        path = os.path.join(out_dir, "config.json")
        with open(path, "w") as f:
            json.dump({"ops": OPS, "format": ["db"], **TIERS[tier], **extra}, f)
        monitor = TrainerMon(path)
        monitor.set_monitor(model, optimizer=optimizer)
    return model, optimizer, x, monitor


def _records(monitor, step: int) -> int:
    """The rows `monitor` wrote for `step` (0 without a monitor), once it has stopped."""
    if monitor is None:
        return 0
    with sqlite3.connect(monitor.output_dir / "monitor.db") as conn:
        return conn.execute("SELECT count(*) FROM records WHERE step = ?", (step,)).fetchone()[0]


def _step(run, x, optimizer) -> tuple[float, float]:
    """Trains one step of `run` (the chain, or the chain compiled); the training thread's seconds for it, and of them
    the forward pass's (where the activations are recorded and the hooks for their grads registered)."""
    begin = time.thread_time()
    y = run(x)
    forwarded = time.thread_time()
    y.square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.thread_time() - begin, forwarded - begin


def child(tier: str, blocks: int, steps: int, warmup: int, accelerator_path: bool, no_launch: bool,
          compiled: bool, extra: dict) -> dict:
    """Trains the chain with `tier`'s monitor in this process; CPU ms a step and records a step."""
    import torch

    model, optimizer, x, monitor = _setup(tier, blocks, accelerator_path, no_launch, extra)
    if compiled:  # compiled in the warm-up steps
        model = torch.compile(model)
    collecting = {"ms": 0.0, "full": 0, "longest": 0.0, "on": False, "began": 0.0}

    def on_collection(phase: str, info: dict) -> None:  # collections run one at a time, on the allocating thread
        if not collecting["on"]:
            return
        if phase == "start":
            collecting["began"] = time.thread_time()
            return
        ms = (time.thread_time() - collecting["began"]) * 1e3
        collecting["ms"] += ms
        if info["generation"] == 2:
            collecting["full"] += 1
            collecting["longest"] = max(collecting["longest"], ms)

    gc.callbacks.append(on_collection)
    thread = forward = 0.0
    for step in range(warmup + steps):
        if step == warmup:
            start = time.process_time()
            collecting["on"] = True
        thread_s, forward_s = _step(model, x, optimizer)
        if step >= warmup:
            thread += thread_s
            forward += forward_s
    if monitor is not None:
        monitor.stop()  # the writer's work left at the end is the timed steps' too
    cpu_ms = (time.process_time() - start) * 1e3 / steps
    collecting["on"] = False
    records = _records(monitor, warmup + steps - 1)
    return {"cpu_ms": cpu_ms, "thread_ms": thread * 1e3 / steps, "forward_ms": forward * 1e3 / steps,
            "records": records, "gc_ms": collecting["ms"] / steps, "gc_full": collecting["full"],
            "gc_longest_ms": collecting["longest"]}


ALTERNATION = 10  # steps of one mode before the other's


def alternate_child(tier: str, blocks: int, steps: int, warmup: int, accelerator_path: bool, no_launch: bool,
                    extra: dict) -> dict:
    """Trains the chain with `tier`'s monitor in this process, eagerly and compiled in turn (`ALTERNATION` steps
    each), `steps` timed steps of each mode (rounded up to a multiple of `ALTERNATION`) after `warmup` of each: the
    training thread's median ms a step and a forward pass, per mode, and the records a step."""
    import torch

    model, optimizer, x, monitor = _setup(tier, blocks, accelerator_path, no_launch, extra)
    modes = {"eager": model, "compiled": torch.compile(model)}  # compiled in its warm-up steps
    times: dict = {mode: ([], []) for mode in modes}
    step = 0
    for run in modes.values():
        for _ in range(warmup):
            _step(run, x, optimizer)
            step += 1
    for turn in range(2 * -(-steps // ALTERNATION)):
        mode = "eager" if turn % 2 == 0 else "compiled"
        for _ in range(ALTERNATION):
            thread_s, forward_s = _step(modes[mode], x, optimizer)
            times[mode][0].append(thread_s * 1e3)
            times[mode][1].append(forward_s * 1e3)
            step += 1
    if monitor is not None:
        monitor.stop()
    result = {mode: {"thread_ms": statistics.median(thread), "forward_ms": statistics.median(forward)}
              for mode, (thread, forward) in times.items()}
    return {**result, "records": _records(monitor, step - 1)}


def report_alternated(runs: dict, tiers: list[str], blocks: int, path: str, repeats: int, steps: int) -> None:
    """The table of `--alternate`: per tier, each mode's median over the processes, and compiled over eager."""
    print(f"{blocks} blocks of Linear(16, 16) + GELU, batch 2, {path}, eager and torch.compile alternated in each "
          f"process; training thread's median ms a step, median of {repeats} processes of {steps} steps a mode")
    print(f"{'tier':<6} {'records':>8} {'eager ms':>9} {'µs/record':>10} {'forward ms':>11} {'compiled ms':>12} "
          f"{'µs/record':>10} {'forward ms':>11} {'compiled/eager':>15}")

    def median(tier: str, mode: str, figure: str) -> float:
        return statistics.median(r[mode][figure] for r in runs[tier])

    for tier in tiers:
        records = runs[tier][0]["records"]
        row, per = f"{tier:<6} {records:8d}", {}
        for mode in ("eager", "compiled"):
            ms = median(tier, mode, "thread_ms")
            if records:
                per[mode] = (ms - median("none", mode, "thread_ms")) * 1e3 / records
            row += f" {ms:{9 if mode == 'eager' else 12}.2f} " + (f"{per[mode]:10.1f}" if records else f"{'':>10}")
            row += f" {median(tier, mode, 'forward_ms'):11.2f}"
        ratio = f"{per['compiled'] / per['eager']:15.2f}" if records and per["eager"] > 0 else f"{'':>15}"
        print(row + f" {ratio}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiers", default="none,xy,all")
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3, help="processes per tier, interleaved")
    parser.add_argument("--accelerator-path", action="store_true",
                        help="the accelerators' slot-table path on CPU tensors (stats_fused.cpu_as_accelerator)")
    parser.add_argument("--no-launch", action="store_true",
                        help="with --accelerator-path: fold nothing, to count the host work up to the launches")
    parser.add_argument("--compiled", action="store_true", help="train the chain through torch.compile (inductor)")
    parser.add_argument("--alternate", action="store_true",
                        help="train it eagerly and compiled in turn in each process (see above)")
    parser.add_argument("--extra", default="{}", help="JSON config keys added to every monitored tier's")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.alternate and args.compiled:
        parser.error("--alternate trains the chain both ways already: no --compiled with it")
    if args.child:
        if args.alternate:
            result = alternate_child(args.child, args.blocks, args.steps, args.warmup, args.accelerator_path,
                                     args.no_launch, json.loads(args.extra))
        else:
            result = child(args.child, args.blocks, args.steps, args.warmup, args.accelerator_path, args.no_launch,
                           args.compiled, json.loads(args.extra))
        print(json.dumps(result))
        return
    tiers = args.tiers.split(",")
    if "none" not in tiers:
        tiers.insert(0, "none")
    runs: dict = {tier: [] for tier in tiers}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    for repeat in range(args.repeats):
        for tier in tiers if repeat % 2 == 0 else reversed(tiers):
            cmd = [sys.executable, __file__, "--child", tier, "--blocks", str(args.blocks), "--steps",
                   str(args.steps), "--warmup", str(args.warmup)] + \
                (["--accelerator-path"] if args.accelerator_path else []) + (["--no-launch"] if args.no_launch else []) + \
                (["--compiled"] if args.compiled else []) + (["--alternate"] if args.alternate else []) + \
                ["--extra", args.extra]
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
            if done.returncode != 0:
                raise SystemExit(f"{tier} failed:\n{done.stderr[-3000:]}")
            runs[tier].append(json.loads(done.stdout.strip().splitlines()[-1]))
    path = "CPU path" if not args.accelerator_path else \
        "accelerators' path on the CPU" + (", no launch" if args.no_launch else "")
    path += ", torch.compile" if args.compiled else ""
    path += f", with {args.extra}" if json.loads(args.extra) else ""
    if args.alternate:
        report_alternated(runs, tiers, args.blocks, path, args.repeats, args.steps)
        return
    none = statistics.median(r["cpu_ms"] for r in runs["none"])
    print(f"{args.blocks} blocks of Linear(16, 16) + GELU, batch 2, {path}; CPU ms a step, median of "
          f"{args.repeats} processes of {args.steps} steps")
    none_thread = statistics.median(r["thread_ms"] for r in runs["none"])
    print(f"{'tier':<6} {'records':>8} {'process ms':>11} {'µs/record':>10} {'training thread ms':>19} {'µs/record':>10}"
          f" {'of it forward ms':>17} {'gc ms':>6} {'full collections (longest ms)':>30}")
    for tier in tiers:
        ms = statistics.median(r["cpu_ms"] for r in runs[tier])
        thread_ms = statistics.median(r["thread_ms"] for r in runs[tier])
        forward_ms = statistics.median(r["forward_ms"] for r in runs[tier])
        records = runs[tier][0]["records"]
        per = f"{(ms - none) * 1e3 / records:10.1f}" if records else f"{'':>10}"
        per_thread = f"{(thread_ms - none_thread) * 1e3 / records:10.1f}" if records else f"{'':>10}"
        gc_ms = statistics.median(r["gc_ms"] for r in runs[tier])
        full = "/".join(str(r["gc_full"]) for r in runs[tier])
        longest = max(r["gc_longest_ms"] for r in runs[tier])
        full += f" ({longest:.0f})" if longest else ""
        print(f"{tier:<6} {records:8d} {ms:11.2f} {per} {thread_ms:19.2f} {per_thread} {forward_ms:17.2f} {gc_ms:6.2f}"
              f" {full:>30}")


if __name__ == "__main__":
    main()
