"""The one interface of every group of hooks TrainerMon installs (activations, grads, the optimizer, the
sentinel, collectives, ...): TrainerMon installs, steps and removes them in a loop, in the order of its table
(trainmon.hook_table)."""
from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class HookGroup(Protocol):
    collects: str    # what is not collected when the group cannot be installed (the message says so)
    required: bool   # steps and micro-steps come from it: without it nothing is recorded, set-up fails

    def install(self) -> None:
        """Registers the hooks."""

    def step_finished(self, collected: bool) -> None:
        """After every optimizer step, before the step's records are shipped; `collected`: the step was."""

    def finish(self) -> None:
        """The monitor stops: closes what is pending (before `remove`)."""

    def remove(self) -> None:
        """Undoes `install`; safe to call twice."""


class Hooks:
    """Defaults of the HookGroup interface, for groups with nothing to do at a step's end or at stop."""

    collects = ""
    required = False

    def step_finished(self, collected: bool) -> None:
        pass

    def finish(self) -> None:
        pass
