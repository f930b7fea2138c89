"""The device checks of a run on a GPU (or an Ascend NPU), in one command: a lent device's time is short.

Each (mode, tier) trains TinyGPT in its own process (bf16, 12 layers, hidden 2048 by default: a GPU-sized
step) and reports:

- the median step time after warm-up (the benchmark's loop ends each step with a device synchronize,
  outside the monitor) and its ratio against `none` of the same mode;
- device kernels launched per step (torch.profiler over one step after warm-up) and the extra against `none`;
  their summed time (against the step time: how busy the device was) and the kernels that took most of it;
- peak allocated device memory, and the extra against `none`; the bytes autograd holds for a step's backward;
- host synchronisations the training thread made during the monitored steps, under
  `torch.cuda.set_sync_debug_mode("warn")`, with the trainmon frame that made each: the design allows none
  (the writer thread's wait for a step's copy is by design, and counted apart);
- the records each run wrote (the `db` sink's rows).

Modes: `eager`; `compiled` (torch.compile, inductor); `graphs` (torch.compile with mode="reduce-overhead",
which captures CUDA graphs: the monitor must run and say once what it cannot see there).

    python benchmarks/gpu.py --out $OUT/gpu.json                       # every check: over 10 min on an H100
    python benchmarks/gpu.py --kernels                                 # the statistic kernels alone
    python benchmarks/gpu.py --modes compiled,graphs --compiled-tiers none,full --extra '{"step_interval": 10}' \
        --warmup 12                                                    # one step in ten collected, compiled
    python benchmarks/gpu.py --device cpu --layers 2 --hidden 128 --seq 64 --batch 4 --steps 4 --warmup 2 \\
        --modes eager,compiled --dtype float32                         # the script itself, on a CPU

DEVELOPERS.md splits the checks into two calls that fit a lent device's 15 minutes. The targets: full ≤ 1.05×,
sentinel ≤ 1.01× in eager mode, no host synchronisation.
"""
from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings

from overhead import TIERS as OVERHEAD_TIERS, attach_monitor, tier_config

MODES = ("eager", "compiled", "graphs")
# "all": every per-step collection at once (the full tier, Adam's update and ratio, the grads' sign agreement,
# the sentinel), for the host-sync check of what the tiers leave out
GPU_TIERS = {**OVERHEAD_TIERS, "all": {**OVERHEAD_TIERS["full"], "ur_distribution": True, "mg_direction": True,
                                       "sentinel": True}}
TIERS = ("none", "sentinel", "wg", "wg+xy", "full", "all")


def _device_module(torch, device):
    return getattr(torch, device.type)  # torch.cuda, torch.npu (torch_npu), torch.cpu


@contextlib.contextmanager
def _sync_watch(torch, device, found: list):
    """Records every synchronising call the sync debug mode reports while the block runs: (thread, the innermost
    trainmon frame or the innermost frame, message)."""
    if device.type != "cuda":
        yield
        return
    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        text = str(message)
        if "called a synchronizing" not in text:  # not the mode's own notice that it is a prototype
            return shown(message, category, filename, lineno, file, line)
        stack = traceback.extract_stack()[:-1]
        ours = [f for f in stack if f"{os.sep}trainmon{os.sep}" in f.filename]
        frame = (ours or stack)[-1]
        found.append((threading.current_thread().name, f"{frame.filename}:{frame.lineno} {frame.name}", text[:120]))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = shown


def run_child(spec: dict) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from trainmon.demo import TinyGPT, lm_loss, synthetic_batch
    from trainmon.engine import stat_kernels

    faulthandler.dump_traceback_later(max(spec["timeout"] * 0.8, spec["timeout"] - 10))  # a hang shows where
    torch.manual_seed(0)
    device = torch.device(spec["device"])
    dtype = getattr(torch, spec["dtype"])
    accel = _device_module(torch, device)
    with device:  # initialised where it trains: a GPU-sized model's init on the host takes tens of seconds
        model = TinyGPT(vocab=spec["vocab"], hidden=spec["hidden"], layers=spec["layers"], heads=spec["heads"],
                        seq=spec["seq"]).to(dtype=dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    run_model = model
    if spec["mode"] == "compiled":
        run_model = torch.compile(model)
    elif spec["mode"] == "graphs":
        run_model = torch.compile(model, mode="reduce-overhead")
    out_dir = tempfile.mkdtemp(prefix="trainmon_gpu_")
    os.environ["MONITOR_OUTPUT_DIR"] = out_dir
    extra = dict(spec["extra"]) if spec["tier"] != "none" else {}
    config = tier_config(spec["tier"], ["db"], extra, extra.pop("step_interval", 1), tiers=GPU_TIERS)
    monitor = attach_monitor(config, out_dir, run_model, optimizer)
    gen = torch.Generator().manual_seed(1)
    batches = [tuple(t.to(device) for t in synthetic_batch(gen, spec["batch"], spec["seq"], spec["vocab"]))
               for _ in range(4)]

    def step(i: int) -> None:
        if spec["mode"] == "graphs":
            torch.compiler.cudagraph_mark_step_begin()
        tokens, labels = batches[i % len(batches)]
        lm_loss(run_model, tokens, labels).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for i in range(spec["warmup"]):
        step(i)
    # no compile for later runs competes with the timed steps (one slower than half the process's time is left
    # running); the result says which generated kernels this run used ("ready") and which it compiled for later
    settle_start = time.perf_counter()
    kernels_served = stat_kernels.settle(timeout=spec["timeout"] / 2)
    settle_s = time.perf_counter() - settle_start
    accel.synchronize()
    if device.type != "cpu":
        accel.reset_peak_memory_stats()
    times, syncs = [], []
    for i in range(spec["steps"]):
        start = time.perf_counter()
        with _sync_watch(torch, device, syncs):
            step(i)
        accel.synchronize()
        times.append(time.perf_counter() - start)
    saved = _saved_bytes(torch, lambda: step(0))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        step(0)
        accel.synchronize()
    # device events less the user annotations on the device's timeline (the optimizer step's span, say)
    kernels = [e for e in prof.events() if e.device_type.name in ("CUDA", "PrivateUse1")
               and not getattr(e, "is_user_annotation", False)]
    peak = accel.max_memory_allocated() if device.type != "cpu" else 0
    if monitor is not None:
        monitor.stop()
    return {**spec, "step_s": statistics.median(times), "settle_s": settle_s, "stat_kernels": kernels_served,
            "kernels": len(kernels), **_kernel_time(kernels), "peak_bytes": peak, "saved_bytes": saved,
            "syncs_training": [s for s in syncs if s[0] == "MainThread"],
            "syncs_other_threads": len([s for s in syncs if s[0] != "MainThread"]),
            "records": _records_written(out_dir)}


def _saved_bytes(torch, step) -> int:
    """The bytes autograd holds for the backward of one step: the distinct storages packed by its saved-tensor
    hooks (a compiled region's saved tensors included), at the size of each storage."""
    storages: dict = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        step()
    return sum(storages.values())


def _kernel_time(kernels: list, top: int = 8) -> dict:
    """The step's kernel time on the device (its sum: against the step time, how busy the device was), and
    the kernels that took most of it, by name: where a tier's time goes."""
    by_name: dict = {}
    for e in kernels:
        entry = by_name.setdefault(e.name[:90], [0, 0.0])
        entry[0] += 1
        entry[1] += e.time_range.elapsed_us() / 1e3
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    return {"kernel_ms": sum(ms for _, ms in by_name.values()),
            "top_kernels": [[name, count, round(ms, 3)] for name, (count, ms) in ranked]}


def _records_written(out_dir: str) -> int:
    total = 0
    for root, _, files in os.walk(out_dir):
        if "monitor.db" in files:
            with contextlib.closing(sqlite3.connect(os.path.join(root, "monitor.db"))) as conn:
                total += conn.execute("SELECT COUNT(*) FROM records").fetchone()[0]
    return total


# TinyGPT's shape in the GPU runs: a GPU-sized step
MODEL_SHAPE = {"dtype": "bfloat16", "layers": 12, "hidden": 2048, "heads": 16, "seq": 1024, "batch": 8, "vocab": 32000}


def add_model_arguments(parser: argparse.ArgumentParser, **defaults) -> None:
    """The options of TinyGPT's shape, defaulting to the GPU runs' (MODEL_SHAPE) where `defaults` does not say."""
    shape = {**MODEL_SHAPE, **defaults}
    parser.add_argument("--dtype", default=shape["dtype"], help="the model's dtype")
    for name, what in (("layers", "transformer layers"), ("hidden", "hidden size"), ("heads", "attention heads"),
                       ("seq", "sequence length"), ("batch", "sequences a step"), ("vocab", "vocabulary size")):
        parser.add_argument(f"--{name}", type=int, default=shape[name], help=what)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=None, help="default: cuda where available, else cpu")
    add_model_arguments(parser)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--tiers", default=",".join(TIERS), help="the tiers of eager mode")
    parser.add_argument("--compiled-tiers", default="none,sentinel,full",
                        help="the tiers of the compiled modes (each process compiles the model first)")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--timeout", type=int, default=240, help="seconds per (mode, tier) process")
    parser.add_argument("--out", help="also write every result as JSON here")
    parser.add_argument("--extra", default="{}", help="JSON config keys added to every monitored tier's: "
                        "'{\"step_interval\": 10}' times steps of which one in ten is collected")
    parser.add_argument("--output-bytes", action="store_true",
                        help="only print the bytes of the model's module outputs per step (on the meta device): "
                             "what a probe of every output reads, and about as much again for their grads")
    parser.add_argument("--kernels", action="store_true",
                        help="only compile the statistic kernels for the device (fp32, bf16, fp16, fp64: the "
                             "tests then load them) and time their reads against one _foreach_norm pass")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_child(json.loads(args.child))))
        return 0
    if args.output_bytes:
        _print_output_bytes(args)
        return 0
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    print(f"torch {torch.__version__}, device {device}"
          + (f" ({torch.cuda.get_device_name()})" if device.startswith("cuda") else "")
          + f", {args.dtype}, {args.layers} layers, hidden {args.hidden}, seq {args.seq}, batch {args.batch}")
    if args.kernels:
        _print_kernels(torch.device(device))
        return 0
    results = []
    for mode in args.modes.split(","):
        for tier in (args.tiers if mode == "eager" else args.compiled_tiers).split(","):
            spec = {"mode": mode, "tier": tier, "device": device, "dtype": args.dtype, "layers": args.layers,
                    "hidden": args.hidden, "heads": args.heads, "seq": args.seq, "batch": args.batch,
                    "vocab": args.vocab, "steps": args.steps, "warmup": args.warmup, "timeout": args.timeout,
                    "extra": json.loads(args.extra)}
            results.append(_run_process(spec, args.timeout))
            _progress(results[-1])
            if args.out:  # after each process: a device's lease can end before the last
                with open(args.out, "w") as f:
                    json.dump(results, f, indent=1)
    _print_table(results)
    return 0


def _run_process(spec: dict, timeout: int) -> dict:
    """One (mode, tier) in a process of its own; a failure keeps the end of its output (with faulthandler's
    stacks of every thread, where it crashed or hung)."""
    env = dict(os.environ, PYTHONFAULTHANDLER="1")
    try:
        child = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True,
                               text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as exc:
        return {**spec, "error": f"over {timeout} s", "stderr": _tail(exc.stderr)}
    if child.returncode:
        return {**spec, "error": f"exit {child.returncode}", "stderr": _tail(child.stderr)}
    return json.loads(child.stdout.strip().splitlines()[-1])


def _tail(stderr, lines: int = 60) -> list[str]:
    if isinstance(stderr, bytes):
        stderr = stderr.decode(errors="replace")
    return (stderr or "").strip().splitlines()[-lines:]


def _progress(result: dict) -> None:
    if "error" in result:
        print(f"{result['mode']} {result['tier']}: failed: {result['error']}", *result["stderr"], sep="\n    ",
              flush=True)
        return
    print(f"{result['mode']} {result['tier']}: {result['step_s'] * 1e3:.1f} ms per step, {result['kernels']} kernels "
          f"taking {result['kernel_ms']:.1f} ms, {result['saved_bytes'] / 2**20:.0f} MB saved for backward, "
          f"{len(result['syncs_training'])} host syncs, {result['records']} records; "
          f"{result['settle_s']:.1f} s waiting for the statistic kernels' compile "
          f"({', '.join(f'{k} {v}' for k, v in result['stat_kernels'].items()) or 'none asked for'})", flush=True)
    for name, count, ms in result["top_kernels"]:
        print(f"    {ms:8.2f} ms {count:5d}× {name}")


def _print_kernels(device) -> None:
    """Compile time of the record kernel per dtype and of the merge kernel of its rows, then the read rate
    of one records call over bf16 tensors of a few sizes, through the one-pass kernel and through the
    multi-pass kernels, next to one _foreach_norm pass over the same tensors (the floor) and a per-tensor
    aminmax (the sentinel's probe); medians of 10 calls after 3."""
    import torch

    from trainmon.engine import stat_kernels, stats, stats_fused

    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
    start = time.perf_counter()
    stat_kernels.prepare(device, dtypes, wait=True)
    stat_kernels.prepare(device, [torch.float32, torch.float64], wait=True, kernel="merge")  # the rows' dtypes
    print(f"record and merge kernels compiled or loaded in {time.perf_counter() - start:.1f} s: "
          f"{stat_kernels.settle(timeout=0)}", flush=True)
    accel = _device_module(torch, device)
    fields = stats.fields_for_ops(["norm", "min", "max", "mean", "zeros", "nans", "infs"])

    def median_ms(fn) -> float:
        times = []
        for i in range(13):
            accel.synchronize()
            begin = time.perf_counter()
            fn()
            accel.synchronize()
            if i >= 3:
                times.append((time.perf_counter() - begin) * 1e3)
        return statistics.median(times)

    def multi_pass(ts):
        stats_fused.enabled = False
        try:
            return stats.tensor_records(ts, 1e-8, fields)
        finally:
            stats_fused.enabled = True

    from trainmon.core import schema
    from trainmon.engine import folding

    folder = folding.folder_for(device, 1e-8, fields)
    print(f"slot-table folder: {type(folder).__name__}", flush=True)
    print("| bf16 tensors | GB | records (one pass) | records (multi-pass) | fold, a launch each | fold, one launch "
          "| _foreach_norm | aminmax each |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for count, numel in ((16, 1 << 24), (64, 1 << 20), (1000, 1 << 14)):
        ts = [torch.randn(numel, device=device, dtype=torch.bfloat16) for _ in range(count)]
        table = torch.tensor(schema.IDENTITY, dtype=torch.float64, device=device).repeat(count, 1)
        slots = list(range(count))
        gb = count * numel * 2 / 1e9
        rate = lambda ms: f"{ms:.2f} ms, {gb / ms * 1e3:.0f} GB/s"  # noqa: E731
        print(f"| {count} x {numel:,} | {gb:.2f} | {rate(median_ms(lambda: stats.tensor_records(ts, 1e-8, fields)))} "
              f"| {rate(median_ms(lambda: multi_pass(ts)))} "
              f"| {rate(median_ms(lambda: [folder.fold(table, [i], [t]) for i, t in enumerate(ts)]))} "
              f"| {rate(median_ms(lambda: folder.fold(table, slots, ts)))} "
              f"| {rate(median_ms(lambda: torch._foreach_norm(ts)))} "
              f"| {rate(median_ms(lambda: [torch.aminmax(t) for t in ts]))} |", flush=True)
    # the host's part of a hooked call's fold: launches of small tensors, timed without waiting for the device
    small = torch.randn(4096, device=device, dtype=torch.bfloat16)
    table = torch.tensor(schema.IDENTITY, dtype=torch.float64, device=device).repeat(1, 1)
    for _ in range(100):
        folder.fold(table, [0], [small])
    accel.synchronize()
    begin = time.perf_counter()
    for _ in range(1000):
        folder.fold(table, [0], [small])
    host_us = (time.perf_counter() - begin) * 1e3
    accel.synchronize()
    print(f"host time of one fold launch (4 K bf16 elements, 1,000 launches): {host_us:.1f} µs", flush=True)


def _print_output_bytes(args) -> None:
    import torch

    from trainmon.demo import TinyGPT

    with torch.device("meta"):
        model = TinyGPT(vocab=args.vocab, hidden=args.hidden, layers=args.layers, heads=args.heads,
                        seq=args.seq).to(dtype=getattr(torch, args.dtype))
    outputs = {}  # by id: a container returning its child's output is counted once, as the sentinel reads it

    def count(module, inputs, output):
        if isinstance(output, torch.Tensor):
            outputs[id(output)] = output  # kept, so that no id is reused (meta tensors hold no memory)

    for module in model.modules():
        module.register_forward_hook(count)
    model(torch.zeros(args.batch, args.seq, dtype=torch.long, device="meta"))
    total = sum(t.numel() * t.element_size() for t in outputs.values())
    print(f"{len(outputs)} distinct module outputs per step, {total / 2**30:.2f} GiB")


def _print_table(results: list[dict]) -> None:
    base = {r["mode"]: r for r in results if r["tier"] == "none" and "error" not in r}
    print("| mode | tier | step | × none | kernels/step | kernel time | extra | peak MB | extra MB | saved MB "
          "| host syncs (training) | other threads | records |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        if "error" in r:
            print(f"| {r['mode']} | {r['tier']} | failed: {r['error']} | | | | | | | | | | |")
            continue
        b = base.get(r["mode"])
        ratio = f"{r['step_s'] / b['step_s']:.3f}" if b else "-"
        extra_k = r["kernels"] - b["kernels"] if b else "-"
        extra_mb = f"{(r['peak_bytes'] - b['peak_bytes']) / 2**20:.0f}" if b else "-"
        print(f"| {r['mode']} | {r['tier']} | {r['step_s'] * 1e3:.1f} ms | {ratio} | {r['kernels']} | "
              f"{r['kernel_ms']:.1f} ms | {extra_k} | {r['peak_bytes'] / 2**20:.0f} | {extra_mb} | "
              f"{r['saved_bytes'] / 2**20:.0f} | {len(r['syncs_training'])} | {r['syncs_other_threads']} | {r['records']} |")
    for r in results:
        for thread, where, message in r.get("syncs_training", [])[:5]:
            print(f"host sync, {r['mode']} {r['tier']}: {where}: {message}")


if __name__ == "__main__":
    raise SystemExit(main())
