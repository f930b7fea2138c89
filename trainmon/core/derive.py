"""Host side: a record's figures (`ops`) from its stored fields, and the fields back from figures where they
allow (CSV conversions), without torch, so that readers of a run (the command line, `open_run`) need not
import it. The writer thread, the read layer, the daemon and the conversions all derive here."""
from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np

from trainmon.core import schema
from trainmon.core.schema import FIELDS, N_FIELDS, OPS


def derive_ops(record, ops: Sequence[str], fields: frozenset[str] | None = None) -> dict[str, float | None]:
    """Host side: one record row (sequence, numpy row or CPU tensor) -> {op: value}.
    norm, mean, min, max as torch computes them (NaN/Inf propagate; `schema`); the `_finite` ops over the
    finite elements (None when there are none); zeros = fraction of all elements (None when there are
    none); nans/infs = counts.  With ``fields`` (the set passed to
    tensor_records) an op whose fields were not computed raises ValueError instead of reading 0."""
    v = [float(x) for x in record]
    if len(v) != N_FIELDS:
        raise ValueError(f"a record has {N_FIELDS} fields, got {len(v)}")
    return _derive(_resolve_ops(ops, fields), v)


def derive_rows(records, ops: Sequence[str]) -> list[dict[str, float | None]]:
    """`derive_ops` of every row of a float64 ``[k, N_FIELDS]`` numpy array (a step batch's values): each op
    is derived for the whole column with numpy, then the rows become Python floats (the writer thread
    derives every record of every step)."""
    if records.ndim != 2 or records.shape[1] != N_FIELDS:
        raise ValueError(f"records must be [k, {N_FIELDS}], got {records.shape}")
    resolved = _resolve_ops(ops)
    named = {name: records[:, i] for i, name in enumerate(FIELDS)}
    columns = []
    with np.errstate(invalid="ignore", divide="ignore"):
        for _, op in resolved:
            value, has = op.derive_array(named)
            column = value.tolist()
            if has is not None:
                column = [v if ok else None for v, ok in zip(column, has.tolist())]
            columns.append(column)
    names = [name for name, _ in resolved]
    return [dict(zip(names, row)) for row in zip(*columns)] if columns else [{} for _ in range(len(records))]


def _resolve_ops(ops: Sequence[str], fields: frozenset[str] | None = None) -> list[tuple[str, schema.Op]]:
    out = []
    for name in ops:
        op = schema.OP_BY_NAME.get(name)
        if op is None:
            raise ValueError(f"unknown op {name!r}; allowed: {', '.join(OPS)}")
        if fields is not None and not set(op.fields) <= set(fields):
            raise ValueError(f"op {name!r} needs record fields {op.fields} that were not computed")
        out.append((name, op))
    return out


def _derive(ops: list[tuple[str, schema.Op]], values: list[float]) -> dict[str, float | None]:
    named = dict(zip(FIELDS, values))
    return {name: op.derive(named) for name, op in ops}


def _finite_figure(fig: dict, op: str) -> Optional[float]:
    """The figure of an op over the finite elements: its `_finite` op, else the op itself where the tensor had
    no NaN or Inf (there both agree); None where the figures do not tell."""
    if fig.get(f"{op}_finite") is not None:
        return fig[f"{op}_finite"]
    return fig.get(op) if _all_finite(fig) else None


def _all_finite(fig: dict) -> bool:
    """Whether the tensor held no NaN or Inf: its counts say so, or (a CSV without them) a finite norm or
    mean, which one NaN or Inf element would have made non-finite."""
    counts = [fig.get(op) for op in ("nans", "infs")]
    if any(count is not None and count > 0 for count in counts):
        return False
    if None not in counts:
        return True
    return any(fig.get(op) is not None and math.isfinite(fig[op]) for op in ("norm", "mean"))


def _positive_infs(fig: dict) -> Optional[float]:
    """The +Inf elements, where the figures tell: none without Infs, or when the max is not +Inf; all of
    them when the min is not -Inf."""
    infs = fig.get("infs")
    if infs is None or infs == 0:
        return infs
    if fig.get("max") is not None and fig["max"] != math.inf:
        return 0.0
    if fig.get("min") is not None and fig["min"] != -math.inf and fig["min"] == fig["min"]:
        return infs
    return None


def fields_from_figures(rows: list[dict], ops: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """The inverse of `derive_rows` where the figures allow it: the record fields (FIELDS) rebuilt from CSV
    figures (rows with `shape` and the ops), and which of them are known."""
    values = np.full((len(rows), N_FIELDS), np.nan)
    recorded = np.zeros(values.shape, dtype=bool)
    for i, row in enumerate(rows):
        numel = math.prod(row["shape"]) if isinstance(row["shape"], list) else None
        fig = {op: row.get(op) for op in ops}
        nans, infs = fig.get("nans"), fig.get("infs")
        count = None if numel is None else numel - (nans or 0) - (infs or 0)
        no_finite = count == 0
        finite = {op: _finite_figure(fig, op) for op in ("mean", "norm", "min", "max")}
        known = {
            "count": count,
            "nans": nans,
            "infs": infs,
            "zeros": fig["zeros"] * numel if "zeros" in fig and fig["zeros"] is not None and numel is not None
            else None,
            "sum": (0.0 if no_finite else None) if finite["mean"] is None or count is None else finite["mean"] * count,
            "sumsq": None if finite["norm"] is None else finite["norm"] ** 2,
            # a tensor without finite elements has an empty min/max: the record's identities
            "min": (math.inf if no_finite else None) if finite["min"] is None else finite["min"],
            "max": (-math.inf if no_finite else None) if finite["max"] is None else finite["max"],
            "sat": fig.get("sat"),
            "pinfs": _positive_infs(fig),
        }
        for j, name in enumerate(FIELDS):
            if known[name] is not None:
                values[i, j] = known[name]
                recorded[i, j] = True
    return values, recorded
