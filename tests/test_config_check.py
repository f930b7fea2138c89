"""config-check without a job: hyperparameter parsing and aliases, the environment filter, packs captured in
this process, compare's output directory and exit statuses, bad packs."""
import json
import zipfile

import pytest
import torch
import torch.nn as nn

from trainmon import TrainerMon
from trainmon.cli import main as cli_main
from trainmon.config_check import capture
from trainmon.config_check.environment import filtered_environment
from trainmon.config_check.hyperparams import from_script, from_yaml

SCRIPT = """#!/bin/bash
export LR=1e-4
MBS=4  # micro-batch size
HF_TOKEN=hf_abc
torchrun --nproc_per_node 8 pretrain_gpt.py \\
    --lr $LR --micro-batch-size ${MBS} --bf16 \\
    --weight-decay=0.1 --save /ckpt/run1
"""
YAML = """
optimizer:
  learning_rate: 1e-4
  weight_decay: 0.1
per_device_train_batch_size: 4
bf16: true
output_dir: /elsewhere
"""


def test_script_flags_assignments_and_aliases(tmp_path):
    script = tmp_path / "train.sh"
    script.write_text(SCRIPT)
    values = from_script(script)
    assert values["lr"] == 1e-4 and values["micro_batch_size"] == 4 and values["weight_decay"] == 0.1
    assert values["bf16"] is True and values["save"] == "/ckpt/run1"
    assert not any("token" in name for name in values) and "hf_abc" not in json.dumps(values)


def test_yaml_leaves_under_the_same_names(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text(YAML)
    values = from_yaml(path)
    assert values["lr"] == 1e-4 and values["micro_batch_size"] == 4 and values["weight_decay"] == 0.1


def test_environment_filter():
    kept = filtered_environment({"NCCL_ALGO": "Ring", "CUDA_VISIBLE_DEVICES": "0", "MASTER_PORT": "29500",
                                 "TORCHELASTIC_RUN_ID": "x", "HOME": "/root", "HF_TOKEN": "t", "NCCL_IB_KEY": "k",
                                 "TORCH_EXTENSIONS_DIR": "/tmp/x", "OMP_NUM_THREADS": "1"})
    assert kept == {"CUDA_VISIBLE_DEVICES": "0", "NCCL_ALGO": "Ring", "OMP_NUM_THREADS": "1"}


def cli_capture(tmp_path, name, *options):
    path = tmp_path / f"{name}.zip"
    assert cli_main(["config-check", "capture", *options, "-o", str(path)]) == 0
    return path


def test_script_and_yaml_with_the_same_settings_compare_equal(tmp_path, capsys):
    (tmp_path / "train.sh").write_text("python train.py --lr 1e-4 --micro-batch-size 4 --weight-decay 0.1 --bf16\n")
    (tmp_path / "cfg.yaml").write_text(YAML)
    a = cli_capture(tmp_path, "a", "--script", str(tmp_path / "train.sh"))
    b = cli_capture(tmp_path, "b", "--yaml", str(tmp_path / "cfg.yaml"))
    capsys.readouterr()
    assert cli_main(["config-check", "compare", str(a), str(b)]) == 0
    table = dict(line.split()[:2] for line in capsys.readouterr().out.splitlines()[1:7])
    assert table == {"environment": "pass", "packages": "pass", "hyperparameters": "pass", "weights": "skipped",
                     "dataset": "skipped", "random": "skipped"}


def test_compare_never_replaces_a_directory_without_overwrite(tmp_path, capsys, monkeypatch):
    a = cli_capture(tmp_path, "a")
    monkeypatch.setenv("NCCL_ALGO", "Tree")
    b = cli_capture(tmp_path, "b")
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    assert cli_main(["config-check", "compare", str(a), str(b), "-o", str(out)]) == 2
    assert "--overwrite" in capsys.readouterr().err and not (out / "result.json").exists()
    assert cli_main(["config-check", "compare", str(a), str(b), "-o", str(out), "--overwrite"]) == 1
    assert (out / "mine.txt").read_text() == "keep"
    result = json.loads((out / "result.json").read_text())
    assert result["passed"] is False and result["checks"]["environment"]["differences"][0]["key"] == "NCCL_ALGO"
    assert "NCCL_ALGO" in (out / "environment.csv").read_text()


@pytest.mark.parametrize("content", [b"", b"PK\x03\x04 cut", b"not a zip"])
def test_a_bad_pack_is_named(tmp_path, capsys, content):
    good = cli_capture(tmp_path, "good")
    bad = tmp_path / "bad.zip"
    bad.write_bytes(content if content else good.read_bytes()[:100])
    assert cli_main(["config-check", "compare", str(good), str(bad)]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "Traceback" not in err


def test_a_zip_that_is_not_a_pack_is_named(tmp_path, capsys):
    other = tmp_path / "other.zip"
    with zipfile.ZipFile(other, "w") as z:
        z.writestr("readme.txt", "hello")
    assert cli_main(["config-check", "compare", str(other), str(other)]) == 2
    assert "not a config-check pack" in capsys.readouterr().err


def tiny_model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def run_capture(tmp_path, name, seed=0, batches=2):
    model = tiny_model(seed)
    torch.manual_seed(100)  # the training seed
    taken = capture(model, args={"lr": 0.1}, output=tmp_path / f"{name}.zip", batches=batches)
    with torch.no_grad():
        model(torch.ones(2, 4))  # evaluation: not a micro-step
    model.eval()
    model(torch.ones(2, 4))
    model.train()
    for _ in range(3):
        model(torch.randn(3, 4)).sum().backward()
    assert taken.written  # written once the batches were in
    return tmp_path / f"{name}.zip"


def test_in_process_capture_records_training_micro_steps_only(tmp_path):
    with zipfile.ZipFile(run_capture(tmp_path, "a")) as pack:
        dataset = json.loads(pack.read("dataset.json"))
        weights = json.loads(pack.read("weights.json"))
    assert [(r["micro_step"], r["name"], r["shape"]) for r in dataset] == [(0, "input.0", [3, 4]),
                                                                          (1, "input.0", [3, 4])]
    assert [w["name"] for w in weights] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert weights[0]["norm"] == pytest.approx(float(tiny_model(0)[0].weight.detach().norm()), rel=1e-6)


def test_other_initial_weights_fail_the_weight_check(tmp_path, capsys):
    a, b = run_capture(tmp_path, "a"), run_capture(tmp_path, "b", seed=1)
    assert cli_main(["config-check", "compare", str(a), str(b), "-o", str(tmp_path / "out")]) == 1
    checks = json.loads((tmp_path / "out" / "result.json").read_text())["checks"]
    assert {n for n, c in checks.items() if c["status"] == "fail"} == {"weights"}


def test_a_generator_in_another_state_fails_the_random_check(tmp_path, capsys):
    a = run_capture(tmp_path, "a")
    torch.manual_seed(5)
    model = tiny_model(0)
    torch.rand(1)  # one more random call before the capture than in `a`
    torch.manual_seed(100)
    torch.rand(1)
    capture(model, args={"lr": 0.1}, output=tmp_path / "b.zip", batches=0)
    assert cli_main(["config-check", "compare", str(a), str(tmp_path / "b.zip"), "-o", str(tmp_path / "out")]) == 1
    checks = json.loads((tmp_path / "out" / "result.json").read_text())["checks"]
    assert checks["random"]["status"] == "fail" and checks["weights"]["status"] == "pass"
    assert checks["dataset"]["status"] == "fail"  # b recorded no batch: absent micro-steps differ


def test_the_monitor_config_key_writes_a_pack(tmp_path, output_dir, write_config):
    model = tiny_model(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(write_config(config_check={"enable": True, "batches": 1}))
    monitor.set_monitor(model, optimizer)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    monitor.stop()
    pack = monitor.output_dir.parent / "config_check" / "rank_0.zip"
    with zipfile.ZipFile(pack) as z:
        assert {"weights.json", "dataset.json", "random.json", "environment.json"} <= set(z.namelist())


def test_an_unreadable_script_line_is_named(tmp_path, capsys):
    script = tmp_path / "train.sh"
    script.write_text('LR=1\n\npython train.py \\\n    --lr $LR \\\n    --name "no closing quote\n')
    assert cli_main(["config-check", "capture", "--script", str(script), "-o", str(tmp_path / "p.zip")]) == 2
    err = capsys.readouterr().err
    assert f"{script}, line 3" in err and "Traceback" not in err and not (tmp_path / "p.zip").exists()
