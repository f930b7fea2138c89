"""Statistic engine: mergeable per-tensor records, computed on the tensors' device without a host sync.

A record is a float64 row ``FIELDS`` = (count, nans, infs, zeros, sum, sumsq, min, max) over the FINITE
elements (design §3): ``count`` finite elements, ``nans``/``infs`` non-finite ones, ``zeros`` finite
elements with ``|x| < eps``.  Sums add and min/max combine, so chunks, micro-batches, shards and ranks
merge exactly (:func:`merge_records`).  Empty input: count 0, min=+inf, max=-inf (monoid identities).
Fields not requested in ``fields`` (except count/nans/infs, always computed) are 0 and meaningless:
:func:`derive_ops` given ``fields=`` refuses ops that need them.

Kernel (chosen by measurement, see benchmarks/stats_kernels.py).  Each tensor is processed in
cache-sized chunks (CPU: 2**18 elements); every chunk runs ALL of its kernels back to back, so the data
comes from DRAM once and the other passes hit the cache.  The chunk is only ever read by elementwise ops
that write into a reusable same-dtype workspace (never an fp32/fp64 copy); reductions accumulate in fp32
(fp64 for fp64 inputs) through ``dtype=``/BLAS.  Exact finite-only figures without any branch:
  A  ntn(x, +inf) -> amin;  ntn_(-inf) -> amax;  ntn_(0) -> sum, sumsq   (sentinels never win)
  B  |x| -> hardshrink(lambda) -> ntn_(NaN:-65536P, Inf:-256P) -> clamp_max(P) -> sums of 128-rows
     Every row sum is the exact integer B - 256*I - 65536*N times P (B = finite |x| >= eps), decoded once
     per call on the small row tensor.  Without "zeros": code = ntn(x, codes) - a instead.
No ``.item()``, no host copy, no Python branch on values: only shapes/dtypes drive the control flow.
"""
from __future__ import annotations

import math
import struct
import threading
from typing import Iterable, Sequence

import torch

FIELDS = ("count", "nans", "infs", "zeros", "sum", "sumsq", "min", "max")
N_FIELDS = 8
OPS = ("min", "max", "norm", "mean", "zeros", "nans", "infs")
_IDX = {f: i for i, f in enumerate(FIELDS)}
_ALWAYS = frozenset(("count", "nans", "infs"))
_OP_FIELDS = {"min": ("min",), "max": ("max",), "norm": ("sumsq",), "mean": ("sum",),
              "zeros": ("zeros",), "nans": (), "infs": ()}
_ROW = 128                                   # row width of the count code (fields of 8 bits fit fp32)
CHUNK_ELEMS = {"cpu": 1 << 18}               # per device type; others use _DEFAULT_CHUNK
_DEFAULT_CHUNK = 1 << 22
_INF = math.inf


def fields_for_ops(ops: Iterable[str]) -> frozenset[str]:
    """Record fields needed to derive ``ops`` (count, nans and infs are always included)."""
    out = set(_ALWAYS)
    for op in ops:
        if op not in _OP_FIELDS:
            raise ValueError(f"unknown op {op!r}; allowed: {', '.join(OPS)}")
        out.update(_OP_FIELDS[op])
    return frozenset(out)


# ---- per-dtype constants, pure Python (no tensor op, so no sync even under a dispatch mode) ---------
_FMT = {torch.float32: ("<f", "<I", 32, 23), torch.float16: ("<e", "<H", 16, 10),
        torch.float64: ("<d", "<Q", 64, 52), torch.bfloat16: ("<f", "<I", 16, 7)}
_CONSTS: dict = {}


def _from_bits(dtype: torch.dtype, b: int) -> float:
    f, i, _, _ = _FMT[dtype]
    return struct.unpack(f, struct.pack(i, b << 16 if dtype == torch.bfloat16 else b))[0]


def _consts(dtype: torch.dtype, eps: float):
    """(lambda, P, acc dtype): lambda = largest dtype value < eps (|x| <= lambda <=> |x| < eps);
    P = power of two <= smallest dtype value >= eps, small enough that 65536*P is finite."""
    key = (dtype, eps)
    c = _CONSTS.get(key)
    if c is None:
        if dtype not in _FMT:
            raise TypeError(f"tensor_records: unsupported dtype {dtype}")
        _, _, nbits, mbits = _FMT[dtype]
        fmax_bits = (((1 << (nbits - 1 - mbits)) - 1) << mbits) - 1  # just below +inf
        lo, hi = 0, fmax_bits                    # positive bit patterns are ordered like values
        while lo < hi:                           # largest pattern with value < eps
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if _from_bits(dtype, mid) < eps else (lo, mid - 1)
        lam = _from_bits(dtype, lo)
        thr = _from_bits(dtype, lo + 1) if lo < fmax_bits else _INF
        cap = 2.0 ** (math.floor(math.log2(_from_bits(dtype, fmax_bits))) - 17)
        p = min(2.0 ** math.floor(math.log2(thr)), cap) if thr != _INF else cap
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        c = _CONSTS[key] = (lam, p, acc)
    return c


# ---- chunking and workspace ---------------------------------------------------------------------------
def _chunks(x: torch.Tensor, cap: int):
    """Views covering every element of ``x`` once, each with at most ``cap`` elements (any strides)."""
    n = x.numel()
    if n <= cap:
        yield x
    elif x.is_contiguous():
        flat = x.view(-1)
        for i in range(0, n, cap):
            yield flat[i:i + cap]
    else:
        inner = n // x.shape[0]
        if inner <= cap:
            step = cap // inner
            for i in range(0, x.shape[0], step):
                yield x[i:i + step]
        else:
            for i in range(x.shape[0]):
                yield from _chunks(x[i], cap)


_TLS = threading.local()


def _workspace(device: torch.device, dtype: torch.dtype, cap: int):
    """Two flat scratch buffers of ``cap`` elements in the tensor's own dtype.  Cached per thread on
    CPU (avoids page-faulting fresh buffers every call); fresh from the caching allocator elsewhere."""
    if device.type != "cpu":
        return torch.empty(cap, dtype=dtype, device=device), torch.empty(cap, dtype=dtype, device=device)
    cache = getattr(_TLS, "ws", None)
    if cache is None:
        cache = _TLS.ws = {}
    ws = cache.get(dtype)
    if ws is None or ws[0].numel() < cap:
        ws = cache[dtype] = (torch.empty(cap, dtype=dtype), torch.empty(cap, dtype=dtype))
    return ws


# ---- the engine -------------------------------------------------------------------------------------
def tensor_records(tensors: Sequence[torch.Tensor], eps: float, fields: frozenset[str]) -> torch.Tensor:
    """float64 ``[len(tensors), 8]`` records on the tensors' (shared) device; see module docstring.
    Identical views (same storage pointer, dtype, shape and strides) are computed once."""
    fields = frozenset(fields)
    bad = fields - set(FIELDS)
    if bad:
        raise ValueError(f"unknown record fields {sorted(bad)}; allowed: {', '.join(FIELDS)}")
    if not (eps > 0 and math.isfinite(eps)):
        raise ValueError(f"eps must be a finite number > 0, got {eps!r}")
    if len(tensors) == 0:
        return torch.zeros(0, N_FIELDS, dtype=torch.float64)
    dev = tensors[0].device
    want = {f: f in fields for f in FIELDS}
    need_a = want["sum"] or want["sumsq"] or not want["zeros"]
    cap = CHUNK_ELEMS.get(dev.type, _DEFAULT_CHUNK)

    # dedupe identical views; uniq[k] is computed, rowmap[i] says which uniq row tensor i gets
    seen: dict = {}
    uniq: list[torch.Tensor] = []
    rowmap: list[int] = []
    for t in tensors:
        key = (t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()))
        if key not in seen:
            seen[key] = len(uniq)
            uniq.append(t.detach())
        rowmap.append(seen[key])

    ident = torch.zeros(N_FIELDS, dtype=torch.float64, device=dev)
    if want["min"]:
        ident[6] = _INF
    if want["max"]:
        ident[7] = -_INF
    rec = ident.expand(len(uniq), N_FIELDS).clone()   # empty tensors keep the identity record

    groups: dict = {}
    for u, t in enumerate(uniq):
        if t.numel():
            groups.setdefault(t.dtype, []).append(u)
    for dtype, members in groups.items():
        lam, p, acc = _consts(dtype, eps)
        vmin, vmax = (torch.amin, torch.amax) if dtype == acc else (torch.min, torch.max)  # fastest
        big = min(cap, max(uniq[u].numel() for u in members))
        buf, buf2 = _workspace(dev, dtype, -(-big // _ROW) * _ROW)
        codes = (-65536.0 * p, -256.0 * p, -256.0 * p)   # NaN, +Inf, -Inf
        owner, ns, mins, maxs, sums, sqs, rows = [], [], [], [], [], [], []
        for u in members:
            for xc in _chunks(uniq[u], cap):
                n = xc.numel()
                npad = -(-n // _ROW) * _ROW
                w, wv, wp = buf[:n], buf[:n].view(xc.shape), buf[:npad]
                if npad != n:
                    buf[n:npad].zero_()               # row padding: 0 = "zero" class, adds nothing
                src = xc
                if want["min"]:                       # NaN/+-Inf -> +inf never wins a min
                    torch.nan_to_num(src, _INF, _INF, _INF, out=wv)
                    mins.append(vmin(w))
                    src = None
                if want["max"]:                       # all non-finite -> -inf
                    if src is None:
                        w.nan_to_num_(0.0, -_INF, -_INF)
                    else:
                        torch.nan_to_num(src, -_INF, -_INF, -_INF, out=wv)
                        src = None
                    maxs.append(vmax(w))
                if need_a:                            # non-finite -> 0: exact finite sum / sumsq
                    if src is None:
                        w.nan_to_num_(0.0, 0.0, 0.0)
                    else:
                        torch.nan_to_num(src, 0.0, 0.0, 0.0, out=wv)
                    if want["sum"]:
                        sums.append(w.sum(dtype=acc))
                    if want["sumsq"]:                 # 16-bit: 128-row norms (powsum drifts 4e-5)
                        sqs.append(torch.dot(w, w) if dtype == acc else
                                   torch.linalg.vector_norm(wp.view(-1, _ROW), 2, 1, dtype=acc))
                if want["zeros"]:                     # 0 | P | -256P (inf) | -65536P (nan)
                    torch.abs(xc, out=wv)
                    torch.ops.aten.hardshrink.out(wp, lam, out=wp)
                    wp.nan_to_num_(*codes).clamp_max_(p)
                    rows.append(wp.view(-1, _ROW).sum(1, dtype=acc))
                else:                                 # finite -> x - a = 0
                    c = buf2[:npad]
                    if npad != n:
                        buf2[n:npad].zero_()
                    torch.nan_to_num(xc, *codes, out=buf2[:n].view(xc.shape))
                    buf2[:n].sub_(w)
                    rows.append(c.view(-1, _ROW).sum(1, dtype=acc))
                owner.append(u)
                ns.append(n)
        _assemble(rec, dev, p, want, owner, ns, mins, maxs, sums, sqs, rows)
    if len(uniq) == len(tensors):
        return rec
    return rec.index_select(0, torch.tensor(rowmap, device=dev))


def _assemble(rec, dev, p, want, owner, ns, mins, maxs, sums, sqs, rows) -> None:
    """Per-chunk partials -> exact counts -> per-tensor rows of ``rec`` (a handful of small ops)."""
    f64, i64 = torch.float64, torch.int64
    ends, e = [], 0
    for r in rows:
        e += r.numel()
        ends.append(e - 1)
    ends = torch.tensor(ends, device=dev)
    j = (torch.cat(rows) * (1.0 / p)).to(i64)        # exact integers  B - 256 I - 65536 N per row
    big = j & 255
    t = (big - j) >> 8                               # I + 256 N
    cs = torch.stack((big, t & 255, t >> 8), 1).cumsum(0).index_select(0, ends)
    cnt = torch.diff(cs, dim=0, prepend=cs.new_zeros(1, 3)).to(f64)   # per chunk: B, I, N
    n = torch.tensor(ns, dtype=f64, device=dev)
    count = n - cnt[:, 1] - cnt[:, 2]
    zero = torch.zeros_like(n)
    cols = [count, cnt[:, 2], cnt[:, 1], count - cnt[:, 0] if want["zeros"] else zero]
    cols.append(torch.stack(sums).to(f64) if sums else zero)
    if sqs and sqs[0].dim():                         # 16-bit: squared row norms summed per chunk
        lens = torch.tensor([q.numel() for q in sqs], device=dev)
        cols.append(torch.segment_reduce(torch.cat(sqs).to(f64).square(), "sum", lengths=lens))
    else:
        cols.append(torch.stack(sqs).to(f64) if sqs else zero)
    cols.append(torch.stack(mins).to(f64) if mins else zero)
    cols.append(torch.stack(maxs).to(f64) if maxs else zero)
    ch = torch.stack(cols, 1)
    uid = torch.tensor(owner, device=dev)
    if len(set(owner)) == len(owner):                # one chunk per tensor: place directly
        rec.index_copy_(0, uid, ch)
        return
    rec[:, :6].index_add_(0, uid, ch[:, :6])
    if mins:
        rec[:, 6].scatter_reduce_(0, uid, ch[:, 6], "amin")
    if maxs:
        rec[:, 7].scatter_reduce_(0, uid, ch[:, 7], "amax")


def merge_records(records: torch.Tensor) -> torch.Tensor:
    """``[k, 8]`` -> ``[8]``: counts and sums add, min of mins, max of maxes.  Any device, no sync."""
    if records.dim() != 2 or records.shape[1] != N_FIELDS:
        raise ValueError(f"merge_records expects [k, {N_FIELDS}], got {tuple(records.shape)}")
    r = records.to(torch.float64)
    if r.shape[0] == 0:
        return torch.tensor([0.0] * 6 + [_INF, -_INF], dtype=torch.float64, device=r.device)
    return torch.cat((r[:, :6].sum(0), r[:, 6].amin(0, keepdim=True), r[:, 7].amax(0, keepdim=True)))


def derive_ops(record, ops: Sequence[str], fields: frozenset[str] | None = None) -> dict[str, float | None]:
    """Host side: one record row (sequence, numpy row or CPU tensor) -> {op: value}.
    norm = sqrt(sumsq); mean = sum / count; min/max (None when count == 0); zeros = fraction of all
    elements (None when there are none); nans/infs = counts.  With ``fields`` (the set passed to
    tensor_records) an op whose fields were not computed raises ValueError instead of reading 0."""
    v = [float(x) for x in record]
    if len(v) != N_FIELDS:
        raise ValueError(f"a record has {N_FIELDS} fields, got {len(v)}")
    count, nans, infs, zeros, s, sq, mn, mx = v
    total = count + nans + infs
    out: dict[str, float | None] = {}
    for op in ops:
        if op not in _OP_FIELDS:
            raise ValueError(f"unknown op {op!r}; allowed: {', '.join(OPS)}")
        if fields is not None and not set(_OP_FIELDS[op]) <= set(fields):
            raise ValueError(f"op {op!r} needs record fields {_OP_FIELDS[op]} that were not computed")
        if op == "norm":
            out[op] = math.sqrt(sq)
        elif op == "mean":
            out[op] = s / count if count > 0 else None
        elif op in ("min", "max"):
            out[op] = (mn if op == "min" else mx) if count > 0 else None
        elif op == "zeros":
            out[op] = zeros / total if total > 0 else None
        else:
            out[op] = nans if op == "nans" else infs
    return out
