"""`trainmon.save` / `trainmon.save_grad`: records of any variable of a training script, in every sink, in the
ordering key (online alert and nan-analyze), in tensor dumps and in `trainmon compare`."""
from __future__ import annotations

import json

import pytest
import torch

import trainmon
from op_log import Ops
from trainmon import TrainerMon, open_run
from trainmon.cli import main as cli_main
from trainmon.hooks import saved

GA, STEPS, NAN_STEP, NAN_MICRO = 2, 3, 2, 1
STATS = dict(targets={}, all_xy=True, xy_distribution=True, ops=["norm", "min", "max", "mean", "nans", "infs"],
             format=["csv", "db", "tensorboard"], alert={"rules": [{"rule_name": "AnomalyNan"}]})


class GatedNet(torch.nn.Module):
    """fc1 -> gate (an elementwise product with a parameter: no module's output) -> fc2. The gate is the
    kind of variable only `save` can record."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 4)
        self.gain = torch.nn.Parameter(torch.ones(16))
        self.perturb = 1.0  # run B of the comparison scales the gate by this
        self.seen_grads = []  # what a test hook on the gate reads, per backward
        self.seen_values = []

    def forward(self, x):
        gate = self.fc1(x) * self.gain * self.perturb
        self.seen_values.append(gate.detach().clone())
        gate.register_hook(lambda g: self.seen_grads.append(g.detach().clone()))
        trainmon.save("gate", gate)
        gate = trainmon.save_grad("gate", gate)
        return self.fc2(gate)


def train(model, optimizer, steps=STEPS, ga=GA, nan_at=None, perturb_at=None):
    data = torch.Generator().manual_seed(1)
    for step in range(steps):
        for micro in range(ga):
            if (step, micro) == nan_at:
                with torch.no_grad():
                    model.gain[3] = float("nan")
            model.perturb = 1.01 if step == perturb_at else 1.0
            x = torch.randn(4, 8, generator=data)
            model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def monitored_run(write_config, output_dir, config, **train_args):
    model = GatedNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    monitor = TrainerMon(write_config(**config)).set_monitor(model, optimizer=optimizer, grad_acc_steps=GA)
    train(model, optimizer, **train_args)
    monitor.stop()
    return model, next(output_dir.iterdir())


@pytest.mark.parametrize("config", [STATS, dict(sentinel=True, format=["csv"])], ids=["rules", "sentinel"])
def test_a_saved_variable_that_goes_nan_first_is_named_first_online_and_by_nan_analyze(
        output_dir, write_config, capsys, config):
    _, run = monitored_run(write_config, output_dir, config, nan_at=(NAN_STEP, NAN_MICRO))
    expected = {"rank": 0, "step": NAN_STEP, "micro_step": NAN_MICRO, "module": "gate", "phase": "forward",
                "tensor": "save"}
    events = [json.loads(line) for line in (run / "rank_0" / "anomalies.jsonl").read_text().splitlines()]
    first = [e for e in events if e["first"]]
    assert len(first) == 1 and {k: first[0][k] for k in expected} == expected
    assert first[0]["family"] == "save"
    assert cli_main(["nan-analyze", str(run), "--json"]) == 1  # found
    report = json.loads(capsys.readouterr().out)
    assert {k: report["first"][k] for k in expected} == expected
    # the gate's NaN reached fc2 next: without the save, fc2's forward would have been named first
    assert (report["chain"][0]["module"], report["chain"][0]["phase"]) == ("fc2", "forward")
    assert any(c["module"] == "gate" and c["tensor"] == "save_grad" for c in report["chain"])


def test_a_saved_variable_and_its_sentinel_probe_are_one_event(output_dir, write_config):
    """With the sentinel on, a saved variable's record and its probe carry one call index, in every step and
    micro-step, with or without the activation hooks beside them."""
    for config in (dict(sentinel=True), dict(STATS, sentinel=True)):
        model = GatedNet()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        monitor = TrainerMon(write_config(**config)).set_monitor(model, optimizer=optimizer, grad_acc_steps=GA)
        batches = []
        monitor._api.write = batches.append  # the api sink receives every step batch in the writer thread
        train(model, optimizer)
        monitor.stop()
        assert len(batches) == STEPS
        for batch in batches:
            for family in ("save", "save_grad"):
                records = sorted((k.micro_step, k.call_index) for k in batch.keys if k.family == family)
                probes = sorted((k.micro_step, k.call_index) for k in batch.flag_keys if k.family == family)
                assert len(records) == GA and records == probes, (config, family)


def test_save_and_save_grad_records_equal_what_torch_computes_from_the_tensors(output_dir, write_config):
    model, run = monitored_run(write_config, output_dir, STATS)
    assert len(model.seen_grads) == len(model.seen_values) == STEPS * GA
    with open_run(run) as data:
        frames = {source: data.family(family) for source, family in (("value", "save"), ("grad", "save_grad"))}
    for source, tensors in (("value", model.seen_values), ("grad", model.seen_grads)):
        frame = frames[source].sort_values(["step", "micro_step"])
        assert list(zip(frame.step, frame.micro_step)) == [(s, m) for s in range(STEPS) for m in range(GA)]
        assert set(frame.name) == {"gate"}
        # backward runs the hooks in reverse order of registration: the test hook's grad is the one recorded
        for (_, row), tensor in zip(frame.iterrows(), tensors):
            t = tensor.double()
            assert row["norm"] == pytest.approx(t.norm().item(), rel=1e-6)
            assert row["min"] == pytest.approx(t.min().item(), rel=1e-6)
            assert row["max"] == pytest.approx(t.max().item(), rel=1e-6)
            assert row["mean"] == pytest.approx(t.mean().item(), rel=1e-5, abs=1e-12)
            assert row["nans"] == 0
    # every sink holds them: CSV files of their own, TensorBoard tags
    rank = run / "rank_0"
    assert sorted(p.name for p in rank.glob("save_*.csv"))[:2] == ["save_0-0.csv", "save_1-1.csv"]
    assert list(rank.glob("save_grad_0-0.csv"))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    tags = EventAccumulator(str(rank)).Reload().Tags()["scalars"]
    assert any(t.startswith("0:gate:1/rank0/save_grad") for t in tags), tags


def test_compare_names_the_saved_variable_that_was_perturbed(tmp_path, monkeypatch, write_config, capsys):
    runs = []
    for name, perturb in (("a", None), ("b", 1)):
        out = tmp_path / name
        monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(out))
        runs.append(monitored_run(write_config, out, dict(STATS, format=["db"]), perturb_at=perturb)[1])
    assert cli_main(["compare", str(runs[0]), str(runs[1]), "--json"]) == 1  # the runs differ
    first = json.loads(capsys.readouterr().out)["first_divergent"]
    assert (first["family"], first["name"], first["step"], first["micro_step"]) == ("save", "gate", 1, 0)
    assert first["ops"]["norm"]["rel"] == pytest.approx(0.01 / 1.01, rel=1e-3)


def test_saved_tensors_are_dumped_on_dump_steps(output_dir, write_config):
    _, run = monitored_run(write_config, output_dir, dict(format=["csv"], dump={"steps": [1]}))
    index = json.loads((run / "rank_0" / "dumps" / "step1" / "index.json").read_text())
    saved_entries = [(t["module"], t["phase"], t["role"], t["micro_step"]) for t in index["tensors"]
                     if t["module"] == "gate"]
    assert saved_entries == [("gate", "forward", "save", 0), ("gate", "backward", "save_grad", 0),
                             ("gate", "forward", "save", 1), ("gate", "backward", "save_grad", 1)]
    assert not (run / "rank_0" / "dumps" / "step0").exists()


def test_a_name_saved_twice_in_a_micro_step_gets_a_call_suffix(output_dir, write_config):
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(write_config(format=["csv"], ops=["norm"])).set_monitor(model, optimizer)
    for _ in range(2):
        y = model(torch.ones(2, 4))
        trainmon.save("y", y)
        trainmon.save("y", y * 2)
        y.sum().backward()
        optimizer.step()
    monitor.stop()
    with open_run(next(output_dir.iterdir())) as data:
        frame = data.family("save")
    assert sorted(zip(frame.step, frame.name)) == [(0, "y"), (0, "y#1"), (1, "y"), (1, "y#1")]
    norms = dict(zip(zip(frame.step, frame.name), frame.norm))
    assert norms[(0, "y#1")] == pytest.approx(2 * norms[(0, "y")])


def test_off_and_uncollected_steps_do_no_tensor_work_and_collected_ones_no_host_sync(output_dir, write_config):
    x = torch.ones(3, requires_grad=True) * 2
    with Ops() as counter:  # no monitor at all
        trainmon.save("x", x)
        assert trainmon.save_grad("x", x) is x
    assert counter.ops == [] and saved._active is None

    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(write_config(format=["csv"], ops=["norm", "max"], step_interval=2))
    monitor.set_monitor(model, optimizer)
    counts = []
    for step in range(4):
        y = model(torch.ones(2, 4))
        with Ops() as counter:
            trainmon.save("y", y)
            out = trainmon.save_grad("y", y)
        counts.append(counter.ops)
        out.sum().backward()
        optimizer.step()
    monitor.stop()
    assert saved._active is None
    assert counts[1] == [] and counts[3] == []  # steps 1 and 3 are not collected
    for ops in (counts[0], counts[2]):
        assert "aten._local_scalar_dense" not in ops and "aten.item" not in ops
    with open_run(next(output_dir.iterdir())) as data:
        assert sorted(set(data.family("save").step)) == [0, 2]
        assert sorted(set(data.family("save_grad").step)) == [0, 2]


def test_evaluation_forwards_are_not_recorded(output_dir, write_config):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(write_config(format=["csv"], ops=["norm"])).set_monitor(model, optimizer)
    y = model(torch.ones(2, 4))
    trainmon.save("train", y)
    y.sum().backward()
    model.eval()
    with torch.no_grad():
        trainmon.save("eval", model(torch.ones(2, 4)))
    model.train()
    optimizer.step()
    monitor.stop()
    with open_run(next(output_dir.iterdir())) as data:
        assert list(data.family("save").name) == ["train"]


def test_activation_checkpointing_records_each_variable_once(output_dir, write_config):
    """The checkpointed function runs again in backward: its saves there record nothing, and the grad
    `save_grad` hooked in the first run is recorded once, equal to the one a test hook reads."""
    from torch.utils.checkpoint import checkpoint

    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []

    def block(x):  # no module in it: the recomputation is no forward pass of the model
        h = x.tanh()
        trainmon.save("h", h)
        if not torch._C._current_graph_task_id() != -1:  # the first run, not the recomputation
            h.register_hook(lambda g: grads.append(g.detach().clone()))
        h = trainmon.save_grad("h", h)
        return h * h  # saves h for backward: the recomputation runs through the saves

    monitor = TrainerMon(write_config(format=["csv"], ops=["norm"])).set_monitor(model, optimizer)
    for _ in range(2):
        checkpoint(block, model(torch.ones(2, 4)), use_reentrant=False).sum().backward()
        optimizer.step()
    monitor.stop()
    with open_run(next(output_dir.iterdir())) as data:
        values, recorded = data.family("save"), data.family("save_grad")
    assert list(zip(values.step, values.name)) == [(0, "h"), (1, "h")]
    assert list(zip(recorded.step, recorded.name)) == [(0, "h"), (1, "h")]
    assert list(recorded.norm) == pytest.approx([g.double().norm().item() for g in grads], rel=1e-5)  # 6 digits
