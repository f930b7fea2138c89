"""The ordering key (trainmon.core.ordering): phases, pipeline stages and virtual chunks in causal order,
rank last, ties across ranks; and what nan-analyze makes of it on hand-made runs."""
import json

import pytest
import torch

from test_anomaly_online import nan_analyze_json
from training import make_model, run_steps
from trainmon import TrainerMon
from trainmon.core import ordering
from trainmon.core.events import AnomalyEvent
from trainmon.cli import main as cli_main


FAMILIES = {"forward": "actv", "backward": "actv_grad", "optimizer": "grad_reduced"}


def event(rank, phase="forward", micro=0, pp=0, vpp=0, call=None, step=1, module="m"):
    return AnomalyEvent(rank=rank, step=step, micro_step=micro, pp_stage=pp, vpp_stage=vpp, call_index=call,
                        module=module, phase=phase, tensor="grad_output" if phase == "backward" else "output",
                        op="infs", value=1.0, rule="record", family=FAMILIES.get(phase, "comm"))


def in_order(*events):
    return sorted(events, key=AnomalyEvent.order_key)


def test_pipeline_forward_on_a_later_stage_precedes_backward_on_rank_0():
    """The first version sorted by rank first: rank 0's backward beat rank 1's forward of the same micro-step."""
    backward_rank_0 = event(0, "backward", pp=0, call=3)
    forward_rank_1 = event(1, "forward", pp=1, call=40)
    assert in_order(backward_rank_0, forward_rank_1) == [forward_rank_1, backward_rank_0]


def test_stages_ascend_in_forward_and_descend_in_backward():
    forward = [event(r, "forward", pp=r, call=9 - r) for r in range(3)]
    backward = [event(r, "backward", pp=r, call=r) for r in range(3)]
    assert in_order(*reversed(forward)) == forward
    assert in_order(*backward) == backward[::-1]


def test_virtual_chunks_follow_the_interleaved_schedule():
    """PP2 x VPP2: chunk c of stage s is virtual stage 2c + s; forward goes 0, 1, 2, 3, backward 3, 2, 1, 0."""
    schedule = [(0, 0), (0, 1), (1, 0), (1, 1)]  # (vpp_stage, pp_stage), rank = pp_stage
    forward = [event(pp, "forward", pp=pp, vpp=vpp, call=10 * vpp) for vpp, pp in schedule]
    backward = [event(pp, "backward", pp=pp, vpp=vpp, call=10 * vpp) for vpp, pp in schedule]
    assert in_order(*reversed(forward)) == forward
    assert in_order(*backward) == backward[::-1]


def test_micro_step_then_phase_then_stage_then_call_index_then_rank():
    assert in_order(event(1, micro=1, call=0), event(0, "optimizer", micro=0, call=9))[0].micro_step == 0
    once_per_step = event(0, "optimizer", micro=None, call=0)
    assert in_order(once_per_step, event(1, "backward", micro=1, pp=0, call=99))[-1] is once_per_step
    same_place = [event(1, call=4), event(0, call=5), event(0, call=None), event(0, call=4)]
    assert [(e.call_index, e.rank) for e in in_order(*same_place)] == [(4, 0), (4, 1), (5, 0), (None, 0)]


def test_the_key_is_described_in_run_json(output_dir, write_config):
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    monitor = TrainerMon(write_config(sentinel=True)).set_monitor(model, optimizer=optimizer)
    run_steps(model, optimizer, 1)
    monitor.stop()
    meta = json.loads((monitor.output_dir / "run.json").read_text())
    assert meta["ordering_key"] == ordering.DESCRIPTION and meta["ordering_key"]["version"] == 2
    assert meta["pp_stage"] == 0


# ------------------------------------------------------------------------------------- hand-made runs
def write_rank(run, rank, pp_stage=None, csv_rows=(), jsonl=(), cc=None, csv_family="actv_grad"):
    """A rank directory: run.json (with `pp_stage` unless None), one CSV file, anomalies.jsonl."""
    directory = run / f"rank_{rank}"
    directory.mkdir(parents=True)
    meta = {"rank": rank, "config": {"cc_distribution": cc or {"enable": False}}}
    if pp_stage is not None:
        meta["pp_stage"] = pp_stage
    (directory / "run.json").write_text(json.dumps(meta))
    if csv_rows:
        lines = ["vpp_stage,name,step,micro_step,nans,infs"] + [f"0,{name},{step},{micro},0,3"
                                                                 for name, step, micro in csv_rows]
        (directory / f"{csv_family}_0-9.csv").write_text("\n".join(lines) + "\n")
    if jsonl:
        (directory / "anomalies.jsonl").write_text("".join(json.dumps(e.to_json()) + "\n" for e in jsonl))


def test_csv_rows_take_the_pipeline_stage_from_run_json(tmp_path, capsys):
    """Backward grads of the same micro-step on both stages, from CSV alone: stage 1's backward ran first."""
    run = tmp_path / "run"
    write_rank(run, 0, pp_stage=0, csv_rows=[("decoder.layers.1.output", 2, 1)])
    write_rank(run, 1, pp_stage=1, csv_rows=[("decoder.layers.2.output", 2, 1)])
    report = nan_analyze_json(run, capsys)
    assert (report["first"]["rank"], report["first"]["module"], report["first"]["phase"]) == \
        (1, "decoder.layers.2", "backward")
    assert report["ties"] == [] and report["notes"] == []


def test_a_rank_without_pp_stage_in_run_json_is_said_to_be_taken_as_stage_0(tmp_path, capsys):
    run = tmp_path / "run"
    write_rank(run, 0, pp_stage=0, csv_rows=[("decoder.layers.1.output", 2, 1)])
    write_rank(run, 1, csv_rows=[("decoder.layers.2.output", 2, 1)])
    report = nan_analyze_json(run, capsys)
    assert report["notes"] == ["rank 1: run.json names no pp_stage; its CSV rows are taken as pipeline stage 0"]
    # both at the same stage place now: rank order decides, and the other rank is a tie
    assert report["first"]["rank"] == 0 and [t["rank"] for t in report["ties"]] == [1]


def test_a_record_read_twice_is_reported_with_its_call_index(tmp_path, capsys):
    """A run.json without pp_stage puts the CSV copy of stage 1's record on stage 0, before its indexed copy
    from anomalies.jsonl; the copy kept is still the one with the call index (and the right stage)."""
    run = tmp_path / "run"
    indexed = event(0, "forward", micro=1, pp=1, call=17, step=2, module="decoder.layers.2")
    write_rank(run, 0, csv_rows=[("decoder.layers.2.output", 2, 1)], jsonl=[indexed], csv_family="actv")
    report = nan_analyze_json(run, capsys)
    assert report["nonfinite_records"] == 1 and report["first"]["call_index"] == 17


def test_same_stage_place_on_two_ranks_is_a_tie(tmp_path, capsys):
    """Two data-parallel replicas (same stage): call indices count each rank's own events, so neither is known
    to be first; a later stage's record at the same micro-step is no tie."""
    run = tmp_path / "run"
    write_rank(run, 0, pp_stage=0, jsonl=[event(0, "forward", pp=0, call=30, module="b")])
    write_rank(run, 1, pp_stage=0, jsonl=[event(1, "forward", pp=0, call=12, module="a")])
    write_rank(run, 2, pp_stage=1, jsonl=[event(2, "forward", pp=1, call=5, module="c")])
    report = nan_analyze_json(run, capsys)
    assert (report["first"]["rank"], report["first"]["module"]) == (1, "a")
    assert [(t["rank"], t["module"]) for t in report["ties"]] == [(0, "b")]


def test_micro_steps_count_each_chunks_own_forwards(output_dir, write_config):
    """Interleaved schedule: chunk 0 runs micro-batches 0 and 1 before chunk 1 sees micro-batch 0. An inf in chunk
    1's first forward is at micro-step 0, and its weight grads are probed under the micro-step of the backward."""
    torch.manual_seed(0)
    chunks = [torch.nn.Sequential(torch.nn.Linear(4, 4)), torch.nn.Sequential(torch.nn.Linear(4, 4))]
    calls = []

    def inf_in_first_call(module, args, output):
        calls.append(None)
        return output * float("inf") if len(calls) == 1 else None

    chunks[1][0].register_forward_hook(inf_in_first_call)  # before the monitor's hooks
    optimizer = torch.optim.SGD([p for chunk in chunks for p in chunk.parameters()], lr=0.1)
    monitor = TrainerMon(write_config(sentinel=True)).set_monitor(chunks, optimizer=optimizer, grad_acc_steps=2)
    hidden = [chunks[0](torch.randn(2, 4)) for _ in range(2)]
    for output in [chunks[1](h) for h in hidden]:
        output.sum().backward()
    optimizer.step()
    monitor.stop()
    records = [json.loads(line) for line in open(monitor.output_dir / "anomalies.jsonl")]
    first = next(r for r in records if r["first"])
    assert (first["vpp_stage"], first["micro_step"], first["module"], first["phase"]) == (1, 0, "0", "forward")
    weight_grads = {(r["vpp_stage"], r["micro_step"]) for r in records if r["family"] == "grad_unreduced"}
    assert (1, 0) in weight_grads and (1, 1) in weight_grads


@pytest.mark.parametrize("pre_hook", [False, True])
def test_unattributed_collectives_are_named_in_the_text_report(tmp_path, capsys, pre_hook):
    run = tmp_path / "run"
    cc = {"enable": True, "cc_pre_hook": pre_hook}
    for rank in (0, 1):
        outputs = [event(rank, "communication", micro=None, call=20 + seq, module=f"all_reduce[0,1]@tp#{seq}.output")
                   for seq in range(7)]
        write_rank(run, rank, pp_stage=0, jsonl=[event(rank, "forward", call=25, module="mlp")] + outputs, cc=cc)
    report = nan_analyze_json(run, capsys)
    assert report["cross_rank"]["unattributed"] == [f"all_reduce[0,1]@tp#{seq}" for seq in range(7)]
    assert report["cross_rank"]["inputs_not_recorded_on"] == ([] if pre_hook else [0, 1])
    assert cli_main(["nan-analyze", str(run)]) == 1
    text = capsys.readouterr().out
    assert "could not attribute 7 collective call(s) with non-finite outputs" in text
    assert "recorded: all_reduce[0,1]@tp (7 calls)" in text
    hint = "rank(s) 0, 1 did not record collectives' inputs: set cc_distribution.cc_pre_hook to true"
    assert (hint in text) != pre_hook
