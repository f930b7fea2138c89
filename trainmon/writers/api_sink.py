"""The `api` format: the last step's figures, in memory, for `TrainerMon.generate_*_metrics()`."""
from __future__ import annotations

import threading

from trainmon.monitor.records import StepBatch
from trainmon.writers.base import Sink, SinkContext
from trainmon.writers.tags import tag_of


class ApiSink(Sink):
    name = "api"

    def __init__(self):
        self._lock = threading.Lock()
        self._latest: dict[str, list[tuple]] = {}  # family -> (key, figures) of the last step recording it
        self._rank = 0

    def start(self, context: SinkContext) -> None:
        self._rank = context.rank

    def write(self, batch: StepBatch) -> None:
        # Every step is written and few are asked for: tags and copies are made in `latest`.
        by_family: dict[str, list[tuple]] = {}
        for key, figures in zip(batch.keys, batch.derived):
            by_family.setdefault(key.family, []).append((key, figures))
        with self._lock:
            # A family keeps the figures of the last step that recorded it.
            self._latest.update(by_family)

    def latest(self, families) -> dict[str, dict[str, float]]:
        """{tag: {op: value}} of the given families, from the last step that recorded each."""
        with self._lock:
            rows = [row for family in families for row in self._latest.get(family, ())]
        return {tag_of(key, self._rank): dict(figures) for key, figures in rows}
