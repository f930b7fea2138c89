"""The CPU path of the statistic engine: assume-finite figures first, exact kernels only where needed.

On a CPU tensor, reading a value waits for no device, so the engine can afford to look: it computes
the figures that are exact when every element is finite (sum, sumsq, min, max and the count of
|x| >= eps), reads whether they came out finite, and runs the exact kernels only on the tensors holding a
NaN or an Inf (or whose fp32 sums overflowed). The figures of every fp32/fp64 tensor of a call come from
one native call that reads each tensor once where it lies (`stats_native`). Where that kernel cannot be
built (no C compiler), a large tensor's figures come from one read of its elements (the "finite" kernel of
stat_kernels, half the work of the full record kernel); smaller ones, and every tensor while either kernel is
being built, take 4 to 6 passes (sum, dot, aminmax, the count), against 12 for the branch-free exact
kernels. On accelerators the record kernel or the branch-free kernels run instead: there, this look would be
a host synchronisation inside a hook.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np
import torch

from trainmon.core import schema
from trainmon.core.schema import N_FIELDS
from trainmon.engine import paths, stats_fused, stats_native
from trainmon.engine.stat_kernels import FINITE_FIGURES, ROW

# The record's columns this path fills, and the assume-finite figures' (stat_kernels.FINITE_FIGURES).
_COUNT, _ZEROS = schema.INDEX["count"], schema.INDEX["zeros"]
_SUM, _SUMSQ, _MIN, _MAX = (schema.INDEX[f] for f in ("sum", "sumsq", "min", "max"))
_F_SUM, _F_SUMSQ, _F_MIN, _F_MAX, _F_ABOVE = (FINITE_FIGURES.index(f) for f in ("sum", "sumsq", "min", "max", "above"))
# A figure and the record field it fills.
_FILLS = ((_SUM, _F_SUM), (_SUMSQ, _F_SUMSQ), (_MIN, _F_MIN), (_MAX, _F_MAX))

_CPU = torch.device("cpu")

_FAST_DTYPES = (torch.float32, torch.float64)


class RecordsOnArrival:
    """The records of CPU tensors read as they arrive, one native call each, while their data is in the nearer caches.

    A batch (`stats.tensor_records` of many tensors) costs little host work per tensor, but holds each tensor until
    it is reduced: the allocator cannot give that memory to the model's next tensors, and the flush checks each one.
    A tensor read in its hook costs one call (about 1 µs of host work where the library is an extension module, 2-3
    through ctypes) and reads at about the speed of its share of a batch (`benchmarks/stats_kernels.py --arrival`):
    from `paths.ON_ARRIVAL_MIN_ELEMENTS` up, it costs no more than that share, and it saves the hold (benchmarks/README.md). `take`
    reads one; `records` gives the records of those taken since the last `records`.
    """

    def __init__(self, want: tuple, lam: dict, limit: dict):
        """`want`: per packed field, whether it is computed; `lam` and `limit` per dtype: the zeros threshold (the
        largest value below eps) and the saturation limit a taken tensor's elements stay within."""
        self._want = want
        self._bounds = {dtype: (lam[dtype], limit[dtype]) for dtype in lam}
        # no tensor of fewer bytes is taken (fp32 is the smallest dtype read): a caller may skip the call
        self.min_bytes = paths.ON_ARRIVAL_MIN_ELEMENTS * 4
        self._figures = np.empty((256, len(FINITE_FIGURES)))
        self._row_bytes = self._figures.itemsize * len(FINITE_FIGURES)
        self._address = self._figures.ctypes.data     # taken once: about 1 µs each time
        self._lengths: list[int] = []

    def take(self, t: torch.Tensor) -> int:
        """Reads `t`'s figures now where it is a plain CPU tensor of `paths.ON_ARRIVAL_MIN_ELEMENTS` or more the native kernel reads in
        place, and they make its whole record (finite, unsaturated): its row among those taken since the last
        `records`; else -1, and nothing is kept."""
        if type(t) not in stats_fused.PLAIN_TENSORS or not t.is_cpu:
            return -1
        n = t.numel()
        if n < paths.ON_ARRIVAL_MIN_ELEMENTS:
            return -1
        read = stats_native.one(t.dtype)
        if read is None:
            return -1
        if t.is_contiguous():
            run = step = n
        else:
            layout = stats_native.run_layout(t)
            if layout is None:
                return -1
            run, step = layout
        row = len(self._lengths)
        if row == len(self._figures):
            self._figures = np.concatenate([self._figures, np.empty_like(self._figures)])
            self._address = self._figures.ctypes.data
        if not read(t.data_ptr(), n, run, step, *self._bounds[t.dtype], self._address + self._row_bytes * row):
            return -1
        self._lengths.append(n)
        return row

    @property
    def taken(self) -> int:
        """The tensors taken since the last `records`."""
        return len(self._lengths)

    def records(self) -> torch.Tensor:
        """float64 [k, N_FIELDS]: the records of the k tensors taken since the last call, in their rows' order."""
        table = np.zeros((len(self._lengths), N_FIELDS))
        pack_figures(table, self._lengths, self._figures[:len(self._lengths)], self._want)
        self._lengths = []
        return torch.from_numpy(table)


def finite_first_records(uniq: Sequence[torch.Tensor], eps: float, want: tuple,
                         consts: Callable, workspace: Callable, exact: Callable) -> torch.Tensor:
    """float64 [len(uniq), N_FIELDS] records of CPU tensors, the fields of `want` filled (the packed ones,
    the first len(want)); `exact(tensors)` gives the branch-free records.

    Args:
        uniq: CPU tensors, without duplicates.
        eps: the zeros threshold.
        want: per record field, whether it is computed.
        consts: `(dtype, eps) -> (lambda, P, acc dtype)` of the exact engine (lambda: largest value < eps).
        workspace: `dtype -> ` two reused flat scratch buffers of that dtype, of the chunk size.
        exact: records of the tensors the assume-finite figures cannot describe.
    """
    fast = [u for u, t in enumerate(uniq) if _assumable(t, workspace)]
    slow = sorted(set(range(len(uniq))) - set(fast))
    rec = torch.zeros(len(uniq), N_FIELDS, dtype=torch.float64)
    # Rows are filled and read through numpy, whose indexing with lists costs a few µs where torch's
    # costs tens: this route serves many calls of a few tensors each (a hook's activations).
    table = rec.numpy()
    packed = len(want)
    if fast and stats_native.usable([uniq[u] for u in fast]):  # each read in place, in one call per dtype
        for dtype in _FAST_DTYPES:
            group = [u for u in fast if uniq[u].dtype == dtype]
            if group:
                table[group, :packed] = _assume_finite_native([uniq[u] for u in group], want, consts(dtype, eps)[0],
                                                              workspace(dtype)[0])
    elif fast:
        small = [u for u in fast if uniq[u].numel() <= paths.SMALL]
        large = [u for u in fast if uniq[u].numel() > paths.SMALL]
        for dtype in _FAST_DTYPES:
            group = [u for u in small if uniq[u].dtype == dtype]
            if group:
                table[group, :packed] = _assume_finite_small([uniq[u] for u in group], eps, want,
                                                             consts(dtype, eps)[0])
        if large:
            table[large, :packed] = _assume_finite([uniq[u] for u in large], eps, want, consts, workspace)
    if fast:
        slow = sorted(slow + _not_finite(table, fast))
    if slow:
        rec[slow] = exact([uniq[u] for u in slow])
    return rec


def in_place_records(tensors: Sequence[torch.Tensor], eps: float, want: tuple, consts: Callable,
                     exact: Callable) -> tuple[Sequence[int], Optional[torch.Tensor]]:
    """`finite_first_records` of those of `tensors` that are plain and non-empty, of the first one's dtype where the
    native kernel reads it, and contiguous or laid out in runs it reads in place (`stats_native.run_layout`: q, k and
    v split from one projection), from one look at each and one native call: (their indices, their records), or
    ([], None). That is most of a CPU job's flush of activations. The general route looks at each tensor in several
    loops, which for an 8 K-element activation cost about what the kernel's read of it does, and copies views first
    (benchmarks/stats_kernels.py --contiguous). A tensor passed twice is read twice: looking for it would cost about
    as much as the read."""
    dtype = tensors[0].dtype
    if dtype not in _FAST_DTYPES or not stats_native.callable_now():
        return [], None
    plain = stats_fused.PLAIN_TENSORS
    lengths = [t.numel() for t in tensors]
    if set(map(type, tensors)).issubset(plain) and {t.dtype for t in tensors} == {dtype} and \
            all(map(torch.Tensor.is_contiguous, tensors)) and 0 not in lengths:
        # most calls (a flush of activations: hundreds of tensors): every one taken, read whole
        taken, runs, steps = range(len(tensors)), lengths, lengths
        addresses = [t.data_ptr() for t in tensors]
    else:
        taken, addresses, runs, steps = [], [], [], []
        for i, t in enumerate(tensors):
            if type(t) in plain and t.dtype == dtype and lengths[i]:
                layout = (lengths[i], lengths[i]) if t.is_contiguous() else stats_native.run_layout(t)
                if layout is not None:
                    taken.append(i)
                    addresses.append(t.data_ptr())
                    runs.append(layout[0])
                    steps.append(layout[1])
        if not taken:
            return [], None
        lengths = [lengths[i] for i in taken]
    figures = stats_native.read(dtype, addresses, lengths, consts(dtype, eps)[0], runs, steps)
    # Few array ops from here: the read has just pushed their code and data out of the caches, where the first call
    # of each costs several times its usual few µs.
    table = np.zeros((len(taken), N_FIELDS))
    pack_figures(table, lengths, figures, want)
    rec = torch.from_numpy(table)
    slow = [] if np.isfinite(figures[:, [_F_SUM, _F_SUMSQ, _F_MIN, _F_MAX]]).all() else _not_finite(table)
    if slow:
        rec[slow] = exact([tensors[taken[u]] for u in slow])
    return taken, rec


def _not_finite(table: np.ndarray, rows: Optional[list[int]] = None) -> list[int]:
    """Those of `rows` (default: all) of a records table whose assume-finite figures came out non-finite: finite sums
    and extremes mean no element was NaN or Inf, so only these need the exact kernels."""
    values = [_SUM, _SUMSQ, _MIN, _MAX]
    bad = np.flatnonzero(~np.isfinite(table[:, values] if rows is None else table[rows][:, values]).all(1)).tolist()
    return bad if rows is None else [rows[i] for i in bad]


def _assume_finite(tensors: Sequence[torch.Tensor], eps: float, want: tuple, consts: Callable,
                   workspace: Callable) -> np.ndarray:
    """Records that hold when every element is finite.

    A tensor of paths.ONE_PASS_MIN elements or more goes through the one-pass kernel once it is compiled
    (`stats_fused.finite_rows`: every figure from one read), those of whole rows up to paths.GATHER_MAX elements
    copied together into shared calls (`_gathered_rows`); smaller ones, and every tensor until then, are
    read in cache-sized chunks by a few passes each: weights and optimizer state are cold when the optimizer
    step ends, and whole-tensor passes would each stream them from memory.
    """
    scratch = {dtype: _Scratch(*workspace(dtype), workspace(torch.bool)[0], consts(dtype, eps)[0])
               for dtype in {t.dtype for t in tensors}}
    # While the native kernel builds (a fraction of a second), the passes serve rather than a compile of ~30 s
    one_pass = stats_native.unavailable() and stats_fused.usable([t for t in tensors if t.numel() >= paths.ONE_PASS_MIN],
                                                                 _CPU, kernel="finite")
    chunked, figures, at_least = [], [], []       # tensors read by the passes, their figures
    owners, counts, blocks = [], [], []           # the one-pass kernel's row blocks, and whose rows they hold
    gathered = {dtype: [] for dtype in scratch}   # tensors copied whole into shared kernel calls

    def by_passes(i: int, flat: torch.Tensor) -> None:
        figure, count = _by_passes(flat, scratch[flat.dtype], want)
        chunked.append(i)
        figures.append(figure)
        at_least.append(count)

    for i, t in enumerate(tensors):
        work = scratch[t.dtype]
        n = t.numel()
        if one_pass and paths.ONE_PASS_MIN <= n <= min(work.cap, paths.GATHER_MAX) and n % ROW == 0:
            gathered[t.dtype].append(i)
            continue
        flat = _flat(t, work.copy)
        if one_pass and n >= paths.ONE_PASS_MIN:
            rows = stats_fused.finite_rows(flat, work.lam)
            if rows is not None:
                owners.extend([i] * len(rows))
                counts.extend(len(block) for block in rows)
                blocks.extend(rows)
                continue
            one_pass = False                      # the kernel was just retired: the passes read the rest
        by_passes(i, flat)
    for dtype, members in gathered.items():
        work = scratch[dtype]
        for batch in _batches(tensors, members, work.cap):
            read = _gathered_rows(tensors, batch, work) if one_pass else None
            if read is None:                      # the kernel was retired: the passes read these
                one_pass = False
                for i in batch:
                    by_passes(i, _flat(tensors[i], work.copy))
                continue
            order, rows = read
            owners.extend(order)
            counts.extend(tensors[i].numel() // ROW for i in order)
            blocks.append(rows)
    values = np.tile(_IDENTITY, (len(tensors), 1))
    if chunked:
        values[chunked] = _stacked_figures([tensors[i].dtype for i in chunked], figures, at_least)
    if owners:                                    # whole tensors: their rows hold the identity until now
        index, merged = _merged_rows(owners, counts, blocks)
        values[index] = merged
    count = np.array([float(t.numel()) for t in tensors])
    return _packed_records(count, values, want)


def _batches(tensors: Sequence[torch.Tensor], members: list[int], cap: int) -> list[list[int]]:
    """`members` in consecutive batches of at most `cap` elements (none when there are no members)."""
    batches, filled = [], cap
    for i in members:
        n = tensors[i].numel()
        if filled + n > cap:
            batches.append([])
            filled = 0
        batches[-1].append(i)
        filled += n
    return batches


def _gathered_rows(tensors: Sequence[torch.Tensor], batch: list[int], work: "_Scratch") -> Optional[tuple]:
    """The one-pass kernel's rows of the tensors of `batch` (whole rows each), copied one after the other into
    the scratch buffer and read in one call, and the order they were copied in (the contiguous ones first, in
    one concatenation): the call costs less than one per tensor. None where the kernel failed (and was
    retired)."""
    order = [i for i in batch if tensors[i].is_contiguous()]
    at = sum(tensors[i].numel() for i in order)
    flat = work.copy.narrow(0, 0, sum(tensors[i].numel() for i in batch))
    if order:
        torch.cat([tensors[i].view(-1) for i in order], out=flat.narrow(0, 0, at))
    for i in batch:
        t = tensors[i]
        if not t.is_contiguous():
            flat.narrow(0, at, t.numel()).view(t.shape).copy_(t)
            at += t.numel()
            order.append(i)
    rows = stats_fused.finite_rows(flat, work.lam)
    return None if rows is None else (order, rows[0])


# Figure columns of `_assume_finite` (sum, sumsq, min, max, count of |x| >= eps): their identity.
_IDENTITY = np.array([0.0, 0.0, np.inf, -np.inf, 0.0])


def _stacked_figures(dtypes: list, figures: list, at_least: list) -> np.ndarray:
    """Per chunk-read tensor its 0-d figures and count as one float64 row, with one stack and cast per dtype."""
    values = np.empty((len(dtypes), len(_FIGURES) + 1))
    for dtype in _FAST_DTYPES:
        members = [j for j, d in enumerate(dtypes) if d == dtype]
        if members:
            stacked = torch.stack([f for j in members for f in figures[j]]).to(torch.float64)
            values[members, :len(_FIGURES)] = stacked.view(len(members), len(_FIGURES)).numpy()
    values[:, _F_ABOVE] = at_least
    return values


def _merged_rows(owners: list[int], counts: list[int], blocks: list[torch.Tensor]) -> tuple[np.ndarray, np.ndarray]:
    """The figures (`_IDENTITY`'s columns, float64) of each tensor the one-pass kernel read, merged from its
    row partials: the `[rows, 5]` blocks hold, one after the other, `counts[j]` rows of tensor `owners[j]` (a
    tensor's rows adjacent). Counts and sums added, min of mins, max of maxes. Returns the tensors' indices and
    their `[k, 5]` figures."""
    partials = (torch.cat(blocks) if len(blocks) > 1 else blocks[0]).numpy().astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):   # a NaN or Inf here sends its tensor to the exact kernels
        if len(set(owners)) == 1:                 # one tensor: no segments to find
            merged = partials.sum(0, keepdims=True)
            merged[0, _F_MIN], merged[0, _F_MAX] = partials[:, _F_MIN].min(), partials[:, _F_MAX].max()
            return np.asarray(owners[:1]), merged
        owner = np.asarray(owners)
        first = np.ones(len(owner), dtype=bool)   # the first segment of each tensor starts its rows
        first[1:] = owner[1:] != owner[:-1]
        starts = np.cumsum([0] + counts[:-1])[first]
        merged = np.add.reduceat(partials, starts)
        merged[:, _F_MIN] = np.minimum.reduceat(partials[:, _F_MIN], starts)
        merged[:, _F_MAX] = np.maximum.reduceat(partials[:, _F_MAX], starts)
    return owner[first], merged


class _Scratch:
    """One dtype's scratch for a call: `copy` for non-contiguous tensors, and the count's buffers, seen
    through numpy and sliced once per length (slicing a tensor costs more than some of the passes)."""

    def __init__(self, copy: torch.Tensor, buffer: torch.Tensor, mask: torch.Tensor, lam: float):
        self.copy, self.cap, self.lam = copy, buffer.numel(), lam
        self._magnitudes, self._mask = buffer.numpy(), mask.numpy()
        self._lam = self._magnitudes.dtype.type(lam)  # exact: lam is a value of the dtype
        self._views: dict[int, tuple] = {}

    def count_at_least(self, part: torch.Tensor) -> int:
        """Number of |x| > lam in a contiguous chunk (lam being the largest value below eps: |x| >= eps).

        In numpy: |x| into the scratch, compared into a bool mask (a byte per element where torch writes
        a float) and counted, a quarter cheaper than torch's abs, float comparison and sum, and exact.
        """
        n = part.numel()
        views = self._views.get(n)
        if views is None:
            views = self._views[n] = (self._magnitudes[:n], self._mask[:n])
        magnitudes, mask = views
        np.abs(part.numpy(), out=magnitudes)
        np.greater(magnitudes, self._lam, out=mask)
        return int(np.count_nonzero(mask))


def _assumable(t: torch.Tensor, workspace: Callable) -> bool:
    """Whether the assume-finite figures apply: an fp32/fp64 tensor, contiguous or not too large to be
    copied into one chunk (the q, k, v views of a fused projection). Small non-contiguous tensors keep
    the exact kernels, as their figures would otherwise come from another summation order."""
    if t.dtype not in _FAST_DTYPES or not t.numel():
        return False
    return t.is_contiguous() or paths.SMALL < t.numel() <= workspace(t.dtype)[0].numel()


def _flat(t: torch.Tensor, copy: torch.Tensor) -> torch.Tensor:
    """`t`'s elements, flat: a view of a contiguous tensor, else a copy into the scratch buffer `copy` (one pass
    where the exact kernels take twelve, and the same sums, which read the same contiguous copy there)."""
    if t.is_contiguous():
        return t.view(-1)
    flat = copy[:t.numel()]
    flat.view(t.shape).copy_(t)
    return flat


def _by_passes(flat: torch.Tensor, work: "_Scratch", want: tuple) -> tuple[list[torch.Tensor], int]:
    """The `_FIGURES` of a flat contiguous tensor and its count of |x| >= eps, read by a few passes per chunk
    of the scratch buffer's size."""
    n, cap = flat.numel(), work.cap
    if n <= cap:                                  # most tensors: one chunk, no slicing
        return _chunk_figures(flat, want), (work.count_at_least(flat) if want[_ZEROS] else 0)
    chunks = [flat.narrow(0, start, min(cap, n - start)) for start in range(0, n, cap)]
    return (_combine_chunks([_chunk_figures(chunk, want) for chunk in chunks]),
            sum(work.count_at_least(chunk) for chunk in chunks) if want[_ZEROS] else 0)


# The figures of one chunk (0-d tensors of its dtype), and how the figures of chunks combine.
_FIGURES = FINITE_FIGURES[:_F_ABOVE]  # the last figure, "above", is counted apart
_COMBINE = (torch.sum, torch.sum, torch.amin, torch.amax)


def _chunk_figures(part: torch.Tensor, want: tuple) -> list[torch.Tensor]:
    """The `_FIGURES` of one contiguous chunk; a figure not in `want` is a placeholder (its sum)."""
    total = part.sum()                            # fp32/fp64 only: accumulates in the chunk's dtype
    figures = [total, total, total, total]
    if want[_SUMSQ]:
        figures[_F_SUMSQ] = torch.dot(part, part)
    if want[_MIN] and want[_MAX]:
        figures[_F_MIN], figures[_F_MAX] = torch.aminmax(part)  # one pass where amin and amax take two
    elif want[_MIN]:
        figures[_F_MIN] = part.amin()
    elif want[_MAX]:
        figures[_F_MAX] = part.amax()
    return figures


def _combine_chunks(chunks: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    return [reduce(torch.stack([chunk[i] for chunk in chunks])) for i, reduce in enumerate(_COMBINE)]


def _packed_records(count: np.ndarray, values: np.ndarray, want: tuple) -> np.ndarray:
    """[n, 8] records from the element counts, the `_FIGURES` columns and a last one, the count of
    |x| >= eps; fields not in `want` hold 0."""
    rec = np.zeros((len(count), len(want)))
    pack_figures(rec, count, values, want)
    return rec


def pack_figures(rec: np.ndarray, count, values: np.ndarray, want: tuple) -> None:
    """`_packed_records` into the first 8 columns of `rec`, zeros (`count`: an array or a list)."""
    rec[:, _COUNT] = count
    if want[_ZEROS]:
        rec[:, _ZEROS] = rec[:, _COUNT] - values[:, _F_ABOVE]
    if all(want[field] for field, _ in _FILLS):
        rec[:, [field for field, _ in _FILLS]] = values[:, [figure for _, figure in _FILLS]]
        return
    # Detection needs a finite check of every element: the sum (always computed) provides it, and is
    # kept where it is not finite even when its figure is not wanted.
    total = values[:, _F_SUM]
    rec[:, _SUM] = total if want[_SUM] else np.where(np.isfinite(total), 0.0, total)
    for field, figure in _FILLS[1:]:
        if want[field]:
            rec[:, field] = values[:, figure]


def _assume_finite_native(tensors: Sequence[torch.Tensor], want: tuple, lam: float,
                          scratch: torch.Tensor) -> np.ndarray:
    """The records of `_assume_finite` for tensors of one dtype, from the native kernel (`stats_native`).

    Contiguous tensors are read in place. A non-contiguous one (at most a chunk, see `_assumable`) is read from
    a copy packed into `scratch`, a flat buffer reused from call to call: a copy into fresh memory would fault
    its pages in first, which costs several times the copy (an 8 K-element q, k or v view: about 14 against
    2-4 µs). One call reads the contiguous tensors and the first fill of copies; each further fill, one more.
    """
    figures = np.empty((len(tensors), 5))
    whole = [i for i, t in enumerate(tensors) if t.is_contiguous()]
    fills = _batches(tensors, [i for i, t in enumerate(tensors) if not t.is_contiguous()], scratch.numel()) or [[]]
    figures[whole + fills[0]] = stats_native.figures([tensors[i] for i in whole] + _copied(tensors, fills[0], scratch),
                                                     lam)
    for fill in fills[1:]:
        figures[fill] = stats_native.figures(_copied(tensors, fill, scratch), lam)
    count = np.array([t.numel() for t in tensors], dtype=np.float64)
    return _packed_records(count, figures, want)


def _copied(tensors: Sequence[torch.Tensor], fill: list[int], scratch: torch.Tensor) -> list[torch.Tensor]:
    """Contiguous copies of `tensors[i]` for `i` in `fill`, side by side in `scratch` (they fit it together)."""
    copies, used = [], 0
    for i in fill:
        copy = scratch.narrow(0, used, tensors[i].numel())
        copy.view(tensors[i].shape).copy_(tensors[i])
        copies.append(copy)
        used += tensors[i].numel()
    return copies


def _assume_finite_small(tensors: Sequence[torch.Tensor], eps: float, want: tuple, lam: float) -> np.ndarray:
    """The records of `_assume_finite` for many small tensors of one dtype (fp32 or fp64, which the
    sums accumulate in), in about a dozen op calls."""
    lengths = torch.tensor([t.numel() for t in tensors])
    flat = torch.cat([t.view(-1) for t in tensors]) if len(tensors) > 1 else tensors[0].view(-1)

    def per_tensor(values: torch.Tensor, reduce: str) -> torch.Tensor:
        return torch.segment_reduce(values, reduce, lengths=lengths, unsafe=True)

    total = per_tensor(flat, "sum")
    columns = [total, total, total, total, total]
    if want[_ZEROS]:
        columns[_F_ABOVE] = per_tensor(flat.abs().gt_(lam), "sum")
    if want[_SUMSQ]:
        columns[_F_SUMSQ] = per_tensor(flat.square(), "sum")
    if want[_MIN]:
        columns[_F_MIN] = per_tensor(flat, "min")
    if want[_MAX]:
        columns[_F_MAX] = per_tensor(flat, "max")
    values = torch.stack(columns, 1).to(torch.float64).numpy()
    return _packed_records(lengths.numpy().astype(np.float64), values, want)
