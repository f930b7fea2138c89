"""One pass per tensor: every field of the record from a single read of the elements.

The kernels, their compile and their load are in `stat_kernels`; here, which tensors take them and how a
call's tensors are laid out for them.

Layout of one call: a tensor of `paths.GATHER_BELOW` elements or more is viewed as `[n // ROW, ROW]` rows (no copy;
a non-contiguous one is copied chunk by chunk into its own dtype, never wider); its last `n % ROW` elements
and the smaller tensors are copied row-aligned into NaN-padded batches of a reused buffer (one copy and one
kernel call for many tensors). The padding is taken off the NaN count afterwards. The rows' partial records
then combine into one record per tensor: a call of one tensor by the merge kernel on accelerators.

Where it is used: on accelerators always; on CPU for 16-bit tensors (`_faster`). CPU fp32/fp64 tensors take
stats_cpu's assume-finite path, whose own one-pass kernel ("finite") computes five figures per row and
leaves the NaN and Inf counts to the exact kernels, which run only where a figure came out non-finite.
Inside a Dynamo trace, or under a dispatch mode, the kernels are not used: they would bypass both.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from trainmon.core import schema
from trainmon.engine import paths, stat_kernels
from trainmon.engine.buffers import chunks, host_values, merge_records, workspace
from trainmon.engine.stat_kernels import ROW

# Partial records per tensor in an accelerator's combine of row partials (see _combine and _spread).
_SPREAD = 32
_INF = math.inf
_NANS = schema.INDEX["nans"]
_MIN, _MAX = schema.INDEX["min"], schema.INDEX["max"]

# Tensors whose memory the engine's compiled and native kernels may read: fake and subclass tensors have their
# own dispatch, which those kernels would bypass.
PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
enabled = True                                  # benchmarks and tests compare against the other kernels
# CPU calls take the accelerators' path (fp32/fp64 through the record kernel, one tensor's rows merged by the
# merge kernel): for tests and benchmarks of those kernels on a machine without an accelerator
cpu_as_accelerator = False


def finite_rows(flat: torch.Tensor, lam: float) -> Optional[list[torch.Tensor]]:
    """`_finite_row_figures` of a flat contiguous tensor as `[rows, 5]` blocks, one for its whole rows of ROW
    elements and one for the rest, once `usable(..., kernel="finite")` said so; None where the kernel failed
    (it is then retired for that dtype, with one message)."""
    n = flat.numel()
    whole = n // ROW * ROW
    try:
        if whole == n:                              # most tensors: whole rows only, no slicing
            return [stat_kernels.run("finite", flat.view(-1, ROW), lam)]
        blocks = [stat_kernels.run("finite", flat[:whole].view(-1, ROW), lam)] if whole else []
        blocks.append(stat_kernels.run("finite", flat[whole:].view(1, -1), lam))
        return blocks
    except Exception as exc:                        # monitoring never takes training down
        stat_kernels.retire("finite", flat.device, [flat.dtype], exc)
        return None


def usable(tensors: Sequence[torch.Tensor], device: torch.device, kernel: str = "record") -> bool:
    """Whether every tensor of `tensors` goes through `kernel` now (starting its compile when it is not)."""
    return len(taken(tensors, device, kernel)) == len(tensors)


def taken(tensors: Sequence[torch.Tensor], device: torch.device, kernel: str = "record") -> list[int]:
    """The indices of `tensors` that go through `kernel` now, starting its compile for their dtypes when
    it is not: the one-pass record kernel where it is faster than the others (`_faster`), or stats_cpu's
    assume-finite kernel ("finite")."""
    if not enabled or device.type == "meta" or torch.compiler.is_compiling():
        return []
    if _get_current_dispatch_mode() is not None:
        return []                                   # the compiled code would bypass the mode
    plain = [i for i, t in enumerate(tensors) if type(t) in PLAIN_TENSORS]
    # decided per dtype, not per tensor: a flush holds hundreds of tensors of one or two dtypes
    ready = {dtype for dtype in {tensors[i].dtype for i in plain}
             if (kernel != "record" or _faster(dtype, device))
             and stat_kernels.prepare(device, [dtype], kernel=kernel)}
    return [i for i in plain if tensors[i].dtype in ready]


def _faster(dtype: torch.dtype, device: torch.device) -> bool:
    """Where the one-pass record kernel was measured faster (benchmarks/stats_kernels.py --per-element):
    everywhere on accelerators; on CPU for 16-bit tensors. CPU fp32/fp64 tensors take stats_cpu's
    assume-finite path, whose own one-pass kernel computes half the figures (`cpu_as_accelerator` sends them
    here)."""
    return device.type != "cpu" or cpu_as_accelerator or dtype not in (torch.float32, torch.float64)


def _flat_segments(t: torch.Tensor, cap: int):
    """`t`'s elements as flat contiguous pieces: the tensor itself, or copies of chunks of at most `cap`."""
    if t.is_contiguous():
        yield t.view(-1)
        return
    for chunk in chunks(t, cap):
        yield chunk.contiguous().view(-1)


def records(uniq: Sequence[torch.Tensor], device: torch.device, consts, sat_lambda, eps: float,
            sat_limit, cap: int) -> Optional[torch.Tensor]:
    """float64 `[len(uniq), N_FIELDS]` records with every field filled; None where the kernel failed (it
    is then retired for those dtypes, with one message, and the caller takes the other kernels).

    Args:
        consts: `(dtype, eps) -> (lambda, ...)`, lambda being the largest dtype value below eps.
        sat_lambda: `(dtype, limit) -> ` the largest dtype value below the saturation limit.
        sat_limit: `dtype -> ` the saturation limit of a tensor of that dtype.
        cap: the largest non-contiguous chunk copied at once.
    """
    try:
        return _records(uniq, device, consts, sat_lambda, eps, sat_limit, cap)
    except Exception as exc:                        # monitoring never takes training down
        stat_kernels.retire("record", device, sorted({t.dtype for t in uniq}, key=str), exc)
        return None


def _records(uniq, device, consts, sat_lambda, eps, sat_limit, cap) -> torch.Tensor:
    partials, owners = [], []                       # [rows, N_FIELDS] blocks; per block, (owner, rows)
    pads = [0] * len(uniq)                          # per tensor, NaN padding counted in its rows
    for dtype in sorted({t.dtype for t in uniq}, key=str):
        lam = consts(dtype, eps)[0] if eps > 0 else -_INF   # eps 0: nothing is |x| < 0
        sat_lam = sat_lambda(dtype, sat_limit(dtype))
        gathered: list[tuple[int, torch.Tensor]] = []   # (owner, elements) copied into shared batches
        for u, t in enumerate(uniq):
            if t.dtype != dtype or not t.numel():
                continue
            if t.numel() < paths.GATHER_BELOW:
                gathered.append((u, t))
                continue
            for flat in _flat_segments(t, cap):
                whole = flat.numel() // ROW * ROW
                if whole:
                    rows = stat_kernels.run("record", flat[:whole].view(-1, ROW), lam, sat_lam)
                    partials.append(rows)
                    owners.append((u, whole // ROW))
                if whole < flat.numel():            # a copied chunk's tail is cloned, not kept alive
                    gathered.append((u, flat[whole:] if t.is_contiguous() else flat[whole:].clone()))
        if gathered:
            partials.extend(_gathered_rows(gathered, owners, pads, lam, sat_lam, cap))
    return _combine(partials, owners, pads, len(uniq), device)


def _gathered_rows(gathered: list, owners: list, pads: list, lam: float, sat_lam: float, cap: int) -> list:
    """Row partials of small tensors and of large ones' last partial rows, each copied into whole rows of a
    NaN-padded batch (non-contiguous ones included), one kernel call per batch of at most `cap` elements;
    their owners and padding are added to `owners` and `pads`.

    The batch is the engine's reused workspace on CPU: a fresh buffer per call would fault in every page of
    it, which costs more than the kernel, while the reused one is still in the cache.
    """
    t0 = gathered[0][1]
    # accelerators: a buffer of the caching allocator; batches on one stream run in order, so one serves all
    scratch = workspace(t0.device, t0.dtype, cap)[0] if t0.device.type == "cpu" else \
        torch.empty(cap, dtype=t0.dtype, device=t0.device)
    per_batch = cap // ROW
    partials, pieces, filled = [], [], 0
    for u, t in gathered:
        n = t.numel()
        rows = -(-n // ROW)
        if pieces and filled + rows > per_batch:
            partials.append(_batch_rows(scratch, pieces, filled, lam, sat_lam))
            pieces, filled = [], 0
        pieces.append(t if t.dim() == 1 else t.reshape(-1))
        if rows * ROW > n:
            pieces.append(_padding(t.device, t.dtype, rows * ROW - n))
        filled += rows
        owners.append((u, rows))
        pads[u] += rows * ROW - n
    partials.append(_batch_rows(scratch, pieces, filled, lam, sat_lam))
    return partials


def _batch_rows(workspace: torch.Tensor, pieces: list, total: int, lam: float, sat_lam: float) -> torch.Tensor:
    """The kernel's `total` rows of `pieces` (flat tensors and their NaN padding, row-aligned), laid one
    after the other into `workspace` by one `cat`: one copy for all, where a copy each cost a launch each."""
    batch = workspace.narrow(0, 0, total * ROW)
    torch.cat(pieces, out=batch)
    return stat_kernels.run("record", batch.view(-1, ROW), lam, sat_lam)


_nan_rows: dict = {}                            # (device, dtype) -> ROW NaNs, the padding's source
_paddings: dict = {}                            # (device, dtype, n) -> a view of its first n


def _padding(device: torch.device, dtype: torch.dtype, n: int) -> torch.Tensor:
    """n < ROW NaNs of `dtype` on `device`: a view of one row of NaNs, made once per length (a view costs
    microseconds of host time, and a step's small tensors come in a few sizes)."""
    view = _paddings.get((device, dtype, n))
    if view is None:
        if (device, dtype) not in _nan_rows:
            with torch.inference_mode(False):        # usable in and out of the mode
                _nan_rows[(device, dtype)] = torch.full((ROW,), math.nan, dtype=dtype, device=device)
        view = _paddings[(device, dtype, n)] = _nan_rows[(device, dtype)].narrow(0, 0, n)
    return view


def _combine(partials, owners, pads, n: int, device: torch.device) -> torch.Tensor:
    """Row partials -> one record per tensor (counts and sums add, min of mins, max of maxes)."""
    if not partials:                                # only empty tensors
        return host_values(schema.IDENTITY, device, torch.float64).repeat(n, 1)
    if _merged_each(partials, owners, n, device):   # each tensor's rows reduced as they are: no index, no atomics
        merged = [None] * n
        for rows, (u, _) in zip(partials, owners):
            merged[u] = _merged(rows, device)
            if pads[u]:                             # a small tensor alone in its dtype's batch
                merged[u].select(0, _NANS).sub_(pads[u])
        return merged[0].unsqueeze(0) if n == 1 else torch.stack(merged)
    # widened once, after the cat: one kernel for every call's partials (each in its kernel's dtype)
    rows = (torch.cat(partials) if len(partials) > 1 else partials[0]).to(torch.float64)
    # one (owner, row count) per block, expanded on the device: a long tensor's thousands of rows cost no
    # Python list; output_size keeps repeat_interleave from reading the counts back
    blocks = len(owners)
    meta = host_values([u for u, _ in owners] + [k for _, k in owners] + pads, device)
    index = torch.repeat_interleave(meta.narrow(0, 0, blocks), meta.narrow(0, blocks, blocks),
                                    output_size=rows.shape[0])
    padding = meta.narrow(0, 2 * blocks, n)
    # An accelerator adds a tensor's rows with atomics, which its thousands of rows would all aim at one
    # record's fields: they are spread over _SPREAD partial records per tensor first, combined after.
    rows_of = [0] * n
    for u, k in owners:
        rows_of[u] += k
    spread = _spread(device, max(rows_of))
    if spread > 1:
        index = torch.add(_cycle(device, rows.shape[0], spread), index, alpha=spread)
    # every column is added (the min and max columns are replaced below)
    rec = torch.zeros(n * spread, schema.N_FIELDS, dtype=torch.float64, device=device).index_add_(0, index, rows)
    for column, start, reduce in ((_MIN, _INF, "amin"), (_MAX, -_INF, "amax")):
        rec.select(1, column).fill_(start).scatter_reduce_(0, index, rows.select(1, column), reduce)
    if spread > 1:
        rec = merge_records(rec.view(n, spread, schema.N_FIELDS), dim=1)
    rec.select(1, _NANS).sub_(padding)
    return rec


# Up to this many tensors of a call, each its rows' one partial, are merged each by the merge kernel (a launch
# each, and one to stack them) on accelerators, where the combine below launches about twenty whatever their
# number.
MERGED_EACH_UP_TO = 8


def _merged_each(partials: list, owners: list, n: int, device: torch.device) -> bool:
    """Whether every one of the `n` tensors has its rows in one partial of its own (a large tensor of whole
    rows, or a small one alone in its dtype's batch), and they are one (a flush of one activation) or, on the
    accelerators' path, a few (a hook call inside a compiled graph: its inputs and outputs, read at once)."""
    few = n == 1 or ((device.type != "cpu" or cpu_as_accelerator) and n <= MERGED_EACH_UP_TO)
    return few and len(partials) == len(owners) == n and len({u for u, _ in owners}) == n


def _merged(rows: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The fp64 record of one tensor's row partials: on accelerators by the compiled merge kernel (one or two
    launches, where `merge_records`' ops launch six: most of a one-tensor call's host time there), once it
    is ready; else, and on CPU, whose ops launch nothing, by `merge_records`."""
    if (device.type != "cpu" or cpu_as_accelerator) and stat_kernels.prepare(device, [rows.dtype], kernel="merge"):
        try:
            return stat_kernels.run("merge", rows)
        except Exception as exc:                    # monitoring never takes training down
            stat_kernels.retire("merge", device, [rows.dtype], exc)
    return merge_records(rows)


_cycles: dict = {}                              # (device, spread) -> 0, 1, ..., spread - 1, 0, 1, ...


def _cycle(device: torch.device, length: int, spread: int) -> torch.Tensor:
    """The first `length` of `0 .. spread - 1` repeated, on `device`: kept and grown as needed, so that a
    combine spends no kernels on it."""
    cycle = _cycles.get((device, spread))
    if cycle is None or cycle.numel() < length:
        size = max(length, 2 * cycle.numel() if cycle is not None else 1 << 16)
        cycle = _cycles[(device, spread)] = torch.arange(size, device=device) % spread
    return cycle[:length]


def _spread(device: torch.device, most_rows: int) -> int:
    """Partial records per tensor in the combine: one on CPU, whose adds are plain loops, and where no tensor
    has more rows than _SPREAD (a batch of small tensors: few atomics meet, and the spread's merge would cost
    more launches than it saves)."""
    return 1 if device.type == "cpu" or most_rows <= _SPREAD else _SPREAD

