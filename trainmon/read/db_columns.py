"""A database's records as columns: numpy arrays, the figures derived for every row at once.

`DbRankReader.rows` builds one dict per record, which is what a step-by-step consumer wants; a DataFrame
(`open_run`), an Arrow table (`export`) or the daemon's cross-rank reduction wants columns. They come from
the `record_blocks` table, one array per step batch (sqlite3 building a tuple per row of `records` cost
~4.5 µs per record, more than everything else the daemon does with it), or from `records` where the steps
have no blocks (databases of schema version 2 and older). The columns have the names of `rows`' keys, with
the same values: a figure without a value (`rows` gives None) is NaN here and marked in `Columns.missing`.
"""
from __future__ import annotations

import functools
import json
import sqlite3
import zlib
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from trainmon.core.schema import FIELDS
from trainmon.core.schema import OP_BY_NAME
from trainmon.writers import db_schema

RAW_PREFIX = "raw_"  # columns of the stored record fields: raw_count, raw_nans, ..., raw_sat
_TAG_COLUMNS = ("family", "name", "vpp_stage", "shape", "dtype")
_ORDER = ("family", "name", "vpp_stage", "micro_step", "step", "call_index", "pp_stage", "shape", "dtype",
          "nan_fields")  # that of `rows`' keys


@dataclass
class Columns:
    """Records as columns, and per figure the rows where it has no value (`missing`).

    `rows`: the per-row numbers (name -> numpy array: step, call_index, pp_stage, nan_fields, micro_step with
    NO_MICRO_STEP for a once-per-step record, the stored fields `raw_<field>` and the figures); `tag_at`: each
    row's index into `tags`, the (family, name, vpp_stage) of the database's tags, and `tag_info` their
    (shape, dtype): a consumer grouping rows by tensor needs no strings. `data` adds the tags' columns, with
    `rows`' keys and values (micro_step None for once per step), as a DataFrame or an Arrow table wants them.
    """

    rows: dict = field(default_factory=dict)
    missing: dict = field(default_factory=dict)
    tags: list = field(default_factory=list)
    tag_info: list = field(default_factory=list)
    tag_at: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    def __len__(self) -> int:
        return len(self.rows["step"]) if self.rows else 0

    @functools.cached_property
    def data(self) -> dict:
        """name -> numpy array, or list where values are None or objects; in the order of `rows`' keys."""
        per_tag = [(*tag, *info) for tag, info in zip(self.tags, self.tag_info)]
        columns = {}
        for position, name in enumerate(_TAG_COLUMNS):
            column = np.empty(len(per_tag), dtype=object)
            column[:] = [t[position] for t in per_tag]
            columns[name] = column[self.tag_at].astype(np.int64) if name == "vpp_stage" else column[self.tag_at].tolist()
        micro = self.rows["micro_step"].tolist()
        columns["micro_step"] = [None if m == db_schema.NO_MICRO_STEP else m for m in micro]
        ordered = {name: columns[name] if name in columns else self.rows[name] for name in _ORDER}
        return {**ordered, **{name: value for name, value in self.rows.items() if name not in ordered}}


def read_columns(conn: sqlite3.Connection, ops: list[str], family: Optional[str] = None,
                 first: Optional[int] = None, last: Optional[int] = None) -> Columns:
    """The records of one family (or all) within steps first..last, in step and call order.

    Raises:
        sqlite3.Error: the database cannot be read (the caller names the file).
    """
    tags = conn.execute(f"SELECT id, {', '.join(_TAG_COLUMNS)} FROM tags").fetchall()
    family_ids = None if family is None else [t[0] for t in tags if t[1] == family]
    read = _from_blocks if _blocks_cover(conn, first, last) else _from_records
    stored = read(conn, family_ids, first, last)
    index = np.zeros(max((t[0] for t in tags), default=0) + 1, dtype=np.int64)
    index[[t[0] for t in tags]] = np.arange(len(tags))
    shapes = json.loads(f"[{', '.join(t[4] for t in tags)}]")  # one parse for all tags
    fields, tag_at = stored.pop("fields"), index[stored.pop("tag_id")]
    out = Columns(stored, tags=[t[1:4] for t in tags], tag_info=[(shape, t[5]) for shape, t in zip(shapes, tags)],
                  tag_at=tag_at)
    out.rows.update({RAW_PREFIX + f: fields[f] for f in FIELDS})
    derive = ColumnDeriver(fields, out.rows["nan_fields"])
    for op in ops:
        out.rows[op], out.missing[op] = derive(op)
    return out


def _step_range(first: Optional[int], last: Optional[int]) -> tuple[str, list]:
    return "step BETWEEN ? AND ?", [-(1 << 62) if first is None else first, (1 << 62) if last is None else last]


def _blocks_cover(conn: sqlite3.Connection, first: Optional[int], last: Optional[int]) -> bool:
    """Whether every committed batch of the steps has its block (a database of schema version 2 or older, or
    steps written before a job appended to it with version 3, have none)."""
    tables = {name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    if "record_blocks" not in tables:
        return False
    if db_schema.read_meta(conn).get("schema_version", db_schema.SCHEMA_VERSION) < db_schema.BLOCKS_SINCE:
        return False  # blocks of narrower rows
    where, args = _step_range(first, last)
    (batches,), (blocks,) = (conn.execute(f"SELECT COUNT(*) FROM {table} WHERE {where}", args).fetchone()
                             for table in ("batches", "record_blocks"))
    return batches == blocks


def _from_blocks(conn: sqlite3.Connection, family_ids: Optional[list[int]], first: Optional[int],
                 last: Optional[int]) -> dict:
    where, args = _step_range(first, last)
    blocks = conn.execute(f"SELECT step, pp_stage, records FROM record_blocks WHERE {where} ORDER BY step, rowid",
                          args).fetchall()
    try:
        unpacked = [zlib.decompress(blob) for _, _, blob in blocks]
    except zlib.error as err:
        raise sqlite3.DatabaseError(f"a record block cannot be read ({err})") from None
    rows = np.frombuffer(b"".join(unpacked), dtype=db_schema.BLOCK_DTYPE)
    sizes = [len(block) // db_schema.BLOCK_DTYPE.itemsize for block in unpacked]
    step = np.repeat(np.array([b[0] for b in blocks], dtype=np.int64), sizes)
    pp_stage = np.repeat(np.array([b[1] for b in blocks], dtype=np.int64), sizes)
    columns = {name: rows[name].astype(np.int64) for name in ("tag_id", "micro_step", "call_index", "nan_fields")}
    values = rows["fields"]
    if family_ids is not None:
        keep = np.isin(columns["tag_id"], family_ids)
        columns, step, pp_stage, values = {k: v[keep] for k, v in columns.items()}, step[keep], pp_stage[keep], values[keep]
    order = np.lexsort((columns["call_index"], step))  # stable: rows of one call stay in insertion order
    values = values[order]
    return {**{k: v[order] for k, v in columns.items()}, "step": step[order], "pp_stage": pp_stage[order],
            "fields": {f: values[:, i] for i, f in enumerate(FIELDS)}}


def _from_records(conn: sqlite3.Connection, family_ids: Optional[list[int]], first: Optional[int],
                  last: Optional[int]) -> dict:
    where, args = _step_range(first, last)
    where = [f"r.{where}"]
    if family_ids is not None:
        where.append(f"r.tag_id IN ({', '.join('?' * len(family_ids))})")
        args += family_ids
    present = db_schema.record_columns(conn)
    # a field an older schema lacks reads as NULL: not recorded
    fields = ", ".join(f'r."{f}"' if f in present else "NULL" for f in FIELDS)
    rows = conn.execute(f"SELECT r.tag_id, r.micro_step, r.step, r.call_index, r.pp_stage, r.nan_fields, {fields} "
                        f"FROM records r WHERE {' AND '.join(where)} ORDER BY r.step, r.call_index, r.rowid",
                        args).fetchall()
    values = list(zip(*rows)) if rows else [()] * (6 + len(FIELDS))
    tag_id, micro, step, call_index, pp_stage, nan_fields = values[:6]
    ints = {"tag_id": tag_id, "step": step, "call_index": call_index, "pp_stage": pp_stage, "nan_fields": nan_fields,
            "micro_step": [db_schema.NO_MICRO_STEP if m is None else m for m in micro]}
    return {**{name: np.array(column, dtype=np.int64) for name, column in ints.items()},
            "fields": {f: np.array(values[6 + i], dtype=np.float64) for i, f in enumerate(FIELDS)}}  # NULL is NaN


class ColumnDeriver:
    """The figures of records given as columns: `core.schema.OP_TABLE`'s column derivation, as `DbRankReader.rows`
    applies it (NaN and Inf counts that were not recorded count as none; a NaN figure of a row without NaN
    fields and without NaN/Inf elements comes from fields that were not recorded, and has no value). What every
    op needs is made once.

    Args:
        stored: the stored fields, name -> array (NaN where NULL).
        nan_fields: each row's bit mask of the fields stored as NULL because they were NaN.
    """

    def __init__(self, stored: dict, nan_fields: np.ndarray):
        self.fields = {**stored, "nans": np.nan_to_num(stored["nans"], nan=0.0),
                       "infs": np.nan_to_num(stored["infs"], nan=0.0)}
        # a NaN figure has a value where a field was NaN or an element was NaN or Inf
        self.nan_is_value = (nan_fields != 0) | (self.fields["nans"] > 0) | (self.fields["infs"] > 0)

    def __call__(self, op: str) -> tuple[np.ndarray, np.ndarray]:
        """(figure, missing) of every row."""
        with np.errstate(invalid="ignore", divide="ignore"):
            value, has = OP_BY_NAME[op].derive_array(self.fields)
        missing = np.isnan(value) & ~self.nan_is_value
        if has is not None:
            missing |= ~has
        return np.where(missing, np.nan, value), missing
