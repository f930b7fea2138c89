"""Forward and backward module hooks: activations (`actv`) and grads with respect to them (`actv_grad`)."""
from __future__ import annotations

import collections
import warnings
from dataclasses import dataclass, field
from typing import Optional

import torch

from trainmon.monitor.records import ACTV, ACTV_GRAD, RecordKey
from trainmon.monitor.state import HookState
from trainmon.monitor.tensor_select import floating_leaves


@dataclass
class WatchedModule:
    """A module whose activations are recorded, with its `targets` entry (tuple selectors)."""

    name: str
    module: torch.nn.Module
    vpp_stage: int
    input_sel: Optional[object] = None
    output_sel: Optional[object] = None
    input_grad_sel: Optional[object] = None
    output_grad_sel: Optional[object] = None
    # (micro_step, call name) of forward calls whose backward has not run yet: backward hooks fire
    # in forward order per module, also under pipeline schedules that interleave micro-batches.
    pending_backward: collections.deque = field(default_factory=collections.deque)
    calls_in_micro: tuple = (-1, -1, 0)  # (step, micro_step, number of forward calls seen in it)


class ActivationHooks:
    """Registers forward hooks (and full backward hooks) on the watched modules."""

    def __init__(self, state: HookState, modules: list[WatchedModule], forward: bool, backward: bool):
        self.state = state
        self.modules = modules
        self.forward = forward
        self.backward = backward
        self._handles: list = []

    def install(self) -> None:
        # Modules fed only integer tensors (embeddings) have no input grads; torch warns about that on
        # every such module, while trainmon simply records their output grads.
        warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed "
                                "with respect to module outputs", category=UserWarning)
        for watched in self.modules:
            item = f"activations of {watched.name or '<root>'}"
            self._handles.append(watched.module.register_forward_hook(
                self.state.guarded(item, self._make_forward(watched))))
            if self.backward:
                self._handles.append(watched.module.register_full_backward_hook(
                    self.state.guarded(item, self._make_backward(watched))))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for watched in self.modules:
            watched.pending_backward.clear()

    def _call_name(self, watched: WatchedModule, micro: int) -> str:
        step = self.state.collector.step
        last_step, last_micro, calls = watched.calls_in_micro
        calls = calls + 1 if (last_step, last_micro) == (step, micro) else 1
        watched.calls_in_micro = (step, micro, calls)
        # A module called several times in one micro-step gets one record per call.
        return watched.name if calls == 1 else f"{watched.name}#{calls - 1}"

    def _make_forward(self, watched: WatchedModule):
        state = self.state

        def forward_hook(module, args, output):
            if not state.collecting:
                return
            micro = max(state.forward_micro, 0)
            name = self._call_name(watched, micro)
            if self.backward and torch.is_grad_enabled():
                watched.pending_backward.append((micro, name))
            if self.forward:
                self._record(ACTV, watched, name, micro, args, output,
                             watched.input_sel, watched.output_sel)

        return forward_hook

    def _make_backward(self, watched: WatchedModule):
        state = self.state

        def backward_hook(module, grad_input, grad_output):
            if not state.collecting or not watched.pending_backward:
                return
            micro, name = watched.pending_backward.popleft()
            self._record(ACTV_GRAD, watched, name, micro, grad_input, grad_output,
                         watched.input_grad_sel, watched.output_grad_sel)

        return backward_hook

    def _record(self, family, watched, name, micro, inputs, outputs, input_sel, output_sel) -> None:
        leaves = floating_leaves(inputs, input_sel, f"{name}.input") + \
            floating_leaves(outputs, output_sel, f"{name}.output")
        if not leaves:
            return
        collector = self.state.collector
        keys = [RecordKey(family, leaf_name, watched.vpp_stage, micro, collector.next_call_index(),
                          tuple(t.shape), str(t.dtype)) for leaf_name, t in leaves]
        collector.record(keys, [t for _, t in leaves], defer=True)
