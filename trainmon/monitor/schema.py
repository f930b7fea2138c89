"""The statistic record in one table: its fields, how they merge, and the ops derived from them.

Everything that handles a record (the stat engine, the step batch, the sinks, the database schema, the
read layer, merging across shards) takes its fields, their order and their merge rules from here. A new
count is one `Field` row plus its kernel in the engine (and an `Op` row when it is shown as a figure);
the database gets its column from the same row.

The first eight fields are the design's mergeable record; `sat` came later, so existing column
positions did not move.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

_INF = math.inf


@dataclass(frozen=True)
class Field:
    """One field of the record.

    Args:
        name: the field (also the database column).
        merge: "sum", "min" or "max": how records of chunks, micro-batches, shards and ranks combine.
        doc: what it counts or holds (over the finite elements unless it says otherwise).
    """

    name: str
    merge: str
    doc: str

    @property
    def identity(self) -> float:
        """The value of an empty record: what merging leaves unchanged."""
        return {"sum": 0.0, "min": _INF, "max": -_INF}[self.merge]


FIELD_TABLE: tuple[Field, ...] = (
    Field("count", "sum", "finite elements"),
    Field("nans", "sum", "NaN elements"),
    Field("infs", "sum", "+-Inf elements"),
    Field("zeros", "sum", "finite elements with |x| < eps"),
    Field("sum", "sum", "sum of the finite elements"),
    Field("sumsq", "sum", "sum of squares of the finite elements"),
    Field("min", "min", "smallest finite element (+inf when there is none)"),
    Field("max", "max", "largest finite element (-inf when there is none)"),
    Field("sat", "sum", "finite elements with |x| >= the saturation limit (`sat_threshold`, `sat_dtype`)"),
)
FIELDS: tuple[str, ...] = tuple(f.name for f in FIELD_TABLE)
N_FIELDS = len(FIELDS)
INDEX: dict[str, int] = {name: i for i, name in enumerate(FIELDS)}
SUM_COLUMNS: tuple[int, ...] = tuple(i for i, f in enumerate(FIELD_TABLE) if f.merge == "sum")
MIN_COLUMNS: tuple[int, ...] = tuple(i for i, f in enumerate(FIELD_TABLE) if f.merge == "min")
MAX_COLUMNS: tuple[int, ...] = tuple(i for i, f in enumerate(FIELD_TABLE) if f.merge == "max")
IDENTITY: tuple[float, ...] = tuple(f.identity for f in FIELD_TABLE)
# Computed whatever the ops: the sentinel and the post-mortem need the non-finite counts.
ALWAYS: frozenset[str] = frozenset(("count", "nans", "infs"))


def _total(r: dict) -> float:
    return r["count"] + r["nans"] + r["infs"]


@dataclass(frozen=True)
class Op:
    """A figure derived from a record (a column in CSV, a TensorBoard tag).

    Args:
        name: the op, as given in the config's `ops`.
        fields: the record fields it needs (the engine computes only the fields some op needs).
        derive: record as {field: value} -> the figure, or None when it has no value.
    """

    name: str
    fields: tuple[str, ...]
    derive: Callable[[dict], Optional[float]]


OP_TABLE: tuple[Op, ...] = (
    Op("min", ("min",), lambda r: r["min"] if r["count"] > 0 else None),
    Op("max", ("max",), lambda r: r["max"] if r["count"] > 0 else None),
    Op("norm", ("sumsq",), lambda r: math.sqrt(r["sumsq"])),
    Op("mean", ("sum",), lambda r: r["sum"] / r["count"] if r["count"] > 0 else None),
    Op("zeros", ("zeros",), lambda r: r["zeros"] / _total(r) if _total(r) > 0 else None),  # a fraction
    Op("nans", (), lambda r: r["nans"]),
    Op("infs", (), lambda r: r["infs"]),
    Op("sat", ("sat",), lambda r: r["sat"]),  # a count, like nans and infs
)
OPS: tuple[str, ...] = tuple(op.name for op in OP_TABLE)
OP_BY_NAME: dict[str, Op] = {op.name: op for op in OP_TABLE}
