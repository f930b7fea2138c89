"""The `db` format: `rank_<R>/monitor.db`, SQLite in WAL mode, one transaction per step batch (on a network
filesystem: `rank_<R>/records.stream`, see writers.filesystem)."""
from __future__ import annotations

import sqlite3
from typing import Optional

import numpy as np

from trainmon.engine import stats
from trainmon.core.records import StepBatch
from trainmon.writers import db_schema
from trainmon.writers.base import Sink, SinkContext
from trainmon.writers.monitor_db import MonitorDb
from trainmon.writers.record_stream import RecordStream
from trainmon.core.layout import DB_NAME, STREAM_NAME


class DbSink(Sink):
    """Writes every step batch into `rank_<R>/monitor.db` with the run's metadata, or, with `stream` (a network
    or parallel filesystem, see writers.filesystem), the same content into `rank_<R>/records.stream`."""

    name = "db"

    def __init__(self):
        self._db = None  # a MonitorDb or a RecordStream
        self._computed: Optional[np.ndarray] = None

    def start(self, context: SinkContext) -> None:
        context.rank_dir.mkdir(parents=True, exist_ok=True)
        if context.stream:
            self._db = RecordStream(context.rank_dir / STREAM_NAME)
        else:
            path = context.rank_dir / DB_NAME
            try:
                self._db = MonitorDb(path)
            except sqlite3.DatabaseError as err:
                raise sqlite3.DatabaseError(f"{path} exists but cannot be used as a monitor database ({err}); "
                                            "move it away or choose another run") from err
        # The engine leaves fields that no op needs at 0: store them as "not recorded", not as data.
        needed = stats.fields_for_ops(context.ops)
        self._computed = np.array([f in needed for f in db_schema.FIELDS])
        self._db.set_meta({**context.metadata, "schema_version": db_schema.SCHEMA_VERSION,
                           "rank": context.rank, "ops": list(context.ops), "fields": list(db_schema.FIELDS)})

    def write(self, batch: StepBatch) -> None:
        recorded = np.broadcast_to(self._computed, batch.values.shape)
        self._db.add_step(batch.step, batch.pp_stage, batch.keys, batch.values, batch.scalars, recorded)

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None
