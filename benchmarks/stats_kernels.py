"""Micro-benchmark of candidate statistic kernels for trainmon.engine.stats (not a test).

    python benchmarks/stats_kernels.py            # kernels on the design §7 hook tensors + train step
    python benchmarks/stats_kernels.py --quick    # 3 rounds instead of 11;  --no-step: kernels only
    python benchmarks/stats_kernels.py --per-element   # ns/element: multi-pass, one-pass, generated, native (shipped), floor
    python benchmarks/stats_kernels.py --one-pass-sizes  # CPU fp32: µs per tensor, passes vs assume-finite kernel
    python benchmarks/stats_kernels.py --call-cost       # µs of host time per generated-kernel call, by path
    python benchmarks/stats_kernels.py --gather-sizes    # CPU bf16 and fp32: µs per tensor, shared calls vs own calls
    python benchmarks/stats_kernels.py --contiguous      # CPU fp32 flushes read in place: µs per tensor, by route
    python benchmarks/stats_kernels.py --cold            # CPU fp32 native read after 64 MB written elsewhere, and again: ns/element
    python benchmarks/stats_kernels.py --arrival         # CPU fp32: a tensor read right after it is written vs in a batch
    python benchmarks/stats_kernels.py --ops-per-tensor  # launches per tensor on an accelerator: multi-pass vs one-pass

Single thread (torch.set_num_threads(1)).  Every round times every candidate once (interleaved), and
"x norm" is the median over rounds of candidate time / one torch._foreach_norm(ord=2, dtype=fp32) pass
over ALL hook tensors in the same round (design §7: that pass is 3.7% of a step, the budget for all
activation statistics ~15%, i.e. ~4x).  Workload: forward inputs/outputs and backward grads seen by
hooks on every module of the §7 model built below (4 layers, hidden 256, seq 128, batch 8, vocab 4096):
172 floating tensors / 81.9M elements per step, 89 distinct views / 47.5M elements.

The CHOSEN rows are the branch-free exact kernels, which accelerators run. On CPU, tensor_records now
computes the figures that hold for all-finite tensors first (trainmon/engine/stats_cpu.py: sum, dot,
amin, amax, hardshrink/sign count; ~1 ns per element on this VM) and runs the exact kernels only on
tensors that hold a NaN or Inf.

RESULTS (AMD EPYC, 2 vCPU VM shared with other jobs, load 2-4.7, torch 2.13 CPU; three full runs,
x norm pass shown as the range over runs; fp32 | bf16; "passes" = sweeps over each element):
  candidate                                   passes   ms (fp32)    x norm fp32    x norm bf16
  _foreach_norm, all 172 tensors (floor)         1     24 - 54         1             1
  _foreach_norm, 89 distinct views               1     16 - 34       0.55-0.66     0.53-0.67
  loop6_fast: aminmax, norm, sum, (|x|<eps).sum, ~11   670 - 1570     18 - 30          -
    isnan.sum, isinf.sum per tensor (NOT exact with NaN/Inf)
  masked_exact: isfinite mask + where() copies    ~17  1130 - 2650    29 - 51          -
  foreach_fast: _foreach_powsum, _foreach_max(x), ~12   560 - 1340    21 - 26       9 - 13
    _foreach_max(_foreach_neg(x)), sum, bool counts (NOT exact)
  opmajor_exact: chosen 12 ops, op-major over      12   280 - 810      8 - 19       4 - 5
    whole tensors (no cache blocking)
  fast_raw+codes: sum/aminmax/dot on raw x + the    8    72 - 191     3.0 - 3.6    2.9 - 3.8
    count chain (NOT exact with NaN/Inf: the price of exactness is ~+1x)
  CHOSEN (tensor_records), ops min,max,norm,      12
    zeros,nans,mean; chunk  64K                        180 - 406     5.3 - 7.8    5.9 - 7.6
                     chunk 256K                        122 - 268     4.1 - 4.7    4.2 - 4.8
                     chunk 512K (shipped)              120 - 256     3.1 - 4.6    4.0 - 4.4
                     chunk   1M                        116 - 265     3.5 - 4.8    3.5 - 4.6
  CHOSEN, norm only                                5    63 - 165     2.7 - 3.2    2.1 - 2.7
  CHOSEN, nans+infs only                           4    59 - 141     1.7 - 2.5    1.4 - 1.9
  CHOSEN, min,max,norm,mean (no zeros)            10   108 - 233     3.6 - 5.0    3.3 - 4.0
Why: in cache (256K fp32 chunk) ntn/abs/hardshrink/clamp cost 0.08-0.2 ns/element and amin/amax/sum/dot
0.07-0.1, while every bool-producing op (isnan, isinf, isfinite, !=, <) costs 0.8-2.4 ns/element and a
bool .sum() 0.4: the obvious versions are 20-60x.  Op-major order re-reads DRAM for every op; chunking
keeps the 12 passes in L2/L3 (64K chunks lose to ~4 us of Python/dispatch per op).
Accuracy: _foreach_powsum/vector_norm accumulate sequentially (fp32: 1.1e-5 relative error at 3M
elements, bf16 with dtype=fp32: 3.8e-5 at 262K), so sumsq uses BLAS dot (fp32/fp64) and per-128-row
norms (16-bit); torch.sum is pairwise and fine.
Also tried (one-off, not in this script): torch.compile of a fused isfinite/where version compiles
(26 s, needs a C++ compiler) but ran at 6.7-13 ns/element single-threaded with dynamic shapes (~20x a
norm pass): rejected.
End to end (fp32 train step, hooks on every module, one tensor_records call per hook; noisy, bare step
480-1130 ms depending on machine load): _foreach_norm hooks +4..18%, tensor_records +40..70%, with a
per-step ``cache`` shared by the hooks (module output = next module's input is computed once)
+11..49%.  Fixed cost of one call: ~45 small ops, 0.36-1.1 ms on this loaded box vs 4 us for one
_foreach_norm, so per-hook callers should pass several tensors per call and use ``cache``.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from trainmon.engine import buffers, paths, stat_kernels, stats, stats_fused, stats_native  # noqa: E402

EPS = 1e-8
INF = math.inf
F32 = torch.float32
ALL = frozenset(stats.FIELDS)
DESIGN_OPS = ("min", "max", "norm", "zeros", "nans", "mean")


# ---- the benchmark model of design §7 and the tensors its module hooks see ----------------------------
class Attn(nn.Module):
    def __init__(self, h, nh):
        super().__init__()
        self.nh, self.qkv, self.proj = nh, nn.Linear(h, 3 * h), nn.Linear(h, h)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.nh, -1).transpose(1, 2) for z in self.qkv(x).split(c, 2))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        att = att.masked_fill(torch.triu(torch.ones(t, t, dtype=torch.bool), 1), -INF).softmax(-1)
        return self.proj((att @ v).transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, h, nh):
        super().__init__()
        self.ln1, self.attn, self.ln2 = nn.LayerNorm(h), Attn(h, nh), nn.LayerNorm(h)
        self.mlp = nn.Sequential(nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class LM(nn.Module):
    def __init__(self, vocab=4096, h=256, layers=4, heads=4, seq=128):
        super().__init__()
        self.emb, self.pos = nn.Embedding(vocab, h), nn.Embedding(seq, h)
        self.blocks = nn.ModuleList(Block(h, heads) for _ in range(layers))
        self.lnf, self.head = nn.LayerNorm(h), nn.Linear(h, vocab)

    def forward(self, idx):
        x = self.emb(idx) + self.pos(torch.arange(idx.shape[1]))
        for b in self.blocks:
            x = b(x)
        return self.head(self.lnf(x))


def make_model(vocab=4096):
    torch.manual_seed(0)
    m = LM(vocab)
    idx, tgt = torch.randint(0, vocab, (8, 128)), torch.randint(0, vocab, (8, 128))
    return m, torch.optim.AdamW(m.parameters(), 1e-3), idx, tgt


def step(m, opt, idx, tgt):
    opt.zero_grad()
    F.cross_entropy(m(idx).flatten(0, 1), tgt.flatten()).backward()
    opt.step()


def hook_tensors(dtype):
    """Forward inputs/outputs and backward grad_inputs/grad_outputs of every module, one step."""
    m, opt, idx, tgt = make_model()
    seen = []

    def keep(ts):
        seen.extend(t.detach() for t in ts if isinstance(t, torch.Tensor) and t.is_floating_point())

    hs = [h for n, mod in m.named_modules() if n for h in (
        mod.register_forward_hook(lambda _m, i, o: keep(list(i) + [o])),
        mod.register_full_backward_hook(lambda _m, gi, go: keep(list(gi) + list(go))))]
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step(m, opt, idx, tgt)
    for h in hs:
        h.remove()
    conv = {}                                        # keep the duplicates duplicated
    for t in seen:
        k = (t.data_ptr(), t.shape, t.stride())
        if k not in conv:
            conv[k] = t.to(dtype)
    return [conv[(t.data_ptr(), t.shape, t.stride())] for t in seen]


# ---- candidates ---------------------------------------------------------------------------------------
def c_foreach_norm(ts):
    torch._foreach_norm(ts, 2, dtype=F32)


def c_loop6_fast(ts):
    """Six reductions per tensor in a Python loop, finite values assumed (not exact), bool counts."""
    out = []
    for x in ts:
        mn, mx = torch.aminmax(x)
        out.append((mn, mx, torch.linalg.vector_norm(x, dtype=F32), x.sum(dtype=F32),
                    (x.abs() < EPS).sum(), torch.isnan(x).sum(), torch.isinf(x).sum()))
    return out


def c_masked_exact(ts):
    """The obvious exact version: isfinite mask, where() copies, bool counts."""
    out = []
    for x in ts:
        fin = torch.isfinite(x)
        a = torch.where(fin, x, 0)
        out.append((torch.where(fin, x, INF).amin(), torch.where(fin, x, -INF).amax(), a.sum(dtype=F32),
                    torch.linalg.vector_norm(a, dtype=F32), (a.abs() < EPS).sum() - (~fin).sum(),
                    torch.isnan(x).sum(), fin.sum()))
    return out


def c_foreach_fast(ts):
    """Kernel-major _foreach fast path, finite values assumed (not exact): powsum, max of x and -x,
    per-tensor sum, bool counts."""
    sq = torch._foreach_powsum(ts, 2, dtype=F32)
    mx = torch._foreach_max(ts)
    mn = torch._foreach_max(torch._foreach_neg(ts))
    s = [x.sum(dtype=F32) for x in ts]
    cnt = [(torch.isnan(x).sum(), torch.isinf(x).sum(), (x.abs() < EPS).sum()) for x in ts]
    return sq, mx, mn, s, cnt


def c_opmajor_exact(ts):
    """The chosen exact kernel set, but op-major over whole tensors (no cache blocking)."""
    b = [torch.nan_to_num(x, INF, INF, INF) for x in ts]
    mn = [t.amin() for t in b]
    for t in b:
        t.nan_to_num_(0.0, -INF, -INF)
    mx = torch._foreach_max(b)
    for t in b:
        t.nan_to_num_(0.0, 0.0, 0.0)
    s = [t.sum(dtype=F32) for t in b]
    q = torch._foreach_powsum(b, 2, dtype=F32)
    c = [torch.abs(x) for x in ts]
    for t in c:
        torch.ops.aten.hardshrink.out(t, EPS, out=t)
        t.nan_to_num_(-65536.0, -256.0, -256.0).clamp_max_(2.0 ** -27)
    rows = [t.view(-1, 128).sum(1, dtype=F32) for t in c]
    return mn, mx, s, q, rows


def c_fast_raw_plus_codes(ts):
    """Lower bound of any 'assume finite' design: raw sum/dot/aminmax on x + the count code chain
    (what exactness costs = chosen - this)."""
    out = []
    for x in ts:
        for xc in buffers.chunks(x, 1 << 18):
            f = xc.reshape(-1)
            c = torch.abs(f)
            torch.ops.aten.hardshrink.out(c, EPS, out=c)
            c.nan_to_num_(-65536.0, -256.0, -256.0).clamp_max_(2.0 ** -27)
            out.append((f.sum(dtype=F32), torch.aminmax(f), torch.dot(f, f) if f.dtype == F32 else
                        torch._foreach_powsum([f], 2, dtype=F32)[0], c[: c.numel() // 128 * 128].view(-1, 128).sum(1)))
    return out


def c_records(fields, chunk=None):
    """The engine as shipped (it computes each distinct storage view once)."""
    def run(ts):
        old = paths.CHUNK_ELEMS["cpu"]
        paths.CHUNK_ELEMS["cpu"] = chunk or old
        try:
            return stats.tensor_records(ts, EPS, fields)
        finally:
            paths.CHUNK_ELEMS["cpu"] = old
    return run


def unique(ts):
    seen, out = set(), []
    for t in ts:
        k = (t.data_ptr(), t.shape, t.stride())
        if k not in seen:
            seen.add(k)
            out.append(t)
    return out


def bench(cands, ts, rounds, base):
    """Interleaved rounds; returns {name: (median ms, min ms, median of per-round time / base time)}."""
    times = {k: [] for k in cands}
    for f in cands.values():
        f(ts)                                        # warm-up (workspace, allocator)
    for _ in range(rounds):
        for k, f in cands.items():
            t0 = time.perf_counter()
            f(ts)
            times[k].append(time.perf_counter() - t0)
    return {k: (statistics.median(v) * 1e3, min(v) * 1e3,
                statistics.median(a / b for a, b in zip(v, times[base]))) for k, v in times.items()}


def call_overhead(rounds):
    """Fixed cost of one tensor_records call on a 4-element tensor (per-hook callers pay it per hook)."""
    x, fields = torch.randn(4), stats.fields_for_ops(DESIGN_OPS)
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(50):
            stats.tensor_records([x], EPS, fields)
        out.append((time.perf_counter() - t0) / 50 * 1e6)
    t0 = time.perf_counter()
    for _ in range(200):
        torch._foreach_norm([x], 2, dtype=F32)
    return statistics.median(out), (time.perf_counter() - t0) / 200 * 1e6


def step_overhead(rounds, fields):
    """End to end: train step with forward+backward hooks on every module calling tensor_records on the
    hook's tensors (one call per hook, realistic cache state) vs the bare step.  "+cache" shares a
    per-step ``cache`` dict, so a module output that is the next module's input is computed once."""
    m, opt, idx, tgt = make_model()
    cache: dict = {}

    def hooks(kind):
        def run(ts):
            if kind == "norm":
                torch._foreach_norm(ts, 2, dtype=F32)
            else:
                stats.tensor_records(ts, EPS, fields, cache=cache if kind == "cache" else None)

        def fh(_m, i, o):
            run([t for t in list(i) + [o] if isinstance(t, torch.Tensor) and t.is_floating_point()])

        def bh(_m, gi, go):
            run([t for t in list(gi) + list(go) if t is not None])
        return fh, bh

    mods = [mod for n, mod in m.named_modules() if n]
    kinds = {"bare": None, "foreach_norm hooks": "norm", "tensor_records hooks": "plain",
             "tensor_records hooks + cache": "cache"}
    res = {k: [] for k in kinds}
    import warnings
    warnings.simplefilter("ignore")
    for _ in range(2):
        step(m, opt, idx, tgt)
    for _ in range(rounds):
        for k, kind in kinds.items():
            hs = []
            if kind:
                f, b = hooks(kind)
                hs = [h for mod in mods for h in (mod.register_forward_hook(f),
                                                   mod.register_full_backward_hook(b))]
            cache.clear()
            t0 = time.perf_counter()
            step(m, opt, idx, tgt)
            res[k].append(time.perf_counter() - t0)
            for h in hs:
                h.remove()
    return {k: (statistics.median(v) * 1e3, min(v) * 1e3) for k, v in res.items()}


def per_element(rounds):
    """ns per element of tensor_records (design ops): with the multi-pass kernels only, with the one-pass
    record kernel only, through the generated kernels where there is no native one ("generated": CPU fp32
    through the assume-finite path and its own one-pass kernel), and as shipped (16-bit through the record
    kernel, CPU fp32 through the native kernel), next to one _foreach_norm pass over the same tensors (the
    floor): one tensor of each size, many small tensors in one call, and the hook tensors of the §7 model in
    one call (172 tensors, 89 distinct views)."""
    fields = stats.fields_for_ops(DESIGN_OPS)
    dtypes = (torch.float32, torch.bfloat16)
    stat_kernels.prepare("cpu", dtypes, wait=True)
    stat_kernels.prepare("cpu", [torch.float32], wait=True, kernel="finite")
    stats_native.prepare()

    def records(enabled, as_accelerator=False, native=False):
        def run(ts):
            stats_fused.enabled, stats_fused.cpu_as_accelerator, stats_native.enabled = enabled, as_accelerator, native
            try:
                return stats.tensor_records(ts, EPS, fields)
            finally:
                stats_fused.enabled, stats_fused.cpu_as_accelerator, stats_native.enabled = True, False, True
        return run
    cands = {"multi-pass": records(False), "one-pass": records(True, True), "generated": records(True),
             "shipped": records(True, native=True), "_foreach_norm": c_foreach_norm}
    print(f"\n== ns per element, median of {rounds} interleaved rounds (one thread)")
    print(f"  {'dtype':9s} {'tensors':>15s} " + " ".join(f"{k:>13s}" for k in cands))
    g = torch.Generator().manual_seed(0)
    for dtype in dtypes:
        workloads = [(f"{numel:.0e}", [torch.randn(numel, generator=g).to(dtype)]) for numel in
                     (10 ** k for k in range(3, 8))]
        workloads += [(f"{count} x {numel:.0e}", [torch.randn(numel, generator=g).to(dtype) for _ in range(count)])
                      for count, numel in ((200, 1000), (1000, 100))]
        workloads.append(("§7 hook tensors", hook_tensors(dtype)))   # one call over all of them
        for label, ts in workloads:
            res = bench(cands, ts, rounds, "_foreach_norm")
            numel = sum(t.numel() for t in ts)
            print(f"  {str(dtype)[6:]:9s} {label:>15s} " + " ".join(f"{res[k][0] * 1e6 / numel:13.2f}" for k in cands))


def median_us(fn, calls: int) -> float:
    for _ in range(min(calls, 20)):
        fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def one_pass_sizes():
    """CPU fp32 tensor_records, µs per tensor, with the multi-pass kernels against the assume-finite one-pass
    kernel (paths.ONE_PASS_MIN moved below / above each size): calls of 20 tensors, and calls of one."""
    from trainmon.engine import stats_cpu

    fields, shipped = stats.fields_for_ops(DESIGN_OPS), paths.ONE_PASS_MIN
    stat_kernels.prepare("cpu", [F32], wait=True, kernel="finite")
    print("\n== CPU fp32, µs per tensor (median of 200 calls, in the cache): multi-pass | one-pass kernel")
    print(f"  {'elements':>9s} {'20 per call':>21s} {'1 per call':>21s}")
    try:
        for n in (4097, 8192, 12000, 16384, 32768, 65536, 131072, 262144):
            row = []
            for count in (20, 1):
                ts = [torch.randn(n) for _ in range(count)]
                for threshold in (1 << 62, 1):
                    paths.ONE_PASS_MIN = threshold
                    row.append(median_us(lambda: stats.tensor_records(ts, EPS, fields), 200) / count)
            print(f"  {n:9d} {row[0]:10.1f} {row[1]:10.1f} {row[2]:10.1f} {row[3]:10.1f}")
    finally:
        paths.ONE_PASS_MIN = shipped


def gather_sizes():
    """µs per tensor, copied into shared kernel calls against a kernel call of each tensor's own: CPU bf16
    through the record kernel (paths.GATHER_BELOW), in calls of 20; CPU fp32 through the assume-finite
    kernel (paths.GATHER_MAX), in calls of 100 distinct tensors or 8 MB, as a step's activations come."""
    from trainmon.engine import stats_cpu

    fields, shipped, shipped_max = stats.fields_for_ops(DESIGN_OPS), paths.GATHER_BELOW, paths.GATHER_MAX
    stat_kernels.prepare("cpu", [torch.bfloat16], wait=True)
    stat_kernels.prepare("cpu", [F32], wait=True, kernel="finite")
    print("\n== CPU bf16, µs per tensor, 20 per call (median of 100 calls): shared batches | own calls")
    try:
        for n in (4096, 16384, 65536):
            ts = [torch.randn(n).bfloat16() for _ in range(20)]
            row = []
            for below in (shipped, 1):
                paths.GATHER_BELOW = below
                row.append(median_us(lambda: stats.tensor_records(ts, EPS, fields), 100) / 20)
            print(f"  {n:9d} {row[0]:10.1f} {row[1]:10.1f}")
        print("\n== CPU fp32, whole rows, µs per tensor, 100 tensors or 8 MB per call (median of 40 calls): shared calls | own calls")
        for n in (8192, 16384, 32768, 65536, 131072, 262144):
            ts = [torch.randn(n) for _ in range(max(4, min(100, (1 << 21) // n)))]
            row = []
            for largest in (1 << 62, 0):
                paths.GATHER_MAX = largest
                row.append(median_us(lambda: stats.tensor_records(ts, EPS, fields), 40) / len(ts))
            print(f"  {n:9d} {row[0]:10.1f} {row[1]:10.1f}")
    finally:
        paths.GATHER_BELOW, paths.GATHER_MAX = shipped, shipped_max


def contiguous_calls():
    """CPU fp32 tensor_records of a flush of activations read in place, µs per tensor (median of 40 calls): the
    route of such calls (stats_cpu.in_place_records), the general route, and the native read alone of contiguous
    tensors of the same size (the floor). The views are q, k and v split from one projection (Megatron's layout at
    hidden 64: [tokens, batch, heads, 3 x 16], a run of 16 elements per head and token)."""
    from trainmon.engine import stats_cpu

    stats_native.prepare()
    fields, shipped = stats.FieldSet(stats.FIELDS), stats_cpu.in_place_records
    lam = stats._consts(F32, EPS)[0]
    print("\n== CPU fp32, µs per tensor: in-place route | general route | native read alone (contiguous)")

    def qkv(count: int) -> list:
        bases = [torch.randn(32, 4, 4, 48) for _ in range((count + 2) // 3)]
        return [b[..., i * 16:(i + 1) * 16] for b in bases for i in range(3)][:count]

    cases = [(f"{n:9d} x {count:4d}", [torch.randn(n) for _ in range(count)]) for n, count in
             ((2048, 800), (8192, 800), (32768, 200))]
    cases.append(("q, k, v 8192 x  300", qkv(300)))
    try:
        for label, ts in cases:
            count = len(ts)
            row = [median_us(lambda: stats.tensor_records(ts, EPS, fields), 40) / count]
            stats_cpu.in_place_records = lambda *_: ([], None)
            row.append(median_us(lambda: stats.tensor_records(ts, EPS, fields), 40) / count)
            stats_cpu.in_place_records = shipped
            dense = [t.contiguous() for t in ts]
            row.append(median_us(lambda: stats_native.figures(dense, lam), 40) / count)
            print(f"  {label} {row[0]:10.2f} {row[1]:10.2f} {row[2]:10.2f}")
    finally:
        stats_cpu.in_place_records = shipped


def cold_reads(rounds: int = 21):
    """ns per element of the native read (`stats_native.figures`) of a step's activations as the flush before the
    optimizer step meets them: many tensors, each allocated apart from the next (other tensors between them), read
    after 64 MB written elsewhere, and read again at once; next to one `_foreach_norm` pass over them (the floor),
    likewise. Median of `rounds` interleaved rounds. Either way the set is larger than the L2 cache; how much of it the
    64 MB push out of the last-level cache depends on that cache's size."""
    stats_native.prepare()
    lam = stats._consts(F32, EPS)[0]
    evict = torch.zeros(16 << 20)
    print("\n== CPU fp32, ns per element: native read after 64 MB written | again; _foreach_norm after 64 MB | again")
    for numel, count in ((2048, 2000), (8192, 900), (32768, 250)):
        tensors, between = [], []
        for _ in range(count):
            tensors.append(torch.randn(numel))
            between.append(torch.randn(numel // 3))
        paths = {"native": lambda: stats_native.figures(tensors, lam), "_foreach_norm": lambda: c_foreach_norm(tensors)}
        times = {(name, cold): [] for name in paths for cold in (True, False)}
        for _ in range(rounds):
            for name, fn in paths.items():
                for cold in (True, False):
                    if cold:
                        evict.add_(1.0)
                    t0 = time.perf_counter()
                    fn()
                    times[name, cold].append(time.perf_counter() - t0)
        per = {k: statistics.median(v) * 1e9 / (numel * count) for k, v in times.items()}
        print(f"  {numel:7d} x {count:4d} " + " ".join(f"{per[k]:8.3f}" for k in times))


def arrival_reads(rounds: int = 11):
    """Per tensor, µs and ns per element of a CPU fp32 tensor's figures read in its hook right after it was written
    (`stats_cpu.RecordsOnArrival.take`, host work included), against its share of one native read of the batch (32 MB of
    such tensors, each written in turn, then read together, as the flush before the optimizer step meets them).
    Median of `rounds` interleaved rounds."""
    stats_native.prepare()
    lam = stats._consts(F32, EPS)[0]
    arrivals = stats.records_on_arrival(EPS, stats.fields_for_ops(DESIGN_OPS))
    paths.ON_ARRIVAL_MIN_ELEMENTS = 1  # every size read on arrival here (this process measures nothing else)
    print("\n== CPU fp32, per tensor: read on arrival µs, ns/element | in a batch µs, ns/element")
    for numel in (2048, 8192, 16384, 65536, 262144, 1048576):
        count = max(8, (32 << 20) // (4 * numel))
        sources = [torch.randn(numel) for _ in range(count)]
        outputs = [torch.empty(numel) for _ in range(count)]
        on_arrival, batched = [], []
        for _ in range(rounds):
            spent = 0
            for x, y in zip(sources, outputs):
                torch.mul(x, 2.0, out=y)
                t0 = time.perf_counter_ns()
                arrivals.take(y)
                spent += time.perf_counter_ns() - t0
            arrivals.records()
            on_arrival.append(spent / count)
            for x, y in zip(sources, outputs):
                torch.mul(x, 2.0, out=y)
            t0 = time.perf_counter_ns()
            stats_native.figures(outputs, lam)
            batched.append((time.perf_counter_ns() - t0) / count)
        a, b = statistics.median(on_arrival), statistics.median(batched)
        print(f"  {numel:8d} x {count:5d}   {a / 1e3:8.2f} {a / numel:6.3f} | {b / 1e3:8.2f} {b / numel:6.3f}")


class _OpCount(TorchDispatchMode):
    """Counts the aten ops that launch work (views excluded): on an accelerator, one kernel launch each."""

    VIEWS = {"view", "_unsafe_view", "narrow", "select", "slice", "unbind", "detach", "alias", "as_strided",
             "expand", "t", "unsqueeze", "squeeze", "_reshape_alias", "lift_fresh"}

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += func.overloadpacket.__name__ not in self.VIEWS
        return func(*args, **(kwargs or {}))


def ops_per_tensor(count: int = 20):
    """The launches per bf16 tensor of an accelerator's record paths, counted on the CPU: the multi-pass
    kernels (stats._exact_records, the sat and +Inf columns; in the accelerators' chunks) and the one-pass
    path (stats_fused.records: its ops plus its compiled-kernel calls, the merge kernel's included)."""
    dev, accel_chunk = torch.device("cpu"), paths.DEFAULT_CHUNK_ELEMS
    want = tuple(f in ALL for f in stats.FIELDS[:8])
    stat_kernels.prepare("cpu", [torch.bfloat16], wait=True)
    stat_kernels.prepare("cpu", [F32], wait=True, kernel="merge")
    print(f"== launches per bf16 tensor on an accelerator's paths, {count} tensors a call "
          f"(accelerators' chunk: {accel_chunk} elements)")
    for size in (1 << 14, 1 << 20, 1 << 24):
        tensors = [torch.randn(size).bfloat16() for _ in range(count)]
        shipped_chunk, paths.CHUNK_ELEMS["cpu"] = paths.CHUNK_ELEMS["cpu"], accel_chunk
        try:
            with _OpCount() as multi:
                rec = stats._exact_records(tensors, dev, EPS, want)
                stats._sat_counts(tensors, dev, stats.FieldSet())
                for u in range(count):  # an accelerator counts +Inf in every tensor (no host read of infs)
                    torch.stack([(c == INF).sum() for c in buffers.chunks(tensors[u], accel_chunk)]).sum()
        finally:
            paths.CHUNK_ELEMS["cpu"] = shipped_chunk
        calls, real_run, real_spread = [], stat_kernels.run, stats_fused._spread
        stat_kernels.run = lambda *a, **k: calls.append(1) or real_run(*a, **k)
        stats_fused._spread = lambda device, most_rows: real_spread(torch.device("cuda"), most_rows)
        stats_fused.cpu_as_accelerator = True                       # and merge
        try:
            stats_fused.records(tensors[:1], dev, stats._consts, stats._sat_lambda, EPS,  # its kept cycle made
                                stats.FieldSet().sat_limit, accel_chunk)
            calls.clear()
            with _OpCount() as one:
                stats_fused.records(tensors, dev, stats._consts, stats._sat_lambda, EPS,
                                    stats.FieldSet().sat_limit, accel_chunk)
        finally:
            stat_kernels.run, stats_fused._spread = real_run, real_spread
            stats_fused.cpu_as_accelerator = False
        print(f"  {size:>10,} elements: multi-pass {multi.ops / count:5.1f}   one-pass "
              f"{(one.ops + len(calls)) / count:5.1f} ({len(calls)} kernel calls in the call)")
        del rec


def call_cost():
    """Host time of one call of the assume-finite kernel on a [2, 4096] fp32 tensor: through the loaded
    package's runner (shipped), the eager ops, and a torch.compile'd function (the earlier path)."""
    stat_kernels.prepare("cpu", [F32], wait=True, kernel="finite")
    x = torch.randn(2, stat_kernels.ROW)
    compiled = torch.compile(stat_kernels._finite_row_figures, dynamic=True, fullgraph=True)
    paths = {"package runner (stat_kernels.run)": lambda: stat_kernels.run("finite", x, 1e-8),
             "eager ops": lambda: stat_kernels._finite_row_figures(x, 1e-8),
             "torch.compile'd function": lambda: compiled(x, 1e-8)}
    print("\n== µs per call, [2, 4096] fp32, median of 3,000 calls")
    for name, fn in paths.items():
        print(f"  {name:36s} {median_us(fn, 3000):7.1f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-step", action="store_true")
    ap.add_argument("--per-element", action="store_true")
    ap.add_argument("--one-pass-sizes", action="store_true")
    ap.add_argument("--call-cost", action="store_true")
    ap.add_argument("--gather-sizes", action="store_true")
    ap.add_argument("--ops-per-tensor", action="store_true")
    ap.add_argument("--contiguous", action="store_true")
    ap.add_argument("--cold", action="store_true")
    ap.add_argument("--arrival", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rounds = 3 if args.quick else 11
    if args.per_element:
        per_element(rounds)
        return
    if args.one_pass_sizes:
        one_pass_sizes()
        return
    if args.call_cost:
        call_cost()
        return
    if args.gather_sizes:
        gather_sizes()
        return
    if args.contiguous:
        contiguous_calls()
        return
    if args.cold:
        cold_reads()
        return
    if args.arrival:
        arrival_reads()
        return
    if args.ops_per_tensor:
        ops_per_tensor(20)
        ops_per_tensor(2)                         # a compiled graph's hook call: an input and an output
        ops_per_tensor(1)
        return
    design = stats.fields_for_ops(DESIGN_OPS)
    for dtype in (torch.float32, torch.bfloat16):
        ts = hook_tensors(dtype)
        u = unique(ts)
        print(f"\n== {dtype}: {len(ts)} tensors, {sum(t.numel() for t in ts) / 1e6:.1f}M elements, "
              f"{len(u)} distinct / {sum(t.numel() for t in u) / 1e6:.1f}M")
        cands = {
            "foreach_norm (1 pass, floor)": c_foreach_norm,
            "foreach_norm distinct only": lambda t: c_foreach_norm(unique(t)),
            "loop6_fast (not exact)": lambda t: c_loop6_fast(unique(t)),
            "masked_exact (where+bool)": lambda t: c_masked_exact(unique(t)),
            "foreach_fast (not exact)": lambda t: c_foreach_fast(unique(t)),
            "opmajor_exact (no blocking)": lambda t: c_opmajor_exact(unique(t)),
            "fast_raw+codes (not exact)": lambda t: c_fast_raw_plus_codes(unique(t)),
            "records design ops, chunk 64K": c_records(design, 1 << 16),
            "records design ops, chunk 256K": c_records(design, 1 << 18),
            "records design ops, chunk 512K*": c_records(design, 1 << 19),
            "records design ops, chunk 1M": c_records(design, 1 << 20),
            "records norm only": c_records(stats.fields_for_ops(["norm"])),
            "records nans,infs only": c_records(stats.fields_for_ops(["nans", "infs"])),
            "records no zeros": c_records(stats.fields_for_ops(["min", "max", "norm", "mean"])),
        }
        if dtype != torch.float32:
            cands = {k: v for k, v in cands.items() if not k.startswith(("loop6", "masked"))}
        base = "foreach_norm (1 pass, floor)"
        res = bench(cands, ts, rounds, base)
        print(f"  {'candidate':32s} {'median':>9s} {'min':>9s}   x norm pass: per-round median, min/min")
        for k, (med, mn, ratio) in res.items():
            print(f"  {k:32s} {med:7.1f}ms {mn:7.1f}ms   x{ratio:5.2f}  x{mn / res[base][1]:5.2f}")
    rec_us, norm_us = call_overhead(rounds)
    print(f"\n== fixed cost of one call (4-element tensor): tensor_records {rec_us:.0f} us, "
          f"_foreach_norm {norm_us:.0f} us")
    if not args.no_step:
        r = step_overhead(rounds, design)
        (bare, bare_min) = r["bare"]
        print("\n== train step (fp32, hooks on every module, one tensor_records call per hook)")
        for k, (v, mn) in r.items():
            print(f"  {k:32s} median {v:7.1f} ms (+{(v / bare - 1) * 100:5.1f}%)   "
                  f"min {mn:7.1f} ms (+{(mn / bare_min - 1) * 100:5.1f}%)")


if __name__ == "__main__":
    main()
