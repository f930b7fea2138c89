"""Reading one rank's `monitor.db`, strictly read-only.

A database whose job has ended and checkpointed has no `-wal` file: it is opened `immutable`, so SQLite
creates no `-wal`/`-shm` beside it and takes no lock. A database with a `-wal` belongs to a running job
(or one that was killed): it is opened `mode=ro`, which reads every committed transaction from the WAL
and ignores one that never committed; its `-wal`/`-shm` files are the job's own.
"""
from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Iterator, Optional
from urllib.parse import quote


from trainmon.core.events import AnomalyEvent
from trainmon.core.derive import derive_ops
from trainmon.core.schema import INDEX
from trainmon.read.db_columns import RAW_PREFIX, Columns, read_columns
from trainmon.read.db_nonfinite import DbNonfinite, read_nonfinite
from trainmon.read.errors import InputError
from trainmon.read.jsonl import whole_lines
from trainmon.read.stream_mirror import is_mirror
from trainmon.writers import db_schema
from trainmon.writers.db_schema import FIELDS

_NANS, _INFS = INDEX["nans"], INDEX["infs"]

_NEEDED_TABLES = ("meta", "tags", "records", "batches")


def open_db(path: Path) -> sqlite3.Connection:
    """A read-only connection to a monitor database, checked to have trainmon's tables.

    Raises:
        InputError: not a database, or an empty or schema-less one (naming the file).
    """
    # a record stream's mirror grows while it is read (read.stream_mirror): never immutable
    immutable = "&immutable=1" if not Path(f"{path}-wal").exists() and not is_mirror(path) else ""
    try:
        conn = sqlite3.connect(f"file:{quote(str(path.resolve()))}?mode=ro{immutable}", uri=True)
    except sqlite3.Error as err:
        raise _db_error(path, err) from None
    try:
        tables = {name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    except sqlite3.Error as err:
        conn.close()
        raise _db_error(path, err) from None
    missing = [t for t in _NEEDED_TABLES if t not in tables]
    if missing:
        conn.close()
        what = "an empty database" if not tables else f"a database without the table(s) {', '.join(missing)}"
        raise InputError.at(path, f"{what}: not a trainmon monitor database (a conversion that failed leaves "
                                  "one); delete it or write it again")
    return conn


def _db_error(path: Path, err: sqlite3.Error) -> InputError:
    return InputError.at(path, f"cannot read the monitor database ({err}); it may be corrupt or not a trainmon "
                               f"database (check with: sqlite3 {path} 'PRAGMA integrity_check')")


class DbRankReader:
    """Records of one `monitor.db`, with the figures (`ops`) derived from the stored fields.

    Raises (all methods):
        InputError: the database cannot be read (naming the file).
    """

    def __init__(self, path: Path):
        self.path = path
        self.conn = open_db(path)
        self.meta = self._guard(lambda: db_schema.read_meta(self.conn))
        self.ops = list(self.meta.get("ops", []))

    def _guard(self, read):
        try:
            return read()
        except sqlite3.Error as err:
            raise _db_error(self.path, err) from None

    def rows(self, family: Optional[str], first: Optional[int], last: Optional[int]) -> Iterator[tuple[int, list]]:
        """(step, rows) in step order; each row has the stored fields (`raw_<field>`, NaN when NULL),
        `nan_fields` and the derived ops (None where the op has no value, e.g. the min of a tensor
        without finite elements)."""
        where, args = _step_filter("r.step", first, last)
        if family is not None:
            where.append("t.family = ?")
            args.append(family)
        present = self._guard(lambda: db_schema.record_columns(self.conn))
        # a field an older schema lacks reads as NULL: not recorded
        fields = ", ".join(f'r."{f}"' if f in present else "NULL" for f in FIELDS)
        query = (f"SELECT t.family, t.name, t.vpp_stage, r.micro_step, r.step, r.call_index, r.pp_stage, t.shape, "
                 f"t.dtype, r.nan_fields, {fields} FROM records r JOIN tags t ON t.id = r.tag_id "
                 f"{'WHERE ' + ' AND '.join(where) if where else ''} ORDER BY r.step, r.call_index")
        names = ("family", "name", "vpp_stage", "micro_step", "step", "call_index", "pp_stage", "shape", "dtype",
                 "nan_fields") + FIELDS
        step, rows = None, []
        try:
            for values in self.conn.execute(query, args):
                row = dict(zip(names, values))
                if row["step"] != step and rows:
                    yield step, rows
                    rows = []
                step = row["step"]
                rows.append(self._with_ops(row))
        except sqlite3.Error as err:
            raise _db_error(self.path, err) from None
        if rows:
            yield step, rows

    def _with_ops(self, row: dict) -> dict:
        stored = db_schema.decode_fields([row.pop(f) for f in FIELDS])
        row.update({RAW_PREFIX + f: value for f, value in zip(FIELDS, stored)})  # min, max, nans... are ops too
        row["shape"] = json.loads(row["shape"])
        # NaN and Inf counts that were not recorded (CSV conversions) count as none; see db_schema.
        # (Plain Python: numpy's per-call overhead on one short row was most of the cost of reading a run.)
        record = list(stored)
        for field in (_NANS, _INFS):
            if record[field] != record[field]:
                record[field] = 0.0
        figures = derive_ops(record, self.ops)
        if not row["nan_fields"] and not (record[_NANS] > 0 or record[_INFS] > 0):
            # no field is NaN and no element is NaN or Inf, so a NaN figure comes from fields that were not
            # recorded: it has no value
            figures = {op: None if v is not None and v != v else v for op, v in figures.items()}
        row.update(figures)
        return row

    def columns(self, family: Optional[str], first: Optional[int], last: Optional[int]) -> Columns:
        """The records of `rows` as columns (`db_columns`), for DataFrames and Arrow tables."""
        return self._guard(lambda: read_columns(self.conn, self.ops, family, first, last))

    def steps(self) -> set[int]:
        """The steps whose batch was committed."""
        return self._guard(lambda: {s for (s,) in self.conn.execute("SELECT DISTINCT step FROM batches")})

    def last_commit(self) -> tuple[Optional[int], Optional[float]]:
        """(the newest committed step, the wall-clock time of the newest commit), (None, None) before any."""
        return self._guard(lambda: self.conn.execute("SELECT MAX(step), MAX(wall_time) FROM batches").fetchone())

    def step_count(self) -> int:
        return len(self.steps())

    def scalars(self, name: Optional[str], first: Optional[int], last: Optional[int]) -> list[dict]:
        where, args = _step_filter("step", first, last)
        if name is not None:
            where.append("name = ?")
            args.append(name)
        query = (f"SELECT name, step, value, is_nan FROM scalars {'WHERE ' + ' AND '.join(where) if where else ''} "
                 "ORDER BY step, rowid")
        rows = self._guard(lambda: self.conn.execute(query, args).fetchall())
        return [{"name": n, "step": s, "value": db_schema.decode_real(v, is_nan)} for n, s, v, is_nan in rows]

    def nonfinite(self, rank: int) -> DbNonfinite:
        """What the post-mortem needs of the database's non-finite records and anomalies (`db_nonfinite`)."""
        return self._guard(lambda: read_nonfinite(self.conn, rank, self.has_anomalies()))

    def first_anomalous_step(self, after: int) -> Optional[int]:
        """The first step after `after` holding a non-finite record or a row of the anomalies table (None:
        none yet). Reads the partial index of non-finite records, so it stays cheap on long runs."""
        def read() -> Optional[int]:
            found = [s for (s,) in self.conn.execute(
                f"SELECT step FROM records WHERE ({db_schema.NONFINITE_RECORD}) AND step > ? ORDER BY step, "
                "call_index LIMIT 1", (after,))]
            if self.has_anomalies():
                found += [s for (s,) in self.conn.execute("SELECT MIN(step) FROM anomalies WHERE step > ?", (after,))
                          if s is not None]
            return min(found) if found else None
        return self._guard(read)

    def holds_lines_of(self, jsonl: Path) -> bool:
        """Whether the anomalies table holds every line of the rank's anomalies.jsonl: the anomaly processor
        writes each anomaly to both, one step at a time, so when the table has as many rows as the file has
        whole lines, they are the same anomalies and the file need not be read (a table that stopped on
        a database error, or a cut-short last line, makes the counts differ: then the file is read)."""
        if not self.has_anomalies():
            return False
        rows = self._guard(lambda: self.conn.execute("SELECT COUNT(*) FROM anomalies").fetchone()[0])
        return rows == whole_lines(jsonl)

    def has_anomalies(self) -> bool:
        """Whether the database has the anomalies table (the run's anomaly processor wrote into it)."""
        return self._guard(lambda: self.conn.execute(
            "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'anomalies'").fetchone() is not None)

    def _anomalies(self, first: Optional[int] = None, last: Optional[int] = None,
                   enough: Optional[int] = None) -> list[AnomalyEvent]:
        if not self.has_anomalies():
            return []
        columns = db_schema.ANOMALY_COLUMNS
        where, args = _step_filter("step", first, last)
        query = (f"SELECT {', '.join(columns)}, is_nan FROM anomalies {'WHERE ' + ' AND '.join(where) if where else ''} "
                 "ORDER BY step, rowid")
        events: list[AnomalyEvent] = []
        for row in self.conn.execute(query, args):
            fields = dict(zip(columns, row))
            if enough is not None and len(events) >= enough and fields["step"] != events[-1].step:
                break  # the ordering key starts with the step: later steps cannot be among the earliest
            fields["value"] = db_schema.decode_real(fields["value"], row[-1])
            fields["first"] = bool(fields["first"])
            events.append(AnomalyEvent(**fields))
        return events

    def anomalies(self, first: Optional[int] = None, last: Optional[int] = None,
                  enough: Optional[int] = None) -> list[AnomalyEvent]:
        """Rows of the anomalies table in step order (none without the table), within steps first..last;
        with `enough`, reading stops at the end of the step that brought that many."""
        return self._guard(lambda: self._anomalies(first, last, enough))

    def close(self) -> None:
        self.conn.close()


def _step_filter(column: str, first: Optional[int], last: Optional[int]) -> tuple[list[str], list]:
    where, args = [], []
    if first is not None:
        where.append(f"{column} >= ?")
        args.append(first)
    if last is not None:
        where.append(f"{column} <= ?")
        args.append(last)
    return where, args
