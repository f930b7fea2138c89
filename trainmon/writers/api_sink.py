"""The `api` format: the last step's figures, in memory, for `TrainerMon.generate_*_metrics()`."""
from __future__ import annotations

import threading

from trainmon.core.records import StepBatch
from trainmon.writers.base import Sink, SinkContext
from trainmon.writers.tags import tag_of


class ApiSink(Sink):
    name = "api"

    def __init__(self):
        self._lock = threading.Lock()
        self._latest: dict[str, StepBatch] = {}  # family -> the batch of the last step recording it
        self._rank = 0

    def start(self, context: SinkContext) -> None:
        self._rank = context.rank

    def write(self, batch: StepBatch) -> None:
        # Every step is written and few are asked for: rows, figures, tags and copies are found in `latest`.
        families = {key.family for key in batch.keys}
        with self._lock:
            # A family keeps the figures of the last step that recorded it.
            self._latest.update((family, batch) for family in families)

    def latest(self, families) -> dict[str, dict[str, float]]:
        """{tag: {op: value}} of the given families, from the last step that recorded each."""
        with self._lock:
            chosen = [(family, self._latest[family]) for family in families if family in self._latest]
        return {tag_of(key, self._rank): dict(batch.derived[row]) for family, batch in chosen
                for row, key in enumerate(batch.keys) if key.family == family}
