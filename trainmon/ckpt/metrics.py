"""Distances between two versions of one parameter: `trainmon compare`'s tensor figures (cosine, max |a - b|,
non-finite mismatches) in float64, plus the L2 distance and norms from the statistic engine."""
from __future__ import annotations

from typing import Any

import torch

from trainmon.compare.tensors import compare_tensors as tensor_figures
from trainmon.engine import records, stats
from trainmon.core.derive import derive_ops

_OPS = ("norm", "nans", "infs")
_FIELDS = stats.fields_for_ops(_OPS)


def compare_tensors(a: torch.Tensor, b: torch.Tensor) -> dict[str, Any]:
    """L2 distance, cosine similarity, max |a - b|, element count, shapes and dtypes.

    Figures are over the elements finite in both (as in `trainmon compare`; cosine is 1 when both are all
    zero, 0 when one is); `nonfinite_mismatch` counts elements finite in one and not the other. `identical`
    compares every element, NaN positions included.
    """
    out: dict[str, Any] = {"shape_a": list(a.shape), "shape_b": list(b.shape), "dtype_a": str(a.dtype)[6:],
                           "dtype_b": str(b.dtype)[6:], "numel": a.numel()}
    if a.shape != b.shape:
        out.update(identical=False, note="shapes differ")
        return out
    a64, b64 = a.detach().to(torch.float64), b.detach().to(torch.float64)
    out["identical"] = bool(torch.equal(a64.isnan(), b64.isnan()) and
                            torch.equal(a64.nan_to_num(0.0), b64.nan_to_num(0.0)))
    figures = tensor_figures(a64, b64, rtol=0.0, atol=0.0)
    both = a64.isfinite() & b64.isfinite()
    diff = torch.where(both, a64 - b64, 0.0)  # inf - inf is NaN: differences count where both are finite
    rows = records.tensor_records([diff, a64, b64], 0.0, _FIELDS).cpu()
    d, ra, rb = (derive_ops(r, _OPS, _FIELDS) for r in rows)
    out.update(l2=d["norm"], cosine=1.0 if out["identical"] else figures["cosine"], max_abs_diff=figures["max_abs"],
               norm_a=ra["norm"], norm_b=rb["norm"], nonfinite_mismatch=figures["nonfinite_mismatch"],
               nonfinite_a=int(ra["nans"] + ra["infs"]), nonfinite_b=int(rb["nans"] + rb["infs"]))
    return out
