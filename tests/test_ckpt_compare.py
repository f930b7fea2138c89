"""ckpt-compare on files written here: torch.save, safetensors, torch.distributed.checkpoint; name mapping,
shapes that differ, and bad input (truncated, foreign, unsafe pickles) named with exit status 2."""
import json

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn

from trainmon.ckpt import compare_checkpoints
from trainmon.cli import main as cli_main


def state(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    nn.init.zeros_(model[0].bias)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_torch_file_safetensors_and_dcp_of_the_same_weights_are_identical(tmp_path):
    save_file = pytest.importorskip("safetensors.torch").save_file
    weights = state()
    torch.save({"model": weights, "iteration": 3}, tmp_path / "model.pt")
    save_file(weights, tmp_path / "model.safetensors")
    dcp.save(weights, checkpoint_id=tmp_path / "dcp", no_dist=True)
    for a, b in (("model.pt", "model.safetensors"), ("dcp", "model.pt"), ("dcp", "dcp")):
        result = compare_checkpoints(tmp_path / a, tmp_path / b)
        assert result["summary"] == {"compared": 4, "identical": 4, "differ": 0, "only_in_a": 0, "only_in_b": 0}, (a, b)
        assert all(p["cosine"] == 1.0 and p["l2"] == 0.0 for p in result["parameters"].values())  # zero bias too
    assert compare_checkpoints(tmp_path / "dcp", tmp_path / "model.pt")["a"]["format"] == "torch.distributed.checkpoint"


def test_distances_shapes_and_names_in_one_side(tmp_path):
    a, b = state(0), state(1)
    b["2.weight"] = torch.zeros(3, 8)
    b["extra"] = torch.ones(1)
    torch.save(a, tmp_path / "a.pt")
    torch.save(b, tmp_path / "b.pt")
    result = compare_checkpoints(tmp_path / "a.pt", tmp_path / "b.pt")
    w = result["parameters"]["0.weight"]
    diff = a["0.weight"].double() - b["0.weight"].double()
    assert w["l2"] == pytest.approx(float(diff.norm())) and w["max_abs_diff"] == pytest.approx(float(diff.abs().max()))
    assert w["cosine"] == pytest.approx(float(nn.functional.cosine_similarity(a["0.weight"].double().flatten(),
                                                                              b["0.weight"].double().flatten(), 0)))
    assert result["parameters"]["2.weight"]["note"] == "shapes differ"
    assert result["only_in_b"] == ["extra"] and result["summary"]["differ"] == 3


def test_a_mapping_file_renames_a_side(tmp_path, capsys):
    torch.save(state(), tmp_path / "a.pt")
    torch.save({f"model.{k}": v for k, v in state().items()}, tmp_path / "b.pt")
    (tmp_path / "map.json").write_text(json.dumps({r"model\.(.*)": r"\1"}))  # B's names in A's terms
    out = tmp_path / "r.json"
    assert cli_main(["ckpt-compare", str(tmp_path / "a.pt"), str(tmp_path / "b.pt"),
                     "--map", str(tmp_path / "map.json"), "-o", str(out)]) == 0
    assert json.loads(out.read_text())["summary"]["identical"] == 4
    assert "4 parameters compared: 4 identical" in capsys.readouterr().out


class Payload:
    pass


@pytest.mark.parametrize("make, expect", [
    (lambda p: p.write_bytes(b"hello, not a checkpoint"), "not a checkpoint file"),
    (lambda p: (torch.save(state(), p), p.write_bytes(p.read_bytes()[:300])), "not a readable torch checkpoint"),
    (lambda p: torch.save({"w": torch.ones(1), "obj": Payload()}, p), "not loaded for safety"),
    (lambda p: p.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{broken"), "not a readable safetensors"),
])
def test_bad_input_is_named(tmp_path, capsys, make, expect):
    path = tmp_path / ("bad.safetensors" if "safetensors" in expect else "bad.pt")
    make(path)
    torch.save(state(), tmp_path / "good.pt")
    assert cli_main(["ckpt-compare", str(path), str(tmp_path / "good.pt")]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and expect in err and "Traceback" not in err


def test_a_directory_that_is_no_checkpoint_and_a_bad_mapping_are_named(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    torch.save(state(), tmp_path / "good.pt")
    assert cli_main(["ckpt-compare", str(tmp_path / "empty"), str(tmp_path / "good.pt")]) == 2
    assert "not a checkpoint directory" in capsys.readouterr().err
    (tmp_path / "map.json").write_text("[1, 2]")
    assert cli_main(["ckpt-compare", str(tmp_path / "good.pt"), str(tmp_path / "good.pt"), "--map",
                     str(tmp_path / "map.json")]) == 2
    assert str(tmp_path / "map.json") in capsys.readouterr().err


def test_megatron_legacy_shards_merge_with_vpp_and_swiglu(tmp_path):
    """Full tensors cut as Megatron cuts them (TP2, PP2, 2 virtual chunks of one layer, swiglu: each fc1 shard
    is [its gate part; its up part]) and saved in the legacy layout merge back to exactly those tensors."""
    import argparse
    torch.manual_seed(0)
    layer = lambda: {"input_layernorm.weight": torch.randn(4), "self_attention.linear_qkv.weight": torch.randn(12, 4),
                     "self_attention.linear_proj.weight": torch.randn(4, 8),
                     "mlp.linear_fc1.weight": torch.randn(16, 4)}
    full = {f"decoder.layers.{g}.{k}": v for g in range(4) for k, v in layer().items()}
    full["embedding.word_embeddings.weight"] = torch.randn(10, 4)
    full["output_layer.weight"] = torch.randn(10, 4)
    torch.save(full, tmp_path / "full.pt")

    def shard(name, tensor, tp):
        if name.endswith("linear_fc1.weight"):
            gate, up = tensor.chunk(2)
            return torch.cat([gate.chunk(2)[tp], up.chunk(2)[tp]])
        if name.endswith(("linear_qkv.weight", "word_embeddings.weight", "output_layer.weight")):
            return tensor.chunk(2, dim=0)[tp]
        if name.endswith("linear_proj.weight"):
            return tensor.chunk(2, dim=1)[tp]
        return tensor

    iteration = tmp_path / "ckpt" / "iter_0000005"
    for tp in (0, 1):
        for pp in (0, 1):
            state = {"args": argparse.Namespace(swiglu=True, params_dtype=torch.float32), "iteration": 5}
            for chunk in (0, 1):
                g = 2 * chunk + pp  # Megatron's interleaved order: chunk-major, then stage
                model = {f"decoder.layers.0.{k}": shard(k, full[f"decoder.layers.{g}.{k}"], tp) for k in layer()}
                if (chunk, pp) == (0, 0):
                    model["embedding.word_embeddings.weight"] = shard("word_embeddings.weight",
                                                                      full["embedding.word_embeddings.weight"], tp)
                if (chunk, pp) == (1, 1):
                    model["output_layer.weight"] = shard("output_layer.weight", full["output_layer.weight"], tp)
                model["decoder.layers.0.mlp.linear_fc1._extra_state"] = None
                state[f"model{chunk}"] = model
            (iteration / f"mp_rank_{tp:02d}_{pp:03d}").mkdir(parents=True)
            torch.save(state, iteration / f"mp_rank_{tp:02d}_{pp:03d}" / "model_optim_rng.pt")
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("5")
    result = compare_checkpoints(tmp_path / "ckpt", tmp_path / "full.pt")
    assert result["a"]["format"] == "megatron-legacy"
    assert result["summary"] == {"compared": len(full), "identical": len(full), "differ": 0, "only_in_a": 0,
                                 "only_in_b": 0}


def test_a_latest_file_naming_a_missing_iteration_is_named(tmp_path, capsys):
    (tmp_path / "ckpt" / "iter_0000001" / "mp_rank_00").mkdir(parents=True)
    torch.save({"model": state()}, tmp_path / "ckpt" / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt")
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("7")
    assert cli_main(["ckpt-compare", str(tmp_path / "ckpt"), str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err
    assert "latest_checkpointed_iteration.txt" in err and "iter_0000007" in err
