"""Statistic engine: mergeable per-tensor records, computed on the tensors' device without a host sync.

A record is a float64 row ``FIELDS`` (trainmon.core.schema: count, nans, infs, zeros, sum, sumsq, min,
max, sat) over the FINITE elements (design §3): count = finite elements, nans/infs = non-finite ones, zeros = finite |x| < eps
(compared exactly against the float64 eps >= 0; eps below a dtype's smallest normal number relies on
subnormal arithmetic, i.e. no flush-to-zero).  Sums add, min/max combine, so chunks, micro-batches,
shards and ranks merge exactly (:func:`merge_records`).  Empty input: count 0, min=+inf, max=-inf.
sat = finite |x| >= the saturation limit.
Fields not in ``fields`` (count/nans/infs are always computed) hold 0 and mean nothing; pass the same
``fields`` to :func:`derive_ops` to have it refuse ops that need them.  sum/sumsq accumulate in fp32 for
16/32-bit inputs (fp64 for fp64), so e.g. sumsq of |x| > 1.8e19 overflows to inf like any fp32 norm.

Kernel, chosen by measurement (benchmarks/stats_kernels.py).  A tensor is cut into cache-sized chunks
(CPU 2**19 elements) and every chunk runs all its kernels back to back: the data comes from memory once,
the other passes hit the cache.  The input is only read by elementwise ops writing into a reused
workspace of its own dtype (never an fp32/fp64 copy); reductions accumulate via ``dtype=``/BLAS.
Exact finite-only figures, branch-free (sentinels that can never win):
  A  ntn(x, +inf) -> min;  ntn_(-inf) -> max;  ntn_(0) -> sum, sumsq (dot; 16-bit: 128-row norms)
  B  |x| -> hardshrink(lambda) -> ntn_(NaN: -65536P, Inf: -256P) -> clamp_max(P) -> 128-row sums.
     A row sum is exactly P * (B - 256 I - 65536 N) (B = finite |x| >= eps, I = infs, N = nans, all
     <= 128), decoded with integer ops once per call.  Without "zeros": ntn(x, codes) - a instead.
No ``.item()``, no device->host copy, no Python branch on values: only shapes/dtypes steer the code.
Where it is compiled and measured faster, one generated kernel reads each element once and fills every field
(stats_fused.py and stat_kernels.py: Triton on accelerators, C++ on CPU); the kernels here serve until it is compiled, where
it cannot be, and where they are faster.
CPU tensors take a cheaper route (stats_cpu.py): there reading a value waits for no device, so the
figures that hold for all-finite tensors come first (one generated pass for large fp32/fp64 tensors), and
only tensors with a NaN/Inf take these kernels.
"""
from __future__ import annotations

import math
import struct
import sys
from typing import Iterable, Optional, Sequence

import numpy as np
import torch

from trainmon.core import schema
from trainmon.core.schema import FIELDS, N_FIELDS, OPS  # the record's definition (re-exported)
from trainmon.engine import paths, stats_cpu, stats_fused, stats_native
from trainmon.engine.buffers import chunks, host_values, merge_records, workspace

# The fields the packed kernels below compute together (count .. max); later fields are counts with kernels of
# their own.
_PACKED = schema.INDEX["max"] + 1
# The packed fields that merge by summing (count .. sumsq): one index_add where a tensor's chunks share a record.
_PACKED_SUMS = schema.INDEX["sumsq"] + 1
assert all(f.merge == "sum" for f in schema.FIELD_TABLE[:_PACKED_SUMS])
_ZEROS, _SUM, _SUMSQ = schema.INDEX["zeros"], schema.INDEX["sum"], schema.INDEX["sumsq"]
_MIN, _MAX = schema.INDEX["min"], schema.INDEX["max"]
_SAT = schema.INDEX["sat"]
_PINFS, _INFS = schema.INDEX["pinfs"], schema.INDEX["infs"]
_ROW = 128                                   # row width of the count code (fields of 8 bits fit fp32)
_INF = math.inf


class FieldSet(frozenset):
    """The record fields to compute, and the limit the `sat` field counts against.

    Args:
        names: field names.
        sat_threshold: count |x| >= this; None: the largest finite value of the tensor's dtype.
        sat_dtype: without a threshold, wider tensors (fp32, fp64) count against this narrower dtype's
            largest finite value ("would this overflow in fp16?").
    """

    def __new__(cls, names: Iterable[str] = (), sat_threshold: Optional[float] = None,
                sat_dtype: Optional[torch.dtype] = None):
        obj = super().__new__(cls, names)
        obj.sat_threshold, obj.sat_dtype = sat_threshold, sat_dtype
        return obj

    def sat_limit(self, dtype: torch.dtype) -> float:
        """The saturation limit of a tensor of `dtype`."""
        if self.sat_threshold is not None:
            return float(self.sat_threshold)
        own = torch.finfo(dtype).max
        return own if self.sat_dtype is None else min(own, torch.finfo(self.sat_dtype).max)


def fields_for_ops(ops: Iterable[str], sat_threshold: Optional[float] = None,
                   sat_dtype: Optional[torch.dtype] = None) -> FieldSet:
    """Record fields needed to derive ``ops`` (count, nans and infs are always included)."""
    out = set(schema.ALWAYS)
    for op in ops:
        if op not in schema.OP_BY_NAME:
            raise ValueError(f"unknown op {op!r}; allowed: {', '.join(OPS)}")
        out.update(schema.OP_BY_NAME[op].fields)
    return FieldSet(out, sat_threshold, sat_dtype)


# ---- per-dtype constants, pure Python (no tensor op, so no sync even under a dispatch mode) ---------
_FMT = {torch.float32: ("<f", "<I", 32, 23), torch.float16: ("<e", "<H", 16, 10),
        torch.float64: ("<d", "<Q", 64, 52), torch.bfloat16: ("<f", "<I", 16, 7)}
_CONSTS: dict = {}


def _from_bits(dtype: torch.dtype, b: int) -> float:
    f, i, _, _ = _FMT[dtype]
    return struct.unpack(f, struct.pack(i, b << 16 if dtype == torch.bfloat16 else b))[0]


def _largest_below(dtype: torch.dtype, value: float) -> tuple[int, int]:
    """(bit pattern of the largest finite dtype value < `value` (0 when none), pattern of the largest)."""
    _, _, nbits, mbits = _FMT[dtype]
    fmax_bits = (((1 << (nbits - 1 - mbits)) - 1) << mbits) - 1  # just below +inf
    lo, hi = 0, fmax_bits                    # positive bit patterns are ordered like values
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if _from_bits(dtype, mid) < value else (lo, mid - 1)
    return lo, fmax_bits


_BELOW: dict = {}


def _sat_lambda(dtype: torch.dtype, limit: float) -> float:
    """The largest dtype value below `limit`: |x| > it <=> |x| >= limit (+inf: no finite value is)."""
    key = (dtype, limit)
    if key not in _BELOW:
        if dtype not in _FMT:
            raise TypeError(f"tensor_records: unsupported dtype {dtype}")
        _BELOW[key] = _from_bits(dtype, _largest_below(dtype, limit)[0])
    return _BELOW[key]


def zeros_threshold(dtype: torch.dtype, eps: float) -> float:
    """The largest `dtype` value below `eps`: |x| <= it counts as zero (-inf for eps 0: nothing is |x| < 0)."""
    return _consts(dtype, eps)[0] if eps > 0 else -_INF


def saturation_threshold(dtype: torch.dtype, fields: "FieldSet") -> float:
    """The largest `dtype` value below the saturation limit `fields` gives that dtype: |x| > it saturates."""
    return _sat_lambda(dtype, fields.sat_limit(dtype))


def _consts(dtype: torch.dtype, eps: float):
    """(lambda, P, acc dtype): lambda = largest dtype value < eps (|x| <= lambda <=> |x| < eps);
    P = power of two <= smallest dtype value >= eps, small enough that the codes (65536 P) fit the
    dtype and a row of them (2**23 P) fits the accumulation dtype."""
    key = (dtype, eps)
    c = _CONSTS.get(key)
    if c is None:
        if dtype not in _FMT:
            raise TypeError(f"tensor_records: unsupported dtype {dtype}")
        lo, fmax_bits = _largest_below(dtype, eps)
        lam = _from_bits(dtype, lo)
        thr = _from_bits(dtype, lo + 1) if lo < fmax_bits and eps > 0 else _INF   # eps 0: no zeros
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        cap = 2.0 ** min(math.frexp(_from_bits(dtype, fmax_bits))[1] - 18,   # codes fit the dtype,
                         math.frexp(torch.finfo(acc).max)[1] - 25)           # row sums fit acc
        p = min(2.0 ** math.floor(math.log2(thr)), cap) if thr != _INF else cap
        c = _CONSTS[key] = (lam, p, acc)
    return c


# ---- the engine -------------------------------------------------------------------------------------
def tensor_records(tensors: Sequence[torch.Tensor], eps: float, fields: frozenset[str],
                   unasked_zeroed: bool = True) -> torch.Tensor:
    """float64 ``[len(tensors), N_FIELDS]`` records on the tensors' (shared) device; see module docstring.

    Identical views (same storage, dtype, shape, strides) are computed once per call, except among the CPU
    tensors the native kernel reads in place (`stats_cpu.in_place_records`). ``fields`` may be
    a `FieldSet`, which carries the saturation limit (default: each dtype's largest finite value).
    ``unasked_zeroed=False``: the columns of `schema.unasked_columns` may hold the one pass's figures, for a
    caller that zeroes them where it reads them (on the host, where it costs no launch)."""
    sat = fields if isinstance(fields, FieldSet) else FieldSet()
    fields = frozenset(fields)
    bad = fields - set(FIELDS)
    if bad:
        raise ValueError(f"unknown record fields {sorted(bad)}; allowed: {', '.join(FIELDS)}")
    if not eps >= 0:
        raise ValueError(f"eps must be a number >= 0, got {eps!r}")
    if len(tensors) == 0:
        return torch.zeros(0, N_FIELDS, dtype=torch.float64)
    dev = tensors[0].device
    want = _wanted(fields, eps)
    with torch.no_grad():  # records are never differentiated: no graph from tensors that require grad, no detach each
        if dev.type == "cpu":
            return _cpu_records(tensors, eps, want, fields, sat, unasked_zeroed)
        return _general_records(tensors, dev, eps, want, fields, sat, unasked_zeroed)


def _wanted(fields: frozenset[str], eps: float) -> tuple:
    """Per packed field, whether it is computed (eps == 0: nothing is |x| < 0, the zeros field is exactly 0 without a
    pass)."""
    return tuple(f in fields and (f != "zeros" or eps > 0) for f in FIELDS[:_PACKED])


def records_on_arrival(eps: float, fields: frozenset[str]) -> stats_cpu.RecordsOnArrival:
    """The reader of CPU tensors' records in their hooks (`stats_cpu.RecordsOnArrival`) for `eps` and `fields` (a
    `FieldSet` carries the saturation limit)."""
    sat = fields if isinstance(fields, FieldSet) else FieldSet()
    # a tensor whose extremes reach the limit needs a count of its own (`_fill_sat`): not taken
    limits = {dtype: sat.sat_limit(dtype) if "sat" in fields else sys.float_info.max for dtype in stats_native.DTYPES}
    return stats_cpu.RecordsOnArrival(_wanted(frozenset(fields), eps),
                                      {dtype: _consts(dtype, eps)[0] for dtype in stats_native.DTYPES}, limits)


def _general_records(tensors, dev, eps, want, fields, sat, unasked_zeroed) -> torch.Tensor:
    """The records of `tensors` on any device, identical views computed once."""
    seen: dict = {}                                   # view key -> unique index
    uniq: list[torch.Tensor] = []
    rowmap: list[int] = []                            # per input: its unique index
    for t in tensors:                                 # about 0.5 µs per tensor: a flush holds hundreds
        # fake/meta/subclass: no storage to compare
        ptr = t.data_ptr() if type(t) in stats_fused.PLAIN_TENSORS and not t.is_meta else id(t)
        key = (ptr, t.dtype, t.shape, t.stride())
        row = seen.get(key)
        if row is None:
            row = seen[key] = len(uniq)
            uniq.append(t)
        rowmap.append(row)
    rec = _records_by_kernel(uniq, dev, eps, want, fields, sat, unasked_zeroed)
    if len(uniq) == len(tensors):
        return rec
    return rec.index_select(0, host_values(rowmap, dev))


_unwanted: dict = {}                            # (fields, device) -> the columns zeroed, on the device


def _unwanted_columns(fields: frozenset[str], dev: torch.device) -> Optional[torch.Tensor]:
    """The columns of the fields not asked for, which the one pass fills and the record leaves 0, as an index
    on `dev`: made once per run's field set (a copy to an accelerator per call would cost a launch each)."""
    key = (fields, dev)
    if key not in _unwanted:
        columns = schema.unasked_columns(fields)
        with torch.inference_mode(False):           # usable in and out of the mode
            _unwanted[key] = host_values(columns, dev) if columns else None
    return _unwanted[key]


def _records_by_kernel(uniq, dev, eps, want, fields, sat, unasked_zeroed) -> torch.Tensor:
    """The records of `uniq`: those the one-pass record kernel takes (`stats_fused.taken`) from it, the
    others from the multi-pass kernels."""
    fused = stats_fused.taken(uniq, dev)
    rec = None
    if fused:
        rec = stats_fused.records([uniq[u] for u in fused], dev, _consts, _sat_lambda, eps, sat.sat_limit,
                                  paths.CHUNK_ELEMS.get(dev.type, paths.DEFAULT_CHUNK_ELEMS))
        if rec is not None and unasked_zeroed:        # the one pass fills every field
            unwanted = _unwanted_columns(fields, dev)
            if unwanted is not None:
                rec.index_fill_(1, unwanted, 0.0)
    if rec is None:                                   # none taken, or the kernel failed
        return _multi_pass_records(uniq, dev, eps, want, fields, sat)
    if len(fused) == len(uniq):
        return rec
    rest = sorted(set(range(len(uniq))) - set(fused))
    out = torch.empty(len(uniq), N_FIELDS, dtype=torch.float64, device=dev)
    out.index_copy_(0, host_values(fused, dev), rec)
    out.index_copy_(0, host_values(rest, dev), _multi_pass_records([uniq[u] for u in rest], dev, eps, want, fields, sat))
    return out


def _multi_pass_records(uniq, dev, eps, want, fields, sat) -> torch.Tensor:
    """The records from the kernels of this module and stats_cpu.py (several passes per tensor)."""
    return _with_counts(_records(uniq, dev, eps, want), uniq, dev, want, fields, sat)


def _cpu_records(tensors, eps, want, fields, sat, unasked_zeroed) -> torch.Tensor:
    """The records of CPU tensors: those stats_cpu.in_place_records takes from it, the others by the general
    route."""
    dev = tensors[0].device
    taken, rec = stats_cpu.in_place_records(tensors, eps, want, _consts,
                                            lambda slow: _exact_records(slow, dev, eps, want))
    if not taken:
        return _general_records(tensors, dev, eps, want, fields, sat, unasked_zeroed)
    whole = len(taken) == len(tensors)
    rec = _with_counts(rec, tensors if whole else [tensors[i] for i in taken], dev, want, fields, sat, rec.numpy())
    if whole:
        return rec
    chosen = set(taken)
    rest = [i for i in range(len(tensors)) if i not in chosen]
    out = torch.empty(len(tensors), N_FIELDS, dtype=torch.float64)
    table = out.numpy()                               # numpy's list indexing: a few µs where torch's takes tens
    table[taken] = rec.numpy()
    table[rest] = _general_records([tensors[i] for i in rest], dev, eps, want, fields, sat, unasked_zeroed).numpy()
    return out


def _with_counts(rec: torch.Tensor, uniq, dev, want, fields, sat,
                 table: Optional[np.ndarray] = None) -> torch.Tensor:
    """`rec` with its `sat` and `pinfs` columns filled, where asked for. `table`: `rec` as a numpy array, where `rec`
    is a plain CPU tensor made outside any compile or dispatch mode: the rows to count are found there, a few µs where
    torch's ops on a small table take tens."""
    if "sat" in fields:
        _fill_sat(rec, uniq, dev, want, sat, table)
    if "pinfs" in fields:
        _fill_pinfs(rec, uniq, dev, table)
    return rec


def _records(uniq: list[torch.Tensor], dev: torch.device, eps: float, want: tuple) -> torch.Tensor:
    if dev.type != "cpu":
        return _exact_records(uniq, dev, eps, want)
    cap = paths.CHUNK_ELEMS["cpu"]
    return stats_cpu.finite_first_records(uniq, eps, want, _consts, lambda dtype: workspace(dev, dtype, cap),
                                          lambda tensors: _exact_records(tensors, dev, eps, want))


def _exact_records(uniq: list[torch.Tensor], dev: torch.device, eps: float, want: tuple) -> torch.Tensor:
    """The branch-free exact kernels (module docstring)."""
    w_min, w_max, w_sum, w_sq, w_zero = want[_MIN], want[_MAX], want[_SUM], want[_SUMSQ], want[_ZEROS]
    need_a = w_sum or w_sq or not w_zero
    cap = paths.CHUNK_ELEMS.get(dev.type, paths.DEFAULT_CHUNK_ELEMS)
    groups: dict = {}
    for u, t in enumerate(uniq):
        if t.numel():
            groups.setdefault(t.dtype, []).append(u)
    parts = []
    for dtype, members in groups.items():
        lam, p, acc = _consts(dtype, eps)
        vmin, vmax = (torch.amin, torch.amax) if dtype == acc else (torch.min, torch.max)  # fastest
        big = min(cap, max(uniq[u].numel() for u in members))
        buf, buf2 = workspace(dev, dtype, -(-big // _ROW) * _ROW)
        codes = (-65536.0 * p, -256.0 * p, -256.0 * p)   # NaN, +Inf, -Inf
        owner, ns, ends, mins, maxs, sums, sqs, rows = [], [], [], [], [], [], [], []
        nrow = 0
        for u in members:
            for xc in chunks(uniq[u], cap):
                n = xc.numel()
                npad = -(-n // _ROW) * _ROW
                wp = buf.narrow(0, 0, npad)
                w = wp.narrow(0, 0, n) if npad != n else wp
                wv = w.view(xc.shape)
                if npad != n:
                    buf.narrow(0, n, npad - n).zero_()   # row padding: "zero" class, adds nothing
                first = True                          # the first fill reads x, later ones w

                def fill(v):                          # every non-finite -> v (NaN gone after first)
                    if first:
                        torch.nan_to_num(xc, v, v, v, out=wv)
                    else:
                        w.nan_to_num_(0.0, v, v)
                if w_min:                             # +inf never wins a min
                    fill(_INF)
                    mins.append(vmin(w))
                    first = False
                if w_max:                             # -inf never wins a max
                    fill(-_INF)
                    maxs.append(vmax(w))
                    first = False
                if need_a:                            # 0: exact finite sum / sumsq
                    fill(0.0)
                    if w_sum:
                        sums.append(w.sum(dtype=acc))
                    if w_sq:                          # 16-bit: 128-row norms (powsum drifts 4e-5)
                        sqs.append(torch.dot(w, w) if dtype == acc else
                                   torch.linalg.vector_norm(wp.view(-1, _ROW), 2, 1, dtype=acc))
                if w_zero:                            # 0 | P | -256P (inf) | -65536P (nan)
                    torch.abs(xc, out=wv)
                    torch.ops.aten.hardshrink.out(wp, lam, out=wp)
                    wp.nan_to_num_(*codes).clamp_max_(p)
                    rows.append(wp.view(-1, _ROW).sum(1, dtype=acc))
                else:                                 # finite -> x - a = 0
                    cp = buf2.narrow(0, 0, npad)
                    c = cp.narrow(0, 0, n)
                    if npad != n:
                        buf2.narrow(0, n, npad - n).zero_()
                    torch.nan_to_num(xc, *codes, out=c.view(xc.shape))
                    c.sub_(w)
                    rows.append(cp.view(-1, _ROW).sum(1, dtype=acc))
                nrow += npad // _ROW
                owner.append(u)
                ns.append(n)
                ends.append(nrow - 1)
        parts.append((owner, _assemble(dev, p, want, ns, ends, mins, maxs, sums, sqs, rows)))
    if len(parts) == 1 and parts[0][0] == list(range(len(uniq))):
        return parts[0][1]                            # common case: one chunk per tensor, one dtype
    rec = torch.zeros(len(uniq), N_FIELDS, dtype=torch.float64, device=dev)
    if w_min:                                         # empty tensors keep the identity record
        rec.select(1, _MIN).fill_(_INF)
    if w_max:
        rec.select(1, _MAX).fill_(-_INF)
    for owner, ch in parts:
        uid = host_values(owner, dev)
        if len(set(owner)) == len(owner):
            rec.index_copy_(0, uid, ch)
            continue
        rec.narrow(1, 0, _PACKED_SUMS).index_add_(0, uid, ch.narrow(1, 0, _PACKED_SUMS))
        if w_min:
            rec.select(1, _MIN).scatter_reduce_(0, uid, ch.select(1, _MIN), "amin")
        if w_max:
            rec.select(1, _MAX).scatter_reduce_(0, uid, ch.select(1, _MAX), "amax")
    return rec


def _assemble(dev, p, want, ns, ends, mins, maxs, sums, sqs, rows) -> torch.Tensor:
    """Per-chunk partials -> ``[chunks, 8]`` float64 with exact counts (a handful of small ops)."""
    f64 = torch.float64
    meta = host_values([ns, ends], dev)
    j = (torch.cat(rows).to(f64) * (1.0 / p)).to(torch.int32)   # exact: B - 256 I - 65536 N
    big = j & 255
    t = (big - j) >> 8                                     # I + 256 N
    codes = torch.stack((big, t & 255, t >> 8))
    if len(ns) == 1:                                       # one chunk: plain row totals
        per_chunk = codes.sum(1, keepdim=True, dtype=torch.int64)
    else:                                                  # segment sums of consecutive rows
        cs = codes.cumsum(1, dtype=torch.int64).index_select(1, meta[1])
        per_chunk = torch.diff(cs, dim=1, prepend=cs.new_zeros(3, 1))
    n, b, i, nan = torch.cat((meta.narrow(0, 0, 1), per_chunk)).to(f64).unbind(0)
    count = n - i - nan
    col = {"zero": torch.zeros_like(count)}
    if sqs and sqs[0].dim():     # 16-bit: squared row norms summed per chunk; unsafe=True skips the
        col["sq"] = torch.segment_reduce(   # kernel's .item() validation of lengths (a hidden sync)
            torch.cat(sqs).to(f64).square(), "sum", lengths=host_values([q.numel() for q in sqs], dev),
            unsafe=True)

        sqs = []
    groups: dict = {}                                 # one stack + cast per dtype of 0-d partials
    for name, vals in (("sum", sums), ("sq", sqs), ("min", mins), ("max", maxs)):
        if vals:
            groups.setdefault(vals[0].dtype, []).append((name, vals))
    for items in groups.values():
        stacked = torch.stack([v for _, vals in items for v in vals]).to(f64).view(len(items), -1)
        col.update(zip((name for name, _ in items), stacked.unbind(0)))
    z = col["zero"]
    columns = {"count": count, "nans": nan, "infs": i, "zeros": count - b if want[_ZEROS] else z,
               "sum": col.get("sum", z), "sumsq": col.get("sq", z), "min": col.get("min", z), "max": col.get("max", z)}
    return torch.stack([columns.get(field, z) for field in FIELDS], 1)


def _sat_counts(uniq: list[torch.Tensor], dev: torch.device, sat: FieldSet) -> torch.Tensor:
    """float64 [len(uniq)]: finite elements with |x| >= the tensor's saturation limit.

    Its own pass, only when `sat` is asked for, so the packed count code (three 8-bit fields per fp32
    row sum) keeps its room. Branch-free: hardshrink(largest value below the limit) -> non-finite to 0
    -> sign -> sum of squares (16-bit: an L1 norm in fp32), exact per chunk (chunks hold < 2**24 elements);
    measured the fastest of the candidates (benchmarks/sat_cost.py)."""
    cap = paths.CHUNK_ELEMS.get(dev.type, paths.DEFAULT_CHUNK_ELEMS)
    counts = []
    for t in uniq:
        acc = torch.float64 if t.dtype == torch.float64 else torch.float32
        lam = _sat_lambda(t.dtype, sat.sat_limit(t.dtype))
        buf = workspace(dev, t.dtype, min(cap, max(1, t.numel())))[0]
        parts = []
        for xc in chunks(t, cap):
            w = buf.narrow(0, 0, xc.numel())
            torch.ops.aten.hardshrink.out(xc, lam, out=w.view(xc.shape))
            w.nan_to_num_(0.0, 0.0, 0.0).sign_()
            parts.append(torch.dot(w, w) if t.dtype == acc else torch.linalg.vector_norm(w, 1, dtype=acc))
        counts.append(torch.stack(parts).sum() if parts else torch.zeros((), dtype=acc, device=dev))
    return torch.stack([c.to(torch.float64) for c in counts]) if counts else \
        torch.zeros(0, dtype=torch.float64, device=dev)


def _fill_sat(rec: torch.Tensor, uniq: list[torch.Tensor], dev: torch.device, want: tuple, sat: FieldSet,
              table: Optional[np.ndarray] = None) -> None:
    """Fills the `sat` column. On CPU, where reading a value waits for no device, a tensor whose finite
    min and max (when computed) stay inside the limit has no saturated element: only the others are
    counted, so the usual case costs no pass at all. `table`: as for `_with_counts`."""
    if dev.type == "cpu" and want[_MIN] and want[_MAX]:
        dtypes = {t.dtype for t in uniq}
        if len(dtypes) == 1:                          # most calls: one limit for all
            limits = sat.sat_limit(dtypes.pop())
        else:
            limit_of = {dtype: sat.sat_limit(dtype) for dtype in dtypes}
            limits = [limit_of[t.dtype] for t in uniq]
            limits = torch.tensor(limits, dtype=torch.float64) if table is None else np.array(limits)
        figures = rec if table is None else table
        reach = (figures[:, _MAX] >= limits) | (figures[:, _MIN] <= -limits)
        rows = (reach.nonzero().flatten() if table is None else np.flatnonzero(reach)).tolist()
        if rows:
            rec[rows, _SAT] = _sat_counts([uniq[i] for i in rows], dev, sat)
        return
    rec.select(1, _SAT).copy_(_sat_counts(uniq, dev, sat))


def _fill_pinfs(rec: torch.Tensor, uniq: list[torch.Tensor], dev: torch.device,
                table: Optional[np.ndarray] = None) -> None:
    """Fills the `pinfs` column: the +Inf elements, whose sign the packed count code has no room for. Its own
    pass, and on CPU only over the tensors holding an Inf (reading the count waits for no device there). `table`:
    as for `_with_counts`."""
    if dev.type != "cpu":
        rows = range(len(uniq))
    elif table is None:
        rows = rec.select(1, _INFS).nonzero().flatten().tolist()
    else:
        rows = np.flatnonzero(table[:, _INFS]).tolist()
    rows = [u for u in rows if uniq[u].numel()]
    if not rows:
        return
    cap = paths.CHUNK_ELEMS.get(dev.type, paths.DEFAULT_CHUNK_ELEMS)
    counts = [torch.stack([(xc == _INF).sum() for xc in chunks(uniq[u], cap)]).sum() for u in rows]
    rec.select(1, _PINFS).index_copy_(0, host_values(rows, dev), torch.stack(counts).to(torch.float64))
