"""The `anomalies` table of `rank_<R>/monitor.db`: the rows of `anomalies.jsonl`, when `format` has `db`.

SQLite stores a bound NaN as NULL, so `value` is NULL with `is_nan` = 1 for NaN (±Inf are REAL).
"""
from __future__ import annotations

import math
import sqlite3
from pathlib import Path
from typing import Sequence

from trainmon.anomaly.events import AnomalyEvent

COLUMNS = ("rank", "step", "micro_step", "pp_stage", "vpp_stage", "call_index", "module", "phase", "tensor",
           "op", "value", "rule", "family", "first")
SCHEMA = """
CREATE TABLE IF NOT EXISTS anomalies (
    rank INTEGER NOT NULL, step INTEGER NOT NULL, micro_step INTEGER, pp_stage INTEGER NOT NULL,
    vpp_stage INTEGER NOT NULL, call_index INTEGER, module TEXT NOT NULL, phase TEXT NOT NULL,
    tensor TEXT NOT NULL, op TEXT NOT NULL, value REAL, rule TEXT NOT NULL, family TEXT NOT NULL,
    first INTEGER NOT NULL, is_nan INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS anomalies_order ON anomalies (step, micro_step, rank, call_index);
"""
_INSERT = f"INSERT INTO anomalies ({', '.join(COLUMNS)}, is_nan) VALUES ({', '.join('?' * (len(COLUMNS) + 1))})"


class AnomalyTable:
    """Appends anomalies to the database, one transaction per step (writer thread only)."""

    def __init__(self, path: Path):
        self.path = path
        self._conn = None

    def open(self) -> None:
        self._conn = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.executescript(SCHEMA)

    def append(self, events: Sequence[AnomalyEvent]) -> None:
        rows = []
        for e in events:
            nan = math.isnan(e.value)
            rows.append((e.rank, e.step, e.micro_step, e.pp_stage, e.vpp_stage, e.call_index, e.module, e.phase,
                         e.tensor, e.op, None if nan else e.value, e.rule, e.family, int(e.first), int(nan)))
        with self._conn:
            self._conn.execute("BEGIN")
            self._conn.executemany(_INSERT, rows)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def read_anomalies(conn: sqlite3.Connection) -> list[AnomalyEvent]:
    """Every row of the table (none when the run wrote no anomaly table)."""
    if not conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'anomalies'").fetchone():
        return []
    rows = conn.execute(f"SELECT {', '.join(COLUMNS)}, is_nan FROM anomalies ORDER BY rowid").fetchall()
    events = []
    for row in rows:
        fields = dict(zip(COLUMNS, row))
        fields["value"] = math.nan if row[-1] else fields["value"]
        fields["first"] = bool(fields["first"])
        events.append(AnomalyEvent(**fields))
    return events
