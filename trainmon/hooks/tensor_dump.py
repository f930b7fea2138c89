"""The `dump` config block: module inputs, outputs and grads of chosen steps, copied to the host.

A separate set of hooks, installed only when `dump` is configured; on other steps each hook returns at
once. On a dump step every floating input and output of the chosen modules (and, with `backward`, the
grads of those that need one, through tensor hooks) is copied to the host (non-blocking into pinned
memory on accelerators, `dump_capture.host_copy`) in call order, until `max_mb_per_step` is used: later
tensors are not stored and the index lists them. The Python stack of each module's first call of the
step is kept. When the step is over, its capture goes to the writer thread (`writers.tensor_dump_sink`),
which waits for the copies, computes each tensor's statistic record and writes the files.
"""
from __future__ import annotations

import os
import traceback
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from trainmon.hooks.hook_group import Hooks
from trainmon.hooks.dump_capture import host_copy
from trainmon.hooks import in_graph
from trainmon.engine.accelerator import copy_done_event


@dataclass
class Captured:
    """One tensor of a dump step."""

    call: int
    module: str
    phase: str
    role: str
    micro_step: int
    shape: list
    dtype: str
    nbytes: int
    host: Optional[torch.Tensor]  # None: cut by the size cap

    @property
    def key(self) -> str:
        return f"{self.call:06d}.{self.module}.{self.phase}.{self.role}"


@dataclass
class StepCapture:
    """Everything one rank captured at one dump step."""

    rank: int
    step: int
    max_bytes: int
    tensors: list = field(default_factory=list)
    stacks: dict = field(default_factory=dict)
    stored_bytes: int = 0
    events: list = field(default_factory=list)  # copy-done events of accelerator copies

    def add(self, module: str, phase: str, role: str, micro_step: int, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        fits = self.stored_bytes + nbytes <= self.max_bytes
        host = host_copy(tensor, tensor.numel()) if fits else None
        if fits:
            self.stored_bytes += nbytes
            if tensor.device.type != "cpu":
                self.events.append(copy_done_event(tensor.device))
        self.tensors.append(Captured(len(self.tensors), module, phase, role, micro_step, list(tensor.shape),
                                     str(tensor.dtype), nbytes, host))

    def wait(self) -> "StepCapture":
        """Waits for the copies to land (writer thread)."""
        for event in self.events:
            event.synchronize()
        self.events.clear()
        return self


_TORCH_CALL = os.path.join("torch", "nn", "modules", "module.py")
_HOOKS = os.path.dirname(os.path.abspath(__file__)) + os.sep  # trainmon's hooks: the wrapper, the guard, this file


def _call_stack() -> list[str]:
    """The frames of the current module call, without torch's module-call machinery and trainmon's hooks."""
    frames = traceback.extract_stack()
    return traceback.format_list([f for f in frames if not (f.filename.endswith(_TORCH_CALL)
                                                            or f.filename.startswith(_HOOKS))])


def _floating(value, prefix: str):
    """(role, tensor) of every floating tensor in a module's inputs or outputs (nested tuples and lists)."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            yield prefix, value
    elif isinstance(value, (tuple, list)):
        leaves = [leaf for i, item in enumerate(value) for leaf in _floating(item, f"{prefix}_{i}")]
        yield from ([(prefix, leaves[0][1])] if len(leaves) == 1 and len(value) == 1 else leaves)


class TensorDump(Hooks):
    """Hooks that capture module tensors at the configured steps; `install`/`remove` like other hook groups.

    Args:
        config: the `dump` block (trainmon.config.settings.DumpConfig).
        modules: (name, module) pairs of the chosen modules, names as in the statistics.
        roots: the model chunks (a training forward of a root is one micro-step).
        rank: this process's rank.
        step_of: the current monitor step.
        deliver: takes a finished StepCapture (the writer's dump sink).
        guard: `(item, hook) -> hook` that turns an exception in a hook into "this item is off"
            (HookState.guarded): monitoring never takes training down.
    """

    collects = "tensor dumps (dump)"

    def __init__(self, config, modules: list, roots: list, rank: int, step_of: Callable[[], int],
                 deliver: Callable[[StepCapture], None], guard: Callable[[str, Callable], Callable]):
        self.config = config
        self.modules = modules
        self.roots = roots
        self.rank = rank
        self.step_of = step_of
        self.deliver = deliver
        self.guard = guard
        self.enabled = not config.ranks or rank in config.ranks
        self._steps = frozenset(config.steps)
        self._handles: list = []
        self._capture: Optional[StepCapture] = None
        self._micro = -1

    def install(self) -> None:
        if not self.enabled:
            return
        # In the wrapper around each module's forward that the other groups share: on the steps that dump nothing
        # a call costs two plain calls, where torch's hooks would put every call on its slow path (and, under
        # torch.compile, add two ops a call).
        for root in self.roots:
            self._handles.append(in_graph.before_forward(root, "tensor_dump_root",
                                                         self.guard("tensor dump", self._root_pre_hook)))
        for name, module in self.modules:
            item = f"tensor dump of {name or '(root)'}"
            self._handles.append(in_graph.around_forward(module, "tensor_dump", self.guard(item, self._pre_hook(name)),
                                                         self.guard(item, self._hook(name))))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._finish()

    def _current(self) -> Optional[StepCapture]:
        """The capture of the current step, or None when this step is not dumped (returns at once)."""
        step = self.step_of()
        if self._capture is not None and self._capture.step != step:
            self._finish()
        if step not in self._steps:
            return None
        if self._capture is None:
            self._capture = StepCapture(self.rank, step, self.config.max_mb_per_step << 20)
            self._micro = -1
        return self._capture

    def _finish(self) -> None:
        if self._capture is not None:
            capture, self._capture = self._capture, None
            self.deliver(capture)

    def add_saved(self, name: str, phase: str, role: str, tensor: torch.Tensor) -> None:
        """Captures a variable given to `trainmon.save` (phase "forward") or its grad (`save_grad`, "backward")
        on a dump step, when `modules` chooses its name as it would a module's."""
        chosen = self.config.modules
        if phase == "backward" and not self.config.backward:
            return
        if chosen != "all" and not any(name == m or name.startswith(m + ".") for m in chosen):
            return
        capture = self._current()
        if capture is not None:
            capture.add(name, phase, role, max(self._micro, 0), tensor.detach())

    def _root_pre_hook(self, module, args, kwargs) -> None:
        if module.training and torch.is_grad_enabled() and self._current() is not None:
            self._micro += 1

    def _pre_hook(self, name: str):
        def pre_hook(module, args, kwargs) -> None:
            capture = self._current()
            if capture is not None and name not in capture.stacks:
                capture.stacks[name] = _call_stack()
        return pre_hook

    def _hook(self, name: str):
        def hook(module, args, kwargs, output) -> None:
            capture = self._current()
            if capture is None:
                return
            micro = max(self._micro, 0)
            for role, tensor in _floating(tuple(args), "input"):
                capture.add(name, "forward", role, micro, tensor)
            for role, tensor in _floating(output, "output"):
                capture.add(name, "forward", role, micro, tensor)
            if self.config.backward and torch.is_grad_enabled():
                for role, tensor in list(_floating(tuple(args), "input")) + list(_floating(output, "output")):
                    if tensor.requires_grad:
                        tensor.register_hook(self.guard(f"tensor dump of {name or '(root)'}",
                                                        self._grad_hook(name, f"grad_{role}", micro)))
        return hook

    def _grad_hook(self, name: str, role: str, micro: int):
        def grad_hook(grad: torch.Tensor) -> None:
            capture = self._current()
            if capture is not None:
                capture.add(name, "backward", role, micro, grad)
        return grad_hook
