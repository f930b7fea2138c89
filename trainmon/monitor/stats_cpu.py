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

from trainmon.monitor.schema import N_FIELDS

_FAST_DTYPES = (torch.float32, torch.float64)
# Tensors up to this size (biases, norms, small weights) are reduced together as segments of one
# buffer: for them the cost of an op call, not of the data, dominates.
_SMALL = 1 << 12


def finite_first_records(uniq: Sequence[torch.Tensor], eps: float, want: tuple,
                         consts: Callable, workspace: Callable, exact: Callable) -> torch.Tensor:
    """float64 [len(uniq), N_FIELDS] records of CPU tensors, the fields of `want` filled (the packed ones,
    the first len(want)); `exact(tensors)` gives the branch-free records.

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
    rec = torch.zeros(len(uniq), N_FIELDS, dtype=torch.float64)
    packed = len(want)
    small = [u for u in fast if uniq[u].numel() <= _SMALL]
    large = [u for u in fast if uniq[u].numel() > _SMALL]
    for dtype in _FAST_DTYPES:
        group = [u for u in small if uniq[u].dtype == dtype]
        if group:
            rec[group, :packed] = _assume_finite_small([uniq[u] for u in group], eps, want, consts(dtype, eps)[0])
    if large:
        rec[large, :packed] = _assume_finite([uniq[u] for u in large], eps, want, consts, workspace)
    if fast:
        # Finite sums and extremes mean no element was NaN or Inf (`.numpy()` reads the CPU values).
        finite = torch.isfinite(rec[fast][:, 4:8]).all(1).numpy()
        slow = sorted(slow + [u for u, ok in zip(fast, finite) if not ok])
    if slow:
        rec[slow] = exact([uniq[u] for u in slow])
    return rec


def _assume_finite(tensors: Sequence[torch.Tensor], eps: float, want: tuple, consts: Callable,
                   workspace: Callable) -> torch.Tensor:
    """Records that hold when every element is finite, reading each tensor in cache-sized chunks.

    Every pass over a chunk after the first hits the cache: weights and optimizer state are cold
    when the optimizer step ends, and whole-tensor passes would each stream them from memory.
    """
    count = torch.tensor([float(t.numel()) for t in tensors], dtype=torch.float64)
    zero = torch.zeros_like(count)
    sums, squares, mins, maxs, large = [], [], [], [], []
    for t in tensors:
        acc = torch.float64 if t.dtype == torch.float64 else torch.float32
        buffer = workspace(t.dtype)
        lam = consts(t.dtype, eps)[0]
        flat = t.view(-1)
        parts = [flat[start:start + buffer.numel()] for start in range(0, flat.numel(), buffer.numel())]
        chunk_sums, chunk_squares, chunk_mins, chunk_maxs, chunk_large = [], [], [], [], []
        for part in parts:
            chunk_sums.append(part.sum(dtype=acc))
            if want[5]:
                chunk_squares.append(torch.dot(part, part))
            if want[6] and want[7]:
                low, high = torch.aminmax(part)  # one pass where amin and amax take two
                chunk_mins.append(low)
                chunk_maxs.append(high)
            elif want[6]:
                chunk_mins.append(part.amin())
            elif want[7]:
                chunk_maxs.append(part.amax())
            if want[3]:
                chunk_large.append(_count_at_least(part, lam, buffer))
        one = len(parts) == 1
        sums.append(chunk_sums[0] if one else torch.stack(chunk_sums).sum())
        if want[5]:
            squares.append(chunk_squares[0] if one else torch.stack(chunk_squares).sum())
        if want[6]:
            mins.append(chunk_mins[0] if one else torch.stack(chunk_mins).amin())
        if want[7]:
            maxs.append(chunk_maxs[0] if one else torch.stack(chunk_maxs).amax())
        if want[3]:
            large.append(chunk_large[0] if one else torch.stack(chunk_large).sum())

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


def _assume_finite_small(tensors: Sequence[torch.Tensor], eps: float, want: tuple, lam: float) -> torch.Tensor:
    """The records of `_assume_finite` for many small tensors of one dtype, in a dozen op calls."""
    lengths = torch.tensor([t.numel() for t in tensors])
    flat = torch.cat([t.view(-1) for t in tensors])
    acc = torch.float64 if flat.dtype == torch.float64 else torch.float32

    def per_tensor(values: torch.Tensor, reduce: str) -> torch.Tensor:
        return torch.segment_reduce(values, reduce, lengths=lengths, unsafe=True).to(torch.float64)

    count = lengths.to(torch.float64)
    zero = torch.zeros_like(count)
    columns = [count, zero, zero, zero, per_tensor(flat.to(acc), "sum"), zero, zero, zero]
    if want[3]:
        at_least = torch.nn.functional.hardshrink(flat, lam).sign_().square_()
        columns[3] = count - per_tensor(at_least, "sum")
    if want[5]:
        columns[5] = per_tensor(flat.to(acc).square(), "sum")
    if want[6]:
        columns[6] = per_tensor(flat, "min")
    if want[7]:
        columns[7] = per_tensor(flat, "max")
    rec = torch.stack(columns, 1)
    if not want[4]:
        rec[:, 4] = torch.where(torch.isfinite(rec[:, 4]), 0.0, rec[:, 4])  # keep the check, not the figure
    return rec


def _count_at_least(part: torch.Tensor, lam: float, buffer: torch.Tensor) -> torch.Tensor:
    """Number of |x| > lam in one chunk (lam being the largest value below eps: |x| >= eps).

    hardshrink zeroes |x| <= lam, sign maps the rest to ±1, and the dot product of that with itself
    counts them: exact in fp32 for a chunk of fewer than 2**24 elements, and three cheap float passes
    where a bool mask and count_nonzero cost twice as much.
    """
    out = buffer[:part.numel()]
    torch.ops.aten.hardshrink.out(part, lam, out=out)
    torch.sign(out, out=out)
    return torch.dot(out, out)
