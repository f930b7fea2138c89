"""The sink interface and the container that fans a step batch out to several sinks."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from trainmon.core.records import StepBatch

logger = logging.getLogger("trainmon")


@dataclass(frozen=True)
class SinkContext:
    """What every sink needs to know about where and what it writes."""

    rank_dir: Path
    rank: int
    ops: tuple
    ndigits: int
    step_count_per_record: int
    per_micro_families: frozenset  # families whose records carry a micro_step column
    metadata: dict = field(default_factory=dict)
    stream: bool = False  # the output is on a network filesystem: the db format writes its record stream


class Sink:
    """A do-nothing sink. Constructors only store arguments; files are opened in `start`."""

    name = "none"

    def start(self, context: SinkContext) -> None:
        """Opens files and imports optional packages."""

    def write(self, batch: StepBatch) -> None:
        """Writes one step batch whose `values` and `derived` are filled."""

    def flush(self) -> None:
        """Makes what was written durable."""

    def close(self) -> None:
        """Flushes and releases resources; safe to call twice."""


class SinkContainer(Sink):
    """Fans a batch out to many sinks; a sink that raises is disabled, reported once, and counted.

    `lost_steps[name]` counts the step batches a disabled sink did not write: the one it failed on and
    every later one. A failure in `flush` or `close` may also lose what the sink buffered; its reason
    says so.
    """

    name = "container"

    def __init__(self, sinks: Sequence[Sink]):
        self.sinks = list(sinks)
        self.failures: dict[str, str] = {}
        self.lost_steps: dict[str, int] = {}

    def _each(self, method: str, *args) -> None:
        for sink in list(self.sinks):
            try:
                getattr(sink, method)(*args)
            except Exception as err:
                self.sinks.remove(sink)
                self.failures[sink.name] = f"{method}: {type(err).__name__}: {err}"
                self.lost_steps.setdefault(sink.name, 0)
                logger.error("trainmon: the %s sink failed in %s (%s: %s) and is disabled; "
                             "training and the other sinks continue", sink.name, method, type(err).__name__, err)
                if method != "close":
                    _close_quietly(sink)

    def start(self, context: SinkContext) -> None:
        self._each("start", context)

    def write(self, batch: StepBatch) -> None:
        self._each("write", batch)
        for name in self.lost_steps:
            self.lost_steps[name] += 1

    def flush(self) -> None:
        self._each("flush")

    def close(self) -> None:
        self._each("close")

    def report(self) -> dict:
        """{sink name: {"error": reason, "lost_steps": n}} for every disabled sink."""
        return {name: {"error": reason, "lost_steps": self.lost_steps[name]}
                for name, reason in self.failures.items()}


def _close_quietly(sink: Sink) -> None:
    """Releases a failed sink's files; its own failure was reported, a second one would only repeat it."""
    try:
        sink.close()
    except Exception:
        logger.debug("trainmon: closing the failed %s sink failed too", sink.name, exc_info=True)
