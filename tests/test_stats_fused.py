"""Tests of the one-pass statistic kernels (trainmon.engine.stats_fused and stat_kernels) against direct torch
computations."""
from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from test_stats import ALL, FIELDS, OpLog, cases, check, reference, sprinkle
from training import DEVICES
from trainmon.core import schema
from trainmon.core.records import RecordKey
from trainmon.engine import paths, stat_kernels, stats_fused, stats_native
from trainmon.hooks.collector import StepCollector
from trainmon.engine.buffers import merge_records
from trainmon.engine.paths import CHUNK_ELEMS, ONE_PASS_MIN
from trainmon.engine.stats import fields_for_ops, tensor_records

CPU = torch.device("cpu")
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
WIDE = [torch.float32, torch.float64]


@pytest.fixture(scope="module", autouse=True)
def compiled():
    """One compile per kernel and dtype for the whole module; every call of these tests takes the accelerators'
    path (`cpu_as_accelerator`): the one-pass record kernel, CPU fp32 and fp64 included, and one tensor's rows
    merged by the merge kernel, unless a test says otherwise. That the CPU kernels compiled is asserted by the
    CPU cases (`fused`), not here: where they fail to compile, the accelerator cases still run."""
    for wait in (False, True):                      # every kernel compiles at once
        stat_kernels.prepare(CPU, DTYPES, wait=wait)
        stat_kernels.prepare(CPU, WIDE, wait=wait, kernel="finite")
        stat_kernels.prepare(CPU, WIDE, wait=wait, kernel="merge")
    stats_fused.cpu_as_accelerator = True
    yield
    stats_fused.cpu_as_accelerator = False


@pytest.fixture
def assume_finite_kernel(monkeypatch):
    """CPU fp32/fp64 through stats_cpu's assume-finite path, as shipped; yields, per tensor its one-pass kernel
    read, the rows it read (a last partial row included)."""
    monkeypatch.setattr(stats_fused, "cpu_as_accelerator", False)
    monkeypatch.setattr(stats_native, "enabled", False)      # the path while the native kernel is not built
    read = []

    def finite_rows(flat, lam, run=stats_fused.finite_rows):
        blocks = run(flat, lam)
        read.append(sum(len(block) for block in blocks))
        return blocks
    monkeypatch.setattr(stats_fused, "finite_rows", finite_rows)
    yield read


@pytest.fixture
def no_compile(monkeypatch):
    """A compile in a child process fails the test (through the kernel's state, where it runs in a thread)."""
    def no_child(*args, **kwargs):
        raise AssertionError("a kernel was compiled again")
    monkeypatch.setattr(stat_kernels.subprocess, "run", no_child)


@pytest.fixture
def unknown_kernels(monkeypatch):
    """This process as a run's starts: no kernel known or loaded. One tensor's rows are merged by the engine's
    ops, as on CPU, so that no merge kernel compiles behind a test of the record kernel's compile; a compile
    the test started ends with it, not in the next test's kernel states."""
    for name in ("_state", "_threads", "_runners"):
        monkeypatch.setattr(stat_kernels, name, {})
    monkeypatch.setattr(stats_fused, "cpu_as_accelerator", False)
    yield
    for thread in list(stat_kernels._threads.values()):
        thread.join()


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch, unknown_kernels):
    """This process as a first run's starts: no kernel known, loaded or on disk."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))


@pytest.fixture
def fresh_process(unknown_kernels, no_compile):
    """This process as a later run's starts: no kernel known or loaded, and no compile allowed."""


def fused(tensors, eps, fields=ALL, device=CPU):
    assert stats_fused.usable(tensors, device)
    return tensor_records(tensors, eps, fields)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("eps", [1e-8, 1e-3, 0.5, 0.0])
def test_fused_records_match_torch(dtype, eps, device):
    device = torch.device(device)
    if device != CPU:                 # a GPU's kernel (Triton): compiled once, by the first such test
        assert stat_kernels.prepare(device, DTYPES, wait=True)
    cs = cases(dtype, device)         # NaN, ±Inf, empty, scalar, non-contiguous, expanded, subnormal
    rec = fused(list(cs.values()), eps, device=device)
    for row, x in zip(rec, cs.values()):
        check(row, x, eps)


@pytest.mark.parametrize("dtype", DTYPES[:3])
@pytest.mark.parametrize("numel", [1, 7, 1000, 4096, 8191, 10 ** 6])
def test_fused_sizes(dtype, numel):
    g = torch.Generator().manual_seed(numel)
    x = (torch.randn(numel, generator=g) * 3).to(dtype)
    if numel >= 7:
        sprinkle(x, seed=numel)
    y = x[::2] if numel > 1 else x.expand(3)     # non-contiguous
    rec = fused([x, y], 1e-3)
    check(rec[0], x, 1e-3)
    check(rec[1], y, 1e-3)


def test_fused_large_non_contiguous_is_read_in_chunks():
    x = sprinkle(torch.randn(2000, 700).to(torch.bfloat16)).t()
    assert x.numel() > 2 * stats_fused.ROW and not x.is_contiguous()
    check(fused([x], 1e-8)[0], x, 1e-8)


def test_fused_many_small_tensors_of_mixed_dtypes_in_one_call():
    g = torch.Generator().manual_seed(3)
    ts = [sprinkle((torch.randn(n, generator=g)).to(dtype), seed=n)
          for n in range(20, 400, 7) for dtype in DTYPES[:3]]
    ts += [torch.zeros(0), torch.tensor(float("nan")), torch.tensor(-float("inf")).half(), torch.randn(9000)]
    for row, x in zip(fused(ts, 1e-8), ts):
        check(row, x, 1e-8)


@pytest.mark.parametrize("numel", [7, 3 * stats_fused.ROW, 3 * stats_fused.ROW + 5, 2 ** 20])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_call_of_one_tensor_gives_its_record(dtype, numel):
    """A flush of one activation: its rows reduced as they are (whole rows only, or a padded batch), or
    combined by owner (whole rows and a last partial row)."""
    x = sprinkle((torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 3).to(dtype), seed=numel)
    check(fused([x], 1e-3)[0], x, 1e-3)
    check(fused([x[1:]], 1e-3)[0], x[1:], 1e-3)


def test_accelerators_spread_only_a_call_with_a_tensor_of_many_rows():
    """A combine spreads a tensor's rows over partial records against the atomics of thousands of rows; a
    call of small tensors (a batch of weight grads) is combined without, saving the spread's launches."""
    accelerator = torch.device("cuda")                # only its type is read
    assert stats_fused._spread(accelerator, stats_fused._SPREAD) == 1
    assert stats_fused._spread(accelerator, stats_fused._SPREAD + 1) == stats_fused._SPREAD
    assert stats_fused._spread(CPU, 10 ** 6) == 1


@pytest.mark.parametrize("spread", [2, 32])
def test_row_partials_spread_over_partial_records_combine_exactly(monkeypatch, spread):
    """The accelerators' combine (a tensor's row partials added into `spread` partial records, merged after),
    taken here on the CPU: long tensors of thousands of rows, their last partial rows, small tensors, mixed
    dtypes, NaN, ±Inf and empty ones."""
    spreads = []
    monkeypatch.setattr(stats_fused, "_spread", lambda device, most_rows: spreads.append(spread) or spread)
    g = torch.Generator().manual_seed(4)
    ts = [sprinkle((torch.randn(n, generator=g) * 3).to(dtype), seed=n)
          for n, dtype in ((3 * 10 ** 6, torch.bfloat16), (5 * stats_fused.ROW + 3, torch.float16),
                           (10 ** 6, torch.float32), (300, torch.bfloat16), (31 * stats_fused.ROW, torch.float64))]
    ts += [torch.zeros(0), torch.tensor(-float("inf")).half(), torch.full((9000,), float("nan"))]
    for row, x in zip(fused(ts, 1e-3), ts):
        check(row, x, 1e-3)
    assert spreads == [spread]


@pytest.mark.parametrize("ops", [["norm"], ["zeros"], ["min", "max"], ["mean", "nans"]])
def test_fused_fills_only_requested_fields(ops):
    fields = fields_for_ops(ops)
    cs = cases(torch.bfloat16)
    for row, x in zip(fused(list(cs.values()), 1e-8, fields), cs.values()):
        check(row, x, 1e-8, fields)


@pytest.mark.parametrize("device", DEVICES)
def test_the_unasked_fields_are_zeroed_by_the_host_the_writer_reads(device):
    """The one pass computes every field. A step's records leave the unasked ones to the host to zero (on an
    accelerator each records call would launch a kernel for it): the engine's rows still hold their figures,
    the step the writer reads holds 0 there, and the asked fields as torch computes them."""
    fields = fields_for_ops(["norm", "min", "max"])
    unasked = [FIELDS.index(f) for f in ("zeros", "sum", "sat")]
    assert set(unasked) <= set(schema.unasked_columns(fields))
    x = torch.randn(4096, device=device, dtype=torch.bfloat16) * 3
    assert stats_fused.usable([x], x.device)
    kept = tensor_records([x], 1e-8, fields, unasked_zeroed=False)
    x64 = x.double()
    assert abs(float(kept[0, FIELDS.index("sum")]) - float(x64.sum())) <= 1e-5 * float(x64.abs().sum())
    check(tensor_records([x], 1e-8, fields)[0].cpu(), x, 1e-8, fields)

    collector = StepCollector(1e-8, fields, rank=0, batch_bytes=1 << 30)
    collector.record([RecordKey("actv", "a", 0, 0, 0, (4096,), "bfloat16")], [x])
    collector.record([RecordKey("actv", "b", 0, 0, 0, (100,), "bfloat16")], [x[:100]], defer=True)
    batch = collector.finish_step().wait()
    assert (batch.values[:, unasked] == 0).all()
    for row, t in zip(batch.values, (x, x[:100])):
        check(torch.from_numpy(row.copy()), t, 1e-8, fields)


def test_fused_saturation_limit():
    x = torch.tensor([1.0, -300.0, 70000.0, float("inf"), 256.0, 255.9])
    fields = fields_for_ops(["sat"], sat_dtype=torch.float16)
    assert fused([x], 1e-8, fields)[0, FIELDS.index("sat")] == 1        # |x| >= fp16 max, finite
    fields = fields_for_ops(["sat"], sat_threshold=256.0)
    assert fused([x], 1e-8, fields)[0, FIELDS.index("sat")] == 3


def test_one_package_serves_every_call_without_tracing_or_compiling(no_compile):
    """Once loaded, a kernel serves every shape, stride, grad mode and call site, inference tensors included:
    no Dynamo trace and no compile in a child process, and every record equals torch's."""
    from torch._dynamo.utils import counters

    before, state = dict(counters["stats"]), dict(stat_kernels._state)
    w = torch.randn(300, 500, requires_grad=True)
    inputs = [[torch.randn(n).to(dtype)] for n in (1, 2, 3, 4096, 8192, 50_000) for dtype in DTYPES]
    inputs += [[w], [w.t()], [torch.randn(2, 3, 4)[:, 1]], [torch.randn(10_001)[1:]],
               list(cases(torch.float16).values())]
    for ts in inputs:
        for row, t in zip(fused(ts, 1e-8), ts):
            check(row, t, 1e-8)
    with torch.inference_mode():
        ts = [w * 2, torch.randn(5000).bfloat16()]
        for row, t in zip(fused(ts, 1e-8), ts):
            check(row, t, 1e-8)
    assert dict(counters["stats"]) == before and stat_kernels._state == state


def test_a_kernel_never_reads_strided_rows():
    """The compiled code reads its input's memory as contiguous rows: a strided view is refused, not misread."""
    rows = torch.randn(4096, 3, generator=torch.Generator().manual_seed(1)).t()
    with pytest.raises(ValueError, match="contiguous"):
        stat_kernels.run("finite", rows, 1e-8)
    # the same figures up to fp32 summation order
    torch.testing.assert_close(stat_kernels.run("finite", rows.contiguous(), 1e-8),
                               stat_kernels._finite_row_figures(rows, 1e-8), rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("shape", [(1, 1), (1, 7), (3, 1), (5, 4096)])
def test_kernels_take_every_shape(shape):
    """Rows and columns of 1 included (a trace would have specialised them)."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    x.view(-1)[0] = float("nan") if x.numel() > 1 else 1.5
    # the same figures as the eager ops, up to fp32 summation order
    torch.testing.assert_close(stat_kernels.run("record", x.bfloat16(), 1e-8, 2.0),
                               stat_kernels._row_figures(x.bfloat16(), 1e-8, 2.0), equal_nan=True, rtol=1e-5, atol=1e-3)
    finite = x.nan_to_num()
    torch.testing.assert_close(stat_kernels.run("finite", finite, 1e-8), stat_kernels._finite_row_figures(finite, 1e-8),
                               rtol=1e-5, atol=1e-3)


def test_a_package_on_disk_is_loaded_not_compiled_again(fresh_process):
    """A later process finds the compiled package and loads it at the first request, so every record of the
    run comes from the one-pass kernel; no child process runs, and no background thread."""
    assert stat_kernels.prepare(CPU, [torch.bfloat16])
    assert stat_kernels._threads == {}
    x = sprinkle(torch.randn(9000).bfloat16())
    check(fused([x], 1e-3)[0], x, 1e-3)


def test_cpu_takes_the_one_pass_record_kernel_for_16_bit_tensors_only():
    stats_fused.cpu_as_accelerator = False
    try:
        assert not stats_fused.usable([torch.randn(1 << 20)], CPU)
        assert not stats_fused.usable([torch.randn(1 << 20).double(), torch.randn(9).bfloat16()], CPU)
        assert stats_fused.usable([torch.randn(1000).bfloat16()], CPU)
        assert stats_fused.usable([torch.randn(1 << 20)], CPU, kernel="finite")
    finally:
        stats_fused.cpu_as_accelerator = True
    assert not stats_fused.usable([torch.empty(5, device="meta")], torch.device("meta"))
    with OpLog():                                    # the compiled code would bypass the dispatch mode
        assert not stats_fused.usable([torch.randn(5)], CPU)


@pytest.mark.parametrize("dtype", WIDE)
@pytest.mark.parametrize("eps", [1e-8, 0.5, 0.0])
def test_assume_finite_kernel_records_match_torch(assume_finite_kernel, dtype, eps):
    """CPU fp32/fp64: whole rows and the last partial row through the assume-finite one-pass kernel, small
    tensors through the chunk passes, tensors holding a NaN or an Inf through the exact kernels; each record
    equals torch's."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1 << 20, generator=g).to(dtype)
    x[:5000] = 0
    tensors = [x, torch.randn(ONE_PASS_MIN + 777, generator=g).to(dtype),              # a tail
               torch.randn(700, 400, generator=g).to(dtype).t(),                      # non-contiguous, copied
               sprinkle(torch.randn(ONE_PASS_MIN, generator=g).to(dtype)),            # NaN and ±Inf
               torch.randn(ONE_PASS_MIN - 1, generator=g).to(dtype),                  # chunk passes
               torch.randn(100, generator=g).to(dtype), *cases(dtype).values()]
    rec = tensor_records(tensors, eps, ALL)
    rows = ONE_PASS_MIN // stats_fused.ROW
    assert sorted(assume_finite_kernel) == [rows, rows + 1, 69, 256]
    for row, t in zip(rec, tensors):
        check(row, t, eps)


def test_cpu_call_shares_its_tensors_between_the_kernels(assume_finite_kernel, monkeypatch):
    """One call of CPU tensors as shipped: 16-bit ones through the record kernel (small ones copied into
    one batch, a non-contiguous one and one holding NaN and ±Inf among them), large fp32 ones through the
    assume-finite kernel, the other fp32 ones through the multi-pass kernels; every record equals torch's,
    in the caller's order."""
    batches = []

    def run(kernel, x, *consts, real=stat_kernels.run):
        batches.append((kernel, x.dtype, x.shape[0]))
        return real(kernel, x, *consts)
    monkeypatch.setattr(stat_kernels, "run", run)
    g = torch.Generator().manual_seed(9)
    big, row = paths.GATHER_BELOW, stats_fused.ROW
    bf16 = [torch.randn(300, 100, generator=g).bfloat16().t(), sprinkle(torch.randn(5000, generator=g).bfloat16()),
            torch.randn(7, generator=g).bfloat16(), torch.randn(big, generator=g).bfloat16()]
    fp32 = [torch.randn(ONE_PASS_MIN, generator=g), torch.randn(9000, generator=g), torch.randn(7, generator=g),
            sprinkle(torch.randn(ONE_PASS_MIN, generator=g)), torch.zeros(0)]
    tensors = [t for pair in zip(fp32, bf16 + [torch.zeros(0).half()]) for t in pair]
    rec = tensor_records(tensors, 1e-3, ALL)
    for row_, t in zip(rec, tensors):
        check(row_, t, 1e-3)
    assert sorted(batches, key=str) == sorted([
        ("finite", torch.float32, 2 * ONE_PASS_MIN // row),           # whole rows only: one shared call
        ("finite", torch.float32, 9000 // row), ("finite", torch.float32, 1),   # 9000: whole rows, then the rest
        ("record", torch.bfloat16, big // row),                       # large: its own call, no copy
        ("record", torch.bfloat16, 8 + 2 + 1)], key=str)              # small ones: one batch, row-aligned


def test_whole_row_tensors_share_the_assume_finite_kernels_calls(assume_finite_kernel, monkeypatch):
    """CPU fp32 tensors of whole rows, each no larger than the scratch buffer, are copied one after the other
    (strided ones too) and read in shared calls, a new one where the buffer is full; a larger tensor is read in
    place. Every record equals torch's, in the caller's order, those holding a NaN or an Inf included."""
    calls = []

    def run(kernel, x, *consts, real=stat_kernels.run):
        calls.append(x.shape[0])
        return real(kernel, x, *consts)
    monkeypatch.setattr(stat_kernels, "run", run)
    g = torch.Generator().manual_seed(11)
    row, per_call = stats_fused.ROW, CHUNK_ELEMS["cpu"] // stats_fused.ROW
    tensors = []
    for i in range(40):
        rows = 2 + i % 7
        t = torch.randn(rows * row, generator=g) if i % 3 else torch.randn(64, rows * row // 64, generator=g).t()
        tensors.append(sprinkle(t, seed=i) if i % 11 == 5 and i % 3 else t)
    tensors.insert(7, torch.randn(1 << 20, generator=g))
    for row_, t in zip(tensor_records(tensors, 1e-3, ALL), tensors):
        check(row_, t, 1e-3)
    gathered = sum(t.numel() for t in tensors) // row - 256
    assert calls[0] == 256 and sum(calls[1:]) == gathered                 # the large one first, in place
    assert len(calls) == 1 + -(-gathered // per_call) and max(calls[1:]) <= per_call
    calls.clear()
    tensor_records([tensors[7], torch.randn(5000, generator=g)], 1e-3, ALL)   # none to share: no empty call
    assert calls == [256]


def test_failing_kernels_are_retired_and_the_records_stay_right(monkeypatch, caplog):
    """Both generated kernels raising at run time: each is retired for its dtype with one message, and every
    record still equals torch's."""
    monkeypatch.setattr(stats_fused, "cpu_as_accelerator", False)
    monkeypatch.setattr(stat_kernels, "_state", dict(stat_kernels._state))
    monkeypatch.setattr(stats_native, "enabled", False)

    def run(kernel, x, *consts):
        raise RuntimeError(f"{kernel} kernel broke")
    monkeypatch.setattr(stat_kernels, "run", run)
    g = torch.Generator().manual_seed(4)
    tensors = [sprinkle(torch.randn(ONE_PASS_MIN + 5, generator=g)), torch.randn(ONE_PASS_MIN, generator=g),
               sprinkle(torch.randn(5000, generator=g).bfloat16())]
    for _ in range(2):
        for row, t in zip(tensor_records(tensors, 1e-3, ALL), tensors):
            check(row, t, 1e-3)
    assert stat_kernels._state[("finite", "cpu", torch.float32)] == "failed"
    assert stat_kernels._state[("record", "cpu", torch.bfloat16)] == "failed"
    assert caplog.text.count("finite kernel broke") == 1 and caplog.text.count("record kernel broke") == 1


@pytest.mark.parametrize("ops", [["norm"], ["zeros"], ["min", "max"], ["mean", "nans"]])
def test_assume_finite_kernel_fills_only_requested_fields(assume_finite_kernel, ops):
    fields = fields_for_ops(ops)
    x = torch.randn(ONE_PASS_MIN, generator=torch.Generator().manual_seed(6))
    check(tensor_records([x], 1e-3, fields)[0], x, 1e-3, fields)
    assert assume_finite_kernel == [ONE_PASS_MIN // stats_fused.ROW]


def test_a_damaged_package_is_refused_once_and_removed(tmp_path, monkeypatch, caplog, fresh_process):
    """A package that cannot be loaded (here: cut short) leaves the multi-pass kernels serving, with one
    message, and is deleted, so that the next run compiles it again."""
    key = ("record", "cpu", torch.bfloat16)
    compiled = stat_kernels._package(key)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    package = stat_kernels._package(key)
    package.parent.mkdir()
    package.write_bytes(compiled.read_bytes()[:5000])
    assert not stat_kernels.prepare(CPU, [torch.bfloat16], wait=True)
    assert not package.exists() and caplog.text.count("one-pass statistic kernel is not available") == 1
    x = sprinkle(torch.randn(9000).bfloat16())
    check(tensor_records([x], 1e-3, ALL)[0], x, 1e-3)


@contextlib.contextmanager
def another_rank_compiling(tmp_path, monkeypatch):
    """A fresh cache where another rank is compiling the bf16 record kernel (it holds the lock beside the
    package) until the block ends; yields the landing of that rank's package (this module's fixture's)."""
    fcntl = pytest.importorskip("fcntl")
    key = ("record", "cpu", torch.bfloat16)
    compiled = stat_kernels._package(key)            # by this module's fixture, in the default cache
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    package = stat_kernels._package(key)
    package.parent.mkdir()
    with open(package.with_name(package.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield lambda: shutil.copyfile(compiled, package)


def test_ranks_that_start_together_compile_a_package_once(tmp_path, monkeypatch, fresh_process):
    """While one process compiles a package (it holds the lock beside it), another that needs the same kernel
    waits, then loads that package instead of compiling its own."""
    with another_rank_compiling(tmp_path, monkeypatch) as land:
        assert not stat_kernels.prepare(CPU, [torch.bfloat16])
        time.sleep(0.5)
        assert stat_kernels._state[("record", "cpu", torch.bfloat16)] == "warming"
        land()                                      # its package lands; its lock goes with the block's end
    assert stat_kernels.prepare(CPU, [torch.bfloat16], wait=True)
    x = sprinkle(torch.randn(9000).bfloat16())
    check(fused([x], 1e-3)[0], x, 1e-3)


CRASH = "import os, signal, warnings; warnings.warn('deprecated'); os.kill(os.getpid(), signal.SIGSEGV)"
ERROR = "import warnings; warnings.warn('deprecated'); raise ValueError('no CUDA toolkit')"


@pytest.mark.parametrize("code,told", [
    (CRASH, "the compile process was ended by SIGSEGV"),
    (ERROR, "the compile process exited with status 1: ValueError: no CUDA toolkit")], ids=["crash", "error"])
def test_a_compile_process_that_crashes_or_fails_publishes_nothing_and_says_why(tmp_path, monkeypatch, caplog,
                                                                                fresh_cache, code, told):
    """The compile's child ends by a signal after a warning (its last line of output a warning's source line),
    or with an error: the kernel is refused with a message naming the signal or the error, no package or
    partial file is left, and the records come from the other kernels."""
    monkeypatch.setattr(stat_kernels, "_child_command", lambda *args: [sys.executable, "-c", code])
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        assert not stat_kernels.prepare(CPU, [torch.bfloat16], wait=True)
    assert caplog.text.count("one-pass statistic kernel is not available") == 1
    assert f"RuntimeError: {told}" in caplog.text
    assert [p.name for p in (tmp_path / "trainmon").iterdir()] == \
        [stat_kernels._package(("record", "cpu", torch.bfloat16)).name + ".lock"]
    x = sprinkle(torch.randn(9000).bfloat16())
    check(tensor_records([x], 1e-3, ALL)[0], x, 1e-3)


def test_settle_waits_no_longer_than_told_and_says_which_kernels_serve(tmp_path, monkeypatch, fresh_process):
    """A compile that outlasts `settle`'s timeout is left running and reported "warming"; once its package
    lands, `settle` reports it "warm": compiled for later runs, not loaded into this one, which asked for it
    without waiting."""
    with another_rank_compiling(tmp_path, monkeypatch) as land:
        assert not stat_kernels.prepare(CPU, [torch.bfloat16])
        start = time.monotonic()
        assert stat_kernels.settle(timeout=0.3) == {"record/cpu/bfloat16": "warming"}
        assert 0.3 <= time.monotonic() - start < 5
        land()
    assert stat_kernels.settle() == {"record/cpu/bfloat16": "warm"}
    assert not stat_kernels.prepare(CPU, [torch.bfloat16])


def test_a_run_keeps_the_kernel_its_first_request_found(tmp_path, monkeypatch, fresh_process):
    """A kernel compiled while the run goes on serves later runs only: every record of this run comes from the
    kernels its first request found, so its figures do not change bits halfway (a rerun finds the package on disk
    and uses it from its first step)."""
    x = sprinkle(torch.randn(3 * paths.GATHER_BELOW + 5).bfloat16())
    with another_rank_compiling(tmp_path, monkeypatch) as land:
        first = tensor_records([x], 1e-3, ALL)
        land()
    stat_kernels.settle()
    assert torch.equal(tensor_records([x], 1e-3, ALL), first)
    check(first[0], x, 1e-3)


@pytest.mark.slow  # compiles in a child process
def test_the_accelerators_artifact_gives_the_records_of_every_shape(tmp_path, monkeypatch, fresh_cache):
    """The accelerators' format, inductor's standalone artifact, compiled here for the CPU: compiled in the
    child, published, loaded by the training thread, and its records those of torch, from a batch of one row
    to a tensor of many rows with a partial last one."""
    monkeypatch.setattr(stat_kernels, "_suffix", lambda place: stat_kernels._ARTIFACT)
    monkeypatch.setattr(stats_fused, "cpu_as_accelerator", True)
    assert stat_kernels.prepare(CPU, [torch.bfloat16], wait=True)
    assert stat_kernels.prepare(CPU, [torch.float32], wait=True, kernel="merge")
    assert [p.suffix for p in (tmp_path / "trainmon").iterdir() if not p.name.endswith(".lock")] == [".bin"] * 2
    cs = cases(torch.bfloat16)
    cs["rows"] = sprinkle(torch.randn(3 * paths.GATHER_BELOW + 5).bfloat16())
    one_row = {"one": torch.randn(5).bfloat16()}
    whole_rows = {"long": sprinkle(torch.randn(3 * paths.GATHER_BELOW).bfloat16())}   # the merge kernel's
    for tensors in (cs, one_row, whole_rows):
        for row, x in zip(fused(list(tensors.values()), 1e-3), tensors.values()):
            check(row, x, 1e-3)


@pytest.mark.parametrize("dtype", WIDE)
@pytest.mark.parametrize("rows", [1, 3, 5000])
def test_the_merge_kernel_merges_row_partials_as_merge_records(dtype, rows):
    """Row partials as the record kernel gives them (rows of no finite element among them: the identity's
    ±Inf extremes), merged by the compiled kernel and by the engine's ops."""
    assert stat_kernels.prepare(CPU, [dtype], kernel="merge")
    x = torch.randn(rows * stat_kernels.ROW, generator=torch.Generator().manual_seed(rows)).to(dtype) * 1e3
    x[: stat_kernels.ROW] = math.inf                # the first row: no finite element
    partials = stat_kernels.run("record", x.view(rows, -1), 1e-3, 1e4)
    merged = stat_kernels.run("merge", partials)
    assert merged.dtype == torch.float64 and merged.shape == (len(FIELDS),)
    torch.testing.assert_close(merged, merge_records(partials), rtol=1e-12, atol=0)


def test_one_tensors_rows_are_merged_by_the_merge_kernel(monkeypatch):
    """A call of one tensor (a flush of one activation) takes the record kernel and then the merge kernel: two
    kernel calls, where the engine's ops launch six on an accelerator; its record is torch's."""
    calls = []

    def run(kernel, *args, run=stat_kernels.run, **kwargs):
        calls.append(kernel)
        return run(kernel, *args, **kwargs)
    monkeypatch.setattr(stat_kernels, "run", run)
    x = sprinkle(torch.randn(4 * paths.GATHER_BELOW).bfloat16())
    check(fused([x], 1e-3)[0], x, 1e-3)
    assert calls == ["record", "merge"]
    calls.clear()
    stats_fused.cpu_as_accelerator = False          # CPU: the engine's ops, which launch nothing there
    try:
        check(fused([x], 1e-3)[0], x, 1e-3)
    finally:
        stats_fused.cpu_as_accelerator = True
    assert calls == ["record"]


@pytest.mark.parametrize("sizes", [(4, 4), (4, 1, 2), (4, None, 3), (1,) * 8, (1,) * 9],
                         ids=["two", "three", "bf16-fp32-bf16", "eight", "nine"])
def test_a_few_large_tensors_rows_are_merged_each_by_the_merge_kernel(monkeypatch, sizes):
    """A call of a few tensors of whole rows (a hook call in a compiled graph: its inputs and outputs) merges
    each tensor's rows by the merge kernel, where the combine launches about twenty kernels; from nine tensors
    on, the combine. The records are torch's, an fp32 tensor in its own (padded) batch among bf16 ones
    included (None: 1,000 fp32 elements)."""
    calls = []

    def run(kernel, *args, run=stat_kernels.run, **kwargs):
        calls.append(kernel)
        return run(kernel, *args, **kwargs)
    monkeypatch.setattr(stat_kernels, "run", run)
    xs = [sprinkle(torch.randn(1000)) if k is None else sprinkle(torch.randn(k * paths.GATHER_BELOW).bfloat16())
          for k in sizes]
    for row, x in zip(fused(xs, 1e-3), xs):
        check(row, x, 1e-3)
    merged_each = len(xs) <= stats_fused.MERGED_EACH_UP_TO
    assert calls == ["record"] * len(xs) + (["merge"] * len(xs) if merged_each else [])


@pytest.mark.slow  # compiles in a child process
def test_without_a_compiler_the_multi_pass_kernels_serve(tmp_path):
    """A machine without a working C++ compiler: the compile fails once, in the background, with one
    message, and the records are still right."""
    code = ("import torch, math\n"
            "from trainmon.engine import stat_kernels, stats\n"
            "x = torch.tensor([1.0, math.nan, -math.inf, 0.0]).bfloat16()\n"
            "assert not stat_kernels.prepare('cpu', [torch.bfloat16], wait=True)\n"
            "rec = stats.tensor_records([x], 1e-8, frozenset(stats.FIELDS))[0].tolist()\n"
            "print(rec[:4])\n")
    env = dict(os.environ, CXX=str(tmp_path / "no-compiler"), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache"),
               PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[2.0, 1.0, 1.0, 1.0]"
    assert out.stderr.count("one-pass statistic kernel is not available") == 1


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_1e8_elements(dtype):
    x = (torch.randn(10 ** 8, generator=torch.Generator().manual_seed(7)) * 2).to(dtype)
    sprinkle(x, seed=8)
    rec = fused([x], 1e-3)[0]
    # the torch reference, computed in float64 over chunks and merged exactly (counts, sums, extremes)
    refs = [reference(c, 1e-3) for c in x.split(10 ** 7)]
    want = merge_records(torch.tensor([[r[f] for f in FIELDS] for r in refs], dtype=torch.float64))
    exact = [FIELDS.index(f) for f in ("count", "nans", "infs", "zeros", "min", "max", "sat", "pinfs")]
    assert rec[exact].tolist() == want[exact].tolist()
    abssum = sum(r["abssum"] for r in refs)
    assert abs(float(rec[4] - want[4])) <= 1e-5 * abssum
    torch.testing.assert_close(rec[5], want[5], rtol=1e-5, atol=0)


@pytest.mark.slow  # compiles in a child process
def test_compiling_never_disturbs_the_training_loops_random_draws(tmp_path):
    """The compile runs while training draws random numbers (dropout, sampling); Dynamo saves and restores
    the RNG state around a compile, which must not rewind those draws. (An empty cache: a package on disk
    would be loaded at the first request, with no compile.)"""
    code = ("import time, torch\n"
            "from trainmon.engine import stat_kernels, stats, stats_fused\n"
            "x = torch.randn(5000).bfloat16()\n"
            "torch.manual_seed(0)\n"
            "draws, deadline = [], time.time() + 280\n"
            "while stat_kernels._state.get(('record', 'cpu', torch.bfloat16)) != 'warm' and time.time() < deadline:\n"
            "    stats.tensor_records([x], 1e-8, frozenset(stats.FIELDS))\n"
            "    draws.append(torch.rand(64))\n"
            "    time.sleep(0.02)\n"
            "assert stat_kernels.prepare(torch.device('cpu'), [torch.bfloat16], wait=True), stat_kernels._state\n"
            "stats.tensor_records([x], 1e-8, frozenset(stats.FIELDS))\n"
            "draws.append(torch.rand(64))\n"
            "torch.manual_seed(0)\n"
            "assert all(torch.equal(d, torch.rand(64)) for d in draws)\n"
            "print(len(draws))\n")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]), TORCHINDUCTOR_CACHE_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) > 3                       # the loop drew while the kernel compiled
