"""What each part of the activation hooks costs on a framework job, every part measured in the same process.

`frameworks.py` compares tiers run in separate processes, whose heaps and load differ by a few percent. Here one
job runs the tier's config (default: `full`) and its steps take turns among variants of the activation hooks,
each with one part turned off:

| variant | what is off |
| --- | --- |
| base | nothing |
| no input taps | each call's identity autograd node on its inputs, or its input node's hook (so no input grads) |
| taps without records | the records of the grads the taps see (of inputs, and of outputs that are inputs); the taps still run |
| no input-node hooks | the post-hooks on the nodes that take untapped calls' inputs (no input grads there) |
| no output-grad hooks | the pre-hooks on the nodes that made module outputs (so no output grads either) |
| node hooks without records | the records of the grads the nodes' pre- and post-hooks see; the hooks still run |
| no forward records | the records of module inputs and outputs |
| hooks idle | everything: the hooks are registered and return at once |

All variants share the process, its heap and the machine's load, so their differences are the parts' costs. Rank 0
times each step by its training thread's CPU time, from the end of one `optimizer.step()` to the end of the
next (the step's forward, backward, batch reductions and optimizer step), and reports each variant's median
against base. The writer thread is not counted: what the records cost it lags the step that made them.

    python benchmarks/activation_costs.py --job megatron-pp2-vpp2-small --steps 360
"""
from __future__ import annotations

import argparse
import atexit
import json
import os
import runpy
import statistics
import sys
import tempfile
import time

from frameworks import JOBS, SCRIPTS, TIERS, tier_config, torchrun

VARIANTS = {
    "base": "nothing off",
    "no-input-taps": "no input taps",
    "taps-no-records": "taps without records",
    "no-input-node-hooks": "no input-node hooks",
    "no-output-grad-hooks": "no output-grad hooks",
    "node-hooks-no-records": "node hooks without records",
    "no-forward-records": "no forward records",
    "hooks-idle": "hooks idle",
}


def _install_variants(order: list[str], out_path: str, warmup: int) -> None:
    """Child side: patches ActivationHooks so that each step runs the next variant of `order`, and times the steps."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from trainmon.hooks import module_hooks

    hooks = module_hooks.ActivationHooks
    running = [order[0]]

    def off(name: str, variant: str, replacement) -> None:
        original = hooks.__dict__[name]
        static = isinstance(original, staticmethod)
        function = original.__func__ if static else original

        def switched(*args, **kwargs):
            return (replacement if running[0] == variant else function)(*args, **kwargs)

        setattr(hooks, name, staticmethod(switched) if static else switched)

    off("_tap_inputs", "no-input-taps", lambda call, args, kwargs: None)
    off("_record_tap_grads", "taps-no-records", lambda self, call, grads: None)
    off("_hook_input_node", "no-input-node-hooks", lambda self, *args: None)
    off("_hook_output_grads", "no-output-grad-hooks", lambda watched, micro, leaves: None)
    off("_record_grad", "node-hooks-no-records", lambda self, *args: None)
    off("_record_activations", "no-forward-records", lambda self, *args: None)
    off("_target", "hooks-idle", lambda self: None)

    times: dict[str, list[float]] = {v: [] for v in order}
    steps, last = [0], [None]

    def step_done(optimizer, args, kwargs) -> None:
        now = time.thread_time()
        if last[0] is not None and steps[0] >= warmup:
            times[running[0]].append(now - last[0])
        last[0] = now
        steps[0] += 1
        running[0] = order[steps[0] % len(order)]

    register_optimizer_step_post_hook(step_done)

    def write() -> None:
        with open(out_path, "w") as f:
            json.dump(times, f)

    if os.environ.get("RANK", "0") == "0":
        atexit.register(write)


def run(job: str, tier: str, formats: list[str], order: list[str], steps: int, warmup: int) -> dict:
    script, job_args = JOBS[job]
    with tempfile.TemporaryDirectory(prefix="trainmon_parts_") as tmp:
        config = os.path.join(tmp, "config.json")
        with open(config, "w") as f:
            json.dump(tier_config(tier, formats, tiers=TIERS), f)
        out = os.path.join(tmp, "parts.json")
        torchrun([os.path.abspath(__file__), "--child", out, "--variants", ",".join(order), "--warmup", str(warmup),
                  "--", os.path.join(SCRIPTS, script), *job_args, "--steps", str(warmup + steps), "--config", config],
                 os.path.join(tmp, "monitor_output"), job)
        with open(out) as f:
            return json.load(f)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", default="megatron-pp2-vpp2-small", help=f"one of {', '.join(JOBS)}")
    parser.add_argument("--tier", default="full", help=f"one of {', '.join(t for t in TIERS if t != 'none')}")
    parser.add_argument("--format", default="db", help="comma-separated formats")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--steps", type=int, default=360, help="timed steps, shared by the variants in turn")
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args()
    order = args.variants.split(",")
    unknown = [v for v in order if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    if args.child:
        _install_variants(order, args.child, args.warmup)
        script_argv = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
        sys.argv = script_argv
        runpy.run_path(script_argv[0], run_name="__main__")
        return 0
    if args.job not in JOBS or args.tier not in TIERS or TIERS[args.tier] is None:
        parser.error("--job and --tier must name a job and a monitored tier")
    result = run(args.job, args.tier, args.format.split(","), order, args.steps, args.warmup)
    base = statistics.median(result[order[0]])
    print(f"{args.job}, tier {args.tier}, format {args.format}: {args.steps} steps after {args.warmup} of warm-up, "
          f"taking turns among {len(order)} variants. Rank 0's training-thread CPU time per step, median:\n")
    print(f"| variant | steps | CPU/step | against {order[0]} |")
    print("| --- | --- | --- | --- |")
    for variant in order:
        times = result[variant]
        median = statistics.median(times)
        print(f"| {VARIANTS[variant]} | {len(times)} | {median * 1e3:.1f} ms | {(median - base) * 1e3:+.1f} ms |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
