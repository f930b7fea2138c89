"""FSDP2 with each block compiled on its own, torchtitan-style, on 2 processes (gloo) with every tier on (sentinel,
weight grads, activations and their grads, Adam state, collectives): training runs to the end with no graph break
and no graph from trainmon, the records are those of the same job in eager mode, and an Inf injected on one rank
is named exactly, online and by nan-analyze. `aot_eager` traces as inductor does without its compile time;
inductor runs once."""
import json
import math

import pytest

from launch import torchrun
from trainmon.read import open_run
from verify import assert_injection_named, assert_one_record_per_call, the_run

OPS = ("norm", "min", "max", "nans", "infs", "zeros", "mean")
INJECT = ["--inject", "1:1:1"]  # rank 1, step 1, micro-step 1
JOBS = {
    "eager": ["--compile", "none"],
    "wrap": ["--compile", "wrap", "--baseline"],  # torchtitan: torch.compile(block) put back in its place
    "in_place": ["--compile", "in_place", "--baseline"],  # block.compile()
    "inject-eager": ["--compile", "none"] + INJECT,
    "inject-wrap": ["--compile", "wrap"] + INJECT,
    "inject-inductor": ["--compile", "wrap", "--backend", "inductor"] + INJECT,
}


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """job(name) -> (the job's own output folder, its run directory, its log), each job run once per module."""
    done = {}

    def run(name: str):
        if name not in done:
            out = tmp_path_factory.mktemp(name)
            log = torchrun("job_fsdp2_compile.py", 2, JOBS[name] + ["--out", str(out)], out / "monitor_output")
            done[name] = (out, the_run(out / "monitor_output"), log)
        return done[name]

    return run


def records(run_dir: str) -> dict:
    """{(rank, family, name, step, micro_step or None): record} of every rank, read from the database."""
    with open_run(run_dir, source="db") as run:
        frame = run.records()
    return {(int(r.rank), r.family, r.name, int(r.step), None if r.micro_step != r.micro_step else int(r.micro_step)): r
            for r in frame.itertuples()}


@pytest.mark.parametrize("mode", ["wrap", "in_place"])
def test_trains_to_the_end_with_no_graph_break_or_graph_from_trainmon(job, mode):
    out, _, _ = job(mode)
    for rank in (0, 1):
        figures = json.load(open(out / f"compile.rank{rank}.json"))
        unmonitored, monitored = figures["unmonitored"], figures["monitored"]
        assert unmonitored["graph_breaks"] == monitored["graph_breaks"] == 0
        assert unmonitored["graphs"] == monitored["graphs"] == 1  # one graph for the four blocks, no recompile
        assert len(monitored["losses"]) == 3 * 2 and all(math.isfinite(loss) for loss in monitored["losses"])
        assert monitored["losses"] == unmonitored["losses"], "monitoring does not change the numerics"
        # torch.compile's wrappers put `_orig_mod` in the model's own parameter names (not in the records: below)
        assert (monitored["orig_mod_params"] > 0) == (mode == "wrap")


@pytest.mark.parametrize("mode", ["wrap", "in_place"])
def test_records_are_the_eager_ones(job, mode):
    eager, compiled = records(job("eager")[1]), records(job(mode)[1])
    assert {key[0] for key in compiled} == {0, 1}
    assert not any("_orig_mod" in key[2] for key in compiled)
    # every family, the grads of activations made inside a compiled block included
    assert set(compiled) == set(eager)
    assert all((rank, "actv_grad", f"layers.{i}.{name}", 2, 1) in compiled
               for rank in (0, 1) for i in range(4) for name in ("input", "output", "mlp.0.output", "ln1.input"))
    for run in (job("eager")[1], job(mode)[1]):
        assert_one_record_per_call(run)
    families = {key[1] for key in eager}
    assert families == {key[1] for key in compiled} >= {"actv", "actv_grad", "grad_unreduced", "grad_reduced",
                                                       "param_origin", "param_updated", "exp_avg", "exp_avg_sq",
                                                       "comm"}
    for family in families:
        where = {(rank, step, micro) for rank, fam, _, step, micro in compiled if fam == family}
        assert where == {(rank, step, micro) for rank, fam, _, step, micro in eager if fam == family}, family
    for key, got in compiled.items():
        want = eager[key]
        for op in OPS:
            assert getattr(got, op) == pytest.approx(getattr(want, op), rel=1e-4, abs=1e-6), (key, op)


@pytest.mark.parametrize("name", ["inject-eager", "inject-wrap", "inject-inductor"])
def test_an_inf_in_one_blocks_mlp_on_rank_1_is_named_exactly(job, tmp_path, name):
    out, run, _ = job(name)
    expected = {"rank": 1, "step": 1, "micro_step": 1, "module": "layers.1.mlp.0", "phase": "forward"}
    # online (anomalies.jsonl) and by nan-analyze, which traces it through FSDP's reduce-scatter to rank 0
    assert_injection_named(run, tmp_path, expected, cc="on")
    for rank in (0, 1):
        losses = json.load(open(out / f"compile.rank{rank}.json"))["monitored"]["losses"]
        assert all(map(math.isfinite, losses[:3])) and not any(map(math.isfinite, losses[4:]))
    online = [json.loads(line) for line in open(f"{run}/rank_0/anomalies.jsonl")]
    assert not [r for r in online if r["step"] == 1 and r["phase"] == "forward"], "rank 0's forward stayed finite"


def test_inductor_records_are_the_eager_ones_before_the_injection(job):
    """At step 0 inductor's figures are eager's (to its last bits; later steps differ more, as Adam amplifies
    them): the tensors its graph lends trainmon's hooks are read before its kernels reuse their memory."""
    eager, compiled = records(job("eager")[1]), records(job("inject-inductor")[1])
    step_0 = [key for key in compiled if key[3] == 0]
    assert {key[1] for key in step_0} >= {"actv", "actv_grad", "grad_unreduced", "grad_reduced", "comm"}
    for key in step_0:
        if key[1] in ("actv", "actv_grad", "grad_unreduced", "grad_reduced", "comm"):
            for op in ("norm", "min", "max"):
                assert getattr(compiled[key], op) == pytest.approx(getattr(eager[key], op), rel=1e-5, abs=1e-6), \
                    (key, op)
