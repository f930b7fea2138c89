"""The statistic record in one table: its fields, how they merge, and the ops derived from them.

Everything that handles a record (the stat engine, the step batch, the sinks, the database schema, the
read layer, merging across shards) takes its fields, their order and their merge rules from here. A new
count is one `Field` row plus its kernel in the engine (and an `Op` row when it is shown as a figure);
the database gets its column from the same row.

The first eight fields are the design's mergeable record; `sat` and `pinfs` came later, so existing column
positions did not move.

The figures a user reads follow torch (design §3): a tensor with a NaN element has NaN norm, mean, min and
max; with ±Inf and no NaN, norm is +Inf, min/max are the infinities it holds and mean is what their signs
give. The finite-only figures (`norm_finite`, `mean_finite`, `min_finite`, `max_finite`) are ops of their
own, for diagnosis. Each op is derived twice from the same rules, next to each other here: one record at a
time in plain Python (the readers' per-row path, where numpy's per-call cost dominated) and a column of
records at once with numpy (the writer thread, the database's column reads); `tests/test_stats.py` holds
the two to the same answers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

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
    Field("pinfs", "sum", "+Inf elements (of `infs`: the rest are -Inf)"),
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
_BY_RULE = ((list(SUM_COLUMNS), np.add), (list(MIN_COLUMNS), np.minimum), (list(MAX_COLUMNS), np.maximum))


def merge_rows(rows: np.ndarray, merges: np.ndarray) -> None:
    """Folds, in place and in order, row `source` of `rows` [n, N_FIELDS] into row `target` for each (source, target)
    of `merges` [m, 2], by the merge rules: as one pass where no target is also a source, else one at a time."""
    sources, targets = merges[:, 0], merges[:, 1]
    if np.isin(targets, sources).any():
        for source, target in merges.tolist():
            for columns, rule in _BY_RULE:
                rows[target, columns] = rule(rows[target, columns], rows[source, columns])
        return
    for columns, rule in _BY_RULE:
        rule.at(rows, (targets[:, None], columns), rows[sources[:, None], columns])


def unasked_columns(fields) -> tuple[int, ...]:
    """The columns a record of `fields` leaves 0: the fields neither asked for nor always computed."""
    return tuple(i for i, f in enumerate(FIELDS) if f not in fields and f not in ALWAYS)


def _total(r: dict) -> float:
    return r["count"] + r["nans"] + r["infs"]


# ---- one record (plain Python; a NaN field was not recorded, and comparisons with it are False) ----------
def _norm(r: dict) -> Optional[float]:
    if r["nans"] > 0:
        return math.nan
    return math.inf if r["infs"] > 0 else math.sqrt(r["sumsq"])


def _signed_infs(r: dict) -> tuple[float, float]:
    """(+Inf, -Inf) elements; NaN where the sign was not recorded."""
    return r["pinfs"], r["infs"] - r["pinfs"]


def _extreme(r: dict, field: str, own_inf: float) -> Optional[float]:
    """min (own_inf -inf) or max (+inf) as torch gives it: NaN wins, then an Inf of the figure's own sign, then
    the finite extreme, then the other sign's Inf; NaN where an Inf's sign was not recorded."""
    if r["nans"] > 0:
        return math.nan
    if r["infs"] > 0:
        pos, neg = _signed_infs(r)
        own = pos if own_inf > 0 else neg
        if not own == own:
            return math.nan
        if own > 0:
            return own_inf
    if r["count"] > 0:
        return r[field]
    return -own_inf if r["infs"] > 0 else None


def _mean(r: dict) -> Optional[float]:
    if r["nans"] > 0:
        return math.nan
    if r["infs"] > 0:
        pos, neg = _signed_infs(r)
        if not (pos == pos) or (pos > 0 and neg > 0):
            return math.nan  # +Inf and -Inf (or an unknown sign): torch's mean is NaN
        return math.inf if pos > 0 else -math.inf
    return r["sum"] / r["count"] if r["count"] > 0 else None


# ---- columns of records (numpy): (figure, has a value; None: every row has one) ------------------------
def _norm_array(r: dict) -> tuple:
    return np.where(r["nans"] > 0, np.nan, np.where(r["infs"] > 0, np.inf, np.sqrt(r["sumsq"]))), None


def _extreme_array(r: dict, field: str, own_inf: float) -> tuple:
    """`_extreme` over columns."""
    has_inf = r["infs"] > 0
    own = r["pinfs"] if own_inf > 0 else r["infs"] - r["pinfs"]
    value = np.select([r["nans"] > 0, has_inf & np.isnan(own), has_inf & (own > 0), r["count"] > 0, has_inf],
                      [np.nan, np.nan, own_inf, r[field], -own_inf], np.nan)
    return value, (r["nans"] > 0) | has_inf | (r["count"] > 0)


def _mean_array(r: dict) -> tuple:
    pos, neg = r["pinfs"], r["infs"] - r["pinfs"]
    has_inf = r["infs"] > 0
    value = np.select([r["nans"] > 0, has_inf & (np.isnan(pos) | ((pos > 0) & (neg > 0))), has_inf & (pos > 0),
                       has_inf], [np.nan, np.nan, np.inf, -np.inf], r["sum"] / r["count"])
    return value, (r["nans"] > 0) | has_inf | (r["count"] > 0)


@dataclass(frozen=True)
class Op:
    """A figure derived from a record (a column in CSV, a TensorBoard tag).

    Args:
        name: the op, as given in the config's `ops`.
        fields: the record fields it needs (the engine computes only the fields some op needs).
        derive: record as {field: value} -> the figure, or None when it has no value.
        derive_array: records as {field: float64 array} -> (figures, bool array of the rows that have one, or
            None when all do); the same rules as `derive`.
        doc: what it shows.
    """

    name: str
    fields: tuple[str, ...]
    derive: Callable[[dict], Optional[float]]
    derive_array: Callable[[dict], tuple]
    doc: str


def _total_array(r: dict):
    return r["count"] + r["nans"] + r["infs"]


OP_TABLE: tuple[Op, ...] = (
    Op("min", ("min", "pinfs"), lambda r: _extreme(r, "min", -math.inf), lambda r: _extreme_array(r, "min", -np.inf),
       "smallest element, as torch.min: NaN if any element is, -Inf if one is"),
    Op("max", ("max", "pinfs"), lambda r: _extreme(r, "max", math.inf), lambda r: _extreme_array(r, "max", np.inf),
       "largest element, as torch.max: NaN if any element is, +Inf if one is"),
    Op("norm", ("sumsq",), _norm, _norm_array, "L2 norm, as torch.linalg.vector_norm: NaN if any element is, "
                                               "else +Inf if one is ±Inf"),
    Op("mean", ("sum", "pinfs"), _mean, _mean_array,
       "mean, as torch.mean: NaN with a NaN or with both +Inf and -Inf, else the sign of the Inf"),
    Op("zeros", ("zeros",), lambda r: r["zeros"] / _total(r) if _total(r) > 0 else None,
       lambda r: (r["zeros"] / _total_array(r), _total_array(r) > 0), "fraction of the elements with |x| < eps"),
    Op("nans", (), lambda r: r["nans"], lambda r: (r["nans"], None), "NaN elements"),
    Op("infs", (), lambda r: r["infs"], lambda r: (r["infs"], None), "±Inf elements"),
    Op("sat", ("sat",), lambda r: r["sat"], lambda r: (r["sat"], None),
       "finite elements at or beyond the saturation limit"),
    Op("norm_finite", ("sumsq",), lambda r: math.sqrt(r["sumsq"]), lambda r: (np.sqrt(r["sumsq"]), None),
       "L2 norm of the finite elements"),
    Op("mean_finite", ("sum",), lambda r: r["sum"] / r["count"] if r["count"] > 0 else None,
       lambda r: (r["sum"] / r["count"], r["count"] > 0), "mean of the finite elements"),
    Op("min_finite", ("min",), lambda r: r["min"] if r["count"] > 0 else None,
       lambda r: (r["min"], r["count"] > 0), "smallest finite element"),
    Op("max_finite", ("max",), lambda r: r["max"] if r["count"] > 0 else None,
       lambda r: (r["max"], r["count"] > 0), "largest finite element"),
)
OPS: tuple[str, ...] = tuple(op.name for op in OP_TABLE)
OP_BY_NAME: dict[str, Op] = {op.name: op for op in OP_TABLE}
