"""The small mutable state that every hook reads: is this step collected, which micro-step is it."""
from __future__ import annotations

import functools
import logging
from typing import Callable

from trainmon.monitor.collector import StepCollector

logger = logging.getLogger("trainmon")


class HookState:
    """Shared by all hooks of one TrainerMon.

    `collecting` is decided once per step, before the step's first hook runs, so a hook that is
    not collecting returns before any tensor work.
    """

    def __init__(self, collector: StepCollector, grad_acc_steps: int, strict: bool):
        self.collector = collector
        self.grad_acc_steps = grad_acc_steps
        self.strict = strict
        self.collecting = False
        # Per model chunk (vpp stage): index of its running forward micro-batch. An interleaved pipeline
        # schedule runs several micro-batches through one chunk before the next chunk sees the first.
        self._forward_micro: dict[int, int] = {}
        self.backward_micro = 0  # index of the running backward pass
        self._failed: set[str] = set()

    def start_step(self, step: int, collecting: bool) -> None:
        self.collector.step = step
        self.collecting = collecting
        self._forward_micro.clear()
        self.backward_micro = 0

    def start_forward(self, vpp_stage: int) -> None:
        """A forward micro-batch of chunk `vpp_stage` starts (its root's forward pre-hook)."""
        self._forward_micro[vpp_stage] = self._forward_micro.get(vpp_stage, -1) + 1

    def forward_micro(self, vpp_stage: int) -> int:
        """The micro-step of chunk `vpp_stage`'s running forward (0 before its first)."""
        return self._forward_micro.get(vpp_stage, 0)

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
