"""Host side: a record's figures (`ops`) from its stored fields, without torch, so that readers of a run
(the command line, `open_run`) need not import it. `stats` re-exports both functions."""
from __future__ import annotations

from typing import Sequence

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
