"""The small mutable state that every hook reads: is this step collected, which micro-step is it."""
from __future__ import annotations

import functools
import logging
from typing import Callable, Optional

import torch

from trainmon.hooks.collector import StepCollector

logger = logging.getLogger("trainmon")


def without_torch_function(fn: Callable) -> Callable:
    """`fn` run with torch-function handling off while a `TorchFunctionMode` is active (a `torch.device`
    context, a device-mapping shim).

    For trainmon's own work only (hooks, closing a step): it reads tensors on their own device, and the
    mode would otherwise see every attribute read and small op of it, several per hooked call. Tensor
    subclasses still dispatch through `__torch_dispatch__`.
    """

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if not torch._C._is_torch_function_mode_enabled():
            return fn(*args, **kwargs)
        with torch._C.DisableTorchFunction():
            return fn(*args, **kwargs)

    return run


class HookState:
    """Shared by all hooks of one TrainerMon.

    `collecting` is decided once per step, before the step's first hook runs, so a hook that is
    not collecting returns before any tensor work. `training_forward` is decided once per forward
    pass of the model (see `forward_passes`): hooks of evaluation forwards return at once too, unless
    `eval_collector` takes their activations.
    """

    def __init__(self, collector: StepCollector, grad_acc_steps: int, strict: bool,
                 eval_collector: Optional[StepCollector] = None):
        self.collector = collector
        self.eval_collector = eval_collector
        self.grad_acc_steps = grad_acc_steps
        self.strict = strict
        self.collecting = False
        self.training_forward = False  # the running (or last) forward pass of the model is a training one
        # Per model chunk (vpp stage): index of its running training forward (micro-step) and of its running
        # evaluation forward since the last optimizer step. An interleaved pipeline schedule runs several
        # micro-batches through one chunk before the next chunk sees the first.
        self._forward_micro: dict[int, int] = {}
        self._eval_pass: dict[int, int] = {}
        self.backward_micro = 0  # index of the running backward pass
        self.forward_passes = 0  # forward passes of the model's chunks started so far
        self._failed: set[str] = set()

    def start_step(self, step: int, collecting: bool) -> None:
        self.collector.step = step
        self.collecting = collecting
        self.training_forward = False
        self._forward_micro.clear()
        self._eval_pass.clear()
        self.backward_micro = 0

    def start_forward(self, vpp_stage: int, training: bool) -> None:
        """A forward pass of chunk `vpp_stage` starts (its root's forward pre-hook): a training micro-step
        or an evaluation forward."""
        self.training_forward = training
        self.forward_passes += 1
        counts = self._forward_micro if training else self._eval_pass
        counts[vpp_stage] = counts.get(vpp_stage, -1) + 1

    @property
    def evaluating(self) -> bool:
        """Whether the step's last forward pass was an evaluation one (none yet: False)."""
        return not self.training_forward and bool(self._eval_pass)

    def forward_micro(self, vpp_stage: int) -> int:
        """The micro-step of chunk `vpp_stage`'s running training forward (0 before its first)."""
        return self._forward_micro.get(vpp_stage, 0)

    def eval_pass(self, vpp_stage: int) -> int:
        """The number of chunk `vpp_stage`'s running evaluation forward since the last optimizer step."""
        return self._eval_pass.get(vpp_stage, 0)

    def guarded(self, item: str, fn: Callable) -> Callable:
        """Wraps a hook so that an exception disables monitoring of `item` instead of training.

        The first failure of an item is logged with its context; the item is then skipped. With
        `strict` (tests) the exception propagates. The hook runs `without_torch_function` (inlined: a
        frame less per hooked call).
        """

        @functools.wraps(fn)
        def hook(*args, **kwargs):
            if item in self._failed:
                return None
            try:
                if not torch._C._is_torch_function_mode_enabled():
                    return fn(*args, **kwargs)
                with torch._C.DisableTorchFunction():
                    return fn(*args, **kwargs)
            except Exception:
                if self.strict:
                    raise
                self._failed.add(item)
                logger.exception("trainmon: monitoring of %s failed at step %s and is now off for it; "
                                 "training continues", item, self.collector.step)
                return None

        return hook

    @property
    def failed_items(self) -> frozenset:
        return frozenset(self._failed)
