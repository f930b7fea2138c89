"""The CPU path of the statistic engine: assume-finite figures first, exact kernels only where needed.

On a CPU tensor, reading a value waits for no device, so the engine can afford to look: it computes
the figures that are exact when every element is finite (sum, dot, amin, amax and one count of
|x| >= eps: 4 to 6 passes, against 12 for the branch-free exact kernels), reads whether they came out
finite, and runs the exact kernels only on the tensors holding a NaN or an Inf (or whose fp32 sums
overflowed). On accelerators the branch-free kernels run instead: there, this look would be a host
synchronisation inside a hook.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

_FAST_DTYPES = (torch.float32, torch.float64)


def finite_first_records(uniq: Sequence[torch.Tensor], eps: float, want: tuple,
                         consts: Callable, workspace: Callable, exact: Callable) -> torch.Tensor:
    """float64 [len(uniq), 8] records of CPU tensors; `exact(tensors)` gives the branch-free records.

    Args:
        uniq: CPU tensors, without duplicates.
        eps: the zeros threshold.
        want: per record field, whether it is computed.
        consts: `(dtype, eps) -> (lambda, P, acc dtype)` of the exact engine (lambda: largest value < eps).
        workspace: `dtype -> ` a reused flat scratch buffer of that dtype.
        exact: records of the tensors the assume-finite figures cannot describe.
    """
    fast = [u for u, t in enumerate(uniq) if t.dtype in _FAST_DTYPES and t.is_contiguous() and t.numel()]
    slow = sorted(set(range(len(uniq))) - set(fast))
    rec = torch.zeros(len(uniq), 8, dtype=torch.float64)
    if fast:
        rec[fast] = _assume_finite([uniq[u] for u in fast], eps, want, consts, workspace)
        # Finite sums and extremes mean no element was NaN or Inf (`.numpy()` reads the CPU values).
        finite = torch.isfinite(rec[fast][:, 4:8]).all(1).numpy()
        slow = sorted(slow + [u for u, ok in zip(fast, finite) if not ok])
    if slow:
        rec[slow] = exact([uniq[u] for u in slow])
    return rec


def _count_at_least(flat: torch.Tensor, lam: float, buffer: torch.Tensor) -> torch.Tensor:
    """Number of |x| > lam (lam being the largest value below eps: |x| >= eps), chunk by chunk
    through a reused buffer, so no temporary of the tensor's size is made.

    hardshrink zeroes |x| <= lam, sign maps the rest to ±1, and the dot product of that with itself
    counts them: exact in fp32 while a chunk has fewer than 2**24 elements, and three cheap float
    passes where a bool mask and count_nonzero cost twice as much.
    """
    chunk = buffer.numel()
    counts = []
    for start in range(0, flat.numel(), chunk):
        part = flat[start:start + chunk]
        out = buffer[:part.numel()]
        torch.ops.aten.hardshrink.out(part, lam, out=out)
        torch.sign(out, out=out)
        counts.append(torch.dot(out, out))
    return counts[0] if len(counts) == 1 else torch.stack(counts).to(torch.float64).sum()


def _assume_finite(tensors: Sequence[torch.Tensor], eps: float, want: tuple, consts: Callable,
                   workspace: Callable) -> torch.Tensor:
    count = torch.tensor([float(t.numel()) for t in tensors], dtype=torch.float64)
    zero = torch.zeros_like(count)
    sums, squares, mins, maxs, large = [], [], [], [], []
    for t in tensors:
        flat = t.view(-1)
        sums.append(flat.sum(dtype=torch.float64 if t.dtype == torch.float64 else torch.float32))
        if want[5]:
            squares.append(torch.dot(flat, flat))
        if want[6]:
            mins.append(flat.amin())
        if want[7]:
            maxs.append(flat.amax())
        if want[3]:
            large.append(_count_at_least(flat, consts(t.dtype, eps)[0], workspace(t.dtype)))

    def column(values, wanted):
        return torch.stack(values).to(torch.float64) if wanted else zero

    # Detection needs a finite check of every element: the sum (always computed) provides it.
    columns = [count, zero, zero,
               count - column(large, want[3]) if want[3] else zero,
               column(sums, True), column(squares, want[5]), column(mins, want[6]), column(maxs, want[7])]
    rec = torch.stack(columns, 1)
    if not want[4]:
        rec[:, 4] = torch.where(torch.isfinite(rec[:, 4]), 0.0, rec[:, 4])  # keep the check, not the figure
    return rec
