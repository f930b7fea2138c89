"""Megatron-Core on 2 and 4 processes (CPU shims, gloo): the figures written for TP shards, pipeline stages and
DistributedOptimizer shards are those of the gathered full tensors."""
import json
import os

import pytest

from launch import torchrun
from verify import assert_norms_match, differing, norms, the_run

pytest.importorskip("megatron.core")
FAMILIES = ("grad_unreduced", "grad_reduced", "exp_avg", "exp_avg_sq")


def run_job(tmp_path, nproc, *options):
    output_dir = tmp_path / "monitor_output"
    torchrun("job_megatron.py", nproc, ["--out", str(tmp_path), *options], output_dir)
    run = the_run(output_dir)
    metas = [json.load(open(os.path.join(run, f"rank_{r}", "run.json"))) for r in range(nproc)]
    for rank, meta in enumerate(metas):
        assert meta["adapter"].startswith("megatron (")
        assert meta["parallel"]["global_rank"] == rank
    assert assert_norms_match(run, tmp_path, range(nproc), FAMILIES) > 0
    return run, [m["parallel"] for m in metas]


def test_tensor_parallel_2(tmp_path):
    run, coords = run_job(tmp_path, 2, "--tp", "2")
    assert [c["tp"] for c in coords] == [{"rank": r, "size": 2, "ranks": [0, 1]} for r in (0, 1)]
    for family in FAMILIES:  # the merged records of the full parameters, the same on both TP ranks
        assert differing(run, family, 0, 1)[0] == 0, family


def test_pipeline_parallel_2(tmp_path):
    run, coords = run_job(tmp_path, 2, "--pp", "2")
    assert [c["pp"] for c in coords] == [{"rank": r, "size": 2, "ranks": [0, 1]} for r in (0, 1)]
    first, last = (set(n for _, n in norms(os.path.join(run, f"rank_{r}"), "grad_reduced")) for r in (0, 1))
    assert "embedding.word_embeddings.weight" in first and "embedding.word_embeddings.weight" not in last
    assert "output_layer.weight" in last and "output_layer.weight" not in first


def test_data_parallel_2_distributed_optimizer(tmp_path):
    run, coords = run_job(tmp_path, 2, "--distopt")
    assert [c["dp"] for c in coords] == [{"rank": r, "size": 2, "ranks": [0, 1]} for r in (0, 1)]
    changed, total = differing(run, "grad_unreduced", 0, 1)
    assert changed == total, "each DP rank's unreduced grads come from its own data"
    for family in ("grad_reduced", "exp_avg", "exp_avg_sq"):
        assert differing(run, family, 0, 1)[0] == 0, family


def test_tensor_2_by_pipeline_2(tmp_path):
    run, coords = run_job(tmp_path, 4, "--tp", "2", "--pp", "2")
    assert [c["tp"]["ranks"] for c in coords] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [c["pp"]["ranks"] for c in coords] == [[0, 2], [1, 3], [0, 2], [1, 3]]
