"""DeepSpeed ZeRO-0/1/2/3 on 2 processes (CPU accelerator, gloo): the figures written for partitioned tensors
are those of the full tensors that DeepSpeed's safe_get_full_* gather, and reduced grads are the ranks' mean.
With clipping that bites (max norm 0.05), grad_reduced is what the inner torch optimizer's step consumes. With
DeepSpeed MoE under expert parallelism each rank records its own experts, under their global numbers."""
import json
import math
import os

import pytest

from common import TinyLM
from launch import torchrun
from test_csv_output import read_family
from verify import (SAVED_FAMILIES, SHARDED_FAMILIES, assert_clipped, assert_injection_named, assert_norms_match,
                    assert_one_record_per_call, assert_reduced_is_the_mean, assert_same_labels,
                    assert_sharding_collectives, assert_unpatched, differing, nan_analyze, norms, the_run, truth)

pytest.importorskip("deepspeed")
OPTIMIZER_FAMILIES = SHARDED_FAMILIES + ("mg_direction",)
CLIP = 0.05  # DeepSpeed's gradient_clipping: below every step's grad norm in these jobs


# How ZeRO reduces grads and gathers params, through deepspeed.comm's bindings of torch.distributed
SHARDING_COLLECTIVES = {1: ("all_gather_into_tensor", "all_reduce"), 2: ("all_gather_into_tensor", "all_reduce"),
                        3: ("all_gather_into_tensor", "reduce_scatter_tensor")}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stage_two_ranks(tmp_path, stage):
    output_dir = tmp_path / "monitor_output"
    torchrun("job_deepspeed.py", 2, ["--stage", str(stage), "--clip", str(CLIP), "--out", str(tmp_path), "--cc", "on"],
             output_dir)
    run = the_run(output_dir)
    assert_sharding_collectives(run, 3, *SHARDING_COLLECTIVES[stage])
    for rank in (0, 1):
        meta = json.load(open(os.path.join(run, f"rank_{rank}", "run.json")))
        assert meta["adapter"].startswith("deepspeed (DeepSpeedZeroOptimizer")
        assert meta["parallel"]["dp"] == {"rank": rank, "size": 2, "ranks": [0, 1]}
    assert_unpatched(tmp_path, (0, 1))
    parameters = len(list(TinyLM().parameters()))
    checked = assert_norms_match(run, tmp_path, (0, 1), OPTIMIZER_FAMILIES + ("grad_unreduced",))
    assert checked == 2 * 3 * 7 * parameters  # ranks × steps × families × parameters
    assert assert_clipped(run, tmp_path, (0, 1), CLIP) == 2 * 3 * parameters
    changed, total = differing(run, "grad_unreduced", 0, 1)
    assert changed == total, "each rank's unreduced grads come from its own data"
    for family in OPTIMIZER_FAMILIES:
        assert differing(run, family, 0, 1)[0] == 0, f"{family}: merged records are the same on every rank"
    # trainmon.save / save_grad of the logits: ranks × steps × families
    assert assert_norms_match(run, tmp_path, (0, 1), SAVED_FAMILIES, per_micro=True) == 2 * 3 * 2
    assert_one_record_per_call(run)


def test_zero0_reduced_grads_are_the_mean_of_the_ranks(tmp_path):
    """ZeRO-0 keeps whole tensors on every rank and all-reduces the grads through `.grad.data`, which leaves
    their `_version` as it was: grad_reduced is still read after that reduction, and after the engine's
    clipping, which runs before the torch optimizer's step."""
    output_dir = tmp_path / "monitor_output"
    torchrun("job_deepspeed.py", 2, ["--stage", "0", "--clip", str(CLIP), "--out", str(tmp_path)], output_dir)
    run = the_run(output_dir)
    parameters = len(list(TinyLM().parameters()))
    checked = assert_norms_match(run, tmp_path, (0, 1), OPTIMIZER_FAMILIES + ("grad_unreduced",))
    assert checked == 2 * 3 * 7 * parameters  # ranks × steps × families × parameters
    changed, total = differing(run, "grad_unreduced", 0, 1)
    assert changed == total, "each rank's unreduced grads come from its own data"
    for family in OPTIMIZER_FAMILIES:
        assert differing(run, family, 0, 1)[0] == 0, f"{family}: after the all-reduce every rank holds the same"
    assert assert_reduced_is_the_mean(run, tmp_path, (0, 1), max_norm=CLIP) == 2 * 3 * parameters
    assert_same_labels(run, OPTIMIZER_FAMILIES + ("grad_unreduced",), 0, 1)


def test_bf16_optimizer_two_ranks(tmp_path):
    """bf16 weights, fp32 master weights and grads in DeepSpeed's BF16_Optimizer (ZeRO-1 partitions)."""
    output_dir = tmp_path / "monitor_output"
    torchrun("job_deepspeed.py", 2, ["--stage", "1", "--bf16", "--clip", str(CLIP), "--out", str(tmp_path)], output_dir)
    run = the_run(output_dir)
    assert json.load(open(os.path.join(run, "rank_0", "run.json")))["adapter"] == "deepspeed (BF16_Optimizer)"
    # grad_unreduced is left out: the job's fp32 replica cannot reproduce bf16 grads to 1e-5
    parameters = len(list(TinyLM().parameters()))
    checked = assert_norms_match(run, tmp_path, (0, 1), OPTIMIZER_FAMILIES)
    assert checked == 2 * 3 * 6 * parameters
    assert assert_clipped(run, tmp_path, (0, 1), CLIP) == 2 * 3 * parameters


@pytest.mark.parametrize("cc", ["off", "on"])
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_inf_on_rank_1_is_named_first(tmp_path, stage, cc):
    """An inf put into rank 1's blocks.0 output at step 1 (a hook registered before set_monitor) reaches rank 0
    only through the grad reduction: the online alert and nan-analyze, from every source, name rank 1."""
    output_dir = tmp_path / "monitor_output"
    log = torchrun("job_deepspeed.py", 2, ["--stage", str(stage), "--out", str(tmp_path), "--cc", cc,
                                           "--inject", "1:1:0"], output_dir)
    assert "anomaly at rank 1 step 1 micro-step 0: blocks.0 forward output (sentinel" in log
    run = the_run(output_dir)
    assert_injection_named(run, tmp_path, dict(rank=1, step=1, micro_step=0, module="blocks.0", phase="forward"), cc)
    assert_one_record_per_call(run)  # the model's output: the engine's and its module's, once
    if cc == "on":  # rank 0 got it through that step's grad reduction: ZeRO-3 reduce-scatters, ZeRO-0 all-reduces
        link = nan_analyze(run)["cross_rank"]["chain"][0]
        assert (link["step"], link["from"], link["to"]) == (1, [1], [0]), link
        assert link["via"].startswith(("reduce_scatter_tensor" if stage == 3 else "all_reduce") + "[0,1]@"), link
    # ZeRO-2/3 skip that step for its non-finite grad norm, before the inner optimizer consumes anything: the
    # grads are recorded where DeepSpeed skips, so every rank's grad_reduced shows them non-finite
    for rank in (0, 1):
        at_fault = {name: norm for (step, name), norm in norms(os.path.join(run, f"rank_{rank}"), "grad_reduced").items()
                    if step == 1}
        assert at_fault and any(not math.isfinite(norm) for norm in at_fault.values()), (rank, at_fault)


def expert_numbers(run, rank, family):
    """The expert numbers a rank's records of `family` name (`deepspeed_experts.<i>`)."""
    names = read_family(os.path.join(run, f"rank_{rank}"), family).name
    return sorted({n.split("deepspeed_experts.")[1].split(".")[0] for n in names if "deepspeed_experts." in n})


@pytest.mark.parametrize("stage", [1, 2])
def test_moe_expert_parallel_2_each_rank_records_its_own_experts(tmp_path, stage):
    """DeepSpeed MoE, 4 experts on EP2 (2 ranks, expert data parallel 1), ZeRO-1/2 with a torch AdamW: every figure
    of an expert equals the job's own tensors of that rank's experts, under the global expert number (rank 0:
    experts 0 and 1, rank 1: 2 and 3), activations included; dense parameters merge over data parallel."""
    output_dir = tmp_path / "monitor_output"
    torchrun("job_deepspeed_moe.py", 2, ["--stage", str(stage), "--moe-experts", "4", "--ep", "2",
                                         "--out", str(tmp_path)], output_dir)
    run = the_run(output_dir)
    for rank in (0, 1):
        parallel = json.load(open(os.path.join(run, f"rank_{rank}", "run.json")))["parallel"]
        assert parallel["ep"] == {"rank": rank, "size": 2, "ranks": [0, 1]}
        assert parallel["edp"] == {"rank": 0, "size": 1, "ranks": [rank]}
    assert_unpatched(tmp_path, (0, 1))
    checked = assert_norms_match(run, tmp_path, (0, 1), SHARDED_FAMILIES)
    parameters = len(truth(tmp_path, 0)["0"]["param_origin"])
    assert checked == 2 * 3 * 5 * parameters  # ranks × steps × families × parameters
    for family in SHARDED_FAMILIES + ("actv",):
        assert expert_numbers(run, 0, family) == ["0", "1"] and expert_numbers(run, 1, family) == ["2", "3"], family
    for family in SHARDED_FAMILIES:  # experts: each rank its own; dense: the same merged records on both ranks
        a, b = (norms(os.path.join(run, f"rank_{r}"), family) for r in (0, 1))
        dense = [k for k in a if "deepspeed_experts" not in k[1]]
        assert dense and all(a[k] == pytest.approx(b[k], rel=1e-9) for k in dense), family
        for step, name in a:
            if "deepspeed_experts.0." in name:  # rank 1's expert 2 is not rank 0's expert 0
                assert b[(step, name.replace("experts.0.", "experts.2."))] != pytest.approx(a[(step, name)], rel=1e-3)
