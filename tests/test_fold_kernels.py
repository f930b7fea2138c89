"""The accelerators' record kernels (Triton) against a float64 reference, run on the CPU by Triton's interpreter, and
on a GPU where there is one: every field, every dtype, non-finite values, odd layouts, folds that merge."""
from __future__ import annotations

import math

import pytest
import torch

from reference import reference_record
from trainmon.core import schema
from trainmon.engine import fold_kernels, folding, stats

triton = pytest.importorskip("triton")

FIELDS = stats.fields_for_ops(schema.OPS)
EPS = 1e-3
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


@pytest.fixture(params=["cpu", "cuda"])
def device(request):
    """The device the kernels run on: the CPU under Triton's interpreter (conftest.py turns it on where there is no
    GPU), or the GPU."""
    device = torch.device(request.param)
    if not folding.triton_reads(device) or (device.type == "cuda" and not torch.cuda.is_available()):
        pytest.skip(f"Triton does not run on {device.type} here")
    return device


def _folder(device) -> folding.TritonFolder:
    assert folding.triton_reads(device)
    return folding.TritonFolder(device, EPS, FIELDS)


def _empty_table(rows: int, device) -> torch.Tensor:
    return torch.tensor(schema.IDENTITY, dtype=torch.float64, device=device).repeat(rows, 1)


def _assert_record(row: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """`row` is the merged record of `tensors`, field by field, against the float64 reference."""
    expected = reference_record(tensors, EPS, FIELDS)
    got = dict(zip(schema.FIELDS, row.cpu().tolist()))
    for field in schema.FIELDS:
        want = expected[field]
        if field in ("sum", "sumsq"):               # fp32 partials of blocks, added in float64
            assert got[field] == pytest.approx(want, rel=1e-5, abs=1e-5 * math.sqrt(max(expected["sumsq"], 1))), field
        else:
            assert got[field] == want, (field, got, expected)


def _sample(n: int, dtype: torch.dtype, device, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=generator, dtype=torch.float64) * 3
    x[::7] = 0.0                                    # zeros (|x| < eps)
    x[::11] *= 1e-4                                 # near the eps threshold
    if n > 20:
        x[3], x[10], x[17] = math.nan, math.inf, -math.inf
    return x.to(dtype).to(device)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 5, 2047, 2048, 2049, 70_001])
def test_one_tensor_equals_the_float64_reference(device, dtype, n):
    table = _empty_table(3, device)
    x = _sample(n, dtype, device)
    _folder(device).fold(table, [1], [x])
    _assert_record(table[1], [x])
    assert torch.equal(table[[0, 2]], _empty_table(2, device))   # other rows untouched


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_layouts_non_contiguous_expanded_scalar_empty(device, dtype):
    base = _sample(6 * 50 * 8, dtype, device).view(6, 50, 8)
    cases = {
        "transposed": base.transpose(0, 2),
        "sliced": base[:, ::3, 1:7],
        "expanded": base[:, :1, :].expand(6, 9, 8),
        "scalar": base[2, 3, 4],
        "empty": base[:, :0],
        "five dimensions": base.view(2, 3, 5, 10, 8).permute(4, 3, 2, 1, 0),
    }
    table = _empty_table(len(cases), device)
    folder = _folder(device)
    for slot, tensor in enumerate(cases.values()):
        folder.fold(table, [slot], [tensor])
    for slot, (name, tensor) in enumerate(cases.items()):
        _assert_record(table[slot], [tensor])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_many_tensors_in_one_launch_each_into_its_row(device, dtype):
    tensors = [_sample(n, dtype, device, seed) for seed, n in enumerate([1, 4096, 9_000, 17, 0, 2048 * 64 + 3])]
    table = _empty_table(len(tensors) + 1, device)
    slots = [5, 0, 2, 1, 4, 3]
    _folder(device).fold(table, slots, tensors)
    for slot, tensor in zip(slots, tensors):
        _assert_record(table[slot], [tensor])
    _assert_record(table[6], [])


def test_folds_merge_into_a_row_as_the_records_merge(device):
    """A row folded several times in a step (micro-batches, a tensor read in pieces, a row merged into another)
    holds the merge of the separate records."""
    folder = _folder(device)
    parts = [_sample(n, torch.bfloat16, device, seed) for seed, n in enumerate([5000, 1, 70_000])]
    table = _empty_table(3, device)
    for part in parts:
        folder.fold(table, [0], [part])
    folder.fold(table, [1, 1], parts[:2])
    folder.merge_row(table, 0, 2)
    _assert_record(table[0], parts)
    _assert_record(table[1], parts[:2])
    assert torch.equal(table[2], table[0])


def test_the_same_tensor_gives_the_same_bits_every_time(device):
    """The last program of a launch reduces the partial records in a fixed order: no float atomics decide."""
    folder = _folder(device)
    x = _sample(70_001, torch.float32, device)
    rows = []
    for _ in range(3):
        table = _empty_table(1, device)
        folder.fold(table, [0], [x])
        rows.append(table[0].cpu())
    assert all(torch.equal(rows[0], row) for row in rows[1:])


def test_the_flag_off_folds_nothing(device):
    folder = _folder(device)
    table = _empty_table(2, device)
    folder.flag.zero_()
    folder.fold(table, [0], [_sample(100, torch.float32, device)])
    folder.fold(table, [0, 1], [_sample(100, torch.float32, device), _sample(9, torch.float32, device)])
    assert torch.equal(table, _empty_table(2, device))


@pytest.mark.slow
def test_a_hundred_million_elements(device, monkeypatch):
    if device.type == "cpu":  # the interpreter runs one block at a time in numpy: the same loop, 100 blocks, not 49,000
        monkeypatch.setattr(fold_kernels, "BLOCK", 1 << 20)
    x = torch.randn(100_000_000, dtype=torch.bfloat16, device=device)
    x[12_345_678] = math.nan
    table = _empty_table(1, device)
    _folder(device).fold(table, [0], [x])
    _assert_record(table[0], [x])


def test_records_outside_a_step_come_from_the_same_kernels(device, monkeypatch):
    """Parameter pieces, checkpoints and digests on an accelerator are read by the Triton kernels too, one launch per
    dtype, each tensor into its own fresh row; the fields not asked for are 0."""
    from trainmon.engine import records, stats_fused

    monkeypatch.setattr(stats_fused, "cpu_as_accelerator", True)
    fields = stats.fields_for_ops(["norm", "nans"])
    tensors = [_sample(n, dtype, device, n) for n, dtype in [(3000, torch.bfloat16), (5, torch.float32),
                                                            (70, torch.bfloat16)]]
    launches = []
    real = folding.TritonFolder.fold
    monkeypatch.setattr(folding.TritonFolder, "fold", lambda self, *a: launches.append(len(a[1])) or real(self, *a))
    rows = records.tensor_records(tensors, EPS, fields)
    assert launches == [3]
    for row, tensor in zip(rows, tensors):
        expected = reference_record([tensor], EPS, fields)
        assert row[schema.INDEX["count"]] == expected["count"] and row[schema.INDEX["nans"]] == expected["nans"]
        assert float(row[schema.INDEX["sumsq"]]) == pytest.approx(expected["sumsq"], rel=1e-5)
        assert row[schema.INDEX["min"]] == 0 and row[schema.INDEX["zeros"]] == 0   # not asked for
