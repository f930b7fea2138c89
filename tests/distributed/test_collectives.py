"""cc_distribution on 2 processes: every collective and p2p op recorded with its group, sequence number and
figures, sync and async; stop() puts back every patched torch.distributed function."""
import json
import math
import os

from launch import torchrun
from test_csv_output import read_family
from trainmon.core.collective_ops import parse_comm_name
from verify import the_run


def rows(run, rank, step):
    frame = read_family(os.path.join(run, f"rank_{rank}"), "comm")
    frame = frame[frame.step == step]
    assert not frame.duplicated(["name"]).any()
    return {r.name: (r.norm, r.min, r.max) for r in frame.itertuples()}


def same(actual: dict, expected: dict) -> bool:
    return actual.keys() == expected.keys() and all(
        math.isclose(a, e, rel_tol=1e-12) for k in actual for a, e in zip(actual[k], expected[k]))


def filled(value, n=4):
    return (math.sqrt(n) * abs(value), value, value)


def expected_step0(rank):
    mine = rank + 1
    world, pair = "[0,1]@0", "[0,1]@1"
    out = {
        f"all_reduce{world}#0.input": filled(mine), f"all_reduce{world}#0.output": filled(3),
        f"all_reduce{pair}#0.input": filled(mine), f"all_reduce{pair}#0.output": filled(3),
        f"all_reduce{world}#1.input": filled(mine), f"all_reduce{world}#1.output": filled(3),  # async, at wait()
        f"all_gather_into_tensor{world}#2.input": filled(mine),
        f"all_gather_into_tensor{world}#2.output": (math.sqrt(4 * 1 + 4 * 4), 1, 2),
        f"reduce_scatter_tensor{world}#3.input": filled(mine), f"reduce_scatter_tensor{world}#3.output": filled(3, 2),
        f"broadcast{world}#4.input": filled(mine), f"broadcast{world}#4.output": filled(2),
        f"all_gather{world}#5.input": filled(mine),
        f"all_gather{world}#5.output_0": filled(1), f"all_gather{world}#5.output_1": filled(2),
        # coalesced (outputs read after the coalescing manager ran them), and torch's *_single spellings
        f"reduce_scatter_tensor{world}#6.input": filled(mine), f"reduce_scatter_tensor{world}#6.output": filled(3, 2),
        f"reduce_scatter_tensor{world}#7.input": filled(mine), f"reduce_scatter_tensor{world}#7.output": filled(3, 2),
        f"all_gather_into_tensor{world}#8.input": filled(mine),
        f"all_gather_into_tensor{world}#8.output": (math.sqrt(4 * 1 + 4 * 4), 1, 2),
        f"reduce_scatter_single{world}#9.input": filled(mine), f"reduce_scatter_single{world}#9.output": filled(3, 2),
        f"all_gather_single{world}#10.input": filled(mine),
        f"all_gather_single{world}#10.output": (math.sqrt(4 * 1 + 4 * 4), 1, 2),
        f"all_reduce{world}#11.input": filled(mine),  # its Work waited for in the next step: no output
        # the batch: this rank's isend and the peer's, received
        f"isend[{rank}->{1 - rank}]@0#{2 if rank == 0 else 0}.input": filled(10 + rank),
        f"irecv[{1 - rank}->{rank}]@0#{2 if rank == 1 else 0}.output": filled(10 + 1 - rank),
    }
    if rank == 0:
        out.update({"send[0->1]@0#0.input": filled(7), "isend[0->1]@0#1.input": filled(8)})
    else:
        out.update({"recv[0->1]@0#0.output": filled(7), "irecv[0->1]@0#1.output": filled(8)})
    return out


def test_collectives_and_p2p_recorded_and_unpatched(tmp_path):
    output_dir = tmp_path / "monitor_output"
    torchrun("job_comm.py", 2, ["--out", str(tmp_path)], output_dir)
    run = the_run(output_dir)
    for rank in (0, 1):
        assert json.load(open(tmp_path / f"patches.rank{rank}.json")) == {
            "patched": True, "restored_after_step0": False, "restored": True}
        assert same(rows(run, rank, 0), expected_step0(rank)), (rows(run, rank, 0), expected_step0(rank))
        # sequence numbers start again every step; nothing is recorded after stop()
        assert same(rows(run, rank, 1), {"all_reduce[0,1]@0#0.input": filled(rank + 1),
                                         "all_reduce[0,1]@0#0.output": filled(3)})
    # a send and its receive carry the same [src->dst]@group#seq on the two ranks, with the same figures
    sent, received = rows(run, 0, 0), rows(run, 1, 0)
    for name, figures in sent.items():
        parsed = parse_comm_name(name)
        if parsed["op"] in ("send", "isend"):
            match = [n for n in received if parse_comm_name(n)["op"] in ("recv", "irecv")
                     and n.split("[", 1)[1].rsplit(".", 1)[0] == name.split("[", 1)[1].rsplit(".", 1)[0]]
            assert len(match) == 1 and received[match[0]] == figures, name


def test_cc_codeline_keeps_only_matching_call_sites(tmp_path):
    source = open(os.path.join(os.path.dirname(__file__), "job_comm.py")).read().splitlines()
    line = next(i for i, text in enumerate(source, 1) if "(codeline-target)" in text)
    output_dir = tmp_path / "monitor_output"
    codeline = json.dumps({"cc_codeline": [rf"job_comm\.py\[{line}\]"]})
    torchrun("job_comm.py", 2, ["--out", str(tmp_path), "--cc", codeline], output_dir)
    run = the_run(output_dir)
    for rank in (0, 1):
        assert same(rows(run, rank, 0), {"all_reduce[0,1]@1#0.input": filled(rank + 1),
                                         "all_reduce[0,1]@1#0.output": filled(3)})


def test_cc_log_only_lists_the_collectives_and_stops_watching(tmp_path):
    output_dir = tmp_path / "monitor_output"
    torchrun("job_comm.py", 2, ["--out", str(tmp_path), "--cc", json.dumps({"cc_log_only": True})], output_dir)
    run = the_run(output_dir)
    for rank in (0, 1):
        assert json.load(open(tmp_path / f"patches.rank{rank}.json")) == {
            "patched": True, "restored_after_step0": True, "restored": True}
        listed = json.load(open(os.path.join(run, f"rank_{rank}", "cc_log.json")))
        assert set(listed) == {"all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast",
                               "all_gather", "reduce_scatter_single", "all_gather_single", "isend", "irecv",
                               "send" if rank == 0 else "recv"}
        assert listed["all_reduce"]["groups"] == ["0,1"] and listed["all_reduce"]["dtypes"] == ["torch.float32"]
        assert all("job_comm.py[" in site for entry in listed.values() for site in entry["call_sites"])
        assert not [f for f in os.listdir(os.path.join(run, f"rank_{rank}")) if f.startswith("comm_")]
