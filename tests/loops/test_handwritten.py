"""A nanoGPT-style loop: evaluation forwards every few iterations (eval(), no_grad), gradient accumulation,
clipping, a short last step; and a NaN that comes with the input batch."""
from __future__ import annotations

import json
import logging

import pytest
import torch

from loops.harness import (CONFIG, INJECTED_MICRO, INJECTED_STEP, LoopProbe, TinyRegressor, check_healthy,
                           check_injected, rank_dir_of, read_family, samples)
from trainmon import TrainerMon
from trainmon.cli import main as cli_main

STEPS, GA, EVAL_EVERY, EVAL_ITERS = 10, 2, 4, 3


def batches(nan_at=None):
    """Batches of 2 samples; with `nan_at=(step, micro)`, x[0, 0] of that micro-batch is NaN."""
    data = samples(64)
    for i in range(0, len(data), 2):
        x = torch.stack([d["x"] for d in data[i:i + 2]])
        labels = torch.stack([d["labels"] for d in data[i:i + 2]])
        yield x, labels


def train(model, optimizer, nan_at=None):
    """The loop: evaluation every EVAL_EVERY iterations and once at the end; the last step has one micro-batch."""
    data = batches()
    held_out = torch.randn(4, 8)
    for it in range(STEPS):
        if it % EVAL_EVERY == 0:
            evaluate(model, held_out)
        for micro in range(GA if it < STEPS - 1 else 1):
            x, labels = next(data)
            if (it, micro) == nan_at:
                x[0, 0] = float("nan")
            loss = model(x, labels)["loss"] / GA
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    evaluate(model, held_out)


def evaluate(model, x):
    model.eval()
    with torch.no_grad():
        for _ in range(EVAL_ITERS):
            model(x)
    model.train()


def run(write_config, inject=None, nan_at=None, **config):
    torch.manual_seed(0)
    model = TinyRegressor()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    probe = LoopProbe(model, inject=inject)
    probe.attach(optimizer)
    monitor = TrainerMon(write_config(**{**CONFIG, **config}))
    monitor.set_monitor(model, optimizer=optimizer, grad_acc_steps=GA)
    train(model, optimizer, nan_at=nan_at)
    monitor.stop()
    return monitor, probe


def test_healthy_loop_with_evaluation(output_dir, write_config):
    monitor, probe = run(write_config)
    check_healthy(output_dir, probe)
    assert not list(monitor.output_dir.glob("actv_eval_*.csv"))  # evaluation is not recorded by default


def test_injected_inf_is_named_at_its_micro_step(output_dir, write_config, capsys):
    run(write_config, inject="hidden")
    check_injected(output_dir, "hidden", capsys)


def test_evaluation_forwards_recorded_on_request(output_dir, write_config):
    monitor, probe = run(write_config, eval_xy_distribution=True)
    check_healthy(output_dir, probe)  # the training records are the same as without it
    evaluation = read_family(monitor.output_dir, "actv_eval")
    # evaluation after step 3's update (iteration 4) and after step 7's, and the final one after the last
    # step (9); the one before the first update is at no step that happened
    assert sorted(set(evaluation.step)) == [3, 7, STEPS - 1]
    assert set(evaluation.micro_step) == set(range(EVAL_ITERS))
    assert set(evaluation[evaluation.micro_step == 0].name) >= {"hidden.output", ".output", ".input"}



def test_evaluation_forwards_are_recorded_at_the_collected_steps(output_dir, write_config):
    """With a schedule, an evaluation is recorded where the step whose weights it sees was collected, beside that
    step's training records."""
    monitor, _ = run(write_config, eval_xy_distribution=True, start_step=3, step_interval=4)
    evaluation = read_family(monitor.output_dir, "actv_eval")
    training = read_family(monitor.output_dir, "actv")
    assert sorted(set(training.step)) == [3, 7]
    assert sorted(set(evaluation.step)) == [3, 7]  # not the last evaluation's step 9, which was not collected

@pytest.mark.parametrize("config", [dict(), dict(sentinel=True, xy_distribution=False, wg_distribution=False,
                                                 mv_distribution=False, param_distribution=False)],
                         ids=["statistics", "sentinel_only"])
def test_nan_in_the_input_batch_is_named_as_the_model_input(output_dir, write_config, capsys, caplog, config):
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        monitor, _ = run(write_config, nan_at=(INJECTED_STEP, INJECTED_MICRO), **config)
    expected = {"rank": 0, "step": INJECTED_STEP, "micro_step": INJECTED_MICRO, "module": "", "phase": "forward",
                "tensor": "input_0"}  # x; labels are input_1
    records = [json.loads(line) for line in open(rank_dir_of(output_dir) / "anomalies.jsonl")]
    first = min((r for r in records if r["first"]), key=lambda r: r["step"])
    assert {k: first[k] for k in expected} == expected, first
    assert "came in with the input batch" in next(r.getMessage() for r in caplog.records if "anomaly at" in
                                                  r.getMessage())
    capsys.readouterr()
    assert cli_main(["nan-analyze", str(output_dir), "--json"]) == 1  # 1: found
    report = json.loads(capsys.readouterr().out)
    assert {k: report["first"][k] for k in expected} == expected
    assert cli_main(["nan-analyze", str(output_dir)]) == 1
    assert "came in with the input batch" in capsys.readouterr().out
