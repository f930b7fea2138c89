"""ckpt-compare on Megatron-Core legacy checkpoints saved by real TP2xPP2 and TP1xPP2 jobs (CPU shims, gloo):
shards merge into the full parameters the jobs gathered themselves, under global layer numbers."""
import json

import pytest
import torch

from launch import torchrun
from trainmon.cli import main as cli_main

pytest.importorskip("megatron.core")


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """TP2xPP2 saving at iterations 0 and 2, and TP1xPP2 from the same seed saving at iteration 0, also as a
    dist checkpoint."""
    root = tmp_path_factory.mktemp("megatron_ckpt")
    torchrun("job_megatron_ckpt.py", 4, ["--out", str(root / "tp2"), "--tp", "2", "--pp", "2", "--save-at", "0,2",
                                          "--capture"],
             root / "monitor")
    torchrun("job_megatron_ckpt.py", 2,
             ["--out", str(root / "tp1"), "--tp", "1", "--pp", "2", "--save-at", "0", "--dist"], root / "monitor")
    return root


def truth(job_dir, iteration):
    """The full parameters the job gathered, from both pipeline stages."""
    merged = {}
    for stage in (0, 1):
        merged.update(torch.load(job_dir / "truth" / f"iter_{iteration:07d}.pp{stage}.pt"))
    return merged


def ckpt_compare(capsys, tmp_path, a, b, *options):
    out = tmp_path / "result.json"
    code = cli_main(["ckpt-compare", str(a), str(b), "-o", str(out), *options])
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    summary = result["summary"]
    assert code == (0 if summary["differ"] == summary["only_in_a"] == summary["only_in_b"] == 0 else 1)
    return result, printed


def test_with_itself_latest_iteration(jobs, capsys, tmp_path):
    result, printed = ckpt_compare(capsys, tmp_path, jobs / "tp2" / "legacy", jobs / "tp2" / "legacy")
    assert result["a"]["format"] == "megatron-legacy"
    assert result["a"]["read"].endswith("iter_0000002")  # latest_checkpointed_iteration.txt
    names = set(truth(jobs / "tp2", 2))
    assert set(result["parameters"]) == names and "decoder.layers.3.mlp.linear_fc2.weight" in names
    assert result["summary"]["identical"] == len(names) and result["summary"]["differ"] == 0
    assert all(p["cosine"] == 1.0 and p["l2"] == 0.0 for p in result["parameters"].values())
    assert f"{len(names)} parameters compared: {len(names)} identical" in printed


def test_two_iterations_match_torch_on_the_gathered_parameters(jobs, capsys, tmp_path):
    legacy = jobs / "tp2" / "legacy"
    result, _ = ckpt_compare(capsys, tmp_path, legacy / "iter_0000000", legacy / "iter_0000002")
    first, last = truth(jobs / "tp2", 0), truth(jobs / "tp2", 2)
    assert result["summary"]["differ"] == len(first)
    for name, p in result["parameters"].items():
        a, b = first[name].double(), last[name].double()
        assert p["shape_a"] == list(a.shape) and p["numel"] == a.numel()
        assert p["l2"] == pytest.approx(float((a - b).norm()), rel=1e-9) and p["l2"] > 0
        assert p["max_abs_diff"] == pytest.approx(float((a - b).abs().max()), rel=1e-9)
        norms = float(a.norm() * b.norm())
        assert p["cosine"] == (pytest.approx(float((a * b).sum()) / norms, rel=1e-9) if norms else 0.0)


def test_tp2_and_tp1_of_the_same_weights_are_identical(jobs, capsys, tmp_path):
    result, _ = ckpt_compare(capsys, tmp_path, jobs / "tp2" / "legacy" / "iter_0000000", jobs / "tp1" / "legacy")
    assert result["summary"]["differ"] == 0 and result["summary"]["only_in_a"] == 0
    assert result["summary"]["identical"] == len(truth(jobs / "tp1", 0))


def test_a_mapping_file_renames_a_side(jobs, capsys, tmp_path):
    """B's layer 3 is compared as A's layer 0 and the other way round: same shapes, other values."""
    mapping = tmp_path / "map.json"
    mapping.write_text(json.dumps({r"decoder\.layers\.3\.(.*)": r"decoder.layers.0.\1",
                                   r"decoder\.layers\.0\.(.*)": r"decoder.layers.3.\1"}))
    legacy = jobs / "tp2" / "legacy" / "iter_0000000"
    result, _ = ckpt_compare(capsys, tmp_path, legacy, legacy, "--map", str(mapping))
    swapped = result["parameters"]["decoder.layers.0.mlp.linear_fc1.weight"]
    assert swapped["name_b"] == "decoder.layers.3.mlp.linear_fc1.weight" and not swapped["identical"]
    assert result["parameters"]["decoder.layers.1.mlp.linear_fc1.weight"]["identical"]


def test_dist_checkpoint_of_the_same_weights_is_identical(jobs, capsys, tmp_path):
    """Megatron's dist checkpoint stacks every layer's parameter and names the local spec's layer norms as the
    fused layout does: a mapping file bridges the names."""
    mapping = tmp_path / "map.json"
    mapping.write_text(json.dumps({
        r"(.*)\.self_attention\.linear_qkv\.layer_norm_(weight|bias)": r"\1.input_layernorm.\2",
        r"(.*)\.mlp\.linear_fc1\.layer_norm_(weight|bias)": r"\1.pre_mlp_layernorm.\2"}))
    result, _ = ckpt_compare(capsys, tmp_path, jobs / "tp2" / "legacy" / "iter_0000000",
                             jobs / "tp1" / "dist" / "iter_0000000", "--map", str(mapping))
    assert result["b"]["format"] == "torch.distributed.checkpoint"
    assert result["summary"] == {"compared": len(truth(jobs / "tp2", 0)), "identical": result["summary"]["compared"],
                                 "differ": 0, "only_in_a": 0, "only_in_b": 0}


def test_a_truncated_shard_is_named(jobs, capsys, tmp_path):
    import shutil
    copy = tmp_path / "iter"
    shutil.copytree(jobs / "tp2" / "legacy" / "iter_0000000", copy)
    shard = copy / "mp_rank_01_001" / "model_optim_rng.pt"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    assert cli_main(["ckpt-compare", str(copy), str(jobs / "tp1" / "legacy")]) == 2
    err = capsys.readouterr().err
    assert str(shard) in err and "Traceback" not in err


def test_config_check_capture_of_megatron_args_and_chunks(jobs, capsys, tmp_path):
    """Megatron's `args` and every rank's weight shards and first micro-batch go into the pack; the pack of a job
    compared with itself passes; a missing pack is named."""
    import zipfile
    pack = jobs / "tp2" / "pack"
    assert sorted(p.name for p in pack.iterdir()) == [f"rank_{r}.zip" for r in range(4)]
    with zipfile.ZipFile(pack / "rank_3.zip") as z:
        hyper = json.loads(z.read("hyperparameters.json"))["compared"]
        weights = json.loads(z.read("weights.json"))
        dataset = json.loads(z.read("dataset.json"))
    assert hyper["tensor_model_parallel_size"] == 2 and hyper["lr"] == 1e-3 and hyper["params_dtype"] == "torch.float32"
    assert any(w["name"].endswith("decoder.layers.0.mlp.linear_fc1.weight") and w["shape"] == [128, 64]
               for w in weights)  # a TP shard of fc1 (256 x 64 in full)
    assert {row["micro_step"] for row in dataset} == {0} and any(row["name"] == "input.0" for row in dataset)
    assert cli_main(["config-check", "compare", str(pack), str(pack)]) == 0
    capsys.readouterr()
    assert cli_main(["config-check", "compare", str(pack), str(tmp_path / "missing")]) == 2
    assert str(tmp_path / "missing") in capsys.readouterr().err
