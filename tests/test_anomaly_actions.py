"""alert.action: skip_step leaves an anomalous step's weights unchanged; stop raises after writing, naming
the first bad tensor; the optimizer is restored by stop()."""
import json

import pytest
import torch

from test_anomaly_online import SENTINEL_ONLY, Clock, forward_inf
from training import make_model, run_steps
from trainmon import TrainerMon
from trainmon.anomaly.actions import AnomalyStopError

FAULT_STEP = 2


def monitored(write_config, action, fault_module="layers.1.mlp.0", **config):
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    forward_inf(model, Clock(model, 1), fault_module, FAULT_STEP, 0)
    monitor = TrainerMon(write_config(**{**SENTINEL_ONLY, **config, "alert": {"action": action}}))
    monitor.set_monitor(model, optimizer=optimizer)
    return model, optimizer, monitor


def snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_skip_step_leaves_weights_of_the_anomalous_step_unchanged(output_dir, write_config):
    model, optimizer, monitor = monitored(write_config, "skip_step")
    before = {}
    run_steps(model, optimizer, 5, on_step=lambda step: before.__setitem__(step, snapshot(model)))
    gate = next(h for h in monitor._hooks if type(h).__name__ == "StepGate")
    skipped = list(gate.skipped_steps)
    monitor.stop()
    assert skipped == [FAULT_STEP]
    for name in before[FAULT_STEP]:
        assert torch.equal(before[FAULT_STEP][name], before[FAULT_STEP + 1][name]), name  # not applied
        assert not torch.equal(before[FAULT_STEP - 1][name], before[FAULT_STEP][name]), name  # healthy: applied
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert int(optimizer.state[next(model.parameters())]["step"]) == 4  # five steps, one skipped
    records = [json.loads(line) for line in open(monitor.output_dir / "anomalies.jsonl")]
    assert {r["step"] for r in records} == {FAULT_STEP}  # training went on cleanly afterwards


def test_stop_raises_after_writing_and_names_the_first_tensor(output_dir, write_config):
    model, optimizer, monitor = monitored(write_config, "stop")
    before = {}
    with pytest.raises(AnomalyStopError, match=r"step 2 micro-step 0: layers\.1\.mlp\.0 forward output") as info:
        run_steps(model, optimizer, 5, on_step=lambda step: before.__setitem__(step, snapshot(model)))
    assert info.value.event.module == "layers.1.mlp.0"
    # written before the raise, while the job is still alive
    records = [json.loads(line) for line in open(monitor.output_dir / "anomalies.jsonl")]
    assert records and records[0]["first"] and records[0]["module"] == "layers.1.mlp.0"
    after = snapshot(model)
    assert all(torch.equal(before[FAULT_STEP][n], after[n]) for n in after)
    monitor.stop()


def test_stop_restores_the_optimizer_step(output_dir, write_config):
    model, optimizer, monitor = monitored(write_config, "skip_step", fault_module="head")
    assert "step" in vars(optimizer)
    monitor.stop()
    assert "step" not in vars(optimizer)
    run_steps(model, optimizer, 1)  # plain training works after stop()
