"""The NaN sentinel: a device-side non-finite probe on every module output, module grad, weight grad and
updated weight, every step, whatever `targets` and the statistic switches say.

A probe is the tensor's sum accumulated in fp32: it is NaN or ±Inf exactly when an element is, except
that a finite tensor whose sum exceeds fp32's range (|sum| > 3.4e38) also trips it, which is itself a
numerical fault. Probes are written into a preallocated device buffer, one slot per probed event in
the order of the events (each event's `call_index` is kept in its key), and the filled part of the
buffer joins the step's single device->host copy. Nothing is read on the host inside the hooks.
"""
from __future__ import annotations

import collections
import warnings
from typing import Optional

import torch

from trainmon.monitor.records import ACTV, ACTV_GRAD, GRAD_UNREDUCED, PARAM_UPDATED, RecordKey
from trainmon.monitor.selection import display_name
from trainmon.monitor.state import HookState
from trainmon.monitor.tensor_select import floating_leaves

_INITIAL_SLOTS = 1024


def probe(tensor: torch.Tensor) -> torch.Tensor:
    """fp32 sum of `tensor`: non-finite iff one of its elements is (see the module docstring)."""
    if tensor.dtype == torch.float64:
        return tensor.detach().sum()
    return tensor.detach().sum(dtype=torch.float32)


class _ProbeBuffer:
    """Slots for one step's probes on the device; grows between steps when a step needs more."""

    def __init__(self):
        self.keys: list[RecordKey] = []
        self._buffer: Optional[torch.Tensor] = None
        self._overflow: list[torch.Tensor] = []
        self._capacity = _INITIAL_SLOTS

    def write(self, keys: list[RecordKey], tensors: list[torch.Tensor]) -> None:
        if self._buffer is None:
            self._buffer = torch.empty(self._capacity, dtype=torch.float32, device=tensors[0].device)
        values = (probe(tensors[0]) if len(tensors) == 1 else torch.stack([probe(t) for t in tensors])).reshape(-1)
        start = len(self.keys)
        self.keys.extend(keys)
        fit = max(0, min(len(self.keys), self._buffer.numel()) - start)
        if fit:
            self._buffer[start:start + fit].copy_(values[:fit])
        if fit < len(keys):
            # The buffer grows at the next step; within a step the excess probes are kept aside.
            self._overflow.append(values[fit:].to(torch.float32))

    def filled(self) -> Optional[torch.Tensor]:
        """The probes written this step, in slot order (a device tensor), or None."""
        if not self.keys:
            return None
        if not self._overflow:
            return self._buffer[:len(self.keys)]
        return torch.cat([self._buffer] + self._overflow)

    def reset(self) -> None:
        if self._overflow:
            self._capacity = int(len(self.keys) * 1.25) + 1
            self._buffer = None
        self.keys = []
        self._overflow = []


class _SentinelModule:
    __slots__ = ("name", "module", "vpp_stage", "pending_micro")

    def __init__(self, name: str, module: torch.nn.Module, vpp_stage: int):
        self.name = name
        self.module = module
        self.vpp_stage = vpp_stage
        self.pending_micro: collections.deque = collections.deque()


class NanSentinel:
    """Installs the sentinel's hooks; `close_step()` adds the step's probes to the collector.

    Args:
        state: the shared hook state (collector, forward micro-step).
        modules: (name, module, vpp_stage) of every module of every model chunk.
        params: (name, parameter, vpp_stage) of every trainable parameter; its grad is read from
            `param.main_grad` when that exists (Megatron), else `param.grad`.
    """

    def __init__(self, state: HookState, modules: list[tuple], params: list[tuple]):
        self.state = state
        self.modules = [_SentinelModule(*m) for m in modules]
        self.params = params
        self.slots = _ProbeBuffer()
        self._handles: list = []
        self._backward_micro = 0
        self._callback_queued = False

    def install(self) -> None:
        # Modules fed only integer tensors (embeddings) have no input grads; torch warns about that on
        # every such module, while the sentinel simply probes their output grads.
        warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed "
                                "with respect to module outputs", category=UserWarning)
        for watched in self.modules:
            item = f"NaN sentinel on {watched.name or '<root>'}"
            self._handles.append(watched.module.register_forward_hook(
                self.state.guarded(item, self._make_forward(watched))))
            self._handles.append(watched.module.register_full_backward_hook(
                self.state.guarded(item, self._make_backward(watched))))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for watched in self.modules:
            watched.pending_micro.clear()
        self.slots.reset()

    # ------------------------------------------------------------------------------------ hooks
    def _probe(self, family: str, leaves: list, vpp_stage: int, micro: Optional[int]) -> None:
        leaves = [(n, t) for n, t in leaves if t.numel()]
        if not leaves:
            return
        collector = self.state.collector
        keys = [RecordKey(family, name, vpp_stage, micro, collector.next_call_index(), tuple(t.shape),
                          str(t.dtype)) for name, t in leaves]
        self.slots.write(keys, [t for _, t in leaves])

    def _make_forward(self, watched: _SentinelModule):
        state = self.state

        def forward_hook(module, args, output):
            micro = max(state.forward_micro, 0)
            if torch.is_grad_enabled():
                watched.pending_micro.append(micro)
            self._probe(ACTV, floating_leaves(output, None, f"{watched.name}.output"), watched.vpp_stage, micro)

        return forward_hook

    def _make_backward(self, watched: _SentinelModule):
        def backward_hook(module, grad_input, grad_output):
            if not watched.pending_micro:
                return
            micro = watched.pending_micro.popleft()
            self._ensure_end_of_backward()
            # The grad arriving at the module first, then the one it computed: a fault inside the
            # module's backward shows in grad_input and is named after the module.
            leaves = floating_leaves(grad_output, None, f"{watched.name}.output") + \
                floating_leaves(grad_input, None, f"{watched.name}.input")
            self._probe(ACTV_GRAD, leaves, watched.vpp_stage, micro)

        return backward_hook

    def _ensure_end_of_backward(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(
                self.state.guarded("NaN sentinel on weight grads", self._end_of_backward))

    @staticmethod
    def _grad(param: torch.nn.Parameter) -> Optional[torch.Tensor]:
        main_grad = getattr(param, "main_grad", None)
        return main_grad if main_grad is not None else param.grad

    def _end_of_backward(self) -> None:
        """Probes every weight grad as accumulated so far, once per backward pass (micro-batch)."""
        self._callback_queued = False
        grads = [(name, self._grad(p), vpp) for name, p, vpp in self.params]
        for vpp in sorted({vpp for _, g, vpp in grads if g is not None}):
            leaves = [(name, g) for name, g, v in grads if g is not None and v == vpp]
            self._probe(GRAD_UNREDUCED, leaves, vpp, self._backward_micro)
        self._backward_micro += 1

    # ----------------------------------------------------------------------------- step cycle
    def close_step(self) -> None:
        """Probes the updated weights and hands the step's probes to the collector (training thread)."""
        for vpp in sorted({vpp for _, _, vpp in self.params}):
            self._probe(PARAM_UPDATED, [(name, p) for name, p, v in self.params if v == vpp], vpp, None)
        filled = self.slots.filled()
        if filled is not None:
            self.state.collector.add_flags(self.slots.keys, filled)
        self.slots.reset()
        self._backward_micro = 0

    def any_nonfinite(self) -> Optional[torch.Tensor]:
        """Device bool: whether a probe of this step so far is non-finite (None when none was taken)."""
        filled = self.slots.filled()
        return None if filled is None else ~torch.isfinite(filled).all()


def nan_sentinel(state: HookState, chunks: list[torch.nn.Module], squash_name: bool) -> NanSentinel:
    """The sentinel over every module and trainable parameter of the model chunks (vpp stage = index)."""
    modules = [(display_name(name, squash_name), module, vpp)
               for vpp, chunk in enumerate(chunks) for name, module in chunk.named_modules()]
    params = [(display_name(name, squash_name), param, vpp)
              for vpp, chunk in enumerate(chunks) for name, param in chunk.named_parameters() if param.requires_grad]
    return NanSentinel(state, modules, params)
