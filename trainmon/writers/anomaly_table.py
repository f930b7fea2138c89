"""Writing the `anomalies` table of `rank_<R>/monitor.db` (its schema is in db_schema; the read layer reads it)."""
from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Sequence

from trainmon.core.events import AnomalyEvent
from trainmon.writers import db_schema

_COLUMNS = db_schema.ANOMALY_COLUMNS
INSERT_ANOMALY = (f"INSERT INTO anomalies ({', '.join(_COLUMNS)}, is_nan) "
                  f"VALUES ({', '.join('?' * (len(_COLUMNS) + 1))})")


class AnomalyTable:
    """Appends anomalies to the database, one transaction per step (writer thread only)."""

    def __init__(self, path: Path):
        self.path = path
        self._conn = None

    def open(self) -> None:
        self._conn = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.executescript(db_schema.ANOMALY_SCHEMA)

    def append(self, events: Sequence[AnomalyEvent]) -> None:
        with self._conn:
            self._conn.execute("BEGIN")
            self._conn.executemany(INSERT_ANOMALY, [anomaly_row(e) for e in events])

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def anomaly_row(e: AnomalyEvent) -> tuple:
    """The row of one anomaly for INSERT_ANOMALY."""
    value, is_nan = db_schema.encode_real(e.value)
    row = {name: getattr(e, name) for name in _COLUMNS} | {"value": value, "first": int(e.first)}
    return tuple(row[name] for name in _COLUMNS) + (is_nan,)
