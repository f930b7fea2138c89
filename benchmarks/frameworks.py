"""Overhead of trainmon on the example Megatron-Core and DeepSpeed jobs, per tier, against no monitor.

Each job is `scripts/train_megatron.py` or `scripts/train_deepspeed.py` on 2 processes (torchrun on
127.0.0.1, gloo, CPU, OMP_NUM_THREADS=1), at a size where the unmonitored step takes 300 ms or more on
a 2-core machine. The tiers are those of `overhead.py` (same configs, same ops); `all` adds the remaining
families (update ratio, momentum/grad direction, collectives) and the sentinel; `full-forward` and
`full-backward` are the full tier with `forward_only` or `backward_only`.

Inside each job rank 0 times every `optimizer.step()`-delimited step (`--timings`); the figure is the
median over the steps after warm-up, pooled over the repeats. Tiers run interleaved: each repeat runs
every tier of a job back to back, in reverse order on odd repeats, so a drift in the machine's load
does not land on one tier. `× none` compares pooled medians; `per repeat` gives each repeat's own ratio
(tier / none of the same repeat), a measure of the noise.

Hooked calls: the jobs also count, over one extra step, the module forward calls and the calls whose
output received a grad (a monitor's module hooks run once in each), averaged over the two ranks. The
added time per step divided by that count is the cost per hooked call: an upper bound, since a tier's
per-parameter and per-step work is counted in it too. The micro-benchmark isolates it: a parameter-free
chain of N modules (one Linear in front) trained with and without the tier's hooks, in one process,
plainly and under the CPU shim the Megatron jobs run in (a TorchFunctionMode that sees every torch call).
Its `bare hook` row is the reference a machine's speed cancels out of: per module a plain forward hook
that launches one reduction of the output and puts a pre-hook on its grad node launching one reduction
of the grad, the least any monitor of activations and their grads runs; `× bare` divides a tier's cost
per hooked call by it.

    python benchmarks/frameworks.py --steps 20 --warmup 5 --repeats 2 --json frameworks.json
    python benchmarks/frameworks.py --jobs megatron-tp2 --tiers none,full --steps 4 --warmup 2 --repeats 1

`megatron-pp2-vpp2-small` (hidden 64, 4 micro-batches, interleaved pipeline) is not among the default jobs:
a small, fast model where the cost per hooked call, not the statistics, decides the ratios.

Two processes of the same job differ by up to ±20% in step time on a busy 2-core machine. `--interleave k`
measures each tier inside its own process instead: the monitor collects every k-th step, and the collected
steps are compared with the idle ones (`in_run_ratio`). The sentinel, which probes every step whatever the
schedule, has no such figure.

    python benchmarks/frameworks.py --jobs megatron-pp2-vpp2-small --tiers none,full --steps 40 --warmup 4 \
        --repeats 2 --micro-calls 0 --format db --interleave 4
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

from overhead import TIERS as BASE_TIERS
from overhead import attach_monitor, tier_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "scripts")
TIERS = {**BASE_TIERS,
         "all": {**BASE_TIERS["full"], "ur_distribution": True, "mg_direction": True,
                 "cc_distribution": {"enable": True, "cc_pre_hook": True}, "sentinel": True},
         # the full tier's activations one way only: what recording them and recording their grads each cost
         "full-forward": {**BASE_TIERS["full"], "forward_only": True},
         "full-backward": {**BASE_TIERS["full"], "backward_only": True}}
DEFAULT_TIERS = ["none", "sentinel", "wg", "wg+xy", "full"]

# Sizes: the unmonitored step takes 300 ms or more on the 2-core benchmark machine (see the README).
_MEGATRON = ["--hidden", "256", "--layers", "4", "--seq", "128", "--mbs", "4", "--micro-batches", "2",
             "--vocab", "1024"]
_DEEPSPEED = ["--hidden", "256", "--layers", "4", "--seq", "128", "--mbs", "4", "--vocab", "1024"]
JOBS = {
    "megatron-tp2": ("train_megatron.py", ["--tp", "2", *_MEGATRON]),
    "megatron-pp2": ("train_megatron.py", ["--pp", "2", *_MEGATRON]),
    "zero2": ("train_deepspeed.py", ["--stage", "2", *_DEEPSPEED]),
    "zero3": ("train_deepspeed.py", ["--stage", "3", *_DEEPSPEED]),
    # A small, fast model, where a hooked call is cheap for the model: the monitor's cost per call dominates.
    "megatron-pp2-vpp2-small": ("train_megatron.py", ["--pp", "2", "--vpp", "2", "--hidden", "64",
                                                      "--micro-batches", "4"]),
}
DEFAULT_JOBS = ["megatron-tp2", "megatron-pp2", "zero2", "zero3"]
NPROC = 2
JOB_TIMEOUT_S = 600


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(argv: list[str], out_dir: str, what: str) -> None:
    """Runs `argv` (a script and its arguments) in NPROC processes under torchrun on 127.0.0.1, as the jobs run:
    one thread each, DeepSpeed on the CPU, trainmon's output in `out_dir`. Raises with the output's end if
    `what` fails."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "MONITOR_OUTPUT_DIR": out_dir,
           "PYTHONPATH": os.pathsep.join(p for p in (ROOT, SCRIPTS, os.environ.get("PYTHONPATH")) if p)}
    env.pop("DYNAMIC_MONITOR", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={NPROC}", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", *argv]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed ({done.returncode}):\n{(done.stdout + done.stderr)[-4000:]}")


def run_job(job: str, tier: str, formats: list[str], steps: int, extra: dict, interleave: int = 1) -> dict:
    """One torchrun job; returns rank 0's step times, the hooked calls per rank and the bytes written. With
    `interleave` k > 1 the monitor collects every k-th step (steps 0, k, 2k, ...)."""
    script, job_args = JOBS[job]
    with tempfile.TemporaryDirectory(prefix="trainmon_fw_") as tmp:
        config = tier_config(tier, formats, extra if tier != "none" else None, interleave, tiers=TIERS)
        config_arg = "none"
        if config is not None:
            config_arg = os.path.join(tmp, "config.json")
            with open(config_arg, "w") as f:
                json.dump(config, f)
        out_dir = os.path.join(tmp, "monitor_output")
        start = time.perf_counter()
        torchrun([os.path.join(SCRIPTS, script), *job_args, "--steps", str(steps), "--config", config_arg,
                  "--timings", os.path.join(tmp, "timings")], out_dir, f"{job} {tier}")
        ranks = []
        for rank in range(NPROC):
            with open(os.path.join(tmp, f"timings.rank{rank}.json")) as f:
                ranks.append(json.load(f))
        disk = sum(os.path.getsize(os.path.join(d, name)) for d, _, names in os.walk(out_dir) for name in names)
    return {"step_s": ranks[0]["step_s"], "cpu_s": ranks[0]["cpu_s"], "thread_s": ranks[0]["thread_s"],
            "gc_s": ranks[0]["gc_s"],
            "calls": [r["calls"] for r in ranks],
            "disk_bytes_per_rank_step": disk / NPROC / (steps + 1), "job_s": time.perf_counter() - start}


BARE = "bare hook"  # the micro-benchmark's reference (`attach_bare_hooks`), run with every tier list


def attach_bare_hooks(model) -> None:
    """Per module, one forward hook launching a reduction of the output, and on the output's grad node a
    pre-hook launching a reduction of the grad: two hooked calls, one op each, nothing recorded."""
    def on_grad(grads):
        grads[0].sum()

    def on_output(module, args, output):
        output.detach().sum()
        output.grad_fn.register_prehook(on_grad)

    for module in model.modules():
        module.register_forward_hook(on_output)


def micro_chain(tier: str, calls: int, formats: list[str], extra: dict) -> tuple:
    """The micro-benchmark's run: a parameter-free chain of `calls` modules behind one Linear, its AdamW, the
    tier's monitor (None for `none`, and for BARE, whose hooks `attach_bare_hooks` puts on), its input and the
    monitor's output folder. One thread."""
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), *[torch.nn.GELU() for _ in range(calls)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    out_dir = tempfile.mkdtemp(prefix="trainmon_micro_")
    os.environ["MONITOR_OUTPUT_DIR"] = out_dir
    monitor = None
    if tier == BARE:
        attach_bare_hooks(model)
    else:
        monitor = attach_monitor(tier_config(tier, formats, extra if tier != "none" else None, tiers=TIERS),
                                 out_dir, model, optimizer)
    return model, optimizer, monitor, torch.randn(8, 16), out_dir


def micro_child(tier: str, formats: list[str], calls: int, steps: int, warmup: int, shim: bool, extra: dict) -> dict:
    """Trains `micro_chain` and times every step (child side)."""
    sys.path.insert(0, SCRIPTS)
    from step_timer import GcClock

    model, optimizer, monitor, x, out_dir = micro_chain(tier, calls, formats, extra)
    if shim:
        from cpu_shims import CudaToCpuMode

        CudaToCpuMode().__enter__()
    wall, cpu, thread, in_gc = [], [], [], []
    clock = GcClock()
    for _ in range(warmup + steps):
        start = (time.perf_counter(), time.process_time(), time.thread_time())
        clock.take()
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        wall.append(time.perf_counter() - start[0])
        cpu.append(time.process_time() - start[1])
        thread.append(time.thread_time() - start[2])
        in_gc.append(clock.take())
    clock.close()
    if monitor is not None:
        monitor.stop()
    shutil.rmtree(out_dir, ignore_errors=True)
    # Module calls per step: the chain, its Linear and the Sequential around them, each forward and backward.
    return {"step_s": wall, "cpu_s": cpu, "thread_s": thread, "gc_s": in_gc,
            "calls": [{"forward": calls + 2, "backward": calls + 2}]}


def run_micro(tier: str, formats: list[str], calls: int, steps: int, warmup: int, shim: bool, extra: dict) -> dict:
    cmd = [sys.executable, __file__, "--micro-child", tier, "--format", ",".join(formats), "--micro-calls",
           str(calls), "--steps", str(steps), "--warmup", str(warmup), "--extra", json.dumps(extra)]
    if shim:
        cmd.append("--shim")
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"micro {tier} failed ({done.returncode}):\n{(done.stdout + done.stderr)[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def in_run_ratio(times: list[float], warmup: int, interleave: int) -> float:
    """The collected steps' time against the idle ones' of the same run (`--interleave` k, at least 3).

    A cycle is a collected step and the k - 1 idle steps after it. The writer thread's work on a collected step
    ends in the next one, so that step counts with it; the steps after are the base: ratio = 1 + (median of the
    collected steps + median of the next ones - 2 * base) / base, base the median of the other idle steps.
    Registered hooks cost an idle step something too (they return at once), which this leaves out."""
    first = warmup + (-warmup) % interleave
    cycles = [times[i:i + interleave] for i in range(first, len(times) - interleave + 1, interleave)]
    base = statistics.median(t for cycle in cycles for t in cycle[2:])
    collected, next_ = (statistics.median(cycle[i] for cycle in cycles) for i in (0, 1))
    return 1 + (collected + next_ - 2 * base) / base


def summarize(runs: list[dict], warmup: int, interleave: int = 1) -> list[dict]:
    """One row per (job, tier): pooled medians of wall and CPU time per step, ratios against `none`,
    per-repeat ratios, the added time per hooked call, and the mean wall and garbage collection time per
    step (the jobs'); with `interleave` > 1, the in-run ratios of each repeat (`in_run_ratio`). Runs' step
    lists start after the warm-up."""
    rows = []
    for key in dict.fromkeys(r["job"] for r in runs):
        mine = [r for r in runs if r["job"] == key]
        pooled: dict = {}
        for r in mine:
            for metric in ("step_s", "cpu_s", "thread_s", "gc_s"):
                if metric in r:
                    pooled.setdefault((r["tier"], metric), []).extend(r[metric][warmup:])
        median = {k: statistics.median(v) for k, v in pooled.items()}
        repeat_median = {(r["tier"], r["repeat"]): statistics.median(r["step_s"][warmup:]) for r in mine}
        for tier in dict.fromkeys(r["tier"] for r in mine):
            tier_runs = [r for r in mine if r["tier"] == tier]
            calls = statistics.mean(c["forward"] + c["backward"] for c in tier_runs[0]["calls"])
            row = {"job": key, "tier": tier, "steps": len(pooled[tier, "step_s"]), "hooked_calls_per_step": calls,
                   "per_repeat": [repeat_median[tier, r["repeat"]] / repeat_median["none", r["repeat"]]
                                  for r in tier_runs if ("none", r["repeat"]) in repeat_median]}
            for metric, name in (("step_s", "wall"), ("cpu_s", "cpu"), ("thread_s", "thread")):
                if (tier, metric) not in median:
                    continue
                value, base = median[tier, metric], median.get(("none", metric))
                row[f"{name}_ms"] = value * 1e3
                row[f"{name}_ratio"] = value / base if base else None
                # Module hooks run in every tier but `wg` (grad hooks on parameters only).
                row[f"{name}_us_per_hooked_call"] = ((value - base) / calls * 1e6
                                                     if base and tier not in ("none", "wg") else None)
            if (tier, "gc_s") in pooled:
                mean = statistics.mean(pooled[tier, "step_s"])
                base = statistics.mean(pooled["none", "step_s"]) if ("none", "step_s") in pooled else None
                row["wall_mean_ms"], row["wall_mean_ratio"] = mean * 1e3, mean / base if base else None
                row["gc_ms"] = statistics.mean(pooled[tier, "gc_s"]) * 1e3
            if interleave > 1 and not (TIERS.get(tier) or {}).get("sentinel"):  # it probes every step
                for metric, name in (("step_s", "wall"), ("cpu_s", "cpu"), ("thread_s", "thread")):
                    row[f"{name}_in_run"] = [in_run_ratio(r[metric], warmup, interleave) for r in tier_runs]
            if "disk_bytes_per_rank_step" in tier_runs[0]:
                row["disk_kb_per_rank_step"] = statistics.mean(r["disk_bytes_per_rank_step"] for r in tier_runs) / 1024
            rows.append(row)
    return rows


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_tables(rows: list[dict], micro_rows: list[dict], args) -> None:
    if rows:
        _print_jobs(rows, args)
    if micro_rows:
        _print_micro(micro_rows, args)


def _print_in_run(rows: list[dict], args) -> None:
    print(f"{args.steps} collected steps after {args.warmup} of warm-up, each followed by {args.interleave - 1} idle "
          f"one(s), {args.repeats} repeat(s), format {args.format}. Rank 0's in-run ratio per repeat "
          "(`in_run_ratio`: collected against idle steps of the same process) and their median, in wall time, "
          "in the process's CPU time (every thread) and in the training thread's; the `none` row is the method's own "
          "bias.\n")
    print("| job | tier | wall, per repeat | median | CPU, per repeat | median | training thread, per repeat | median |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        if "wall_in_run" not in r:
            continue
        cells = " | ".join(f"{', '.join(f'{x:.3f}' for x in r[name])} | {statistics.median(r[name]):.3f}"
                           for name in ("wall_in_run", "cpu_in_run", "thread_in_run"))
        print(f"| {r['job']} | {r['tier']} | {cells} |")


def _print_jobs(rows: list[dict], args) -> None:
    if args.interleave > 1:
        _print_in_run(rows, args)
        return
    print(f"{args.steps} steps after {args.warmup} of warm-up, {args.repeats} repeat(s), format {args.format}. "
          "Rank 0's median wall time per step, its ratio against `none` (pooled, and per repeat), the same "
          "for the process's CPU time (every thread), the added time per hooked call in both, and the mean wall "
          "time per step with the mean time in Python's garbage collector (pauses a median hides).\n")
    print("| job | tier | wall/step | × none | per repeat | CPU/step | CPU × none | hooked calls/step "
          "| µs per hooked call: wall | CPU | mean wall/step | × none | GC/step | disk/rank/step |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        per_repeat = ", ".join(f"{x:.2f}" for x in r["per_repeat"]) if r["tier"] != "none" else ""
        print(f"| {r['job']} | {r['tier']} | {r['wall_ms']:.0f} ms | {_fmt(r['wall_ratio'], '.3f')} | {per_repeat} "
              f"| {r['cpu_ms']:.0f} ms | {_fmt(r['cpu_ratio'], '.3f')} | {r['hooked_calls_per_step']:.0f} "
              f"| {_fmt(r['wall_us_per_hooked_call'], '.0f')} | {_fmt(r['cpu_us_per_hooked_call'], '.0f')} "
              f"| {r['wall_mean_ms']:.0f} ms | {_fmt(r['wall_mean_ratio'], '.3f')} | {r['gc_ms']:.1f} ms "
              f"| {r['disk_kb_per_rank_step']:.1f} KB |")


def _print_micro(micro_rows: list[dict], args) -> None:
    print(f"\nMicro-benchmark: a chain of {args.micro_calls} parameter-free modules in one process; a hooked call "
          "is one forward or one backward hook run; µs per hooked call = added time per step / hooked calls, "
          "in wall time, in the training thread's CPU time (the hooks and the step's own work) and in the "
          "process's CPU time (the writer thread too); the mean step and the mean time in Python's garbage "
          "collector per step; `× bare`: the training thread's µs per hooked call against the `bare hook` row's "
          "(a forward hook and a grad-node pre-hook per module, one reduction each).\n")
    print("| setting | tier | step | × none | per repeat | µs per hooked call: wall | training thread | × bare "
          "| process | mean step | GC/step |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    bare = {r["job"]: r.get("thread_us_per_hooked_call") for r in micro_rows if r["tier"] == BARE}
    for r in micro_rows:
        per_repeat = ", ".join(f"{x:.2f}" for x in r["per_repeat"]) if r["tier"] != "none" else ""
        thread, reference = r.get("thread_us_per_hooked_call"), bare.get(r["job"])
        times_bare = thread / reference if thread is not None and reference else None
        print(f"| {r['job']} | {r['tier']} | {r['wall_ms']:.1f} ms | {_fmt(r['wall_ratio'], '.3f')} | {per_repeat} "
              f"| {_fmt(r['wall_us_per_hooked_call'], '.1f')} | {_fmt(thread, '.1f')} | {_fmt(times_bare, '.2f')} "
              f"| {_fmt(r['cpu_us_per_hooked_call'], '.1f')} | {r['wall_mean_ms']:.1f} ms | {r['gc_ms']:.2f} ms |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", default=",".join(DEFAULT_JOBS),
                        help=f"comma-separated, of {', '.join(JOBS)}; empty: the micro-benchmark only")
    parser.add_argument("--tiers", default=",".join(DEFAULT_TIERS), help=f"comma-separated, of {', '.join(TIERS)}")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per job, after the warm-up")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2, help="runs of every (job, tier), interleaved")
    parser.add_argument("--interleave", type=int, default=1,
                        help="k >= 3: the jobs' monitor collects every k-th step, and each tier is measured against "
                             "its own idle steps (`--steps` collected steps a run)")
    parser.add_argument("--format", default="csv,db", help="comma-separated formats for the monitored tiers")
    parser.add_argument("--extra", default="{}", help="JSON merged into every monitored config")
    parser.add_argument("--micro-calls", type=int, default=200, help="modules in the micro-benchmark (0: skip it)")
    parser.add_argument("--micro-steps", type=int, default=100, help="timed steps of each micro-benchmark run")
    parser.add_argument("--json", default="frameworks.json", help="where to write every run and the summary")
    parser.add_argument("--micro-child", help=argparse.SUPPRESS)
    parser.add_argument("--shim", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    formats, extra = args.format.split(","), json.loads(args.extra)
    if args.interleave == 2 or args.interleave < 1:
        parser.error("--interleave is 1 (off) or at least 3: a collected step, the step its writer work ends in, "
                     "and idle steps")
    if args.micro_child:
        print(json.dumps(micro_child(args.micro_child, formats, args.micro_calls, args.steps, args.warmup,
                                     args.shim, extra)))
        return 0
    jobs, tiers = [j for j in args.jobs.split(",") if j], args.tiers.split(",")
    for name, known in (("job", JOBS), ("tier", TIERS)):
        unknown = [x for x in (jobs if name == "job" else tiers) if x not in known]
        if unknown:
            parser.error(f"unknown {name} {unknown}; choose from {', '.join(known)}")
    runs, micro_runs = [], []
    for repeat in range(args.repeats):
        order = tiers if repeat % 2 == 0 else tiers[::-1]
        for job in jobs:
            for tier in order:
                result = run_job(job, tier, formats, args.warmup + args.steps * args.interleave, extra,
                                 args.interleave)
                runs.append({"job": job, "tier": tier, "repeat": repeat, **result})
                print(f"[{time.strftime('%H:%M:%S')}] repeat {repeat} {job} {tier}: median "
                      f"{statistics.median(result['step_s'][args.warmup:]) * 1e3:.1f} ms ({result['job_s']:.0f} s)",
                      file=sys.stderr, flush=True)
        if args.micro_calls:
            micro_order = [*order, BARE] if repeat % 2 == 0 else [BARE, *order]
            for shim in (False, True):
                for tier in micro_order:
                    result = run_micro(tier, formats, args.micro_calls, args.micro_steps, args.warmup, shim, extra)
                    micro_runs.append({"job": "micro, CPU shim" if shim else "micro", "tier": tier,
                                       "repeat": repeat, **result})
    rows = summarize(runs, args.warmup, args.interleave)
    micro_rows = summarize(micro_runs, args.warmup) if micro_runs else []
    print_tables(rows, micro_rows, args)
    with open(args.json, "w") as f:
        json.dump({"command": sys.argv, "date": time.strftime("%Y-%m-%d %H:%M"), "jobs": {j: JOBS[j] for j in jobs},
                   "configs": {t: tier_config(t, formats, extra if t != "none" else None, tiers=TIERS)
                               for t in tiers},
                   "rows": rows, "micro_rows": micro_rows, "runs": runs, "micro_runs": micro_runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
