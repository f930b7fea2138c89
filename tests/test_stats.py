"""Tests of the statistic engine trainmon.engine.stats (records, merge, derive, no-sync, no-copy)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from training import DEVICES
from trainmon.engine import paths, stats, stats_native
from trainmon.core.derive import derive_ops, derive_rows
from trainmon.engine.buffers import merge_records
from trainmon.engine.stats import FIELDS, N_FIELDS, OPS, fields_for_ops, tensor_records

ALL = frozenset(FIELDS)
NAN, INF = math.nan, math.inf
FLOATS = [torch.float32, torch.bfloat16, torch.float16]
COUNT_FIELDS = ("count", "nans", "infs", "zeros", "min", "max", "sat", "pinfs")   # must match exactly
# On a machine with a GPU (DEVELOPERS.md, "On a GPU") the engine's record tests run there too.


def reference(x: torch.Tensor, eps: float) -> dict:
    """Direct float64 computation on the finite elements."""
    d = x.detach().to(torch.float64).reshape(-1)
    fin = torch.isfinite(d)
    f = d[fin]
    return {"count": f.numel(), "nans": int(torch.isnan(d).sum()), "infs": int(torch.isinf(d).sum()),
            "zeros": int((f.abs() < eps).sum()), "sum": float(f.sum()), "sumsq": float((f * f).sum()),
            "min": float(f.min()) if f.numel() else INF, "max": float(f.max()) if f.numel() else -INF,
            "sat": int((f.abs() >= torch.finfo(x.dtype).max).sum()),  # default limit: the dtype's largest
            "pinfs": int(torch.isposinf(d).sum()),
            "abssum": float(f.abs().sum())}


def check(row, x, eps, fields=ALL, rel=1e-5):
    ref = reference(x, eps)
    got = dict(zip(FIELDS, [float(v) for v in row]))
    for f in FIELDS:
        if f not in fields and f not in ("count", "nans", "infs"):
            assert got[f] == 0.0, f"{f} not requested but {got[f]}"
        elif f in COUNT_FIELDS:
            assert got[f] == ref[f], f"{f}: {got[f]} != {ref[f]}  ({x.dtype}, {tuple(x.shape)})"
        elif f == "sum":        # fp32 accumulation: error relative to sum |x|
            assert abs(got[f] - ref[f]) <= rel * max(ref["abssum"], 1e-30), (f, got[f], ref[f])
        elif x.dtype != torch.float64 and ref[f] > torch.finfo(torch.float32).max:
            assert got[f] == INF                     # fp32 accumulation overflows, as specified
        else:
            assert got[f] == pytest.approx(ref[f], rel=rel, abs=1e-30), (f, got[f], ref[f])


def sprinkle(x: torch.Tensor, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    flat = x.view(-1)
    for v in (NAN, INF, -INF, NAN):
        flat[torch.randint(0, flat.numel(), (3,), generator=g)] = v
    return x


def cases(dtype, device="cpu"):
    g = torch.Generator().manual_seed(1)
    r = lambda *s: torch.randn(*s, generator=g).to(device=device, dtype=dtype)  # noqa: E731
    full = lambda shape, value: torch.full(shape, value, dtype=dtype, device=device)  # noqa: E731
    t = lambda values: torch.tensor(values, dtype=dtype, device=device)  # noqa: E731
    big = r(64, 33, 17)
    mixed = sprinkle(r(50, 70))
    tiny = r(1000) * 1e-4
    tiny[:100] = 0
    return {
        "randn": r(37, 129),
        "nan_inf": mixed,
        "nan_inf_T": mixed.t(),                      # non-contiguous
        "strided": big[::3, 1::2, ::5],
        "expanded": r(1, 7).expand(5, 7),
        "all_zero": full((300,), 0.0),
        "neg_zero": full((5,), -0.0),
        "all_nan": full((130,), NAN),
        "all_inf": t([INF, -INF, INF]),
        "nan_and_pos": t([NAN, 2.0, 3.0, INF]),   # min_f > 0 with a NaN
        "inf_and_neg": t([-INF, -2.0, -3.0, NAN]),
        "empty": full((0, 3), 0.0),
        "scalar": t(2.5),
        "scalar_nan": t(NAN),
        "scalar_zero": t(0.0),
        "near_eps": tiny,
        "extremes": t([torch.finfo(dtype).max, torch.finfo(dtype).tiny, -torch.finfo(dtype).max,
                       torch.finfo(dtype).smallest_normal / 4]),
    }


@pytest.fixture(params=["native", "torch ops"])
def cpu_kernels(request, monkeypatch):
    """CPU fp32/fp64 figures from the native kernel (`stats_native`), or from torch ops and the one-pass kernel
    (the path while the native one is being built, or where it cannot be)."""
    native = request.param == "native"
    if native:
        assert stats_native.prepare()
    monkeypatch.setattr(stats_native, "enabled", native)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOATS + [torch.float64])
@pytest.mark.parametrize("eps", [1e-8, 1e-3, 0.5])
def test_records_match_float64_reference(dtype, eps, device, cpu_kernels):
    cs = cases(dtype, device)
    rec = tensor_records(list(cs.values()), eps, ALL)
    assert rec.shape == (len(cs), N_FIELDS) and rec.dtype == torch.float64 and rec.device.type == device
    for row, (name, x) in zip(rec, cs.items()):
        check(row, x, eps)


@pytest.mark.parametrize("dtype", FLOATS)
def test_eps_boundary_is_exact(dtype, cpu_kernels):
    eps = 1e-3
    e = torch.tensor(eps, dtype=torch.float64).to(dtype)
    below, above = torch.nextafter(e, torch.tensor(0.0, dtype=dtype)), torch.nextafter(e, torch.tensor(1.0, dtype=dtype))
    x = torch.stack([e, -e, below, -below, above]).to(dtype)
    check(tensor_records([x], eps, ALL)[0], x, eps)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOATS)
def test_large_tensor_with_nonfinite_many_chunks(dtype, device, cpu_kernels):
    x = (torch.randn(3_000_000, generator=torch.Generator().manual_seed(2)) * 3 + 1).to(dtype)
    sprinkle(x, seed=5)
    x[123_456:123_456 + 10_000] = 0                  # a run of zeros crossing row boundaries
    assert x.numel() > paths.CHUNK_ELEMS["cpu"]       # several chunks on the CPU
    x = x.to(device)
    check(tensor_records([x], 1e-8, ALL)[0], x, 1e-8, rel=1e-5)


def test_many_nonfinite_in_one_row_and_chunk():
    # every count field of the row code saturated: 128 NaN, 128 Inf, 128 big, 128 zero rows
    x = torch.cat([torch.full((128,), NAN), torch.full((128,), INF), torch.ones(128), torch.zeros(128),
                   torch.tensor([NAN, -INF, 5.0] * 1000)])
    check(tensor_records([x], 1e-8, ALL)[0], x, 1e-8)


@pytest.mark.parametrize("ops", [["norm"], ["nans"], ["infs"], ["zeros"], ["min"], ["max"], ["mean"],
                                 ["min", "max", "norm", "mean"], ["zeros", "mean"], list(OPS)])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_only_requested_fields(ops, dtype, device):
    fields = fields_for_ops(ops)
    cs = cases(dtype, device)
    rec = tensor_records(list(cs.values()), 1e-8, fields)
    for row, x in zip(rec, cs.values()):
        check(row, x, 1e-8, fields)


def test_fields_for_ops():
    assert fields_for_ops([]) == {"count", "nans", "infs"}
    assert fields_for_ops(["norm", "mean"]) == {"count", "nans", "infs", "sumsq", "sum", "pinfs"}
    assert fields_for_ops(["norm_finite", "mean_finite"]) == {"count", "nans", "infs", "sumsq", "sum"}
    assert fields_for_ops(OPS) == set(FIELDS)
    with pytest.raises(ValueError, match="unknown op 'nrom'"):
        fields_for_ops(["nrom"])


def test_extreme_eps():
    x = sprinkle(torch.tensor([0.0, -0.0, 1e-30, 2.0, -3.0, 0.0, 5.0, 1e-45, 1.0, 1e-39, 1.0, 1.0]))
    for eps in (0.0, 1e-45, 2e-45, 1e-40, 1e-20, INF, 1e300):   # 0: nothing is |x| < 0
        for dtype in FLOATS + [torch.float64]:
            check(tensor_records([x.to(dtype)], eps, ALL)[0], x.to(dtype), eps)


def test_bad_arguments():
    x = torch.ones(3)
    with pytest.raises(ValueError):
        tensor_records([x], -1e-8, ALL)
    with pytest.raises(ValueError):
        tensor_records([x], NAN, ALL)
    with pytest.raises(ValueError, match="unknown record fields"):
        tensor_records([x], 1e-8, frozenset({"count", "median"}))
    assert tensor_records([], 1e-8, ALL).shape == (0, N_FIELDS)


def test_duplicates_and_autograd_inputs():
    w = torch.randn(20, 30, requires_grad=True)
    y = w * 2                                        # non-leaf with grad_fn
    rec = tensor_records([y, w, y, y.t(), w], 1e-8, ALL)
    assert torch.equal(rec[0], rec[2]) and torch.equal(rec[1], rec[4])
    check(rec[3], y.t(), 1e-8)
    assert not rec.requires_grad


# ---- merging ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("parts", [1, 2, 3, 4, 5])
def test_merged_chunks_equal_whole(dtype, parts):
    x = sprinkle(torch.randn(41, 23, 7).to(dtype), seed=parts)
    x[3] = 0
    whole = tensor_records([x], 1e-3, ALL)[0]
    pieces = tensor_records(list(torch.tensor_split(x, parts, dim=0)), 1e-3, ALL)
    merged = merge_records(pieces)
    for i, f in enumerate(FIELDS):
        if f in COUNT_FIELDS:
            assert merged[i] == whole[i], f
        else:                   # fp32 partial sums: tolerance relative to sum |x| / sumsq
            scale = reference(x, 1e-3)["abssum"] if f == "sum" else float(whole[i])
            assert abs(float(merged[i]) - float(whole[i])) <= 1e-6 * scale, f


def test_merge_identities_and_shapes():
    e = merge_records(torch.zeros(0, N_FIELDS, dtype=torch.float64))
    assert e.tolist() == [0, 0, 0, 0, 0, 0, INF, -INF, 0, 0]
    a = tensor_records([torch.zeros(0), torch.tensor([1.0, -2.0])], 1e-8, ALL)
    assert merge_records(a).tolist() == a[1].tolist()
    with pytest.raises(ValueError):
        merge_records(torch.zeros(3, 7))
    with pytest.raises(ValueError, match="dim 1"):
        merge_records(a, dim=1)                      # the fields' own dimension


def test_merge_over_an_inner_dimension_merges_each_group():
    g = torch.Generator().manual_seed(5)
    xs = [sprinkle(torch.randn(60, generator=g), seed=i) for i in range(3)]
    pieces = torch.stack([tensor_records(list(x.chunk(4)), 1e-3, ALL) for x in xs])    # [3, 4, N_FIELDS]
    merged = merge_records(pieces, dim=1)
    assert merged.shape == (3, N_FIELDS)
    for i in range(3):
        assert torch.equal(merged[i], merge_records(pieces[i]))
    assert torch.equal(merge_records(pieces.transpose(0, 1), dim=-3), merged)
    empty = merge_records(torch.zeros(2, 0, N_FIELDS), dim=1)
    assert empty.tolist() == [[0, 0, 0, 0, 0, 0, INF, -INF, 0, 0]] * 2


# ---- derive -------------------------------------------------------------------------------------------
def _same(a, b) -> bool:
    return a == b or (a is not None and b is not None and math.isnan(a) and math.isnan(b))


def test_derive_ops():
    x = torch.tensor([3.0, -4.0, 0.0, NAN, INF, 1e-9])
    row = tensor_records([x], 1e-8, ALL)[0]
    d = derive_ops(row.numpy(), OPS)
    # torch's figures: a NaN element makes them NaN
    assert math.isnan(d["norm"]) and math.isnan(d["mean"]) and math.isnan(d["min"]) and math.isnan(d["max"])
    assert math.isnan(float(torch.linalg.vector_norm(x))) and math.isnan(float(x.max()))
    # the finite-only figures
    assert d["norm_finite"] == pytest.approx(5.0) and d["mean_finite"] == pytest.approx(-1.0 / 4 + 1e-9 / 4)
    assert d["min_finite"] == -4.0 and d["max_finite"] == 3.0
    assert d["zeros"] == pytest.approx(2 / 6) and d["nans"] == 1.0 and d["infs"] == 1.0
    assert derive_ops(row.tolist(), ["norm_finite"]) == {"norm_finite": pytest.approx(5.0)}
    assert derive_ops(np.asarray(row), ["min_finite"])["min_finite"] == -4.0


@pytest.mark.parametrize("values", [
    [3.0, -4.0, INF], [3.0, -4.0, -INF], [3.0, INF, -INF], [INF, INF], [-INF], [INF, -INF],
    [1.0, NAN, INF], [NAN], [2.0, -1.0], [0.0]])
def test_figures_are_what_torch_computes(values):
    x = torch.tensor(values, dtype=torch.float32)
    d = derive_ops(tensor_records([x], 1e-8, ALL)[0].numpy(), OPS)
    want = {"norm": torch.linalg.vector_norm(x), "mean": x.mean(), "min": x.min(), "max": x.max()}
    for op, value in want.items():
        value = float(value)
        assert _same(d[op], value) or math.isclose(d[op], value, rel_tol=1e-6), (op, values, d[op], value)


def test_one_record_and_a_column_derive_the_same_figures():
    """The plain-Python and numpy derivations of `schema.OP_TABLE` agree row by row, None included; also for
    records whose fields were not recorded (NaN, as read from an older database)."""
    tensors = [torch.tensor(v) for v in ([3.0, -4.0, INF], [3.0, INF, -INF], [INF], [-INF], [NAN, 1.0], [NAN],
                                         [2.0, -1.0], [0.0])] + [torch.zeros(0)]
    records = tensor_records(tensors, 1e-8, ALL).numpy()
    unknown_sign = records[:3].copy()
    unknown_sign[:, FIELDS.index("pinfs")] = NAN
    records = np.concatenate([records, unknown_sign])
    columns = derive_rows(records, OPS)
    for row, column in zip(records, columns):
        one = derive_ops(row, OPS)
        assert one.keys() == column.keys()
        assert all(_same(one[op], column[op]) for op in OPS), (row, one, column)
    assert math.isnan(columns[-3]["max"]) and columns[-3]["norm"] == INF  # a sign not recorded is not guessed


def test_derive_empty_and_all_nonfinite():
    rows = tensor_records([torch.zeros(0), torch.tensor([NAN, INF])], 1e-8, ALL)
    d0 = derive_ops(rows[0].tolist(), OPS)
    assert d0 == {"min": None, "max": None, "norm": 0.0, "mean": None, "zeros": None, "nans": 0.0, "infs": 0.0,
                  "sat": 0.0, "norm_finite": 0.0, "mean_finite": None, "min_finite": None, "max_finite": None}
    d1 = derive_ops(rows[1].tolist(), OPS)
    assert math.isnan(d1["mean"]) and math.isnan(d1["min"]) and math.isnan(d1["norm"])
    assert d1["mean_finite"] is None and d1["min_finite"] is None and d1["zeros"] == 0.0 and d1["nans"] == 1.0


def test_derive_refuses_uncomputed_fields():
    fields = fields_for_ops(["norm"])
    row = tensor_records([torch.ones(4)], 1e-8, fields)[0].tolist()
    assert derive_ops(row, ["norm", "nans"], fields=fields)["norm"] == 2.0
    with pytest.raises(ValueError, match="not computed"):
        derive_ops(row, ["mean"], fields=fields)
    with pytest.raises(ValueError, match="unknown op"):
        derive_ops(row, ["median"])


# ---- no host sync, no device->host copy, no fp32 copy of 16-bit data -------------------------------
class OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []                              # (func, args, out)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.calls.append([func, args, kwargs, None])    # logged before running: failures show too
        self.calls[-1][3] = out = func(*args, **kwargs)
        return out

    def syncs(self):
        return [str(f) for f, *_ in self.calls if f in (torch.ops.aten._local_scalar_dense.default,
                                                         torch.ops.aten.item.default)]

    def host_copies(self):
        """Ops that would move data from a non-CPU device to the host."""
        bad = []
        for f, args, kwargs, _ in self.calls:
            if f == torch.ops.aten.copy_.default:
                src, dst = args[1], args[0].device
            elif f in (torch.ops.aten._to_copy.default, torch.ops.aten.to.device):
                src = args[0]
                dst = kwargs.get("device", args[1] if f == torch.ops.aten.to.device else src.device)
            else:
                continue
            if isinstance(src, torch.Tensor) and src.device.type != "cpu" and torch.device(dst).type == "cpu":
                bad.append(str(f))
        return bad

    def big_float_outputs(self, numel):
        """fp32/fp64 results holding more than 1/32 of ``numel`` elements (the 128-row count codes and
        16-bit row norms are numel/128)."""
        bad = []
        for f, _, _, out in self.calls:
            outs = out if isinstance(out, (tuple, list)) else [out]
            for o in outs:
                if isinstance(o, torch.Tensor) and o.dtype in (torch.float32, torch.float64) \
                        and o.numel() > max(numel // 32, 64):
                    bad.append((str(f), o.dtype, o.numel()))
        return bad


def test_no_sync_and_no_host_copy_on_cpu():
    xs = [sprinkle(torch.randn(300, 500)), torch.randn(7).t(), torch.zeros(0), torch.tensor(1.0),
          torch.randn(3_000_00).bfloat16(), torch.randn(1000).half()]
    with OpLog() as log:
        tensor_records(xs, 1e-8, ALL)
        tensor_records(xs[:1], 1e-8, fields_for_ops(["min", "norm"]))
    assert log.calls and log.syncs() == []
    # the detector itself works
    with OpLog() as log:
        xs[0].sum().item()
    assert log.syncs() != []


@pytest.mark.parametrize("dtype", FLOATS)
def test_no_sync_and_no_host_copy_on_a_non_cpu_device(dtype):
    # 'meta' tensors have no data: any value-dependent host branch, .item() or copy would fail or show
    xs = [torch.empty(3, 1000, 300, device="meta", dtype=dtype), torch.empty(0, device="meta", dtype=dtype),
          torch.empty(77, 13, device="meta", dtype=dtype).t(), torch.empty((), device="meta", dtype=dtype)]
    with OpLog() as log:
        rec = tensor_records(xs, 1e-8, ALL)
    assert rec.shape == (4, N_FIELDS) and rec.device.type == "meta"
    assert log.syncs() == [] and log.host_copies() == []
    assert all(not isinstance(o, torch.Tensor) or o.device.type == "meta" for *_, o in log.calls), \
        "every op result stays on the tensors' device"
    with OpLog() as log:                             # the copy detector itself works
        with pytest.raises(NotImplementedError):
            xs[0].to("cpu")
    assert log.host_copies() != []


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("numel", [4096, 1 << 20, 3_000_000])
def test_16bit_input_is_never_copied_to_float32(dtype, numel):
    x = sprinkle(torch.randn(numel).to(dtype))
    with OpLog() as log:
        rec = tensor_records([x, x.view(-1, 64).t()], 1e-8, ALL)
    assert log.big_float_outputs(2 * numel) == []
    check(rec[0], x, 1e-8)
    check(rec[1], x.view(-1, 64).t(), 1e-8)
    with OpLog() as log:                             # the detector catches an fp32 copy
        x.float().sum()
    assert log.big_float_outputs(2 * numel) != []
    with OpLog() as log:                             # ... and a chunk-sized one
        x[: numel // 8].to(torch.float32)
    assert log.big_float_outputs(2 * numel) != []


def test_inference_mode_and_threads():
    import threading
    with torch.inference_mode():
        x = sprinkle(torch.randn(100, 30))
        check(tensor_records([x, x], 1e-8, ALL)[1], x, 1e-8)
    y = torch.randn(64, 64)
    check(tensor_records([y], 1e-8, ALL)[0], y, 1e-8)   # workspace made in inference mode still usable
    errors = []

    def work(seed):
        try:
            for k in range(5):
                z = sprinkle(torch.randn(700, 300 + seed), seed=k)
                check(tensor_records([z], 1e-8, ALL)[0], z, 1e-8)
        except Exception as e:                       # pragma: no cover - reported below
            errors.append(e)
    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_cpu_assume_finite_path_agrees_with_the_exact_kernels(cpu_kernels):
    """On CPU, finite fp32/fp64 tensors take the assume-finite path and the rest the exact kernels;
    both must give the same records (to fp32 summation order) for every field."""
    from trainmon.engine.stats import _exact_records
    finite = [torch.randn(300, 70), torch.randn(5000, dtype=torch.float64), torch.zeros(10), torch.randn(1 << 20)]
    mixed = finite + [sprinkle(torch.randn(400, 30))]
    want = (True,) * 8
    fast = tensor_records(mixed, 1e-8, ALL)
    exact = _exact_records([t.detach() for t in mixed], torch.device("cpu"), 1e-8, want)
    torch.testing.assert_close(fast[:, :4], exact[:, :4], rtol=0, atol=0)      # counts: exact
    torch.testing.assert_close(fast[:, 6:8], exact[:, 6:8], rtol=0, atol=0)    # extremes: exact
    torch.testing.assert_close(fast[:, 4:6], exact[:, 4:6], rtol=1e-5, atol=1e-3)
    for row, t in zip(fast, mixed):
        check(row, t, 1e-8)
