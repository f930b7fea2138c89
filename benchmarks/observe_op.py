"""Host time of the two `trainmon::observe` ops a compiled graph runs for each hooked module call.

Under `torch.compile` a module's hooks run from the graph through these ops (one before its forward, one after):
the dispatcher parses their arguments and calls the Python kernel, which finds the module's hooks, unpacks the
call site's layout and, where the call's tensors are tapped for their grads, makes the scalar that carries the
hook's requests to the backward. Here the hooks do nothing, so the figure is the ops' own work; the hooks' is
`host_cost.py --compiled`'s. A chain of `--modules` Linear(4, 4) layers, compiled whole, runs its forward (grad
on, no backward) with every layer hooked, with its inputs and outputs tapped (`tapped`) or not (`not tapped`),
against the same chain unhooked; the figure is the difference a hooked call, the best of `--repeats` runs of
`--number` forwards each.

    python benchmarks/observe_op.py
"""
from __future__ import annotations

import argparse
import os
import sys
import timeit

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from trainmon.hooks import in_graph  # noqa: E402


def _chain(modules: int, grads, x: torch.Tensor) -> torch.nn.Module:
    """The chain, hooked where `grads` is not None, compiled by its first forward: the ops tap what the hooks
    registered so far watch."""
    torch.manual_seed(0)
    chain = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(modules)])
    if grads is not None:
        for layer in chain:
            in_graph.around_forward(layer, "activations", lambda module, args, kwargs: None,
                                    lambda module, args, kwargs, output: None, grads=grads, active=lambda: True)
    compiled = torch.compile(chain)
    compiled(x)
    return compiled


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modules", type=int, default=32)
    parser.add_argument("--number", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    x = torch.randn(2, 4, requires_grad=True)
    chains = {"unhooked": _chain(args.modules, None, x), "not tapped": _chain(args.modules, (), x),
              "tapped": _chain(args.modules, in_graph.ALL_GRADS, x)}
    best = {}
    for name, chain in chains.items():
        best[name] = min(timeit.repeat(lambda: chain(x), number=args.number, repeat=args.repeats)) / args.number
    print(f"{args.modules} Linear(4, 4) compiled whole, forward with grad on; best of {args.repeats} runs of "
          f"{args.number} forwards (torch {torch.__version__})")
    print(f"unhooked forward {best['unhooked'] * 1e6:8.1f} µs")
    for name in ("not tapped", "tapped"):
        per_call = (best[name] - best["unhooked"]) / args.modules
        print(f"{name:<10} forward {best[name] * 1e6:8.1f} µs, {per_call * 1e6:5.2f} µs a hooked call (two ops)")


if __name__ == "__main__":
    main()
