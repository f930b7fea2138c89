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


class NodeGrads:
    """A post-hook on an autograd node: hands `callback(grad_inputs[input_index], grad_outputs[output_nr])`, the
    grad the node computed for its input edge `input_index` and (where `output_nr` is not None, else None) the
    grad it was given for its output `output_nr`. Made once per recurring call, like `OutputGrad`."""

    __slots__ = ("callback", "input_index", "output_nr")

    def __init__(self, callback: Callable, input_index: int, output_nr):
        self.callback, self.input_index, self.output_nr = callback, input_index, output_nr

    def __call__(self, grad_inputs: tuple, grad_outputs: tuple) -> None:
        self.callback(grad_inputs[self.input_index], None if self.output_nr is None else grad_outputs[self.output_nr])


_ACCUMULATE_GRAD = torch._C._functions.AccumulateGrad


NO_CONSUMER = ()  # what `sole_consumer` finds where no node behind `start` takes `target`'s output


def sole_consumer(start, target, target_nr: int, budget: int = 8):
    """(node, i): the one autograd node among `start` and the nodes behind it whose input edge `i` is output
    `target_nr` of node `target`; NO_CONSUMER where none is; None where more than one is, or where more than
    `budget` nodes lie between `start` and `target` or a leaf (a module's nodes stop at its input and its
    parameters; a walk that goes further has left the module, and says nothing)."""
    found, stack, seen = None, [start], {start}
    while stack:
        budget -= 1
        if budget < 0:
            return None
        node = stack.pop()
        for i, (behind, nr) in enumerate(node.next_functions):
            if behind is target:
                if nr != target_nr or found is not None:
                    return None
                found = (node, i)
            elif behind is not None and type(behind) is not _ACCUMULATE_GRAD and behind not in seen:
                seen.add(behind)
                stack.append(behind)
    return NO_CONSUMER if found is None else found
