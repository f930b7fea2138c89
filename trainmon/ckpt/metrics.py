"""Distances between two versions of one parameter, from the statistic engine's records."""
from __future__ import annotations

import math
from typing import Any

import torch

from trainmon.monitor import stats

_FIELDS = stats.fields_for_ops(("norm", "min", "max", "nans", "infs"))


def compare_tensors(a: torch.Tensor, b: torch.Tensor) -> dict[str, Any]:
    """L2 distance, cosine similarity, max |a - b|, element count and shapes, computed in float64.

    Cosine is 1 for identical tensors (all-zero ones included) and None when exactly one is all zero.
    Non-finite elements are counted (`nonfinite_a`, `nonfinite_b`) and left out of the figures, as in every
    trainmon statistic; `identical` compares them position by position.
    """
    out: dict[str, Any] = {"shape_a": list(a.shape), "shape_b": list(b.shape), "dtype_a": str(a.dtype)[6:],
                           "dtype_b": str(b.dtype)[6:], "numel": a.numel()}
    if a.shape != b.shape:
        out["identical"] = False
        out["note"] = "shapes differ"
        return out
    a64, b64 = a.detach().to(torch.float64), b.detach().to(torch.float64)
    out["identical"] = bool(torch.equal(a64.isnan(), b64.isnan()) and
                            torch.equal(a64.nan_to_num(0.0), b64.nan_to_num(0.0)))
    diff = a64 - b64
    records = stats.tensor_records([diff, a64, b64], 0.0, _FIELDS).cpu()
    d, ra, rb = (stats.derive_ops(r, ("norm", "min", "max", "nans", "infs"), _FIELDS) for r in records)
    finite = a64.isfinite() & b64.isfinite()
    dot = float(torch.where(finite, a64 * b64, 0.0).sum())
    norm_a = float(torch.where(finite, a64, 0.0).norm())
    norm_b = float(torch.where(finite, b64, 0.0).norm())
    if out["identical"]:
        cosine = 1.0
    elif norm_a == 0.0 or norm_b == 0.0:
        cosine = None
    else:
        cosine = dot / (norm_a * norm_b)
    out.update(l2=d["norm"], cosine=cosine,
               max_abs_diff=max(abs(d["min"]), abs(d["max"])) if d["min"] is not None else 0.0,
               norm_a=ra["norm"], norm_b=rb["norm"],
               nonfinite_a=int(ra["nans"] + ra["infs"]), nonfinite_b=int(rb["nans"] + rb["infs"]))
    if out["identical"]:
        out.update(l2=0.0, max_abs_diff=0.0)  # inf - inf is NaN, yet identical positions do not differ
    elif not math.isfinite(out["l2"]):
        out["note"] = "the difference overflows float64"
    return out
