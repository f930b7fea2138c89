"""Reading the grad of a tensor made in the forward pass, when the backward pass computes it."""
from __future__ import annotations

from typing import Callable

import torch


def watch_grad(tensor: torch.Tensor, callback: Callable[[torch.Tensor], None]) -> None:
    """Calls `callback(grad)` with the grad of `tensor` (a non-leaf: it has a `grad_fn`) each time the
    backward pass computes it; not when no grad reaches it.

    A pre-hook on the autograd node that made the tensor sees the grad a tensor hook
    (`Tensor.register_hook`) would, before that node runs, for about half the cost of registering it: no
    handle and no per-tensor hook dict, for hooks that live as long as the graph.
    """
    tensor.grad_fn.register_prehook(OutputGrad(callback, tensor.output_nr))


class OutputGrad:
    """The pre-hook `watch_grad` registers, for a tensor that is output `output_nr` of its node: it hands the
    node's grad of that output to `callback`. Hooks that recur every step can be made once and registered on
    each step's node (`tensor.grad_fn.register_prehook`). One object that lives as long as the graph (a
    `functools.partial` would be two, for Python's garbage collector to track)."""

    __slots__ = ("callback", "output_nr")

    def __init__(self, callback: Callable[[torch.Tensor], None], output_nr: int):
        self.callback, self.output_nr = callback, output_nr

    def __call__(self, grads: tuple) -> None:
        grad = grads[self.output_nr]
        if grad is not None:
            self.callback(grad)
