"""A database's records as columns: one query, numpy arrays, the figures derived for every row at once.

`DbRankReader.rows` builds one dict per record, which is what a step-by-step consumer wants; a DataFrame
(`open_run`) or an Arrow table (`export`) wants columns, and building them from dicts cost ~100 µs per
record. The columns have the names of `rows`' keys, with the same values: a figure without a value
(`rows` gives None) is NaN here and marked in `Columns.missing`.
"""
from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from trainmon.monitor.records import FIELDS
from trainmon.writers import db_schema

RAW_PREFIX = "raw_"  # columns of the stored record fields: raw_count, raw_nans, ..., raw_sat
_TAG_COLUMNS = ("family", "name", "vpp_stage", "shape", "dtype")
_ORDER = ("family", "name", "vpp_stage", "micro_step", "step", "call_index", "pp_stage", "shape", "dtype",
          "nan_fields")  # that of `rows`' keys


@dataclass
class Columns:
    """Records as columns (`data`: name -> numpy array, or list where values are None or objects), and
    per figure the rows where it has no value (`missing`). `tag_at` is each row's index into `tags`, the
    (family, name, vpp_stage) of the database's tags: a consumer grouping rows by tensor needs no strings."""

    data: dict = field(default_factory=dict)
    missing: dict = field(default_factory=dict)
    tags: list = field(default_factory=list)
    tag_at: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    def __len__(self) -> int:
        return len(self.data["step"]) if self.data else 0


def read_columns(conn: sqlite3.Connection, ops: list[str], family: Optional[str] = None,
                 first: Optional[int] = None, last: Optional[int] = None) -> Columns:
    """The records of one family (or all) within steps first..last, in step and call order.

    Raises:
        sqlite3.Error: the database cannot be read (the caller names the file).
    """
    tags = conn.execute(f"SELECT id, {', '.join(_TAG_COLUMNS)} FROM tags").fetchall()
    where, args = ["1"], []
    if family is not None:
        ids = [t[0] for t in tags if t[1] == family]
        where.append(f"r.tag_id IN ({', '.join('?' * len(ids))})")
        args += ids
    if first is not None:
        where.append("r.step >= ?")
        args.append(first)
    if last is not None:
        where.append("r.step <= ?")
        args.append(last)
    present = db_schema.record_columns(conn)
    # a field an older schema lacks reads as NULL: not recorded
    fields = ", ".join(f'r."{f}"' if f in present else "NULL" for f in FIELDS)
    rows = conn.execute(f"SELECT r.tag_id, r.micro_step, r.step, r.call_index, r.pp_stage, r.nan_fields, {fields} "
                        f"FROM records r WHERE {' AND '.join(where)} ORDER BY r.step, r.call_index, r.rowid",
                        args).fetchall()
    values = list(zip(*rows)) if rows else [()] * (6 + len(FIELDS))
    index = {t[0]: i for i, t in enumerate(tags)}
    at = np.fromiter(map(index.__getitem__, values[0]), dtype=np.int64, count=len(rows))
    per_tag = {}
    for position, name in enumerate(_TAG_COLUMNS, 1):
        column = np.empty(len(tags), dtype=object)
        column[:] = [json.loads(t[position]) if name == "shape" else t[position] for t in tags]
        per_tag[name] = column[at].tolist() if name != "vpp_stage" else column[at].astype(np.int64)
    ints = {name: np.array(values[position], dtype=np.int64)
            for position, name in enumerate(("step", "call_index", "pp_stage", "nan_fields"), 2)}
    columns = {**per_tag, **ints, "micro_step": list(values[1])}  # micro_step None: once per step
    out = Columns({name: columns[name] for name in _ORDER}, tags=[(t[1], t[2], t[3]) for t in tags], tag_at=at)
    stored = {f: np.array(values[6 + i], dtype=np.float64) for i, f in enumerate(FIELDS)}  # NULL is NaN
    out.data.update({RAW_PREFIX + f: stored[f] for f in FIELDS})
    for op in ops:
        out.data[op], out.missing[op] = derive_columns(stored, out.data["nan_fields"], op)
    return out


def derive_columns(stored: dict, nan_fields: np.ndarray, op: str) -> tuple[np.ndarray, np.ndarray]:
    """(figure, missing) of every row: `monitor.schema.OP_TABLE`'s derivations over arrays, as
    `DbRankReader.rows` applies them (NaN and Inf counts that were not recorded count as none; a NaN figure
    of a row without NaN fields comes from fields that were not recorded, and has no value)."""
    count = stored["count"]
    nans, infs = np.nan_to_num(stored["nans"], nan=0.0), np.nan_to_num(stored["infs"], nan=0.0)
    some = count > 0  # False where count is NaN, as in the scalar comparison
    with np.errstate(invalid="ignore", divide="ignore"):
        total = count + nans + infs
        value, has = {
            "min": (stored["min"], some),
            "max": (stored["max"], some),
            "norm": (np.sqrt(stored["sumsq"]), None),
            "mean": (stored["sum"] / count, some),
            "zeros": (stored["zeros"] / total, total > 0),
            "nans": (nans, None),
            "infs": (infs, None),
            "sat": (stored["sat"], None),
        }[op]
    missing = np.isnan(value) & (nan_fields == 0)
    if has is not None:
        missing |= ~has
    return np.where(missing, np.nan, value), missing
