"""`trainmon compare RUN_A RUN_B`: statistic records of two runs, aligned and ordered by execution."""
from __future__ import annotations

import csv
import json

import pytest
import torch

from trainmon import TrainerMon
from trainmon.cli import main
from trainmon.demo import lm_loss
from training import batches, make_model

CONFIG = {"xy_distribution": True, "wg_distribution": True, "ops": ["norm", "min", "max", "mean"],
          "format": ["db"]}


def train(tmp_path, monkeypatch, name, steps=3, before_step=None, dtype=torch.float32, prepare=None, fmt=("db",)):
    """A monitored run of the tiny model in `tmp_path/name`; `before_step(model, step)` runs before each forward."""
    out = tmp_path / name
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(out))
    config = tmp_path / f"{name}.json"
    config.write_text(json.dumps({**CONFIG, "format": list(fmt), "strict": True}))
    model = make_model().to(dtype)
    if prepare is not None:
        prepare(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(str(config)).set_monitor(model, optimizer)
    data = batches()
    for step in range(steps):
        if before_step is not None:
            before_step(model, step)
        tokens, labels = next(data)
        lm_loss(model, tokens, labels).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    monitor.stop()
    return next(out.iterdir())


def compare(capsys, *args):
    code = main(["compare", *map(str, args), "--json"])
    captured = capsys.readouterr()
    return code, (json.loads(captured.out) if code in (0, 1) else captured.err)  # 0 agree, 1 differ


def test_same_seed_runs_compare_equal(tmp_path, monkeypatch, capsys):
    a, b = train(tmp_path, monkeypatch, "a"), train(tmp_path, monkeypatch, "b")
    code, summary = compare(capsys, a, b)
    assert code == 0 and summary["agree"]
    assert summary["first_divergent"] is None and summary["records"] > 50
    assert summary["verdicts"]["equal"] == summary["records"] == summary["compared"]


@pytest.mark.parametrize("fmt", [("db",), ("csv",)])
def test_perturbed_weights_are_named_at_that_module_step_and_forward(tmp_path, monkeypatch, capsys, fmt):
    def perturb(model, step):
        if step == 1:
            with torch.no_grad():
                model.layers[1].mlp[0].weight.mul_(1.5)

    a, b = train(tmp_path, monkeypatch, "a", fmt=fmt), train(tmp_path, monkeypatch, "b", before_step=perturb, fmt=fmt)
    out = tmp_path / "result.csv"
    code, summary = compare(capsys, a, b, "-o", out)
    assert code == 1 and not summary["agree"]
    first = summary["first_divergent"]
    assert (first["name"], first["step"], first["phase"]) == ("layers.1.mlp.0.output", 1, "forward"), first
    assert summary["most_divergent"]
    rows = list(csv.DictReader(out.open()))
    assert len(rows) == summary["records"]
    # execution order: step 0 first, and the first "diverged" row is the first divergent record
    assert rows[0]["step"] == "0"
    diverged = next(r for r in rows if r["verdict"] == "diverged")
    assert diverged["name"] == "layers.1.mlp.0.output" and diverged["step"] == "1"
    assert {"norm_a", "norm_b", "norm_abs", "norm_rel"} <= set(rows[0])


def test_bf16_against_fp32_bounded_and_the_misscaled_layer_first(tmp_path, monkeypatch, capsys):
    def break_layer(model):
        with torch.no_grad():
            model.layers[0].attn.proj.weight.mul_(4.0)  # a wrong scale in one layer

    a = train(tmp_path, monkeypatch, "fp32", steps=1)
    b = train(tmp_path, monkeypatch, "bf16", steps=1, dtype=torch.bfloat16, prepare=break_layer)
    code, summary = compare(capsys, a, b, "--rtol", "0.05", "--atol", "1e-3", "--top", "500")
    assert code == 1
    first = summary["first_divergent"]
    assert (first["name"], first["phase"]) == ("layers.0.attn.proj.output", "forward"), first
    # bf16 rounding alone: records before the broken layer differ, but within the tolerance
    assert summary["verdicts"]["close"] > 0


def test_different_rank_counts_and_a_bad_map_are_clear_errors(tmp_path, monkeypatch, capsys):
    a = train(tmp_path, monkeypatch, "a", steps=1)
    b = tmp_path / "b_run"
    (b / "rank_0").mkdir(parents=True)
    (b / "rank_1").mkdir()
    for rank in ("rank_0", "rank_1"):
        for f in (a / "rank_0").iterdir():
            (b / rank / f.name).write_bytes(f.read_bytes())
    code, err = compare(capsys, a, b)
    assert code == 2 and "different ranks" in err and "--rank" in err and "Traceback" not in err
    code, summary = compare(capsys, a, b, "--rank", "0")
    assert code == 0 and summary["first_divergent"] is None
    bad = tmp_path / "map.json"
    bad.write_text("[1, 2]")
    code, err = compare(capsys, a, b, "--rank", "0", "--map", bad)
    assert code == 2 and str(bad) in err


def test_a_name_map_renames_modules_of_run_b(tmp_path, monkeypatch, capsys):
    a = train(tmp_path, monkeypatch, "a", steps=1)
    b = train(tmp_path, monkeypatch, "b", steps=1)
    mapping = tmp_path / "map.json"
    mapping.write_text(json.dumps({"layers.0": "layers.1", "layers.1": "layers.0"}))
    code, summary = compare(capsys, a, b, "--map", mapping)
    assert code == 1 and summary["first_divergent"]["name"].startswith("layers.")
