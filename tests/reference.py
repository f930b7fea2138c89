"""Direct torch computations of every op, to check trainmon's figures against."""
from __future__ import annotations

import math

import torch


def reference_ops(t: torch.Tensor, eps: float = 1e-8) -> dict:
    x = t.detach().double().reshape(-1)
    finite = x[torch.isfinite(x)]
    total = x.numel()
    out = {
        "nans": float(torch.isnan(x).sum()),
        "infs": float(torch.isinf(x).sum()),
        "zeros": float((finite.abs() < eps).sum()) / total if total else None,
        "norm": float(finite.norm()) if finite.numel() else 0.0,
    }
    if finite.numel():
        out.update(min=float(finite.min()), max=float(finite.max()), mean=float(finite.mean()))
    else:
        out.update(min=None, max=None, mean=None)
    return out


def assert_ops_close(actual: dict, expected: dict, ops, rel=1e-5, abs_=1e-7, context=""):
    """`actual` may come from a CSV row (missing cells as NaN) or from the api (None)."""
    for op in ops:
        a, e = actual[op], expected[op]
        if a is not None and isinstance(a, float) and math.isnan(a):
            a = None
        if e is None:
            assert a is None, f"{context} {op}: {a}, expected no value"
        else:
            assert a is not None and math.isclose(float(a), e, rel_tol=rel, abs_tol=abs_), \
                f"{context} {op}: {a} != {e}"
