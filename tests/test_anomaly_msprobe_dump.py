"""`trainmon nan-analyze` on msprobe dump directories (trainmon.analysis.msprobe_dump, msprobe_comm).

The dumps under tests/data/msprobe/ are real msprobe output: mindstudio-probe 26.2.0, task "statistics",
level "mix", torch 2.13.0 on CPU, two 2-process gloo jobs of two steps each, written by
tests/data/msprobe/make_dumps.py (its docstring says how; only the dump.json files are kept). At step 1:
- all_reduce/: rank 1's `inject` module divides by zero (Tensor.__truediv__.0, the 5th entry of its
  dump.json); the hidden activations are all-reduced, so Distributed.all_reduce.0 carries the NaN/Inf to
  rank 0, whose first non-finite tensor is that all-reduce's output.
- p2p/: a two-stage pipeline whose stage 0 (rank 0) divides by zero and sends its output to rank 1 with
  batch_isend_irecv; rank 1 sends the input grads back with send/recv on an explicit group.
The hand-made entries below follow the same format, for what those jobs do not call.
"""
import json
import shutil
from pathlib import Path

import pytest

from trainmon.analysis.msprobe_comm import CommNamer
from trainmon.analysis.msprobe_dump import read_dump
from trainmon.cli import main as cli_main
from trainmon.core.collective_ops import parse_comm_name

DUMPS = Path(__file__).parent / "data" / "msprobe"
WHERE = ("rank", "step", "module", "phase", "tensor", "call_index")


def nan_analyze(directory, capsys) -> dict:
    code = cli_main(["nan-analyze", str(directory), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == (0 if report["first"] is None else 1)  # 0 clean, 1 found
    return report


def tensor(value: float) -> dict:
    return {"type": "torch.Tensor", "dtype": "torch.float32", "shape": [2], "Max": value, "Min": value,
            "Mean": value, "Norm": abs(value), "requires_grad": False}


def group(ranks, group_id="5f0a11c2") -> dict:
    return {"type": "torch.ProcessGroup", "group_ranks": ranks, "group_id": group_id}


def test_first_nonfinite_entry_is_named(capsys):
    report = nan_analyze(DUMPS / "all_reduce", capsys)
    assert report["ranks"] == [0, 1]
    assert report["sources"] == {"0": ["dump.json (steps 0,1)"], "1": ["dump.json (steps 0,1)"]}
    assert {k: report["first"][k] for k in WHERE} == {
        "rank": 1, "step": 1, "module": "Tensor.__truediv__.0", "phase": "forward", "tensor": "output_0",
        "call_index": 4}
    assert report["first"]["micro_step"] is None and report["first_record"]["rule"] == "msprobe"
    places = {(c["rank"], c["module"], c["phase"], c["tensor"]) for c in report["chain"]}
    assert (1, "inject", "forward", "output_0") in places  # Module.inject.Inject.forward.0
    assert (0, "fc2.weight", "backward", "grad") in places  # Module.fc2.Linear.parameters_grad.0


def test_all_reduce_blames_the_rank_whose_input_was_not_finite(capsys):
    report = nan_analyze(DUMPS / "all_reduce", capsys)
    cross = report["cross_rank"]
    assert cross["origin_rank"] == 1 and cross["origin"] == report["first"]
    link = cross["chain"][0]
    assert (link["step"], link["from"], link["via"], link["to"]) == (1, [1], "all_reduce[]@default#0", [0])
    # all_reduce(h) names no group: the dump has no ranks for it, and the report says so.
    assert any("default group" in note for note in report["notes"])
    assert cli_main(["nan-analyze", str(DUMPS / "all_reduce")]) == 1
    assert "rank 1 -> all_reduce[]@default#0" in capsys.readouterr().out


def test_pipeline_send_blames_the_sending_stage(capsys):
    report = nan_analyze(DUMPS / "p2p", capsys)
    assert {k: report["first"][k] for k in ("rank", "step", "module", "phase")} == \
        {"rank": 0, "step": 1, "module": "Tensor.__truediv__.0", "phase": "forward"}
    assert report["cross_rank"]["origin_rank"] == 0
    assert [(c["from"], c["via"], c["to"]) for c in report["cross_rank"]["chain"]] == \
        [([0], "isend[0->1]@77849d8c#0", [1])]
    assert any("batch_isend_irecv receive" in note for note in report["notes"])


def test_a_step_or_rank_directory_is_accepted_and_a_clean_step_is_clean(capsys):
    assert nan_analyze(DUMPS / "all_reduce" / "step0", capsys)["first"] is None
    one = nan_analyze(DUMPS / "all_reduce" / "step1" / "rank0", capsys)
    assert one["ranks"] == [0] and one["cross_rank"] is not None
    assert (one["first"]["module"], one["first"]["call_index"]) == ("all_reduce[]@default#0.output", 6)


def test_a_lone_proc_directory_is_rank_0(tmp_path):
    shutil.copytree(DUMPS / "p2p" / "step1" / "rank1", tmp_path / "step3" / "proc4242")
    dump = read_dump(tmp_path)
    assert {(e.rank, e.step) for e in dump.events} == {(0, 3)}
    assert read_dump(tmp_path / "elsewhere") is None


@pytest.fixture
def dump_copy(tmp_path):
    shutil.copytree(DUMPS / "all_reduce", tmp_path / "dump")
    return tmp_path / "dump"


def test_truncated_dump_json_exits_2_naming_the_file(dump_copy, capsys):
    path = dump_copy / "step1" / "rank0" / "dump.json"
    text = path.read_text()
    path.write_text(text[:len(text) // 2])  # a write cut short by a kill
    assert cli_main(["nan-analyze", str(dump_copy)]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "truncated" in err, err


def test_json_that_is_not_a_dump_exits_2_naming_the_file(dump_copy, capsys):
    path = dump_copy / "step0" / "rank1" / "dump.json"
    path.write_text(json.dumps({"task": "statistics", "entries": []}))
    assert cli_main(["nan-analyze", str(dump_copy)]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "not msprobe's dump.json format" in err, err


def test_collectives_are_numbered_per_op_and_group_with_recorded_ranks():
    namer = CommNamer(rank=2)
    tp = {"input_args": [tensor(1.0)], "input_kwargs": {"group": group([0, 2])},
          "output": [tensor(float("inf")), group([0, 2])]}
    dp = {"input_args": [tensor(1.0)], "input_kwargs": {"group": group([2, 3], "0c9e7d1a")},
          "output": [tensor(1.0), group([2, 3], "0c9e7d1a")]}
    names = [[name for name, _ in namer.records("all_reduce", entry, "x")] for entry in (tp, dp, tp)]
    assert names == [["all_reduce[0,2]@5f0a11c2#0.input", "all_reduce[0,2]@5f0a11c2#0.output"],
                     ["all_reduce[2,3]@0c9e7d1a#0.input", "all_reduce[2,3]@0c9e7d1a#0.output"],
                     ["all_reduce[0,2]@5f0a11c2#1.input", "all_reduce[0,2]@5f0a11c2#1.output"]]
    parsed = parse_comm_name(names[2][1])
    assert (parsed["op"], parsed["ranks"], parsed["group"], parsed["seq"], parsed["io"]) == \
        ("all_reduce", [0, 2], "5f0a11c2", 1, "output")
    assert namer.gaps == []


def test_only_real_inputs_and_outputs_of_a_collective_are_used():
    # msprobe writes null for the output buffer before the call; after it, every argument is recorded.
    entry = {"input_args": [None, tensor(1.0)], "input_kwargs": {},
             "output": [tensor(float("nan")), tensor(1.0)]}
    records = CommNamer(rank=0).records("all_gather_into_tensor", entry, "x")
    assert [(name, stats["Max"] != stats["Max"]) for name, stats in records] == [
        ("all_gather_into_tensor[]@default#0.input", False), ("all_gather_into_tensor[]@default#0.output", True)]


def test_p2p_peers_come_from_positional_keyword_or_group_arguments():
    namer = CommNamer(rank=1)
    positional = {"input_args": [None, {"type": "int", "value": 0}], "input_kwargs": {},
                  "output": [tensor(float("inf")), {"type": "int", "value": 0}]}
    assert [n for n, _ in namer.records("irecv", positional, "x")] == ["irecv[0->1]@default#0.output"]
    by_group = {"input_args": [tensor(float("inf"))],
                "input_kwargs": {"group": group([1, 6]), "group_dst": {"type": "int", "value": 1}},
                "output": [None, group([1, 6]), {"type": "int", "value": 1}]}
    assert [n for n, _ in namer.records("send", by_group, "x")] == ["send[1->6]@5f0a11c2#0.input"]
    anywhere = {"input_args": [None], "input_kwargs": {}, "output": [tensor(1.0)]}
    assert namer.records("recv", anywhere, "Distributed.recv.0.forward") == []
    assert namer.gaps == [("no_peer", "Distributed.recv.0.forward")]


def test_a_dump_without_statistics_is_noted_not_reported_clean_silently(tmp_path, capsys):
    # summary_mode xor_checksum: tensors without Max/Min; and "inf" as text, as older versions wrote it.
    blind = {"type": "torch.Tensor", "dtype": "torch.float32", "shape": [2], "Max": None, "Min": None}
    for rank, stats in ((0, blind), (1, {**tensor(1.0), "Max": "inf"})):
        rank_dir = tmp_path / "step0" / f"rank{rank}"
        rank_dir.mkdir(parents=True)
        entry = {"input_args": [tensor(1.0) if rank else blind], "input_kwargs": {}, "output": [stats]}
        (rank_dir / "dump.json").write_text(json.dumps({"task": "statistics", "level": "L1", "framework": "pytorch",
                                                        "data": {"Torch.matmul.0.forward": entry}}))
    report = nan_analyze(tmp_path, capsys)
    assert any("step0/rank0/dump.json: no Max/Min statistics" in note for note in report["notes"])
    assert {k: report["first"][k] for k in ("rank", "module", "tensor")} == \
        {"rank": 1, "module": "Torch.matmul.0", "tensor": "output_0"}
