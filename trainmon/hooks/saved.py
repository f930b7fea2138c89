"""`trainmon.save(name, tensor)` and `trainmon.save_grad(name, tensor)`: any variable of a training script
(a loss term, attention scores inside a fused function, a router's logits), recorded like a module's output.

`save` records the tensor's statistics now, in the `save` family; `save_grad` returns the tensor and records
its grad when the backward pass computes it, in the `save_grad` family. A record carries the step, the
micro-step of the running training forward (a variable saved before the model's first forward of a step
counts with micro-step 0), and a call index taken when it is saved (its grad: when the grad arrives), so it
takes its place among the module records in the ordering key and nan-analyze can name it first. A name saved
again in the same micro-step gets `#<k>` for its k-th extra call, as a module called twice does. With the
NaN sentinel on, a saved variable is probed too; on a `dump` step whose `modules` choose its name, its
tensor is dumped. Calls made inside backward record nothing: that is activation checkpointing running a
forward again, whose first run was recorded (with non-reentrant checkpointing, `save_grad`'s grad too).

Both only need the process's active monitor: the hook group of the TrainerMon that `set_monitor` installed
registers itself here and `stop()` removes it, so they work in any framework the monitor does. Without an
active monitor, on a step that is not collected, or after an evaluation forward, they return at once,
without touching the tensor.
"""
from __future__ import annotations

import functools
import logging
from typing import Optional

import torch

from trainmon.hooks.hook_group import Hooks
from trainmon.hooks.in_graph import in_backward
from trainmon.hooks.grad_watch import watch_grad
from trainmon.core.records import SAVE, SAVE_GRAD, record_key
from trainmon.hooks.state import HookState

logger = logging.getLogger("trainmon")

_active: Optional["SavedVariables"] = None  # the hook group of the process's monitoring TrainerMon


def save(name: str, tensor: torch.Tensor) -> None:
    """Records the statistics of `tensor` under `name` in the running step and micro-step (family `save`).

    Does nothing when no TrainerMon is monitoring, the step is not collected, or `tensor` is not a floating
    tensor.
    """
    saved = _active
    if saved is not None and saved.state.collecting:
        saved.save(name, tensor)


def save_grad(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """Returns `tensor`, and records the statistics of its grad under `name` when backward computes it
    (family `save_grad`). `tensor` must require grad for anything to be recorded."""
    saved = _active
    if saved is not None and saved.state.collecting:
        saved.save_grad(name, tensor)
    return tensor


class SavedVariables(Hooks):
    """The monitor's end of `save`/`save_grad`: a hook group whose `install` makes it the process's active one.

    Args:
        state: the shared hook state (collector, micro-step).
        sentinel: the NaN sentinel, which probes saved variables too, or None.
        dump: the `dump` block's TensorDump, which dumps them on its steps, or None.
    """

    collects = "saved variables (save, save_grad)"

    def __init__(self, state: HookState, sentinel=None, dump=None):
        self.state = state
        self.sentinel = sentinel
        self.dump = dump
        self._calls: dict[tuple, tuple] = {}  # (family, name) -> ((step, micro), calls seen there)
        self._warned: set[str] = set()
        self.save = state.guarded("trainmon.save", self._save)
        self.save_grad = state.guarded("trainmon.save_grad", self._save_grad)
        self._on_grad = state.guarded("trainmon.save_grad", self._record_grad)

    def install(self) -> None:
        global _active
        _active = self

    def remove(self) -> None:
        global _active
        if _active is self:
            _active = None
        self._calls.clear()

    def _place(self, family: str, name: str) -> Optional[tuple[int, str]]:
        """(micro-step, record name) of a save now, or None when nothing is recorded: after an evaluation forward,
        and inside backward, where activation checkpointing runs a forward again (its first run recorded it)."""
        state = self.state
        if state.evaluating or in_backward():
            return None
        micro = state.forward_micro(0)
        where = (state.collector.step, micro)
        last, calls = self._calls.get((family, name), (None, 0))
        calls = calls + 1 if last == where else 1
        self._calls[(family, name)] = (where, calls)
        return micro, (name if calls == 1 else f"{name}#{calls - 1}")

    def _floating(self, name: str, tensor) -> bool:
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
            return True
        if name not in self._warned:
            self._warned.add(name)
            logger.warning("trainmon: save(%r, ...) got %s, not a floating tensor; it is not recorded", name,
                           type(tensor).__name__ if not isinstance(tensor, torch.Tensor) else tensor.dtype)
        return False

    def _save(self, name: str, tensor: torch.Tensor) -> None:
        if not self._floating(name, tensor):
            return
        place = self._place(SAVE, name)
        if place is not None:
            self._record(SAVE, place[1], place[0], tensor.detach(), "forward")

    def _save_grad(self, name: str, tensor: torch.Tensor) -> None:
        if not self._floating(name, tensor):
            return
        if not tensor.requires_grad:
            if name not in self._warned:
                self._warned.add(name)
                logger.warning("trainmon: save_grad(%r, ...) got a tensor that does not require grad; no grad "
                               "is recorded", name)
            return
        place = self._place(SAVE_GRAD, name)
        if place is None:
            return
        micro, record_name = place
        callback = functools.partial(self._on_grad, record_name, micro, self.state.collector.step)
        if tensor.grad_fn is not None:
            watch_grad(tensor, callback)  # lives as long as the graph
        else:  # a leaf outlives the step: its hook goes after the first grad
            def once(grad: torch.Tensor) -> None:
                handle.remove()
                callback(grad)

            handle = tensor.register_hook(once)

    def _record_grad(self, name: str, micro: int, step: int, grad: torch.Tensor) -> None:
        if self.state.collecting and self.state.collector.step == step:
            self._record(SAVE_GRAD, name, micro, grad.detach(), "backward")

    def _record(self, family: str, name: str, micro: int, tensor: torch.Tensor, phase: str) -> None:
        collector = self.state.collector
        index = collector.next_call_index()
        key = record_key(family, name, 0, micro, index, tuple(tensor.shape), tensor.dtype)
        # Deferred like activations: a variable the script changes in place before the batch is reduced
        # is read at once from then on (StepCollector).
        collector.record([key], [tensor], defer=True)
        if self.sentinel is not None:
            self.sentinel.probe_saved(family, name, tensor, micro, index)
        if self.dump is not None:
            self.dump.add_saved(name, phase, family, tensor)
