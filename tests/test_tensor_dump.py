"""The `dump` config block and `trainmon compare DUMP_A DUMP_B` (trainmon's and msprobe's dumps)."""
from __future__ import annotations

import json

import torch

from msprobe_tensor_dumps import write_msprobe_tensor_dump
from trainmon import TrainerMon
from trainmon.cli import main
from trainmon.demo import lm_loss
from training import batches, make_model


def dumped_run(tmp_path, monkeypatch, name, dump, perturb_at=None):
    """Trains 2 steps of the tiny model with `dump`; returns `rank_0/dumps`."""
    out = tmp_path / name
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(out))
    config = tmp_path / f"{name}.json"
    config.write_text(json.dumps({"format": ["csv"], "strict": True, "dump": dump}))
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(str(config)).set_monitor(model, optimizer)
    data = batches()
    for step in range(2):
        if step == perturb_at:
            with torch.no_grad():
                model.layers[0].mlp[0].weight.add_(torch.randn_like(model.layers[0].mlp[0].weight))
        tokens, labels = next(data)
        lm_loss(model, tokens, labels).backward()  # the line every dumped stack passes through
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    monitor.stop()
    return next(out.iterdir()) / "rank_0" / "dumps"


def test_dumps_hold_the_chosen_step_with_an_index_and_respect_the_cap(tmp_path, monkeypatch):
    dumps = dumped_run(tmp_path, monkeypatch, "a", {"steps": [1], "max_mb_per_step": 1})
    assert [p.name for p in dumps.iterdir()] == ["step1"]
    index = json.loads((dumps / "step1" / "index.json").read_text())
    stored = [t for t in index["tensors"] if t["stored"]]
    assert index["stored_bytes"] <= 1 << 20 and index["cut"], "the tiny model's step is over 1 MB"
    assert {t["key"] for t in index["tensors"] if not t["stored"]} == {c["key"] for c in index["cut"]}
    assert [t["call"] for t in index["tensors"]] == list(range(len(index["tensors"])))
    assert {t["phase"] for t in index["tensors"]} == {"forward", "backward"}
    first = index["tensors"][0]
    assert first["record"]["norm"] > 0 and first["dtype"] == "torch.float32" and first["shape"]
    assert "layers.0.mlp.0" in index["stacks"]
    from safetensors import safe_open
    with safe_open(str(dumps / "step1" / "tensors.safetensors"), framework="pt") as fh:
        assert sorted(fh.keys()) == sorted(t["key"] for t in stored)
        assert sum(fh.get_tensor(k).numel() * 4 for k in fh.keys()) == index["stored_bytes"]


def test_dump_comparison_names_the_perturbed_module_with_its_stack(tmp_path, monkeypatch, capsys):
    dump = {"steps": [1], "modules": ["layers.0"], "max_mb_per_step": 64}
    a = dumped_run(tmp_path, monkeypatch, "a", dump)
    b = dumped_run(tmp_path, monkeypatch, "b", dump, perturb_at=1)
    assert main(["compare", str(a), str(b)]) == 1  # 1: the dumps differ
    text = capsys.readouterr().out
    assert main(["compare", str(a), str(b), "--json"]) == 1
    first = json.loads(capsys.readouterr().out)["first_divergent"]
    assert (first["module"], first["phase"], first["role"], first["step"]) == ("layers.0.mlp.0", "forward", "output", 1)
    assert first["cosine"] < 0.99 and first["max_abs"] > 0.001
    assert first["record_a"]["norm"] != first["record_b"]["norm"]
    assert "first divergent tensor: layers.0.mlp.0 forward output" in text
    assert "test_tensor_dump.py" in text and "lm_loss(model, tokens, labels).backward()" in text


def test_msprobe_dump_directories_name_the_perturbed_api(tmp_path, capsys):
    write_msprobe_tensor_dump(tmp_path / "a", perturb=None)
    write_msprobe_tensor_dump(tmp_path / "b", perturb="Functional.linear.1")
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--json"]) == 1
    summary = json.loads(capsys.readouterr().out)
    first = summary["first_divergent"]
    assert first["module"] == "Functional.linear.1" and first["role"].startswith("output")
    assert first["record_a"]["max"] is not None and first["stack"]
    assert summary["pairs"] == [[0, 0], [1, 0]]


def test_dumps_with_different_ranks_and_a_run_against_a_dump_are_clear_errors(tmp_path, capsys):
    write_msprobe_tensor_dump(tmp_path / "a", perturb=None)
    write_msprobe_tensor_dump(tmp_path / "b", perturb=None, ranks=1)
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert "different ranks" in err and "Traceback" not in err
    (tmp_path / "run" / "rank_0").mkdir(parents=True)
    (tmp_path / "run" / "rank_0" / "actv_0-0.csv").write_text("vpp_stage,name,step,micro_step,norm\n")
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "run")]) == 2
    assert "not a tensor dump" in capsys.readouterr().err


def test_a_corrupt_dump_index_is_named(tmp_path, capsys):
    for side in ("a", "b"):
        (tmp_path / side / "step0").mkdir(parents=True)
        (tmp_path / side / "step0" / "index.json").write_text('{"rank": 0, "step": 0, "tensors": [{"call": 0}]}')
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path / "a" / "step0" / "index.json") in err and "Traceback" not in err


def test_a_dump_puts_no_torch_hook_on_the_modules_and_keeps_the_trainings_frames(tmp_path, monkeypatch):
    """The dump's hooks run in the wrapper around each module's forward that the other groups share: no torch hook,
    which would put every call of every module on torch's slow path on the steps that dump nothing. The stacks it
    keeps hold the training's frames, not trainmon's."""
    def torch_hooks(dump: dict):
        config = tmp_path / "config.json"
        config.write_text(json.dumps({"format": ["csv"], "strict": True, "xy_distribution": True, **dump}))
        model = make_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        monitor = TrainerMon(str(config)).set_monitor(model, optimizer)
        hooks = {name: (len(m._forward_pre_hooks), len(m._forward_hooks)) for name, m in model.named_modules()}
        return model, optimizer, monitor, hooks

    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "plain"))
    *_, plain_monitor, plain = torch_hooks({})
    plain_monitor.stop()
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    model, optimizer, monitor, hooks = torch_hooks({"dump": {"steps": [1], "modules": "all"}})
    assert hooks == plain  # the root's one pre-hook (the forward passes' count), nothing else
    data = batches()
    for _ in range(2):
        tokens, labels = next(data)
        lm_loss(model, tokens, labels).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    monitor.stop()
    index = json.loads(next((tmp_path / "out").iterdir()).joinpath("rank_0", "dumps", "step1", "index.json").read_text())
    stacks = ["".join(frames) for frames in index["stacks"].values()]
    assert len(stacks) > 10 and all("test_tensor_dump.py" in s for s in stacks)
    assert not any("trainmon/hooks" in s.replace("\\", "/") for s in stacks)
