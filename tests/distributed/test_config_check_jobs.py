"""config-check and ckpt-compare on real DeepSpeed ZeRO-2 jobs (2 processes, CPU, gloo).

One job per variant; every assertion about a variant reuses its packs and checkpoints."""
import json
import zipfile

import pytest
import torch

from common import TinyLM
from launch import torchrun
from trainmon.cli import main as cli_main

pytest.importorskip("deepspeed")
SECRETS = {"HF_TOKEN": "hf_do_not_leak_1", "WANDB_API_KEY": "do_not_leak_2", "NCCL_SOCKET_PASSWORD": "do_not_leak_3"}
CHECKS = ("environment", "packages", "hyperparameters", "weights", "dataset", "random")


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """{variant: job directory}: the reference job (also saving checkpoints at iterations 0 and 2), the same job
    again with secret-looking variables set, and one job per single change."""
    root = tmp_path_factory.mktemp("ds_check")
    other_weights = root / "seed1.pt"
    torch.manual_seed(1)
    torch.save(TinyLM().state_dict(), other_weights)
    variants = {"reference": (["--save-at", "0,2"], {}), "again": ([], SECRETS), "lr": (["--lr", "2e-2"], {}),
                "weights": (["--load", str(other_weights)], {}), "shuffled": (["--shuffle"], {}),
                "env": ([], {"NCCL_ALGO": "Tree"})}
    out = {}
    for name, (options, env) in variants.items():
        out[name] = root / name
        torchrun("job_deepspeed_check.py", 2, ["--out", str(out[name])] + options, root / f"{name}_monitor", env)
    return out


def compare(capsys, a, b, out_dir):
    status = cli_main(["config-check", "compare", str(a), str(b), "-o", str(out_dir)])
    printed = capsys.readouterr().out
    result = json.loads((out_dir / "result.json").read_text())
    failed = {name for name, check in result["checks"].items() if check["status"] == "fail"}
    return status, failed, result, printed


def test_the_same_job_twice_passes_every_check(jobs, capsys, tmp_path):
    status, failed, result, printed = compare(capsys, jobs["reference"] / "pack", jobs["again"] / "pack",
                                              tmp_path / "out")
    assert status == 0 and failed == set(), printed
    assert all(result["checks"][name]["status"] == "pass" for name in CHECKS)
    assert result["checks"]["weights"]["compared"] == 2 * len(list(TinyLM().parameters()))  # per rank
    assert result["checks"]["dataset"]["compared"] == 2 * 2 * 2  # ranks x micro-steps x (tokens, labels)


@pytest.mark.parametrize("variant, check, key", [("lr", "hyperparameters", "lr"), ("weights", "weights", "emb.weight"),
                                                 ("shuffled", "dataset", "0/input.0"),
                                                 ("env", "environment", "NCCL_ALGO")])
def test_one_change_fails_its_check_alone(jobs, capsys, tmp_path, variant, check, key):
    status, failed, result, printed = compare(capsys, jobs["reference"] / "pack", jobs[variant] / "pack",
                                              tmp_path / "out")
    assert status == 1 and failed == {check}, printed
    keys = {d["key"] for d in result["checks"][check]["differences"]}
    assert any(k.endswith(key) for k in keys), keys
    assert f"{check:<16}fail" in printed and "first differences" in printed
    header = (tmp_path / "out" / f"{check}.csv").read_text().splitlines()[0]
    assert header.startswith("rank,key,a,b")


def test_shuffled_batches_have_the_same_statistics_but_not_the_same_hash(jobs, capsys, tmp_path):
    _, _, result, _ = compare(capsys, jobs["reference"] / "pack", jobs["shuffled"] / "pack", tmp_path / "out")
    for d in result["checks"]["dataset"]["differences"]:
        assert d["a_norm"] == pytest.approx(d["b_norm"]) and d["a"] != d["b"]


def test_a_changed_package_version_fails_the_package_check_alone(jobs, capsys, tmp_path):
    """The version of torch in rank 1's pack is edited, as if that machine had another torch."""
    edited = tmp_path / "edited"
    edited.mkdir()
    for rank in (0, 1):
        source = jobs["reference"] / "pack" / f"rank_{rank}.zip"
        with zipfile.ZipFile(source) as old, zipfile.ZipFile(edited / source.name, "w") as new:
            for item in old.namelist():
                data = old.read(item)
                if item == "packages.json" and rank == 1:
                    packages = json.loads(data)
                    packages["torch"] = "0.0.1"
                    data = json.dumps(packages)
                new.writestr(item, data)
    status, failed, result, _ = compare(capsys, jobs["reference"] / "pack", edited, tmp_path / "out")
    assert status == 1 and failed == {"packages"}
    differences = result["checks"]["packages"]["differences"]
    assert [(d["rank"], d["key"], d["b"]) for d in differences] == [(1, "torch", "0.0.1")]


def test_secrets_never_reach_a_pack(jobs):
    for rank in (0, 1):
        with zipfile.ZipFile(jobs["again"] / "pack" / f"rank_{rank}.zip") as pack:
            text = "".join(pack.read(item).decode() for item in pack.namelist())
        for name, value in SECRETS.items():
            assert name not in text and value not in text


def ckpt_compare(capsys, tmp_path, a, b):
    out = tmp_path / "result.json"
    code = cli_main(["ckpt-compare", str(a), str(b), "-o", str(out)])
    capsys.readouterr()
    result = json.loads(out.read_text())
    summary = result["summary"]
    assert code == (0 if summary["differ"] == summary["only_in_a"] == summary["only_in_b"] == 0 else 1)
    return result


def test_ckpt_compare_with_itself(jobs, capsys, tmp_path):
    result = ckpt_compare(capsys, tmp_path, jobs["reference"] / "ckpt", jobs["reference"] / "ckpt")
    assert result["a"]["format"] == "deepspeed" and result["a"]["read"].endswith("global_step2")  # from `latest`
    parameters = len(list(TinyLM().parameters()))
    assert result["summary"] == {"compared": parameters, "identical": parameters, "differ": 0, "only_in_a": 0,
                                 "only_in_b": 0}
    assert all(p["cosine"] == 1.0 and p["l2"] == 0.0 for p in result["parameters"].values())


def test_ckpt_compare_of_two_iterations_matches_torch(jobs, capsys, tmp_path):
    """Distances between the checkpoints of iterations 0 and 2 equal those of the full fp32 parameters the job
    gathered with DeepSpeed's safe_get_full_fp32_param."""
    ckpt, truth = jobs["reference"] / "ckpt", jobs["reference"] / "truth"
    result = ckpt_compare(capsys, tmp_path, ckpt / "global_step0", ckpt / "global_step2")
    first, last = torch.load(truth / "global_step0.pt"), torch.load(truth / "global_step2.pt")
    assert set(result["parameters"]) == set(first)
    for name, p in result["parameters"].items():
        a, b = first[name].double(), last[name].double()
        assert p["l2"] == pytest.approx(float((a - b).norm()), rel=1e-9, abs=1e-12)
        assert p["l2"] > 0
        assert p["max_abs_diff"] == pytest.approx(float((a - b).abs().max()), rel=1e-9)
        norms = float(a.norm() * b.norm())
        if norms == 0:  # a bias that starts at zero: no direction in common (trainmon compare's convention)
            assert p["cosine"] == 0.0
        else:
            assert p["cosine"] == pytest.approx(float((a * b).sum()) / norms, rel=1e-9)
        assert p["numel"] == a.numel() and p["shape_a"] == list(a.shape)
