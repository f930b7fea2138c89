"""`alert.action` `skip_step` and `stop`: act on an anomalous step before its optimizer update.

Deciding before `optimizer.step()` needs the step's NaN/Inf evidence on the host, so with these
actions (and only with them) the monitor reads one device boolean per step just before the update:
whether any sentinel probe or statistic record of the step so far saw a NaN or Inf. That read waits
for the device to finish the step's backward (one synchronisation per step; on CPU it costs nothing
measurable). Rules that need history (AnomalySpike, AnomalyTurbulence, thresholds) are judged in the
writer thread after the step: with `stop` they stop training at the next `optimizer.step()`.
"""
from __future__ import annotations

import logging
from typing import Callable, Optional

import torch

from trainmon.hooks.hook_group import Hooks
from trainmon.core.events import AnomalyEvent
from trainmon.anomaly.processor import AnomalyProcessor
from trainmon.adapters.patching import patch_attribute

logger = logging.getLogger("trainmon")


class AnomalyStopError(RuntimeError):
    """Raised by `optimizer.step()` under `alert.action: "stop"`; names the first anomalous tensor."""

    def __init__(self, event: Optional[AnomalyEvent], step: int):
        self.event = event
        where = event.describe() if event is not None else f"step {step} (no record names the tensor)"
        super().__init__(f"trainmon stopped training (alert.action 'stop'): first anomaly at {where}. "
                         f"Everything up to this step is written; run `trainmon nan-analyze` on the output "
                         f"directory for the full chain.")


class StepGate(Hooks):
    """Wraps `optimizer.step` on the optimizer instance; `remove()` restores it.

    Args:
        action: "skip_step" (do not apply the update of an anomalous step) or "stop" (raise
            AnomalyStopError instead of applying it).
        optimizer: the monitored optimizer.
        evidence: returns the device booleans (or None) that say the step so far saw a NaN/Inf.
        step_of: returns the current monitor step.
        end_step: closes the monitor step (ships its batch) when the update is not applied.
        drain: waits until the writer has written every queued step.
        processor: the anomaly processor, which names the first anomaly of a written step.
    """

    collects = "the alert action"

    def __init__(self, action: str, optimizer, evidence: Callable[[], list], step_of: Callable[[], int],
                 end_step: Callable[[], None], drain: Callable[[], None], processor: AnomalyProcessor):
        if action not in ("skip_step", "stop"):
            raise ValueError(f"StepGate handles alert.action 'skip_step' or 'stop', not {action!r}")
        self.action = action
        self.optimizer = optimizer
        self.evidence = evidence
        self.step_of = step_of
        self.end_step = end_step
        self.drain = drain
        self.processor = processor
        self.skipped_steps: list[int] = []
        self._restore: Optional[Callable[[], None]] = None
        self._later_anomaly: Optional[AnomalyEvent] = None

    def install(self) -> None:
        original = self.optimizer.step

        def gated_step(*args, **kwargs):
            if self.action == "stop" and self._later_anomaly is not None:
                raise AnomalyStopError(self._later_anomaly, self._later_anomaly.step)
            if not self._step_is_anomalous():
                return original(*args, **kwargs)
            return self._refuse()

        self._restore = patch_attribute(self.optimizer, "step", gated_step)
        if self.action == "stop":
            self.processor.add_listener(self._on_written_anomaly)

    def remove(self) -> None:
        if self._restore is not None:
            self._restore()
            self._restore = None

    def _on_written_anomaly(self, events: list[AnomalyEvent]) -> None:
        # Writer thread: remembered, raised on the training thread at the next optimizer.step().
        if self._later_anomaly is None:
            self._later_anomaly = events[0]

    def _step_is_anomalous(self) -> bool:
        flags = [f for f in self.evidence() if f is not None]
        if not flags:
            return False
        # The one host read of the step (see the module docstring).
        return bool(torch.stack([f.to(flags[0].device) for f in flags]).any())

    def _refuse(self):
        step = self.step_of()
        self.end_step()
        self.drain()
        first = self.processor.first_of_step(step)
        if self.action == "stop":
            raise AnomalyStopError(first, step)
        self.skipped_steps.append(step)
        logger.warning("trainmon: optimizer step %s skipped (alert.action 'skip_step'): %s", step,
                       first.describe() if first is not None else "a NaN/Inf was seen")
        return None
