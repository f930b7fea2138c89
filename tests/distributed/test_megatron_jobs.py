"""Megatron-Core on 2 and 4 processes (CPU shims, gloo): the figures written for TP shards, pipeline stages and
DistributedOptimizer shards are those of the gathered full tensors."""
import json
import os

import pytest

from launch import torchrun
from test_csv_output import read_family
from trainmon.analysis.cross_rank import attribute
from trainmon.core.collective_ops import parse_comm_name
from trainmon.read.evidence import rank_evidence
from trainmon.read.layout import find_run
from verify import (SAVED_FAMILIES, assert_clipped, assert_injection_named, assert_norms_match,
                    assert_one_record_per_call, assert_same_labels, assert_unpatched, differing, nan_analyze, norms,
                    the_run, truth)

pd = pytest.importorskip("pandas")  # the reader the CSV files are checked with (the `db` extra)

pytest.importorskip("megatron.core")
FAMILIES = ("grad_unreduced", "grad_reduced", "exp_avg", "exp_avg_sq", "mg_direction")
# Megatron's clip_grad where a test makes clipping bite: grad_reduced (compared by run_job with what the inner torch
# optimizer's step sees) is then the clipped grad, and assert_clipped relates it to the grad before clipping.
CLIP = ["--clip", "0.05"]


def run_job(tmp_path, nproc, *options):
    output_dir = tmp_path / "monitor_output"
    torchrun("job_megatron.py", nproc, ["--out", str(tmp_path), *options], output_dir)
    run = the_run(output_dir)
    metas = [json.load(open(os.path.join(run, f"rank_{r}", "run.json"))) for r in range(nproc)]
    for rank, meta in enumerate(metas):
        assert meta["adapter"].startswith("megatron (")
        assert meta["parallel"]["global_rank"] == rank
    assert assert_norms_match(run, tmp_path, range(nproc), FAMILIES) > 0
    assert_unpatched(tmp_path, range(nproc))
    return run, [m["parallel"] for m in metas]


def comm_rows(run, rank, op):
    """{(step, "[src->dst]@group#seq"): (norm, min, max)} of one p2p op's records on one rank."""
    frame = read_family(os.path.join(run, f"rank_{rank}"), "comm")
    return {(r.step, r.name.split("[", 1)[1].rsplit(".", 1)[0]): (r.norm, r.min, r.max)
            for r in frame.itertuples() if parse_comm_name(r.name)["op"] == op}


def test_tensor_parallel_2(tmp_path):
    """FP32Optimizer over TP shards, clipping: the inner optimizer consumes main_grad, clipped in place."""
    run, coords = run_job(tmp_path, 2, "--tp", "2", *CLIP)
    assert assert_clipped(run, tmp_path, (0, 1), 0.05) > 0
    assert [c["tp"] for c in coords] == [{"rank": r, "size": 2, "ranks": [0, 1]} for r in (0, 1)]
    for family in FAMILIES:  # the merged records of the full parameters, the same on both TP ranks
        assert differing(run, family, 0, 1)[0] == 0, family
    # trainmon.save / save_grad of each TP rank's own shard: ranks × steps × micro-batches × families
    assert assert_norms_match(run, tmp_path, (0, 1), SAVED_FAMILIES, per_micro=True) == 2 * 3 * 2 * 2


def test_activation_grads_under_megatron(tmp_path):
    """Grads of module inputs and outputs, with Megatron's in-place ops on both (bias-dropout-add on outputs,
    the masked softmax on its input) running as they do unmonitored, also under full recompute."""
    run, _ = run_job(tmp_path, 2, "--tp", "2", "--xy")
    assert_one_record_per_call(run)  # the model's output: Megatron's DDP, its Float16Module and the model's own
    for rank in (0, 1):
        grads = read_family(os.path.join(run, f"rank_{rank}"), "actv_grad")
        assert {"decoder.layers.1.mlp.output_0", "decoder.layers.0.self_attention.output_0",
                "decoder.layers.0.mlp.linear_fc1.input",
                "decoder.layers.0.self_attention.core_attention.scale_mask_softmax.input_0"} <= set(grads.name)
        assert (grads.nans == 0).all() and (grads.norm > 0).all()
        assert sorted(set(grads.step)) == [0, 1, 2]
        norm = grads.set_index(["step", "micro_step", "name"]).norm
        # a tensor with one consumer: the grad leaving one module is the grad reaching the next
        # TransformerLayer takes `hidden_states=` by keyword: it is still the layer's input_0
        for consumer_input, producer_output in (("decoder.layers.0.self_attention.input",
                                                 "decoder.layers.0.input_layernorm.output"),
                                                ("decoder.final_layernorm.input", "decoder.layers.1.output_0"),
                                                ("decoder.layers.1.input", "decoder.layers.0.output_0")):
            a, b = norm.xs(consumer_input, level="name"), norm.xs(producer_output, level="name")
            assert len(a) == 6 and list(a) == pytest.approx(list(b), rel=1e-6), consumer_input
    # Megatron's full recompute runs every layer's forward again inside backward: the same records result
    recomputed = tmp_path / "recompute"
    recomputed.mkdir()
    again, _ = run_job(recomputed, 2, "--tp", "2", "--xy", "--recompute")
    assert_one_record_per_call(again)
    for family in ("actv", "actv_grad"):
        for rank in (0, 1):
            plain, checkpointed = (read_family(os.path.join(r, f"rank_{rank}"), family)
                                   .set_index(["step", "micro_step", "name"]).sort_index()[["norm", "min", "max"]]
                                   for r in (run, again))
            assert list(checkpointed.index) == list(plain.index), family
            pd.testing.assert_frame_equal(checkpointed, plain, rtol=1e-6)


def test_pipeline_parallel_2(tmp_path):
    run, coords = run_job(tmp_path, 2, "--pp", "2", "--cc")
    assert [c["pp"] for c in coords] == [{"rank": r, "size": 2, "ranks": [0, 1]} for r in (0, 1)]
    first, last = (set(n for _, n in norms(os.path.join(run, f"rank_{r}"), "grad_reduced")) for r in (0, 1))
    assert "embedding.word_embeddings.weight" in first and "embedding.word_embeddings.weight" not in last
    assert "output_layer.weight" in last and "output_layer.weight" not in first
    # layers carry their global numbers: 0-1 on stage 0, 2-3 on stage 1
    assert {n.split(".")[2] for n in first | last if n.startswith("decoder.layers.")} == {"0", "1", "2", "3"}
    assert "decoder.layers.2.mlp.linear_fc1.weight" in last and "decoder.layers.2.mlp.linear_fc1.weight" not in first
    # trainmon.save / save_grad on each stage, under the 1F1B schedule: ranks × steps × micro-batches × families
    assert assert_norms_match(run, tmp_path, (0, 1), SAVED_FAMILIES, per_micro=True) == 2 * 3 * 2 * 2
    # the stages' p2p: every tensor one stage sends is received by the other with the same figures
    sent = {r: comm_rows(run, r, "isend") for r in (0, 1)}
    received = {r: comm_rows(run, r, "irecv") for r in (0, 1)}
    assert sent[0] and sent[1], "activations go forward, grads backward"
    for src, dst in ((0, 1), (1, 0)):
        assert sent[src].keys() == received[dst].keys()
        for key, (norm, low, high) in sent[src].items():
            # min and max exact; the norm to fp32 summation order (see verify.differing)
            assert (low, high) == received[dst][key][1:] and norm == pytest.approx(received[dst][key][0], rel=1e-6), key


def test_deallocated_pipeline_outputs_are_recorded_with_the_values_sent(tmp_path):
    """Megatron-LM's `deallocate_pipeline_outputs`: once a stage has sent its output, the output tensor's `.data` is a
    one-element dummy, with `_version` as it was. The stage's output is recorded with the values it sent (its p2p
    send's own record), not the dummy's."""
    run, _ = run_job(tmp_path, 2, "--pp", "2", "--xy", "--cc", "--deallocate-outputs")
    outputs = read_family(os.path.join(run, "rank_0"), "actv")
    outputs = outputs[outputs.name == "decoder.output"]
    assert len(outputs) == 3 * 2                        # steps × micro-batches
    sent = comm_rows(run, 0, "isend")                   # stage 0 sends only its outputs
    for step in (0, 1, 2):
        recorded = sorted((r.min, r.max) for r in outputs.itertuples() if r.step == step)
        assert recorded == sorted((low, high) for (s, _), (_, low, high) in sent.items() if s == step), step


def test_virtual_pipeline_2_by_2(tmp_path):
    """Interleaved schedule: each stage holds two model chunks (vpp_stage 0 and 1)."""
    run, coords = run_job(tmp_path, 2, "--pp", "2", "--vpp", "2")
    assert [c["vpp"] for c in coords] == [{"size": 2}, {"size": 2}]
    for rank in (0, 1):
        frame = read_family(os.path.join(run, f"rank_{rank}"), "grad_reduced")
        assert set(frame.vpp_stage) == {0, 1}
    first, last = (set(norms(os.path.join(run, f"rank_{r}"), "grad_reduced")) for r in (0, 1))
    assert (0, "embedding.word_embeddings.weight") in first and (0, "1:output_layer.weight") in last
    # interleaved, 2 layers per chunk: stage 0 holds layers 0-1 and 4-5, stage 1 layers 2-3 and 6-7
    layers = {r: sorted({n.split(".")[2] for _, n in names if ".layers." in n}) for r, names in ((0, first), (1, last))}
    assert layers == {0: ["0", "1", "4", "5"], 1: ["2", "3", "6", "7"]}



def losses(log: str) -> list[float]:
    """The last stage's loss per step, as scripts/train_megatron.py prints it."""
    return [float(line.rsplit(" ", 1)[1]) for line in log.splitlines() if " loss " in line]


def test_virtual_pipeline_trains_like_the_pipeline_without_it(tmp_path):
    """The interleaved example learns as the 1F1B one does: each chunk draws its own micro-batches, and no
    batched p2p on gloo swaps activations and grads (8 micro-batches reach the schedule's steady state)."""
    options = ["--pp", "2", "--layers", "4", "--micro-batches", "8", "--steps", "20", "--config", "none"]
    script = os.path.join("..", "..", "scripts", "train_megatron.py")
    plain, interleaved = (losses(torchrun(script, 2, options + vpp, tmp_path)) for vpp in ([], ["--vpp", "2"]))
    assert len(plain) == len(interleaved) == 20
    assert plain[-1] < 0.8 * plain[0]
    assert interleaved[0] == pytest.approx(plain[0], rel=0.01) and interleaved[-1] == pytest.approx(plain[-1], rel=0.05)

def dp_calls(run, rank, op, io):
    """{step: [norm of each `op` call's `io` on the DP group (ranks 0, 1), in call order]} of one rank."""
    calls = {}
    for r in read_family(os.path.join(run, f"rank_{rank}"), "comm").itertuples():
        parsed = parse_comm_name(r.name)
        if parsed["op"] == op and parsed["io"] == io and parsed["ranks"] == [0, 1]:
            calls.setdefault(int(r.step), []).append((parsed["seq"], r.norm))
    return {step: [norm for _, norm in sorted(found)] for step, found in calls.items()}


def assert_dp_collectives_match(run, out_dir, steps, figures=("reduce_scatter_input", "reduce_scatter_output",
                                                               "all_gather_output")):
    """The distributed optimizer's reduce-scatter of grads and all-gather of params, recorded at every step, carry
    the figures of Megatron's grad and param buffers as the job read them (one call per bucket)."""
    ops = {"reduce_scatter": "reduce_scatter_tensor", "all_gather": "all_gather_into_tensor"}
    for rank in (0, 1):
        truth = json.load(open(os.path.join(out_dir, f"comm_truth.rank{rank}.json")))
        for figure in figures:
            op, _, io = figure.rpartition("_")
            written = dp_calls(run, rank, ops[op], io)
            for step in steps:
                expected = truth[str(step)][figure]
                assert written.get(step) == pytest.approx(expected, rel=1e-5), (rank, step, figure, written)


def test_data_parallel_2_distributed_optimizer(tmp_path):
    """Clipping on: grad_reduced is the main-param shards' grads the inner optimizer steps with."""
    run, coords = run_job(tmp_path, 2, "--distopt", "--cc", *CLIP)
    assert assert_clipped(run, tmp_path, (0, 1), 0.05) > 0
    assert [c["dp"] for c in coords] == [{"rank": r, "size": 2, "ranks": [0, 1]} for r in (0, 1)]
    changed, total = differing(run, "grad_unreduced", 0, 1)
    assert changed == total, "each DP rank's unreduced grads come from its own data"
    for family in ("grad_reduced", "exp_avg", "exp_avg_sq"):
        assert differing(run, family, 0, 1)[0] == 0, family
    assert_dp_collectives_match(run, tmp_path, range(3))
    for rank in (0, 1):  # the functions Megatron bound at import were re-pointed while monitoring, then put back
        assert json.load(open(tmp_path / f"bindings.rank{rank}.json")) == {
            "repointed": ["_coalescing_manager", "dist_all_gather_func", "dist_reduce_scatter_func"], "restored": True}


def test_overlapped_distributed_optimizer_nan_spreads_through_the_reduce_scatter(tmp_path):
    """Overlapped (async) grad reduce-scatter and param all-gather are recorded when their Work is waited for; a NaN
    put into every grad of DP rank 1 at step 1 reaches rank 0 through that step's reduce-scatter, and nan-analyze's
    cross-rank path says so (not a later all-reduce)."""
    output_dir = tmp_path / "monitor_output"
    torchrun("job_megatron.py", 2, ["--out", str(tmp_path), "--distopt", "--overlap", "--cc", "--inject-grad", "1:1"],
             output_dir)
    run = the_run(output_dir)
    assert_dp_collectives_match(run, tmp_path, [0], ("reduce_scatter_output", "all_gather_output"))
    report = nan_analyze(run)
    assert (report["first"]["rank"], report["first"]["step"], report["first"]["phase"]) == (1, 1, "backward")
    cross = report["cross_rank"]
    assert cross["origin_rank"] == 1 and cross["unattributed"] == [], cross
    link = cross["chain"][0]
    assert (link["step"], link["from"], link["to"]) == (1, [1], [0]), cross["chain"]
    assert link["via"].startswith("reduce_scatter_tensor[0,1]@"), cross["chain"]


def test_data_parallel_2_distributed_optimizer_bf16(tmp_path):
    """Float16Module (bf16 weights), fp32 grad buffer, fp32 main-param shards in DistributedOptimizer."""
    run, coords = run_job(tmp_path, 2, "--distopt", "--bf16", *CLIP)
    changed, total = differing(run, "grad_unreduced", 0, 1)
    assert changed == total
    assert_same_labels(run, ("grad_reduced", "param_origin", "param_updated", "exp_avg", "exp_avg_sq"), 0, 1)


def test_data_parallel_2_bf16_labels(tmp_path):
    """Float16Module without DistributedOptimizer: every DP rank holds whole fp32 main params, grads and moments,
    which DP rank 0 counts; both ranks label the merged records with the dtype of those tensors. Clipping on:
    grad_reduced is the fp32 main params' grads, copied from main_grad and clipped, as the inner optimizer sees them."""
    run, _ = run_job(tmp_path, 2, "--bf16", *CLIP)
    merged = ("grad_reduced", "param_origin", "param_updated", "exp_avg", "exp_avg_sq", "mg_direction")
    for family in merged:
        assert differing(run, family, 0, 1)[0] == 0, family
    assert_same_labels(run, merged, 0, 1)
    assert set(read_family(os.path.join(run, "rank_1"), "exp_avg").dtype) == {"torch.float32"}


def test_fp16_skipped_step_records_the_nonfinite_grads(tmp_path):
    """fp16 with dynamic loss scaling, clipping on: NaN grads on DP rank 1 at step 1 make Megatron skip that step,
    so its inner torch optimizer never consumes them. grad_reduced at step 1 is then read when Megatron's step
    returns: recorded on both ranks for every parameter, not finite, and no clipping scalar; at steps 0 and 2 it
    is what the inner optimizer consumed (unscaled and clipped)."""
    from trainmon import open_run

    output_dir = tmp_path / "monitor_output"
    torchrun("job_megatron.py", 2, ["--out", str(tmp_path), "--fp16", "--inject-grad", "1:1", *CLIP], output_dir)
    run = the_run(output_dir)
    with open_run(run) as opened:
        scalars = opened.scalars()
    for rank in (0, 1):
        steps = json.load(open(tmp_path / f"steps.rank{rank}.json"))
        assert steps == {"applied": {"0": True, "1": False, "2": True}, "consumed": [0, 2]}, steps
        consumed = truth(tmp_path, rank)
        assert sorted(consumed) == ["0", "1", "2"] and "grad_reduced" not in consumed["1"]
        params = set(consumed["0"]["grad_reduced"])
        written = read_family(os.path.join(run, f"rank_{rank}"), "grad_reduced")
        skipped = written[written.step == 1]
        assert sorted(skipped.name) == sorted(params) and (skipped.nans > 0).all(), skipped[["name", "nans"]]
        written = written.set_index(["step", "name"])
        for step in (0, 2):
            expected = consumed[str(step)]["grad_reduced"]
            assert set(expected) == params
            for name, value in expected.items():
                row = written.loc[(step, name)]
                assert row.nans == 0 and row.norm == pytest.approx(value, rel=1e-5, abs=1e-12), (rank, step, name)
        mine = scalars[scalars["rank"] == rank]
        coef, norm = (mine[mine["name"] == name] for name in ("grad_clip_coef", "grad_norm_preclip"))
        assert sorted(coef.step) == sorted(norm.step) == [0, 2], mine
        assert (coef.value < 1).all(), coef  # the clip bit at the steps that were applied


def test_tensor_2_by_pipeline_2(tmp_path):
    run, coords = run_job(tmp_path, 4, "--tp", "2", "--pp", "2")
    assert [c["tp"]["ranks"] for c in coords] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [c["pp"]["ranks"] for c in coords] == [[0, 2], [1, 3], [0, 2], [1, 3]]


def test_pipeline_inf_on_rank_1_is_traced_through_p2p(tmp_path):
    """PP2 × DP2: rank 1 is stage 0 of the second data-parallel replica; its next stage is rank 3."""
    output_dir = tmp_path / "monitor_output"
    torchrun("job_megatron.py", 4, ["--out", str(tmp_path), "--pp", "2", "--cc", "--inject", "1:1"], output_dir)
    run = the_run(output_dir)
    first = nan_analyze(run)["first"]
    # stage 0's last layer (layers 0-1 are on stage 0, 2-3 on stage 1)
    assert (first["rank"], first["step"], first["module"], first["phase"]) == (1, 1, "decoder.layers.1", "forward")
    # the collectives' records say how it spread: rank 1 -> isend[1->3] -> rank 3 (the next stage), and the
    # data-parallel grad reduction took it to the other replica's ranks
    result = attribute([e for d in find_run(run).ranks for e in rank_evidence(d, d.metadata()).events])
    assert result["origin_rank"] == 1 and result["origin"]["module"] == "decoder.layers.1"
    link = result["chain"][0]
    assert (link["step"], link["from"], link["to"]) == (1, [1], [3]) and "[1->3]" in link["via"]
    step_1 = [link for link in result["chain"] if link["step"] == 1]
    assert {rank for link in step_1 for rank in link["to"]} - {1} == {0, 2, 3}, step_1


# Where each layout gets its inf: a rank of pipeline stage 1, in the first layer of one of its chunks, whose local
# name (decoder.layers.0) is stage 0's too; 2 layers per chunk, so its global number tells the virtual stage.
INJECTED = {  # layout: (processes, options, rank, chunk, global name)
    "pp2": (2, ["--pp", "2"], 1, 0, "decoder.layers.2.mlp.linear_fc1"),
    "tp2xpp2": (4, ["--tp", "2", "--pp", "2"], 3, 0, "decoder.layers.2.mlp.linear_fc1"),  # stage 1, TP rank 1
    "pp2xvpp2": (2, ["--pp", "2", "--vpp", "2"], 1, 1, "decoder.layers.6.mlp.linear_fc1"),  # virtual stage 3 of 4
}


@pytest.mark.parametrize("layout, cc", [("pp2", "off"), ("pp2", "on"), ("tp2xpp2", "off"), ("tp2xpp2", "on"),
                                        ("tp2xpp2", "no-inputs"), ("pp2xvpp2", "off"), ("pp2xvpp2", "on")])
def test_inf_on_a_later_stage_is_named_first(tmp_path, layout, cc):
    """An inf put into stage 1's forward at step 1, micro-step 1 (a hook registered before set_monitor) reaches
    stage 0 only in backward, and stage 1's TP peer only through the row-parallel all-reduce: the online alert
    and nan-analyze, from every source and with or without collectives, name the injected forward."""
    processes, options, rank, chunk, module = INJECTED[layout]
    output_dir = tmp_path / "monitor_output"
    log = torchrun("job_megatron.py", processes,
                   ["--out", str(tmp_path), *options, "--cc", cc, "--inject", f"{rank}:1:1",
                    "--inject-module", f"{chunk}:module.decoder.layers.0.mlp.linear_fc1"], output_dir)
    assert f"anomaly at rank {rank} step 1 micro-step 1: {module} forward output_0 (sentinel" in log
    # TP shards' records are merged with trainmon's own all-gather, which uses torch's current API
    assert "all_gather_into_tensor` is deprecated" not in log
    expected = dict(rank=rank, step=1, micro_step=1, module=module, phase="forward")
    run = the_run(output_dir)
    assert_injection_named(run, tmp_path, expected, cc, csv_peers=[2] if layout == "tp2xpp2" else [])
    if cc == "no-inputs":  # the TP all-reduces cannot be traced, and the text report says what would fix it
        report = nan_analyze(run, text=True)
        assert "could not attribute" in report and "all_reduce[2,3]" in report, report
        assert "rank(s) 0, 1, 2, 3 did not record collectives' inputs: set cc_distribution.cc_pre_hook" in report



def test_torch_optimizer_on_a_megatron_pipeline_names_global_layers(tmp_path):
    """Megatron-Core's quick-start way, torch.optim.AdamW on PP2 chunks: the adapter comes from the model, so an
    inf in stage 1's first layer (decoder.layers.0 there) is named as global layer 2, on rank 1, stage 1."""
    output_dir = tmp_path / "monitor_output"
    log = torchrun("job_megatron_torch_optim.py", 2,
                   ["--out", str(tmp_path), "--pp", "2", "--layers", "4", "--inject", "1:1:1",
                    "--inject-module", "0:decoder.layers.0.mlp.linear_fc1"], output_dir)
    assert "anomaly at rank 1 step 1 micro-step 1: decoder.layers.2.mlp.linear_fc1 forward output_0 (sentinel" in log
    run = the_run(output_dir)
    expected = dict(rank=1, step=1, micro_step=1, module="decoder.layers.2.mlp.linear_fc1", phase="forward")
    assert_injection_named(run, tmp_path, expected, "off")
    for rank in (0, 1):
        meta = json.load(open(os.path.join(run, f"rank_{rank}", "run.json")))
        assert meta["adapter"] == "plain on a Megatron-Core model" and meta["pp_stage"] == rank
        assert meta["parallel"]["pp"] == {"rank": rank, "size": 2, "ranks": [0, 1]}
        for family in ("actv", "grad_reduced", "exp_avg"):
            names = set(read_family(os.path.join(run, f"rank_{rank}"), family).name)
            layers = {n.split(".")[2] for n in names if n.startswith("decoder.layers.")}
            assert layers == ({"0", "1"} if rank == 0 else {"2", "3"}), (rank, family, sorted(names)[:5])

def test_hooks_and_records_stay_constant_over_100_steps(tmp_path):
    """Megatron's linear layers return their bias Parameter as an output: no hook is left on it per forward,
    the records per step do not grow, and stop() leaves nothing."""
    output_dir = tmp_path / "monitor_output"
    torchrun("job_megatron_hooks.py", 1, ["--out", str(tmp_path), "--steps", "100"], output_dir)
    hooks = json.loads((tmp_path / "hooks.rank0.json").read_text())
    assert set(hooks["per_step"]) == {0} and hooks["after_stop"] == 0 and hooks["forward_hooks"] == 0
    rank_dir = os.path.join(the_run(output_dir), "rank_0")
    for family in ("actv", "actv_grad"):
        per_step = read_family(rank_dir, family).groupby("step").size()
        assert len(per_step) == 100 and per_step.nunique() == 1, (family, per_step.value_counts())


# Mixture of experts: 4 experts per layer (SequentialMLP), expert-parallel over 2 ranks: each EP rank holds 2 of
# them and numbers them 0 and 1; trainmon names them by their global index, as Megatron's checkpoints do.
MOE = ["--moe-experts", "4", "--ep", "2"]


def expert_numbers(run, rank, family):
    """The global expert numbers a rank's records of `family` name."""
    names = set(read_family(os.path.join(run, f"rank_{rank}"), family).name)
    return sorted({n.split("local_experts.")[1].split(".")[0] for n in names if "local_experts." in n})


def test_expert_parallel_2_each_rank_records_its_own_experts(tmp_path):
    """EP2 on 2 ranks (alltoall token dispatcher): every figure of an expert equals the job's own tensors of that
    rank's experts, under the global expert number; dense parameters merge over data parallel as before."""
    run, coords = run_job(tmp_path, 2, *MOE, "--dispatcher", "alltoall")
    assert assert_norms_match(run, tmp_path, (0, 1), ("param_updated",)) > 0
    assert [c["ep"] for c in coords] == [{"rank": r, "size": 2, "ranks": [0, 1]} for r in (0, 1)]
    for family in FAMILIES + ("param_origin", "param_updated"):
        assert expert_numbers(run, 0, family) == ["0", "1"] and expert_numbers(run, 1, family) == ["2", "3"], family
    # the job's figures of rank 1's experts under their global names (not rank 0's experts under local ones)
    expected = truth(tmp_path, 1)["1"]["grad_reduced"]
    written = norms(os.path.join(run, "rank_1"), "grad_reduced")
    name = "decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight"
    assert written[(1, name)] == pytest.approx(expected[name], rel=1e-6)
    assert written[(1, name)] != pytest.approx(norms(os.path.join(run, "rank_0"), "grad_reduced")[
        (1, name.replace("experts.3", "experts.1"))], rel=1e-3)
    for family in ("grad_reduced", "exp_avg", "param_updated"):  # dense: the same merged records on both ranks
        a, b = (norms(os.path.join(run, f"rank_{r}"), family) for r in (0, 1))
        dense = [k for k in a if "local_experts" not in k[1]]
        assert dense and all(a[k] == pytest.approx(b[k], rel=1e-9) for k in dense), family


def test_expert_parallel_2_by_expert_data_parallel_2_distributed_optimizer(tmp_path):
    """EP2 × expert-DP2 on 4 ranks (allgather dispatcher), DistributedOptimizer: each expert's grads, weights and
    Adam state are sharded over its expert data-parallel pair (ranks 0 and 2 hold experts 0-1, ranks 1 and 3
    experts 2-3) and merge there; the dense ones over all 4 ranks."""
    run, coords = run_job(tmp_path, 4, *MOE, "--dispatcher", "allgather", "--distopt")
    assert assert_norms_match(run, tmp_path, range(4), ("param_updated",)) > 0
    assert [c["edp"]["ranks"] for c in coords] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    for rank in range(4):
        assert expert_numbers(run, rank, "exp_avg") == (["0", "1"] if rank % 2 == 0 else ["2", "3"])
    for peer in (0, 1):  # the expert data-parallel pairs write the same merged records of their experts
        for family in ("grad_reduced", "param_updated", "exp_avg", "exp_avg_sq"):
            assert differing(run, family, peer, peer + 2)[0] == 0, family
        changed, total = differing(run, "grad_unreduced", peer, peer + 2)
        assert changed == total, "each rank's unreduced grads come from its own data"


@pytest.mark.parametrize("job, dispatcher, cc", [("job_megatron.py", "alltoall", "on"),
                                                 ("job_megatron_torch_optim.py", "allgather", "off")])
def test_inf_in_an_expert_of_rank_1_is_named_by_its_global_number(tmp_path, job, dispatcher, cc):
    """An inf in rank 1's local expert 1 (global expert 3) at step 1, micro-step 1 reaches rank 0 through the token
    dispatcher's collectives: the online alert and nan-analyze name rank 1's expert, with Megatron's optimizer
    and with torch.optim.AdamW on the same model."""
    output_dir = tmp_path / "monitor_output"
    prefix = "module." if job == "job_megatron.py" else ""  # DDP-wrapped chunks for Megatron's optimizer
    options = ["--cc", cc] if job == "job_megatron.py" else []
    module = "decoder.layers.0.mlp.experts.local_experts.3.linear_fc1"
    log = torchrun(job, 2, ["--out", str(tmp_path), *MOE, "--dispatcher", dispatcher, *options,
                            "--inject", "1:1:1", "--inject-module",
                            f"0:{prefix}decoder.layers.0.mlp.experts.local_experts.1.linear_fc1"], output_dir)
    assert f"anomaly at rank 1 step 1 micro-step 1: {module} forward output_0 (sentinel" in log
    run = the_run(output_dir)
    assert_injection_named(run, tmp_path, dict(rank=1, step=1, micro_step=1, module=module, phase="forward"), cc,
                           csv_peers=[0])
    assert expert_numbers(run, 1, "exp_avg") == ["2", "3"]
