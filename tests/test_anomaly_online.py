"""Faults injected at a known (step, micro-step, module) of a real training run are named exactly by the
online alert (anomalies.jsonl, log line) and by `trainmon nan-analyze --json`."""
import json
import logging

import pytest
import torch

from training import make_model, run_steps
from trainmon import TrainerMon
from trainmon.cli import main as cli_main

STATS = dict(targets={}, all_xy=True, xy_distribution=True, wg_distribution=True, ops=["norm", "nans", "infs"],
             format="csv", alert={"rules": [{"rule_name": "AnomalyNan"}]})
SENTINEL_ONLY = dict(sentinel=True, format="csv")


class Clock:
    """Knows the (step, micro-step) of the running forward/backward from a root forward pre-hook."""

    def __init__(self, model, grad_acc_steps):
        self.ga = grad_acc_steps
        self.calls = -1
        model.register_forward_pre_hook(self._tick)

    def _tick(self, module, args):
        self.calls += 1

    def at(self, step, micro) -> bool:
        return divmod(self.calls, self.ga) == (step, micro)


def forward_inf(model, clock, module, step, micro):
    """Multiplies the module's forward output by inf at (step, micro)."""
    dict(model.named_modules())[module].register_forward_hook(
        lambda m, args, out: out * float("inf") if clock.at(step, micro) else None)


def grad_input_nan(model, clock, module, step, micro):
    """Puts NaN into the module's grad_input at (step, micro), from a full backward hook."""
    def hook(m, grad_input, grad_output):
        if clock.at(step, micro):
            return tuple(None if g is None else g * float("nan") for g in grad_input)
        return None

    dict(model.named_modules())[module].register_full_backward_hook(hook)


def weight_inf(model, clock, module, step, micro):
    """Writes inf into row 0 of the module's weight just before the forward of (step, micro)."""
    weight = dict(model.named_modules())[module].weight

    def pre_hook(m, args):
        if clock.at(step, micro):
            with torch.no_grad():
                weight[0, 0] = float("inf")

    model.register_forward_pre_hook(pre_hook)  # after the clock's, so it sees this call's (step, micro)


CASES = {
    "forward_output_inf": (forward_inf, "layers.1.mlp.0", 1, "forward", "output"),
    "grad_input_nan": (grad_input_nan, "layers.0.mlp.2", 1, "backward", "grad_input"),
    "weight_row_inf": (weight_inf, "layers.1.attn.qkv", 1, "forward", "output"),
    "grad_acc_micro_1_only": (forward_inf, "layers.0.attn.proj", 2, "forward", "output"),
}


def faulty_run(write_config, case, config, step=2, steps=4, caplog=None):
    inject, module, ga, phase, tensor = CASES[case]
    micro = ga - 1
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    clock = Clock(model, ga)
    inject(model, clock, module, step, micro)  # registered first: the monitor sees the faulty values
    monitor = TrainerMon(write_config(**config))
    monitor.set_monitor(model, optimizer=optimizer, grad_acc_steps=ga)
    run_steps(model, optimizer, steps, grad_acc_steps=ga)
    monitor.stop()
    expected = {"rank": 0, "step": step, "micro_step": micro, "module": module, "phase": phase, "tensor": tensor}
    return monitor, expected


def nan_analyze_json(directory, capsys) -> dict:
    code = cli_main(["nan-analyze", str(directory), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == (0 if report["first"] is None else 1)  # 0 clean, 1 found
    return report


def online_first(rank_dir) -> dict:
    records = [json.loads(line) for line in open(rank_dir / "anomalies.jsonl")]
    firsts = [r for r in records if r["first"]]
    assert firsts and records
    return min(firsts, key=lambda r: r["step"]), records


@pytest.mark.parametrize("config", [STATS, SENTINEL_ONLY], ids=["statistics", "sentinel_only"])
@pytest.mark.parametrize("case", list(CASES))
def test_fault_is_named_online_and_post_mortem(output_dir, write_config, capsys, caplog, case, config):
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        monitor, expected = faulty_run(write_config, case, config)
    first, records = online_first(monitor.output_dir)
    assert {k: first[k] for k in expected} == expected, first
    assert min(r["step"] for r in records) == expected["step"]  # nothing anomalous before the fault
    alert_lines = [r.getMessage() for r in caplog.records if "anomaly at" in r.getMessage()]
    assert f"step {expected['step']} micro-step {expected['micro_step']}: {expected['module']} " \
           f"{expected['phase']} {expected['tensor']}" in alert_lines[0]
    report = nan_analyze_json(monitor.output_dir.parent, capsys)
    assert {k: report["first"][k] for k in expected} == expected
    assert report["first"]["call_index"] == first["call_index"]
    assert report["chain"], "the fault spreads to later modules"


def test_nan_analyze_from_csv_alone(output_dir, write_config, capsys):
    monitor, expected = faulty_run(write_config, "grad_acc_micro_1_only", STATS)
    (monitor.output_dir / "anomalies.jsonl").unlink()
    report = nan_analyze_json(monitor.output_dir.parent, capsys)
    assert report["sources"] == {"0": ["csv"]}
    assert {k: report["first"][k] for k in expected} == expected
    assert report["first"]["call_index"] is None  # CSV rows carry no call index


@pytest.mark.parametrize("config", [STATS, SENTINEL_ONLY], ids=["statistics", "sentinel_only"])
def test_nan_analyze_from_database_alone(output_dir, write_config, capsys, config):
    monitor, expected = faulty_run(write_config, "grad_input_nan", {**config, "format": ["db"]})
    (monitor.output_dir / "anomalies.jsonl").unlink()
    report = nan_analyze_json(monitor.output_dir.parent, capsys)
    assert report["sources"] == {"0": ["monitor.db"]}
    assert {k: report["first"][k] for k in expected} == expected
    assert report["first"]["call_index"] is not None


def test_clean_run_reports_null_first(output_dir, write_config, capsys):
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    monitor = TrainerMon(write_config(**STATS, sentinel=True))
    monitor.set_monitor(model, optimizer=optimizer)
    run_steps(model, optimizer, 3)
    monitor.stop()
    report = nan_analyze_json(monitor.output_dir.parent, capsys)
    assert report["first"] is None and report["chain"] == [] and report["nonfinite_records"] == 0
    assert cli_main(["nan-analyze", str(monitor.output_dir.parent)]) == 0
    assert "clean" in capsys.readouterr().out


def test_loop_that_stops_on_a_nan_loss_keeps_the_unfinished_step(output_dir, write_config, capsys):
    """The usual `if not torch.isfinite(loss): raise` before optimizer.step(): stop() still writes the step."""
    from trainmon.demo import lm_loss
    from training import batches

    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    clock = Clock(model, 1)
    forward_inf(model, clock, "layers.0.mlp.2", 1, 0)
    data = batches()
    with pytest.raises(FloatingPointError):
        with TrainerMon(write_config(**SENTINEL_ONLY)) as monitor:
            monitor.set_monitor(model, optimizer=optimizer)
            for _ in range(3):
                tokens, labels = next(data)
                loss = lm_loss(model, tokens, labels)
                loss.backward()
                if not torch.isfinite(loss):
                    raise FloatingPointError("loss is not finite")
                optimizer.step()
                optimizer.zero_grad()
    report = nan_analyze_json(monitor.output_dir.parent, capsys)
    assert {k: report["first"][k] for k in ("step", "micro_step", "module", "phase")} == \
        {"step": 1, "micro_step": 0, "module": "layers.0.mlp.2", "phase": "forward"}
