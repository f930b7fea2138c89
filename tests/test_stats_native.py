"""Tests of the native assume-finite kernel (trainmon.engine.stats_native) against direct torch computations."""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from test_stats import ALL, check, sprinkle
from trainmon.engine import paths, stats_native
from trainmon.engine.stats import fields_for_ops, records_on_arrival, tensor_records
from trainmon.engine.stats_cpu import RecordsOnArrival

BLOCK = stats_native.BLOCK
# Around a block and around the lanes of one (128 bytes: 32 fp32, 16 fp64 elements), whole lanes with a tail and without
SIZES = [1, 7, 16, 17, 31, 32, 33, 100, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 5, 1_000_003]


@pytest.fixture(scope="module", autouse=True)
def built():
    assert stats_native.prepare()


@pytest.fixture
def fresh_state(monkeypatch):
    """This process as one that has not asked for the library yet."""
    monkeypatch.setattr(stats_native, "_state", {"state": None})
    monkeypatch.setattr(stats_native, "_functions", {})
    monkeypatch.setattr(stats_native, "_one_functions", {})


@pytest.fixture
def native_reads(monkeypatch) -> list:
    """(dtype, tensors) of each native read, in order."""
    reads = []

    def read(dtype, addresses, lengths, lam, runs, steps, run=stats_native.read):
        reads.append((dtype, len(addresses)))
        return run(dtype, addresses, lengths, lam, runs, steps)
    monkeypatch.setattr(stats_native, "read", read)
    return reads


def assert_records_of_torch(tensors: list, eps: float = 1e-3) -> None:
    for row, t in zip(tensor_records(tensors, eps, ALL), tensors):
        check(row, t, eps)


def float64_figures(t: torch.Tensor, lam: float) -> list[float]:
    d = t.double().reshape(-1)
    return [float(d.sum()), float((d * d).sum()), float(d.min()), float(d.max()), float((d.abs() > lam).sum())]


@pytest.mark.parametrize("dtype", stats_native.DTYPES)
@pytest.mark.parametrize("numel", SIZES)
def test_figures_match_float64(dtype, numel):
    g = torch.Generator().manual_seed(numel)
    tensors = [(torch.randn(numel, generator=g) * 3 + 0.5).to(dtype), torch.rand(numel, generator=g).to(dtype) * 1e-7]
    got = stats_native.figures(tensors, 1e-8)
    for row, t in zip(got, tensors):
        want = float64_figures(t, 1e-8)
        scale = float(t.double().abs().sum())
        assert abs(row[0] - want[0]) <= 1e-6 * scale            # partials of BLOCK elements in the data's type
        assert row[1] == pytest.approx(want[1], rel=1e-6)
        assert list(row[2:]) == want[2:]                         # min, max and the count: exact


@pytest.mark.parametrize("dtype", stats_native.DTYPES)
@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_nonfinite_element_anywhere_makes_a_figure_nonfinite(dtype, numel, bad):
    for at in sorted({0, numel // 2, numel - 1}):
        t = torch.randn(numel, dtype=dtype)
        t[at] = bad
        assert not np.isfinite(stats_native.figures([t], 1e-8)[0, :4]).all(), (numel, bad, at)


def test_the_engine_reads_cpu_fp32_and_fp64_through_it(native_reads):
    """Contiguous tensors, a transpose and a strided view, NaN/Inf (then the exact kernels), empty and 16-bit ones
    (the other kernels): every record equals torch's. The contiguous fp32 tensors and the transpose are read in
    place in one call, the strided view from its copy in one more, the fp64 one in its own."""
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(64, 300, generator=g)
    tensors = [torch.randn(5000, generator=g), wide[:, 1::2], wide.t(), sprinkle(torch.randn(9000, generator=g)),
               torch.randn(7, 9, generator=g).double(), torch.zeros(0), torch.randn(40, generator=g).bfloat16(),
               torch.randn(3, generator=g)]
    assert_records_of_torch(tensors)
    assert native_reads == [(torch.float32, 4), (torch.float32, 1), (torch.float64, 1)]


@pytest.mark.parametrize("dtype", stats_native.DTYPES)
def test_a_call_of_contiguous_tensors_is_one_native_read(native_reads, dtype):
    """The usual flush (contiguous tensors of one dtype, one of them twice, one with NaN/Inf and one reaching the
    saturation limit): one native read of every tensor, the NaN/Inf one then read again by the exact kernels,
    and every record equal to torch's."""
    g = torch.Generator().manual_seed(9)
    activation = torch.randn(4, 32, 64, generator=g).to(dtype)
    top = torch.randn(300, generator=g).to(dtype)
    top[7] = torch.finfo(dtype).max
    tensors = [activation, sprinkle(torch.randn(9000, generator=g).to(dtype)), activation, top,
               torch.randn(3, generator=g).to(dtype) * 1e-4]
    assert_records_of_torch(tensors)
    assert native_reads == [(dtype, len(tensors))]


@pytest.mark.parametrize("dtype", stats_native.DTYPES)
def test_views_in_runs_are_read_in_place_in_the_same_native_read(native_reads, dtype):
    """Views whose elements lie in runs of a multiple of 16, one step apart, or in one run in some order, are read
    where they lie, in the call's one native read: q, k and v split from one projection (runs shorter than a block,
    several to a partial; one with a NaN/Inf, which the exact kernels read again), rows of a wide matrix (runs of
    several blocks), a broadcast (step 0), size-1 dims among them, a transpose and a permutation (one run). Every
    record equals torch's, and so do those of the views that lie otherwise (runs of 8, every other element), which
    the general route copies."""
    g = torch.Generator().manual_seed(3)
    projection = torch.randn(33, 4, 4, 48, generator=g).to(dtype)    # 528 runs a view: two partials and 16 runs
    q, k, v = projection[..., :16], projection[..., 16:32], projection[..., 32:]
    v[0, 0, 0, 3], v[5, 1, 2, 7], v[9, 2, 3, 0] = float("nan"), float("inf"), float("-inf")
    wide = torch.randn(6, 3 * BLOCK + 64, generator=g).to(dtype)
    broadcast = torch.randn(1, 32, generator=g).to(dtype).expand(7, 32)
    in_runs = [q, k, v, wide[:, 16:2 * BLOCK + 48], broadcast, q.unsqueeze(2), projection[3:5, :, 1:2, 16:], wide.t(),
               projection.permute(2, 0, 3, 1)]
    for view in in_runs:
        assert not view.is_contiguous() and stats_native.run_layout(view) is not None
    otherwise = [projection[..., :8], wide[:, ::2]]
    assert all(stats_native.run_layout(view) is None for view in otherwise)
    assert_records_of_torch(in_runs)
    assert native_reads == [(dtype, len(in_runs))]
    native_reads.clear()
    assert_records_of_torch([torch.randn(100, generator=g).to(dtype), *otherwise])
    assert native_reads[0] == (dtype, 1)


def test_views_beyond_one_scratch_fill_take_one_more_call_each_fill(native_reads):
    """Non-contiguous views are copied side by side into a reused scratch buffer; those that do not fit in one
    fill are read in further calls, and every record still equals torch's. The contiguous tensor is read in place,
    in a call of its own."""
    from trainmon.engine.paths import CHUNK_ELEMS

    g = torch.Generator().manual_seed(5)
    cap = CHUNK_ELEMS["cpu"]
    # five views of 0.4 of the scratch each: fills of two, two and one
    views = [torch.randn(2, int(0.4 * cap), generator=g)[:, ::2] for _ in range(5)]
    views[3][0, 5], views[3][1, 7], views[3][1, 9] = float("nan"), float("inf"), float("-inf")  # the exact kernels
    tensors = [torch.randn(300, generator=g), *views]
    assert_records_of_torch(tensors)
    assert [count for _, count in native_reads] == [1, 2, 2, 1]


def test_without_a_c_compiler_the_other_kernels_serve_with_one_message(fresh_state, monkeypatch, caplog):
    monkeypatch.setattr(stats_native, "_compiler", lambda: None)
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        assert not stats_native.prepare()
        x = torch.randn(10_000)
        check(tensor_records([x], 1e-8, ALL)[0], x, 1e-8)
        assert not stats_native.ready()
    assert caplog.text.count("native statistic kernel is not available") == 1 and "no C compiler" in caplog.text


def test_a_library_on_disk_is_loaded_at_the_first_request(fresh_state, monkeypatch):
    """An earlier run's library: ready at once, without a build, so every record of the run comes from it."""
    monkeypatch.setattr(stats_native.subprocess, "run", lambda *a, **k: pytest.fail("built again"))
    assert stats_native.ready() and "thread" not in stats_native._state


def test_a_damaged_library_is_removed_and_refused(fresh_state, monkeypatch, tmp_path, caplog):
    damaged = tmp_path / "figures.so"
    damaged.write_bytes(b"\x7fELF cut short")
    monkeypatch.setattr(stats_native, "_library", lambda: damaged)
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        assert not stats_native.ready()
    assert not damaged.exists() and "not available" in caplog.text


def test_the_first_request_builds_it_before_answering(fresh_state, monkeypatch, tmp_path):
    """No library on disk: the first request builds it, and the first records come from it already, as every later
    one does: the records of a run do not depend on when a build finished."""
    from trainmon.engine import stats_fused
    monkeypatch.setattr(stats_native, "_library", lambda: tmp_path / "figures.so")   # none on disk yet
    monkeypatch.setattr(stats_fused, "usable", lambda *a, **k: pytest.fail("the generated kernel was asked for"))
    reads = []
    real = stats_native.read
    monkeypatch.setattr(stats_native, "read", lambda *a: reads.append(len(a[1])) or real(*a))
    x = torch.randn(1 << 20)
    check(tensor_records([x], 1e-8, ALL)[0], x, 1e-8)
    assert reads and (tmp_path / "figures.so").exists()


def test_under_a_dispatch_mode_the_ops_it_would_bypass_run_instead(monkeypatch):
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            return func(*args, **(kwargs or {}))
    monkeypatch.setattr(stats_native, "read", lambda *a: pytest.fail("the native kernel bypassed the mode"))
    x = torch.randn(20_000)
    with Seen() as mode:
        row = tensor_records([x], 1e-8, ALL)[0]
    check(row, x, 1e-8)
    assert mode.ops > 0


def test_cc_may_name_a_compiler_behind_a_wrapper(fresh_state, monkeypatch, tmp_path):
    """`CC="ccache gcc"` is common: the command is split as a shell would."""
    import shutil
    monkeypatch.setenv("CC", f"env {shutil.which('cc') or shutil.which('gcc')}")
    monkeypatch.setattr(stats_native, "_library", lambda: tmp_path / "figures.so")
    assert stats_native.prepare()
    assert (tmp_path / "figures.so").exists()
    x = torch.randn(5000)
    check(tensor_records([x], 1e-8, ALL)[0], x, 1e-8)


@pytest.mark.parametrize("headers", [True, False], ids=["extension", "ctypes"])
def test_one_tensor_is_read_alike_called_directly_or_through_ctypes(fresh_state, monkeypatch, tmp_path, headers):
    """Built with this Python's headers (on Linux), the library is also an extension module whose one-tensor read
    Python calls directly; built without them, it is called through ctypes. Both read a tensor as torch does, and
    refuse one holding a NaN."""
    import ctypes
    if not headers:
        monkeypatch.setattr(stats_native, "_flags", lambda: stats_native._FLAGS)
    extension = "-DTRAINMON_PY" in stats_native._flags()
    monkeypatch.setattr(stats_native, "_library", lambda: tmp_path / "figures.so")
    assert stats_native.prepare()
    for dtype in stats_native.DTYPES:
        one = stats_native.one(dtype)
        assert isinstance(one, ctypes._CFuncPtr) != extension
        x = torch.randn(10_000, dtype=dtype)
        out = np.empty(5)
        assert one(x.data_ptr(), x.numel(), x.numel(), x.numel(), 0.5, 1e300, out.ctypes.data) == 1
        np.testing.assert_allclose(out, float64_figures(x, 0.5), rtol=1e-5)
        x[77] = float("nan")
        assert one(x.data_ptr(), x.numel(), x.numel(), x.numel(), 0.5, 1e300, out.ctypes.data) == 0


@pytest.mark.parametrize("fault", ["headers that do not build", "a module Python does not load"])
def test_an_extension_module_that_fails_leaves_the_library_to_ctypes(fresh_state, monkeypatch, tmp_path, fault):
    """Python's headers found but unusable: the library is built again without the extension module's part; built,
    but refused by Python's loader: ctypes calls it. Either way the records are torch's."""
    import ctypes
    import importlib.machinery
    if fault == "headers that do not build":
        monkeypatch.setattr(stats_native, "_flags", lambda: [*stats_native._FLAGS, "-DTRAINMON_PY", f"-I{tmp_path}"])
    else:
        def refuse(loader, spec):
            raise ImportError("refused")
        monkeypatch.setattr(importlib.machinery.ExtensionFileLoader, "create_module", refuse)
    monkeypatch.setattr(stats_native, "_library", lambda: tmp_path / "figures.so")
    assert stats_native.prepare()
    assert isinstance(stats_native.one(torch.float32), ctypes._CFuncPtr)
    x = torch.randn(5000)
    check(tensor_records([x], 1e-8, ALL)[0], x, 1e-8)


@pytest.mark.parametrize("dtype", stats_native.DTYPES)
def test_records_on_arrival_equal_torchs(dtype):
    """Tensors read one call each as they arrive (contiguous, q/k/v views in runs, a transpose, 300 of them: more than
    the first figures buffer holds) have the records of torch's direct computation, in the order they were taken;
    the next `records` holds only those taken after."""
    n = paths.ON_ARRIVAL_MIN_ELEMENTS
    g = torch.Generator().manual_seed(4)
    projection = torch.randn(8, n // 64, 3, 64, generator=g).to(dtype)
    tensors = [projection[:, :, 0], projection[:, :, 2], projection.transpose(0, 1)]
    tensors += [(torch.randn(n + i, generator=g) * (i + 1)).to(dtype) for i in range(297)]
    arrivals = records_on_arrival(1e-3, ALL)
    assert [arrivals.take(t) for t in tensors] == list(range(300))
    for row, t in zip(arrivals.records(), tensors):
        check(row, t, 1e-3)
    assert arrivals.take(tensors[5]) == 0 and len(arrivals.records()) == 1


def test_a_tensor_is_taken_on_arrival_only_where_its_figures_are_its_whole_record():
    """Not taken: a NaN or an Inf anywhere (the exact kernels count them), an element at the saturation limit where
    `sat` is asked for, fewer than MIN_ELEMENTS elements, a 16-bit dtype, a view the kernel cannot read in place.
    Nothing is kept for them."""
    n = paths.ON_ARRIVAL_MIN_ELEMENTS
    with_sat = records_on_arrival(1e-3, fields_for_ops(["norm", "sat"], sat_threshold=10.0))
    without = records_on_arrival(1e-3, fields_for_ops(["norm"]))
    for bad in (float("nan"), float("inf"), -float("inf")):
        for at in (0, n // 2, n - 1):
            t = torch.randn(n)
            t[at] = bad
            assert with_sat.take(t) == without.take(t) == -1, (bad, at)
    loud = torch.randn(n)
    loud[9] = -10.0
    assert with_sat.take(loud) == -1 and without.take(loud) == 0
    wide = torch.randn(64, 2 * n)
    for t in (torch.randn(n - 1), torch.randn(n).bfloat16(), torch.randn(n).half(), wide[:, ::2]):
        assert with_sat.take(t) == -1, (t.dtype, t.shape)
    assert with_sat.take(torch.randn(n).double()) == 0
    assert with_sat.taken == 1 and without.taken == 1
