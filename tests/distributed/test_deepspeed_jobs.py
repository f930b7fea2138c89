"""DeepSpeed ZeRO-0/1/2/3 on 2 processes (CPU accelerator, gloo): the figures written for partitioned tensors
are those of the full tensors that DeepSpeed's safe_get_full_* gather, and reduced grads are the ranks' mean."""
import json
import os

import pytest

from common import TinyLM
from launch import torchrun
from verify import (SAVED_FAMILIES, SHARDED_FAMILIES, assert_injection_named, assert_norms_match,
                    assert_reduced_is_the_mean, assert_same_labels, assert_unpatched, differing, the_run)

pytest.importorskip("deepspeed")
OPTIMIZER_FAMILIES = SHARDED_FAMILIES + ("mg_direction",)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stage_two_ranks(tmp_path, stage):
    output_dir = tmp_path / "monitor_output"
    torchrun("job_deepspeed.py", 2, ["--stage", str(stage), "--out", str(tmp_path)], output_dir)
    run = the_run(output_dir)
    for rank in (0, 1):
        meta = json.load(open(os.path.join(run, f"rank_{rank}", "run.json")))
        assert meta["adapter"].startswith("deepspeed (DeepSpeedZeroOptimizer")
        assert meta["parallel"]["dp"] == {"rank": rank, "size": 2, "ranks": [0, 1]}
    assert_unpatched(tmp_path, (0, 1))
    checked = assert_norms_match(run, tmp_path, (0, 1), OPTIMIZER_FAMILIES + ("grad_unreduced",))
    assert checked == 2 * 3 * 7 * len(list(TinyLM().parameters()))  # ranks × steps × families × parameters
    changed, total = differing(run, "grad_unreduced", 0, 1)
    assert changed == total, "each rank's unreduced grads come from its own data"
    for family in OPTIMIZER_FAMILIES:
        assert differing(run, family, 0, 1)[0] == 0, f"{family}: merged records are the same on every rank"
    # trainmon.save / save_grad of the logits: ranks × steps × families
    assert assert_norms_match(run, tmp_path, (0, 1), SAVED_FAMILIES, per_micro=True) == 2 * 3 * 2


def test_zero0_reduced_grads_are_the_mean_of_the_ranks(tmp_path):
    """ZeRO-0 keeps whole tensors on every rank and all-reduces the grads through `.grad.data`, which leaves
    their `_version` as it was: grad_reduced is still read after that reduction."""
    output_dir = tmp_path / "monitor_output"
    torchrun("job_deepspeed.py", 2, ["--stage", "0", "--out", str(tmp_path)], output_dir)
    run = the_run(output_dir)
    parameters = len(list(TinyLM().parameters()))
    checked = assert_norms_match(run, tmp_path, (0, 1), OPTIMIZER_FAMILIES + ("grad_unreduced",))
    assert checked == 2 * 3 * 7 * parameters  # ranks × steps × families × parameters
    changed, total = differing(run, "grad_unreduced", 0, 1)
    assert changed == total, "each rank's unreduced grads come from its own data"
    for family in OPTIMIZER_FAMILIES:
        assert differing(run, family, 0, 1)[0] == 0, f"{family}: after the all-reduce every rank holds the same"
    assert assert_reduced_is_the_mean(run, tmp_path, (0, 1)) == 2 * 3 * parameters
    assert_same_labels(run, OPTIMIZER_FAMILIES + ("grad_unreduced",), 0, 1)


def test_bf16_optimizer_two_ranks(tmp_path):
    """bf16 weights, fp32 master weights and grads in DeepSpeed's BF16_Optimizer (ZeRO-1 partitions)."""
    output_dir = tmp_path / "monitor_output"
    torchrun("job_deepspeed.py", 2, ["--stage", "1", "--bf16", "--out", str(tmp_path)], output_dir)
    run = the_run(output_dir)
    assert json.load(open(os.path.join(run, "rank_0", "run.json")))["adapter"] == "deepspeed (BF16_Optimizer)"
    # grad_unreduced is left out: the job's fp32 replica cannot reproduce bf16 grads to 1e-5
    checked = assert_norms_match(run, tmp_path, (0, 1), OPTIMIZER_FAMILIES)
    assert checked == 2 * 3 * 6 * len(list(TinyLM().parameters()))


@pytest.mark.parametrize("cc", ["off", "on"])
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_inf_on_rank_1_is_named_first(tmp_path, stage, cc):
    """An inf put into rank 1's blocks.0 output at step 1 (a hook registered before set_monitor) reaches rank 0
    only through the grad reduction: the online alert and nan-analyze, from every source, name rank 1."""
    output_dir = tmp_path / "monitor_output"
    log = torchrun("job_deepspeed.py", 2, ["--stage", str(stage), "--out", str(tmp_path), "--cc", cc,
                                           "--inject", "1:1:0"], output_dir)
    assert "anomaly at rank 1 step 1 micro-step 0: blocks.0 forward output (sentinel" in log
    assert_injection_named(the_run(output_dir), tmp_path, dict(rank=1, step=1, micro_step=0, module="blocks.0",
                                                               phase="forward"), cc)
