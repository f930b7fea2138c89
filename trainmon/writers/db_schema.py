"""The SQLite schema of `rank_<R>/monitor.db` (docs/reference/database.md shows it).

NaN in a REAL column: SQLite turns a bound NaN into NULL. So a record keeps `nan_fields`, a bit mask
over FIELDS (bit i set: field i was NaN and is stored as NULL), and a scalar or an anomaly keeps
`is_nan`. A NULL without its bit means "not recorded" (CSV conversions lack some fields). +-Inf is
stored as REAL. Writers and readers encode and decode these values the same way (`encode_fields`, `decode_fields`).
"""
from __future__ import annotations

import json
import math
import sqlite3
import zlib
from typing import Any, Optional

import numpy as np

from trainmon.core.events import EVENT_FIELDS, EVENT_TYPES
from trainmon.core.schema import FIELDS  # the record's fields, in their order
# Version 2 added the `sat` column, version 3 the `record_blocks` table, version 4 the `pinfs` column (and
# with it a wider block row), version 5 the `first_nonfinite` table in place of the `(tag_id, ...)` indexes of
# `records`; an older database gains them when a job appends to it (its earlier steps have no blocks: readers
# read those from `records`).
SCHEMA_VERSION = 5
BLOCKS_SINCE = 4  # the first version whose blocks have today's BLOCK_DTYPE

_BITS = 1 << np.arange(len(FIELDS), dtype=np.int64)

def nonfinite_record(alias: str = "") -> str:
    """The condition of the partial index `records_nonfinite`, its columns qualified by `alias` where given: a query
    must spell the condition the same to use the index."""
    at = f"{alias}." if alias else ""
    return f"{at}nans > 0 OR {at}infs > 0"


def nonfinite_anomaly(alias: str = "") -> str:
    """AnomalyEvent.nonfinite in SQL, the condition of the partial index `anomalies_nonfinite`: a NaN/Inf op, or a
    NaN (stored NULL with is_nan) or infinite value."""
    at = f"{alias}." if alias else ""
    return f"{at}op IN ('nans', 'infs', 'nonfinite') OR {at}is_nan = 1 OR {at}value IN (9e999, -9e999)"


SCHEMA = f"""
CREATE TABLE IF NOT EXISTS meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL                  -- JSON
);
CREATE TABLE IF NOT EXISTS tags (
    id        INTEGER PRIMARY KEY,
    family    TEXT NOT NULL,
    name      TEXT NOT NULL,
    vpp_stage INTEGER NOT NULL,
    shape     TEXT NOT NULL,             -- JSON list, e.g. "[64, 32]"
    dtype     TEXT NOT NULL,
    UNIQUE (family, name, vpp_stage, shape, dtype)
);
CREATE TABLE IF NOT EXISTS records (
    tag_id     INTEGER NOT NULL REFERENCES tags(id),
    step       INTEGER NOT NULL,
    micro_step INTEGER,                  -- NULL: one record per step
    call_index INTEGER NOT NULL,
    pp_stage   INTEGER NOT NULL,
    {", ".join(f'"{f}" REAL' for f in FIELDS)},
    nan_fields INTEGER NOT NULL DEFAULT 0
);
-- Every index of `records` starts with the step, so a step's rows land at the end of each: an index led by
-- the tag would take a write of one page per tag and step, a cost that grows with the database (one tag over
-- steps reads this one by skip-scan, see _PLANNER_HINT).
CREATE INDEX IF NOT EXISTS records_step_tag ON records (step, tag_id);
-- the post-mortem reads only the non-finite records: a partial index holds just those
CREATE INDEX IF NOT EXISTS records_nonfinite ON records (step, call_index) WHERE {nonfinite_record()};
-- and each tag's first step with a non-finite record (insert_records keeps it): one seek per tag
CREATE TABLE IF NOT EXISTS first_nonfinite (
    tag_id INTEGER PRIMARY KEY REFERENCES tags(id),
    step   INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS scalars (
    name   TEXT NOT NULL,
    step   INTEGER NOT NULL,
    value  REAL,
    is_nan INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS scalars_name_step ON scalars (name, step);
CREATE TABLE IF NOT EXISTS batches (     -- one row per committed step batch
    step      INTEGER NOT NULL,
    wall_time REAL NOT NULL,
    records   INTEGER NOT NULL,
    scalars   INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS batches_step ON batches (step);
-- each step batch's records again, as one array (BLOCK_DTYPE): a reader of many steps (trainmon watch,
-- open_run, export) takes a step in one value instead of a Python row per record
CREATE TABLE IF NOT EXISTS record_blocks (
    step     INTEGER NOT NULL,
    pp_stage INTEGER NOT NULL,
    records  BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS record_blocks_step ON record_blocks (step);
"""

# A block's rows (zlib-compressed), little-endian, in the order the batch inserted them into `records`: micro_step -1 is NULL;
# `fields` in FIELDS order, NaN where `records` has NULL (a NaN field, or one not recorded: `nan_fields`
# tells them apart, as in `records`).
BLOCK_DTYPE = np.dtype([("tag_id", "<i4"), ("micro_step", "<i4"), ("call_index", "<i4"), ("nan_fields", "<i4"),
                        ("fields", "<f8", (len(FIELDS),))])
NO_MICRO_STEP = -1

# The rows of anomalies.jsonl, when `format` has `db` (the anomaly processor writes them): one column per
# AnomalyEvent field, plus is_nan (`value` is REAL, which SQLite stores NaN in as NULL).
ANOMALY_COLUMNS = EVENT_FIELDS
_SQL_TYPES = {int: "INTEGER NOT NULL", Optional[int]: "INTEGER", str: "TEXT NOT NULL", float: "REAL",
              bool: "INTEGER NOT NULL"}
ANOMALY_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS anomalies (
    {", ".join(f"{name} {_SQL_TYPES[EVENT_TYPES[name]]}" for name in EVENT_FIELDS)},
    is_nan INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS anomalies_order ON anomalies (step, micro_step, rank, call_index);
-- the post-mortem's first non-finite anomaly of each (phase, module), and the collectives' (read.db_nonfinite);
-- it holds the columns of its condition so that reading it needs no table row
CREATE INDEX IF NOT EXISTS anomalies_nonfinite ON anomalies (phase, module, step, op, is_nan, value)
    WHERE {nonfinite_anomaly()};
"""
NONFINITE_RECORD = nonfinite_record()
# The non-finite records of some steps into `first_nonfinite`, where they come before its step for their tag
# (a step written again, by a job resumed from an earlier checkpoint, can). `WHERE` before `ON CONFLICT`:
# SQLite's grammar needs it there.
_NOTE_FIRST_NONFINITE = (f"INSERT INTO first_nonfinite (tag_id, step) SELECT tag_id, step FROM records "
                         f"WHERE ({NONFINITE_RECORD}){{steps}} ON CONFLICT (tag_id) DO UPDATE "
                         f"SET step = excluded.step WHERE excluded.step < first_nonfinite.step")
# SQLite reads an index by skip-scan (a seek per distinct value of its first column) only where its statistics
# say that value has many rows: a tag's rows over steps are then a seek per step in `records_step_tag`, about
# twice the time of a (tag_id, step) index and a tenth of a scan. A nominal row (rows, per step, per step
# and tag) written once; ANALYZE would replace it with the true figures.
_PLANNER_HINT = ("INSERT INTO sqlite_stat1 (tbl, idx, stat) SELECT 'records', 'records_step_tag', '1000000 1000 1' "
                 "WHERE NOT EXISTS (SELECT 1 FROM sqlite_stat1 WHERE tbl = 'records' AND idx = 'records_step_tag')")

_RECORD_INSERT = (f"INSERT INTO records (tag_id, step, micro_step, call_index, pp_stage, "
                  f"{', '.join(repr(f) for f in FIELDS)}, nan_fields) VALUES ")
_RECORD_PLACES = f"({', '.join('?' * (len(FIELDS) + 6))})"
_MAX_ROWS_PER_INSERT = 2048


def insert_records(conn: sqlite3.Connection, rows) -> None:
    """Inserts `records` rows, (tag_id, step, micro_step, call_index, pp_stage, *FIELDS, nan_fields) each, in
    order, with a multi-row INSERT per chunk: one call into SQLite per chunk, where `executemany` makes one per
    row and releases and takes back the GIL around each, which the training thread then waits on (1,560
    rows: 4.3 against 7.4 ms of the writer's CPU while another thread runs torch ops; benchmarks/db_inserts.py).

    `rows` is an object array of one row per record (a list of row tuples is converted): a chunk's parameters
    are then one flat list, with no Python list or tuple per row for the garbage collector to track."""
    table = rows if isinstance(rows, np.ndarray) else np.array(rows, dtype=object).reshape(len(rows), -1)
    width = len(FIELDS) + 6
    try:
        limit = conn.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER)
    except AttributeError:                      # Python 3.10: SQLite's smallest default
        limit = 999
    per = max(1, min(_MAX_ROWS_PER_INSERT, limit // width))
    for start in range(0, len(table), per):
        chunk = table[start:start + per]
        conn.execute(_RECORD_INSERT + ",".join([_RECORD_PLACES] * len(chunk)), chunk.ravel().tolist())
    steps = sorted(set(table[:, 1].tolist()))  # one, from a step batch
    if steps:
        note_first_nonfinite(conn, steps)


def note_first_nonfinite(conn: sqlite3.Connection, steps: Optional[list[int]]) -> None:
    """Brings `first_nonfinite` up to date with the records of `steps` (None: of every step, for a database
    of an older schema): a seek in the partial index `records_nonfinite` per step, which finds nothing in a
    healthy step."""
    if steps is None:
        conn.execute(_NOTE_FIRST_NONFINITE.format(steps=""))
    else:
        conn.execute(_NOTE_FIRST_NONFINITE.format(steps=f" AND step IN ({', '.join('?' * len(steps))})"), steps)


def connect(path: str, journal_mode: str = "WAL") -> sqlite3.Connection:
    """Opens (creating if needed) a monitor database in WAL mode (or `journal_mode`: a private copy on a
    local disk that readers in other processes open while it grows uses "DELETE", see read.stream_mirror).

    Raises:
        sqlite3.DatabaseError: the file exists but is not a monitor database (e.g. corrupt).
    """
    conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
    try:
        conn.execute(f"PRAGMA journal_mode={journal_mode}")
        # WAL + NORMAL: a commit survives the process being killed (not a power loss) without an fsync per step.
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.executescript(SCHEMA)
        if not conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'sqlite_stat1'").fetchone():
            conn.execute("ANALYZE sqlite_master")  # creates sqlite_stat1 (and analyzes no table of ours)
        conn.execute(_PLANNER_HINT)
        version = read_meta(conn).get("schema_version", SCHEMA_VERSION)
        if version < SCHEMA_VERSION:
            _upgrade(conn, version)
            write_meta(conn, {"schema_version": SCHEMA_VERSION})
        elif version != SCHEMA_VERSION:
            raise sqlite3.DatabaseError(f"{path} has schema version {version}; this trainmon reads version "
                                        f"{SCHEMA_VERSION}")
    except Exception:
        conn.close()
        raise
    return conn


def record_columns(conn: sqlite3.Connection) -> set[str]:
    """The columns of the `records` table (a version 1 database lacks the later fields)."""
    return {row[1] for row in conn.execute("PRAGMA table_info(records)")}


def _upgrade(conn: sqlite3.Connection, version: int) -> None:
    """Adds the fields a database of an older schema version lacks (NULL, "not recorded", in old rows), drops
    its record blocks when their rows are narrower than today's (`records` still holds those steps), and moves
    it from the `(tag_id, ...)` indexes of `records` to `first_nonfinite`."""
    present = record_columns(conn)
    for name in FIELDS:
        if name not in present:
            conn.execute(f'ALTER TABLE records ADD COLUMN "{name}" REAL')
    if version < BLOCKS_SINCE:
        conn.execute("DELETE FROM record_blocks")
    if version < 5:
        conn.executescript("DROP INDEX IF EXISTS records_tag_step; DROP INDEX IF EXISTS records_nonfinite_tag;")
        note_first_nonfinite(conn, None)


def write_meta(conn: sqlite3.Connection, items: dict[str, Any]) -> None:
    conn.executemany("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)",
                     [(k, json.dumps(v, default=str)) for k, v in items.items()])


def read_meta(conn: sqlite3.Connection) -> dict[str, Any]:
    return {k: json.loads(v) for k, v in conn.execute("SELECT key, value FROM meta")}


def encode_fields(values: np.ndarray, recorded: Optional[np.ndarray] = None) -> tuple[np.ndarray, np.ndarray]:
    """The record fields for SQLite, an object array of Python floats (NaN and unrecorded as None), and each
    row's `nan_fields` mask.

    Args:
        values: float64 [n, N_FIELDS].
        recorded: bool [n, N_FIELDS], False where a field is unknown (stored NULL without its NaN bit);
            None means every field was recorded.
    """
    nan = np.isnan(values)
    missing = nan if recorded is None else nan | ~recorded
    fields = values.astype(object)
    fields[missing] = None
    return fields, nan_masks(values, recorded)


def nan_masks(values: np.ndarray, recorded: Optional[np.ndarray] = None) -> np.ndarray:
    """Each row's `nan_fields`: the bits of its fields that are NaN (and recorded); see encode_fields."""
    nan = np.isnan(values)
    if recorded is not None:
        nan = nan & recorded
    return (nan * _BITS).sum(axis=1) if len(values) else np.zeros(0, dtype=np.int64)


def encode_block(tag_ids: list[int], micro_steps: list[Optional[int]], call_indexes: list[int],
                 values: np.ndarray, nan_fields: np.ndarray, recorded: Optional[np.ndarray] = None) -> bytes:
    """The `records` blob of a `record_blocks` row (see BLOCK_DTYPE); `values`/`recorded` as for encode_fields."""
    block = np.empty(len(tag_ids), dtype=BLOCK_DTYPE)
    block["tag_id"] = tag_ids
    block["micro_step"] = [NO_MICRO_STEP if m is None else m for m in micro_steps]
    block["call_index"] = call_indexes
    block["nan_fields"] = nan_fields
    block["fields"] = values if recorded is None else np.where(recorded, values, np.nan)
    return zlib.compress(block.tobytes(), 1)  # to about a quarter: counts and repeated figures compress well


def encode_real(value: float) -> tuple[Optional[float], int]:
    """(value for a REAL column, is_nan) of one float: NaN is stored as NULL with is_nan 1."""
    nan = math.isnan(value)
    return (None if nan else value), int(nan)


def decode_real(value: Optional[float], is_nan: int) -> float:
    """Inverse of `encode_real`."""
    return math.nan if is_nan else value


def decode_fields(stored: list) -> list[float]:
    """The record fields of one row as floats: NULL (a NaN field, or one not recorded) is NaN; the row's
    `nan_fields` tells the two apart."""
    return [math.nan if value is None else value for value in stored]
