"""The small mutable state that every hook reads: is this step collected, which micro-step is it."""
from __future__ import annotations

import functools
import logging
from typing import Callable, Optional

from trainmon.monitor.collector import StepCollector

logger = logging.getLogger("trainmon")


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
        self.forward_micro = -1  # index of the running training forward (micro-step); -1 before the first
        self.backward_micro = 0  # index of the running backward pass
        self.eval_pass = -1  # index of the running evaluation forward since the last optimizer step
        self._failed: set[str] = set()

    @property
    def micro(self) -> int:
        """The micro-step that records of the running training forward belong to."""
        return max(self.forward_micro, 0)

    def start_step(self, step: int, collecting: bool) -> None:
        self.collector.step = step
        self.collecting = collecting
        self.training_forward = False
        self.forward_micro = -1
        self.backward_micro = 0
        self.eval_pass = -1

    def guarded(self, item: str, fn: Callable) -> Callable:
        """Wraps a hook so that an exception disables monitoring of `item` instead of training.

        The first failure of an item is logged with its context; the item is then skipped. With
        `strict` (tests) the exception propagates.
        """

        @functools.wraps(fn)
        def hook(*args, **kwargs):
            if item in self._failed:
                return None
            try:
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
