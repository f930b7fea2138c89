"""DDP and FSDP2 jobs on 2 processes (gloo): figures of sharded and reduced tensors equal direct computations."""
import json
import math
import os

from common import TinyLM
from launch import torchrun
from test_csv_output import read_family
from verify import (SAVED_FAMILIES, SHARDED_FAMILIES, assert_norms_match, assert_one_record_per_call,
                    assert_reduced_is_the_mean, assert_same_labels, assert_sharding_collectives, differing, nan_analyze,
                    the_run)


def test_ddp_two_ranks(tmp_path):
    output_dir = tmp_path / "monitor_output"
    torchrun("job_torch.py", 2, ["--mode", "ddp", "--out", str(tmp_path)], output_dir)
    run = the_run(output_dir)
    for rank in (0, 1):
        meta = json.load(open(os.path.join(run, f"rank_{rank}", "run.json")))
        assert meta["adapter"] == "ddp"
        assert meta["parallel"]["global_rank"] == rank
        assert meta["parallel"]["dp"] == {"rank": rank, "size": 2, "ranks": [0, 1]}
    checked = assert_norms_match(run, tmp_path, (0, 1), SHARDED_FAMILIES + ("grad_unreduced",))
    assert checked == 2 * 3 * 6 * len(list(TinyLM().parameters()))  # ranks × steps × families × parameters
    changed, total = differing(run, "grad_unreduced", 0, 1)
    assert changed == total, "each rank's unreduced grads come from its own data"
    assert differing(run, "grad_reduced", 0, 1)[0] == 0, "after the all-reduce every rank holds the same grads"
    assert assert_reduced_is_the_mean(run, tmp_path, (0, 1)) == 2 * 3 * len(list(TinyLM().parameters()))
    assert_same_labels(run, SHARDED_FAMILIES + ("grad_unreduced",), 0, 1)
    # trainmon.save / save_grad of the logits: ranks × steps × families
    assert assert_norms_match(run, tmp_path, (0, 1), SAVED_FAMILIES, per_micro=True) == 2 * 3 * 2
    assert_one_record_per_call(run)


def test_fsdp2_two_ranks(tmp_path):
    output_dir = tmp_path / "monitor_output"
    torchrun("job_torch.py", 2, ["--mode", "fsdp2", "--out", str(tmp_path), "--micro-batches", "2", "--cc"],
             output_dir)
    run = the_run(output_dir)
    # FSDP2's param all-gathers and grad reduce-scatters (torch's *_single ops)
    assert_sharding_collectives(run, 3, "all_gather_single", "reduce_scatter_single")
    # At odd steps one reduce-scatter per parameter group averages the grads accumulated over the micro-batches:
    # the outputs of both ranks hold the reduced grads, whose norms the job computed.
    scattered = [r.norm for rank in (0, 1) for r in read_family(os.path.join(run, f"rank_{rank}"), "comm").itertuples()
                 if r.step == 1 and r.name.startswith("reduce_scatter_single[0,1]") and r.name.endswith(".output")]
    reduced = json.load(open(tmp_path / "truth.rank0.json"))["1"]["grad_reduced"].values()
    assert len(scattered) == 2 * 3  # ranks × parameter groups (the two blocks and the root)
    assert math.isclose(sum(n ** 2 for n in scattered), sum(n ** 2 for n in reduced), rel_tol=1e-5)
    for rank in (0, 1):
        meta = json.load(open(os.path.join(run, f"rank_{rank}", "run.json")))
        assert meta["adapter"] == "fsdp2"
        assert meta["parallel"]["dp"] == {"rank": rank, "size": 2, "ranks": [0, 1]}
    parameters = len(list(TinyLM().parameters()))
    checked = assert_norms_match(run, tmp_path, (0, 1), SHARDED_FAMILIES)
    assert checked == 2 * 3 * 5 * parameters  # ranks × steps × families × parameters
    # Each micro-batch's own unsharded grad, whether FSDP reduce-scatters after it or accumulates (odd steps).
    checked = assert_norms_match(run, tmp_path, (0, 1), ("grad_unreduced",), per_micro=True)
    assert checked == 2 * 3 * 2 * parameters  # ranks × steps × micro-batches × parameters
    changed, total = differing(run, "grad_unreduced", 0, 1, per_micro=True)
    assert changed == total, "each rank's unreduced grads come from its own data"
    # trainmon.save / save_grad of the logits, per micro-step: ranks × steps × micro-batches × families
    assert assert_norms_match(run, tmp_path, (0, 1), SAVED_FAMILIES, per_micro=True) == 2 * 3 * 2 * 2
    for family in SHARDED_FAMILIES:
        assert differing(run, family, 0, 1)[0] == 0, f"{family}: merged records are the same on every rank"
    for rank in (0, 1):
        left = json.load(open(tmp_path / f"hooks.rank{rank}.json"))
        assert left == {"unsharded": parameters, "hooked": 0, "pre_hooks_added": 0}, "stop() removes every hook"
    assert_one_record_per_call(run)


def test_fsdp2_module_ranks_leaves_the_merge_whole_and_the_other_ranks_silent(tmp_path):
    """Rank 1 still takes part in merging the shards' records (rank 0's full-parameter figures are right)
    but writes no statistics."""
    output_dir = tmp_path / "monitor_output"
    torchrun("job_torch.py", 2, ["--mode", "fsdp2", "--out", str(tmp_path), "--module-ranks", "0"], output_dir)
    run = the_run(output_dir)
    assert assert_norms_match(run, tmp_path, (0,), SHARDED_FAMILIES) == 3 * 5 * len(list(TinyLM().parameters()))
    assert not [f for f in os.listdir(os.path.join(run, "rank_1")) if f.endswith(".csv")]
    assert len(read_family(os.path.join(run, "rank_0"), "actv")) > 0, "rank 0 records its activations"
    assert_one_record_per_call(run)


def test_ddp_inf_on_rank_1_is_traced_to_it(tmp_path):
    output_dir = tmp_path / "monitor_output"
    torchrun("job_torch.py", 2, ["--mode", "ddp", "--out", str(tmp_path), "--inject", "1:1"], output_dir)
    report = nan_analyze(the_run(output_dir))
    first = report["first"]
    assert (first["rank"], first["step"], first["module"], first["phase"]) == (1, 1, "blocks.0", "forward")
    assert any(c["rank"] == 0 for c in report["chain"]), "the all-reduce spread it to rank 0"
    # the model's output, DDP's and its module's, one record per forward
    assert assert_one_record_per_call(the_run(output_dir)) > 0
