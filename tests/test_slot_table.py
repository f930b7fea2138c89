"""The accelerators' path, run on CPU tensors (`cpu_as_accelerator`): every record folded into its key's row of a
slot table as it is recorded, one copy of the table a step. Its records equal the CPU path's, whichever folder
fills the rows (Triton's kernels, under the interpreter where there is no GPU, or the torch kernels)."""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from training import make_model, run_steps
from trainmon import TrainerMon
from trainmon.core import schema
from trainmon.core.records import ACTV, record_key
from trainmon.hooks import collector as collector_module
from trainmon.engine import buffers, folding, stats, stats_fused
from trainmon.hooks.collector import StepCollector
from trainmon.read import open_run

EVERY_FAMILY = {"xy_distribution": True, "all_xy": True, "wg_distribution": True, "mv_distribution": True,
                "param_distribution": True, "ops": ["min", "max", "norm", "zeros", "nans", "infs", "mean"],
                "format": ["db"]}
FIELDS = stats.fields_for_ops(schema.OPS)


@pytest.fixture(params=["triton", "torch"])
def accelerator_path(request, monkeypatch):
    """CPU tensors take the accelerators' path, folded by Triton's kernels (where Triton runs on the CPU here: under
    its interpreter) or by the torch kernels."""
    if request.param == "triton" and not folding.triton_reads(torch.device("cpu")):
        pytest.skip("Triton's interpreter is not available here")
    if request.param == "torch":
        monkeypatch.setattr(folding, "triton_reads", lambda device: False)
    monkeypatch.setattr(stats_fused, "cpu_as_accelerator", True)
    return request.param


def _records(output_dir, write_config, steps: int = 2, grad_acc_steps: int = 2):
    model = make_model(layers=2, hidden=32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    monitor = TrainerMon(write_config(**EVERY_FAMILY)).set_monitor(model, optimizer=optimizer,
                                                                  grad_acc_steps=grad_acc_steps)
    run_steps(model, optimizer, steps, grad_acc_steps=grad_acc_steps)
    monitor.stop()
    with open_run(monitor.output_dir.parent) as run:
        records = run.records()
    order = ["step", "family", "name", "micro_step", "call_index"]
    return records.sort_values(order).reset_index(drop=True), order


@pytest.mark.parametrize("accelerator_path", ["torch", pytest.param("triton", marks=pytest.mark.slow)],
                         indirect=True)  # the interpreter takes about 30 ms a launch
def test_the_accelerators_path_records_what_the_cpu_path_records(output_dir, write_config, accelerator_path,
                                                                 monkeypatch, tmp_path):
    slotted, order = _records(output_dir, write_config)
    monkeypatch.setattr(stats_fused, "cpu_as_accelerator", False)
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "cpu_path"))
    plain, _ = _records(output_dir, write_config)
    assert len(slotted) > 300 and set(slotted.family) == set(plain.family)
    assert slotted[order].fillna(-1).equals(plain[order].fillna(-1))
    # fp32 sums of the same elements in another order differ by a few units of the magnitudes added: sum(|x|)
    scale = np.sqrt(plain.raw_sumsq.to_numpy() * plain.raw_count.to_numpy())
    for field in schema.FIELDS:
        got, want = slotted[f"raw_{field}"].to_numpy(), plain[f"raw_{field}"].to_numpy()
        if field in ("sum", "sumsq"):
            assert np.all(np.abs(got - want) <= 1e-6 * (scale if field == "sum" else np.abs(want))), field
        elif field != "sat":  # not asked for: not stored
            np.testing.assert_array_equal(got, want, err_msg=field)


def _collector() -> StepCollector:
    return StepCollector(1e-3, FIELDS, rank=0)


def _key(name: str, index: int, t: torch.Tensor):
    return record_key(ACTV, name, 0, 0, index, t.shape, t.dtype)


def _values(batch) -> dict:
    batch.wait()
    return {key.name: dict(zip(schema.FIELDS, row)) for key, row in zip(batch.keys, batch.values.tolist())}


def test_a_tensor_changed_in_place_after_its_hook_keeps_its_values_at_the_hook(accelerator_path):
    collector = _collector()
    x = torch.arange(1.0, 9.0)
    collector.record([_key("a.output", 0, x)], [x], defer=True)
    x.mul_(100)
    collector.record([_key("b.output", 1, x)], [x], defer=True)
    values = _values(collector.finish_step())
    assert values["a.output"]["max"] == 8.0 and values["b.output"]["max"] == 800.0


def test_a_tensor_recorded_again_is_read_once_and_its_row_merged(accelerator_path, monkeypatch):
    collector = _collector()
    x = torch.randn(100)
    collector.record([_key("a.output", 0, x)], [x], defer=True)
    table = collector._table
    read = []
    monkeypatch.setattr(table, "fold", lambda slots, tensors: read.append(len(tensors)))
    collector.record([_key("b.input", 1, x)], [x], defer=True)
    assert read == []
    values = _values(collector.finish_step())
    assert values["a.output"] == values["b.input"]
    assert values["a.output"]["count"] == 100 and values["a.output"]["sumsq"] == pytest.approx(float(x.square().sum()))


def _record_of(*tensors) -> dict:
    """The record of `tensors` read together, by the CPU path."""
    collector = StepCollector(1e-3, FIELDS, rank=0)
    joined = torch.cat([t.reshape(-1) for t in tensors])
    collector.record([_key("all", 0, joined)], [joined])
    return _values(collector.finish_step())["all"]


def test_merged_rows_launch_nothing_during_the_step(accelerator_path, monkeypatch):
    collector = _collector()
    chain = [torch.randn(64) for _ in range(4)]
    collector.record([_key("m0.input", 0, chain[0])], [chain[0]], defer=True)
    merges = []
    monkeypatch.setattr(collector._table.folder, "merge_row", lambda *args: merges.append(args))
    for i in range(3):  # each output is the next module's input
        collector.record([_key(f"m{i}.output", 2 * i + 1, chain[i + 1])], [chain[i + 1]], defer=True)
        collector.record([_key(f"m{i + 1}.input", 2 * i + 2, chain[i + 1])], [chain[i + 1]], defer=True)
    batch = collector.finish_step()
    assert merges == [] and batch.table_merges.tolist() == [[1, 2], [3, 4], [5, 6]]
    values = _values(batch)
    for i in range(3):
        assert values[f"m{i}.output"] == values[f"m{i + 1}.input"] == _record_of(chain[i + 1])


def test_a_merged_row_that_changes_later_in_the_step_is_merged_as_it_was(accelerator_path):
    """A key recorded again with another tensor after its row was merged into a second key's, and a row merged into
    that key's: each key holds the records of its own tensors."""
    collector = _collector()
    x, y, z = torch.randn(40), torch.randn(40) * 5, torch.randn(40) - 3
    collector.record([_key("a", 0, x)], [x], defer=True)
    collector.record([_key("b", 1, x)], [x], defer=True)   # a's row merged into b's
    collector.record([_key("a", 0, y)], [y], defer=True)   # then a's row takes y
    collector.record([_key("c", 2, z)], [z], defer=True)
    collector.record([_key("a", 0, z)], [z], defer=True)   # c's row merged into a's
    values = _values(collector.finish_step())
    assert values["b"] == _record_of(x) and values["c"] == _record_of(z)
    got, want = values["a"], _record_of(x, y, z)
    assert got.keys() == want.keys() and all(got[f] == pytest.approx(want[f], rel=1e-6) for f in got)  # fp32 sums


def test_host_merges_follow_the_merge_rules_in_order():
    records = torch.randn(5, schema.N_FIELDS, dtype=torch.float64)
    for merges in ([[0, 3], [1, 3], [2, 4]], [[0, 3], [3, 4], [1, 0]]):  # a target merged twice; a chain
        rows = records.numpy().copy()
        schema.merge_rows(rows, np.array(merges))
        want = records.clone()
        for source, target in merges:
            want[target] = buffers.merge_records(want[[target, source]])
        np.testing.assert_array_equal(rows, want.numpy())


def test_keys_keep_their_rows_and_each_step_is_one_copy(accelerator_path, monkeypatch):
    collector = _collector()
    copies = []
    real = collector_module._to_host
    monkeypatch.setattr(collector_module, "_to_host", lambda flat: copies.append(flat.numel()) or real(flat))
    tensors = [torch.randn(10) for _ in range(5)]
    tables, rows = [], []
    for step in range(3):
        collector.step = step
        keys = [_key(f"m{i}.output", i, t) for i, t in enumerate(tensors)]
        collector.record(keys[:3], tensors[:3], defer=True)
        collector.record(keys[3:], tensors[3:])
        tables.append(collector._table.table)
        batch = collector.finish_step()
        rows.append(batch.table_index.tolist())
        values = _values(batch)
        assert [values[f"m{i}.output"]["count"] for i in range(5)] == [10.0] * 5  # each step starts empty
    assert rows == [[0, 1, 2, 3, 4]] * 3 and tables[0] is tables[1] is tables[2]
    assert copies == [5 * schema.N_FIELDS] * 3


@pytest.mark.parametrize("accelerator_path", ["torch"], indirect=True)
def test_a_table_grows_on_the_step_that_needs_it_and_keeps_its_rows(accelerator_path):
    collector = _collector()
    tensors = [torch.full((3,), float(i)) for i in range(600)]
    for i, t in enumerate(tensors):
        collector.record([_key(f"m{i}", i, t)], [t], defer=True)
    assert collector._table.table.shape[0] == 1024
    values = _values(collector.finish_step())
    assert [values[f"m{i}"]["max"] for i in range(600)] == [float(i) for i in range(600)]


def test_a_failing_triton_kernel_hands_over_to_the_torch_kernels_once(monkeypatch, caplog):
    if not folding.triton_reads(torch.device("cpu")):
        pytest.skip("Triton's interpreter is not available here")
    monkeypatch.setattr(stats_fused, "cpu_as_accelerator", True)
    collector = _collector()
    x = torch.randn(50)
    collector.record([_key("a", 0, x)], [x], defer=True)
    monkeypatch.setattr(folding.TritonFolder, "fold", lambda *args: 1 / 0)
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        for i in range(3):
            y = torch.randn(50) + i
            collector.record([_key(f"b{i}", i + 1, y)], [y], defer=True)
    assert sum("torch kernels fold the records" in r.message for r in caplog.records) == 1
    assert isinstance(collector._table.folder, folding.TorchFolder)
    values = _values(collector.finish_step())
    assert values["a"]["count"] == 50 and values["b2"]["min"] == pytest.approx(float(y.min()))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU here")
def test_a_gpu_records_what_the_cpu_records(output_dir, write_config, monkeypatch, tmp_path):
    """The same training on a GPU (the slot table, Triton's kernels) and on the CPU (its own path): the same keys,
    the same counts, figures within the two devices' float differences."""
    def records(device: str):
        monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / device))
        model = make_model(layers=2, hidden=32, device=device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        monitor = TrainerMon(write_config(**EVERY_FAMILY)).set_monitor(model, optimizer=optimizer, grad_acc_steps=2)
        run_steps(model, optimizer, 2, grad_acc_steps=2)
        monitor.stop()
        with open_run(monitor.output_dir.parent) as run:
            out = run.records()
        return out.sort_values(["step", "family", "name", "micro_step", "call_index"]).reset_index(drop=True)

    gpu, cpu = records("cuda"), records("cpu")
    order = ["step", "family", "name", "micro_step", "call_index"]
    assert gpu[order].fillna(-1).equals(cpu[order].fillna(-1))
    for field in ("count", "nans", "infs"):
        np.testing.assert_array_equal(gpu[f"raw_{field}"], cpu[f"raw_{field}"], err_msg=field)
    for field in ("sumsq", "min", "max"):
        np.testing.assert_allclose(gpu[f"raw_{field}"], cpu[f"raw_{field}"], rtol=1e-3, atol=1e-5, err_msg=field)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["default", pytest.param("fullgraph", marks=pytest.mark.slow), "blocks"])
def test_compiled_records_on_the_accelerators_path_are_the_eager_ones(output_dir, write_config, monkeypatch, mode):
    """torch.compile (whole, fullgraph, block by block): the hooks a compiled graph runs fold into the same rows
    as eager hooks do, every family included."""
    from test_compile import ALL, OPS, _records, monitored_run

    monkeypatch.setattr(folding, "triton_reads", lambda device: False)  # the interpreter: ~30 ms a launch
    monkeypatch.setattr(stats_fused, "cpu_as_accelerator", True)
    *_, eager = monitored_run(write_config, ALL, None)
    *_, compiled = monitored_run(write_config, ALL, mode)
    eager_records, compiled_records = _records(eager), _records(compiled)
    assert set(compiled_records) == set(eager_records)
    assert {"actv", "actv_grad", "grad_unreduced", "grad_reduced", "exp_avg"} <= {key[0] for key in eager_records}
    for key, got in compiled_records.items():
        for op in OPS:
            assert getattr(got, op) == pytest.approx(getattr(eager_records[key], op), rel=1e-4, abs=1e-6), (key, op)


def test_a_tensor_lends_its_own_record_only_where_its_row_holds_others_too(accelerator_path):
    """A key recorded twice in a step holds both records: a tensor read into that row, recorded again under another
    key, gives that key its own record, not the row's."""
    collector = _collector()
    x, y, z = torch.randn(40), torch.randn(40) * 5, torch.randn(40) - 3
    collector.record([_key("a", 0, x)], [x], defer=True)
    collector.record([_key("a", 0, y)], [y], defer=True)   # a's row: x and y
    collector.record([_key("b", 1, x)], [x], defer=True)   # x again: b is x's record alone
    collector.record([_key("c", 2, z)], [z], defer=True)
    collector.record([_key("d", 3, x)], [x], defer=True)
    collector.record([_key("d", 3, z)], [z], defer=True)   # c's row merged into d's: d holds x and z
    collector.record([_key("e", 4, z)], [z], defer=True)   # z again: e is z's record alone
    values = _values(collector.finish_step())
    assert values["b"] == _record_of(x) and values["c"] == values["e"] == _record_of(z)
    for key, parts in (("a", (x, y)), ("d", (x, z))):
        got, want = values[key], _record_of(*parts)
        assert all(got[f] == pytest.approx(want[f], rel=1e-6) for f in got), key
