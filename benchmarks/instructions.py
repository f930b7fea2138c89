"""Instructions per hooked call, counted by valgrind's callgrind: a measure of the hooks' cost that the
machine's load does not move.

The chain is the micro-benchmark's of `frameworks.py` (a Linear and N parameter-free modules, AdamW, one
thread). Each tier runs in its own process under callgrind, which counts the training thread's instructions
over `--steps` steps after `--warmup` (only those steps run inside the one call it is told to count,
`functools.reduce`). A hooked call is one forward or one backward hook run, two per module per step:

    instructions per hooked call = (tier's instructions per step - none's) / hooked calls per step

`bare hook` is `frameworks.py`'s reference (a forward hook and a grad-node pre-hook per module, one reduction
each); `× bare` divides by its figure. The writer thread is left out.

`--job megatron` counts a step of Megatron-Core instead, in one process: the shape one rank of `frameworks.py`'s
`megatron-pp2-vpp2-small` runs (hidden 64, 4 layers, 4 micro-batches of 4 × 32 tokens), its activations of 8 K
elements and more, with Megatron's own modules and autograd functions. It reports the instructions a tier adds a step
(about 1,070 hooked calls of several kinds: no one figure per call). Timing a
change on a shared machine needs many runs to see 5%; two counts of the same code differ by well under
1%. A run under callgrind takes minutes (importing torch alone, about two), about 50 times its native time.
On x86 the native statistics library is built without AVX-512 for the count (`$CC` with `-mno-avx512f`, unless
`$CC` is set): valgrind 3.19 stops at the first AVX-512 instruction.

    python benchmarks/instructions.py --tiers none,sentinel,full,"bare hook"
    python benchmarks/instructions.py --job megatron --tiers none,full --parallel 2
    PYTHONPATH=/path/to/other/checkout python benchmarks/instructions.py --tiers none,full   # that trainmon
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

from frameworks import BARE, SCRIPTS, TIERS, free_port, micro_chain
from overhead import tier_config

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def child(tier: str, calls: int, steps: int, warmup: int) -> None:
    """Trains `micro_chain`; the counted steps run inside `functools.reduce`."""
    model, optimizer, monitor, x, out_dir = micro_chain(tier, calls, ["db"], {})

    def step(*_):
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    functools.reduce(step, range(steps), None)
    if monitor is not None:
        monitor.stop()
    shutil.rmtree(out_dir, ignore_errors=True)


def megatron_child(tier: str, steps: int, warmup: int) -> None:
    """Trains one process of Megatron-Core (see the module doc) under the tier; the counted steps run inside
    `functools.reduce`."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    sys.path.insert(0, SCRIPTS)
    import torch.distributed as dist
    import train_megatron

    with tempfile.TemporaryDirectory(prefix="trainmon_callgrind_") as tmp:
        config = tier_config(tier, ["db"], None, tiers=TIERS)
        config_path = "none"
        if config is not None:
            config_path = os.path.join(tmp, "config.json")
            with open(config_path, "w") as f:
                json.dump(config, f)
        os.environ["MONITOR_OUTPUT_DIR"] = os.path.join(tmp, "out")
        args = train_megatron.parse_args(["--hidden", "64", "--layers", "4", "--micro-batches", "4",
                                          "--config", config_path])
        chunks, optimizer = train_megatron.setup(args)
        monitor = None
        if config is not None:
            from trainmon import TrainerMon
            from trainmon.engine import stats_native

            monitor = TrainerMon(config_path)
            monitor.set_monitor(chunks, optimizer=optimizer, grad_acc_steps=args.micro_batches)
            stats_native.prepare()
        data = train_megatron.data_iterators(args, chunks)
        for _ in range(warmup):
            train_megatron.train_step(args, chunks, optimizer, data)
        functools.reduce(lambda *_: train_megatron.train_step(args, chunks, optimizer, data), range(steps), None)
        if monitor is not None:
            monitor.stop()
        dist.destroy_process_group()


def count(tier: str, args) -> dict:
    """Runs one tier under callgrind; the training thread's instructions per counted step."""
    with tempfile.TemporaryDirectory(prefix="trainmon_callgrind_") as tmp:
        out = os.path.join(tmp, "callgrind.out")
        cmd = ["valgrind", "--tool=callgrind", "--collect-atstart=no", "--toggle-collect=functools_reduce",
               "--separate-threads=yes", f"--callgrind-out-file={out}", sys.executable, __file__, "--child", tier,
               "--job", args.job, "--calls", str(args.calls), "--steps", str(args.steps), "--warmup", str(args.warmup)]
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), ROOT) if p)}
        if platform.machine() == "x86_64" and not env.get("CC", "").strip():
            # valgrind (3.19) stops at the first AVX-512 instruction: the native read is built without them here
            env["CC"] = f"{shutil.which('cc') or 'gcc'} -mno-avx512f"
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{tier} failed ({done.returncode}):\n{(done.stdout + done.stderr)[-4000:]}")
        with open(f"{out}-01") as f:  # thread 1, the training thread (only it runs the counted call)
            totals = re.search(r"^totals: (\d+)", f.read(), re.M)
    return {"tier": tier, "training_per_step": int(totals.group(1)) / args.steps}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiers", default=f"none,sentinel,full,{BARE}",
                        help=f"comma-separated, of {', '.join([*TIERS, BARE])}; none is added if missing")
    parser.add_argument("--job", choices=["chain", "megatron"], default="chain", help="what is trained (module doc)")
    parser.add_argument("--calls", type=int, default=200, help="parameter-free modules in the chain")
    parser.add_argument("--steps", type=int, default=4, help="counted steps")
    parser.add_argument("--warmup", type=int, default=6)
    parser.add_argument("--parallel", type=int, default=1, help="tiers counted at once (one core each)")
    parser.add_argument("--json", help="where to write the counts")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        if args.job == "megatron":
            megatron_child(args.child, args.steps, args.warmup)
        else:
            child(args.child, args.calls, args.steps, args.warmup)
        return 0
    if shutil.which("valgrind") is None:
        parser.error("valgrind is not installed (its callgrind tool counts the instructions)")
    tiers = args.tiers.split(",")
    unknown = [t for t in tiers if t not in TIERS and t != BARE]
    if unknown:
        parser.error(f"unknown tier {unknown}; choose from {', '.join([*TIERS, BARE])}")
    if args.job == "megatron" and BARE in tiers:
        parser.error(f"{BARE!r} is the chain's reference: it has no Megatron job")
    if "none" not in tiers:
        tiers.insert(0, "none")
    with ThreadPoolExecutor(args.parallel) as pool:
        rows = list(pool.map(lambda tier: count(tier, args), tiers))
    report(rows, args)
    return 0


def report(rows: list[dict], args) -> None:
    """Prints the counts; per hooked call on the chain, whose hooked calls a step are known."""
    base = next(r for r in rows if r["tier"] == "none")["training_per_step"]
    if args.job == "megatron":
        what = "one process of Megatron-Core (hidden 64, 4 layers, 4 micro-batches)"
        columns = ["added a step"]
        cells = [[f"{(r['training_per_step'] - base) / 1e6:.2f} M"] for r in rows]
    else:
        hooked_calls = 2 * (args.calls + 2)  # the chain, its Linear and the Sequential, forward and backward
        what = f"a chain of {args.calls} modules, {hooked_calls} hooked calls a step"
        columns = ["per hooked call", "× bare"]
        for r in rows:
            r["per_hooked_call"] = (r["training_per_step"] - base) / hooked_calls if r["tier"] != "none" else None
        bare = next((r["per_hooked_call"] for r in rows if r["tier"] == BARE), None)
        cells = [["-" if call is None else f"{call / 1e3:.1f} K",
                  f"{call / bare:.2f}" if call is not None and bare else "-"]
                 for call in (r["per_hooked_call"] for r in rows)]
    print(f"Instructions of the training thread per step ({args.steps} counted after {args.warmup}), {what}; "
          f"trainmon from {os.environ.get('PYTHONPATH') or ROOT}.\n")
    print("| " + " | ".join(["tier", "per step", "× none", *columns]) + " |")
    print("|" + " --- |" * (3 + len(columns)))
    for r, more in zip(rows, cells):
        print(f"| {r['tier']} | {r['training_per_step'] / 1e6:.1f} M | {r['training_per_step'] / base:.3f} | "
              + " | ".join(more) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": sys.argv, "pythonpath": os.environ.get("PYTHONPATH"), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
