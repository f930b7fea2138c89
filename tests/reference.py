"""Direct torch computations of every op, to check trainmon's figures against."""
from __future__ import annotations

import math

import torch


def reference_ops(t: torch.Tensor, eps: float = 1e-8) -> dict:
    """Every op of `t` computed by torch: norm, mean, min and max over all elements (NaN and Inf propagate
    as torch propagates them), the `_finite` ops over the finite ones."""
    x = t.detach().double().reshape(-1)
    finite = x[torch.isfinite(x)]
    total = x.numel()
    out = {
        "nans": float(torch.isnan(x).sum()),
        "infs": float(torch.isinf(x).sum()),
        "zeros": float((finite.abs() < eps).sum()) / total if total else None,
        "norm": float(torch.linalg.vector_norm(x)) if total else 0.0,
        "norm_finite": float(finite.norm()) if finite.numel() else 0.0,
    }
    out.update(min=float(x.min()), max=float(x.max()), mean=float(x.mean())) if total else \
        out.update(min=None, max=None, mean=None)
    if finite.numel():
        out.update(min_finite=float(finite.min()), max_finite=float(finite.max()), mean_finite=float(finite.mean()))
    else:
        out.update(min_finite=None, max_finite=None, mean_finite=None)
    return out


def assert_ops_close(actual: dict, expected: dict, ops, rel=1e-5, abs_=1e-7, context=""):
    """`actual` may come from a CSV row (missing cells as NaN) or from the api (None). An expected NaN must
    be NaN, an expected Inf the same Inf."""
    for op in ops:
        a, e = actual[op], expected[op]
        nan = a is not None and isinstance(a, float) and math.isnan(a)
        if e is None:
            assert a is None or nan, f"{context} {op}: {a}, expected no value"
        elif math.isnan(e):
            assert nan, f"{context} {op}: {a}, expected NaN"
        elif math.isinf(e):
            assert a == e, f"{context} {op}: {a}, expected {e}"
        else:
            assert a is not None and not nan and math.isclose(float(a), e, rel_tol=rel, abs_tol=abs_), \
                f"{context} {op}: {a} != {e}"


def reference_record(tensors: list, eps: float, fields) -> dict:
    """The merged record (schema fields) of `tensors`, computed in float64 from every element: counts over all, sums,
    min and max over the finite ones; `fields` (a stats.FieldSet) gives each dtype's saturation limit."""
    record = {"count": 0.0, "nans": 0.0, "infs": 0.0, "zeros": 0.0, "sum": 0.0, "sumsq": 0.0, "min": math.inf,
              "max": -math.inf, "sat": 0.0, "pinfs": 0.0}
    for t in tensors:
        x = t.detach().cpu().double().reshape(-1)
        finite = x[torch.isfinite(x)]
        record["count"] += finite.numel()
        record["nans"] += float(torch.isnan(x).sum())
        record["infs"] += float(torch.isinf(x).sum())
        record["pinfs"] += float((x == math.inf).sum())
        record["zeros"] += float((finite.abs() < eps).sum())
        record["sat"] += float((finite.abs() >= fields.sat_limit(t.dtype)).sum())
        record["sum"] += float(finite.sum())
        record["sumsq"] += float(finite.square().sum())
        if finite.numel():
            record["min"] = min(record["min"], float(finite.min()))
            record["max"] = max(record["max"], float(finite.max()))
    return record
