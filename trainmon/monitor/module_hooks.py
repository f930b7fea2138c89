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
    """Registers forward hooks (and backward hooks) on the watched modules.

    Activation grads come from torch's full backward hooks (`grad_input` and `grad_output` of each
    module call). Where a framework's in-place operations reject the views those hooks put around
    module outputs (Megatron), `output_grads_only` takes the grads with respect to each output from
    tensor hooks instead, which leave the outputs untouched; input grads are then not recorded.
    """

    def __init__(self, state: HookState, modules: list[WatchedModule], forward: bool, backward: bool,
                 output_grads_only: bool = False):
        self.state = state
        self.modules = modules
        self.forward = forward
        self.backward = backward
        self.output_grads_only = output_grads_only
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
            if self.backward and not self.output_grads_only:
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
                if self.output_grads_only:
                    self._hook_output_grads(watched, name, micro, output)
                else:
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

    def _hook_output_grads(self, watched: WatchedModule, name: str, micro: int, output) -> None:
        for leaf_name, tensor in floating_leaves(output, watched.output_grad_sel, f"{name}.output"):
            if tensor.requires_grad:
                tensor.register_hook(self.state.guarded(
                    f"activations of {watched.name or '<root>'}",
                    lambda grad, leaf_name=leaf_name: self._record_grad(watched, leaf_name, micro, grad)))

    def _record_grad(self, watched: WatchedModule, leaf_name: str, micro: int, grad: torch.Tensor) -> None:
        if not self.state.collecting:
            return
        collector = self.state.collector
        key = RecordKey(ACTV_GRAD, leaf_name, watched.vpp_stage, micro, collector.next_call_index(),
                        tuple(grad.shape), str(grad.dtype))
        collector.record([key], [grad], defer=True)

    def _record(self, family, watched, name, micro, inputs, outputs, input_sel, output_sel) -> None:
        leaves = floating_leaves(inputs, input_sel, f"{name}.input") + \
            floating_leaves(outputs, output_sel, f"{name}.output")
        if not leaves:
            return
        collector = self.state.collector
        keys = [RecordKey(family, leaf_name, watched.vpp_stage, micro, collector.next_call_index(),
                          tuple(t.shape), str(t.dtype)) for leaf_name, t in leaves]
        collector.record(keys, [t for _, t in leaves], defer=True)
