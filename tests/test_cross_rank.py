"""Cross-rank attribution from collective records (trainmon.analysis.cross_rank) on hand-made event lists."""
from trainmon.analysis.cross_rank import attribute, format_chain
from trainmon.core.events import AnomalyEvent


def event(rank, step, family, module, micro=None, phase="forward", tensor="output", call=None):
    return AnomalyEvent(rank=rank, step=step, micro_step=micro, pp_stage=0, vpp_stage=0, call_index=call,
                        module=module, phase=phase, tensor=tensor, op="infs", value=1.0, rule="AnomalyNan",
                        family=family)


def test_all_reduce_blames_the_rank_whose_input_was_not_finite():
    events = [
        event(0, 3, "grad_reduced", "head.weight", phase="optimizer"),  # rank 0 sorts first, but was infected
        event(1, 3, "actv", "blocks.0", micro=0),
        event(1, 3, "comm", "all_reduce[0,1]@0#4.input", phase="communication"),
        event(0, 3, "comm", "all_reduce[0,1]@0#4.output", phase="communication"),
        event(1, 3, "comm", "all_reduce[0,1]@0#4.output", phase="communication"),
    ]
    result = attribute(events)
    assert result["origin_rank"] == 1
    assert result["origin"]["module"] == "blocks.0" and result["origin"]["step"] == 3
    assert result["chain"] == [{"step": 3, "from": [1], "via": "all_reduce[0,1]@0#4", "to": [0],
                                "calls": 1}]
    assert format_chain(result) == ["rank 1 -> all_reduce[0,1]@0#4 (step 3) -> rank 0"]


def test_p2p_carries_a_stage_output_to_the_next_stage_and_grads_back():
    events = [
        event(0, 2, "actv", "decoder.layers.1", micro=0),
        event(0, 2, "comm", "isend[0->1]@14#0.input", phase="communication"),
        event(1, 2, "comm", "irecv[0->1]@14#0.output", phase="communication"),
        event(1, 2, "actv", "decoder.layers.0", micro=0),
        event(1, 2, "comm", "isend[1->0]@14#0.input", phase="communication"),  # its grads go back
    ]
    result = attribute(events)
    assert result["origin_rank"] == 0 and result["origin"]["module"] == "decoder.layers.1"
    assert [(c["from"], c["to"]) for c in result["chain"]] == [([0], [1]), ([1], [0])]


def test_the_chain_follows_each_ranks_call_order_not_rank_numbers():
    """PP2 × DP2: rank 1 (stage 0) sends to rank 3, and only later do the DP grad all-reduces reach ranks 0
    and 2. Rank 0's records sort first by the ordering key, yet its all-reduces come after rank 1's send."""
    comm = dict(family="comm", phase="communication")
    events = sorted([
        event(1, 1, "actv", "decoder.layers.1", micro=0, call=5),
        event(1, 1, module="isend[1->3]@22#0.input", call=6, **comm),
        event(3, 1, module="irecv[1->3]@22#0.output", call=2, **comm),
        event(3, 1, module="isend[3->1]@22#0.input", call=9, **comm),
        event(1, 1, module="irecv[3->1]@22#0.output", call=12, **comm),
        *[event(1, 1, module=f"all_reduce[0,1]@5#{seq}.input", call=20 + seq, **comm) for seq in range(3)],
        *[event(0, 1, module=f"all_reduce[0,1]@5#{seq}.output", call=30 + seq, **comm) for seq in range(3)],
        event(3, 1, module="all_reduce[2,3]@7#0.input", call=40, **comm),
        event(2, 1, module="all_reduce[2,3]@7#0.output", call=41, **comm),
    ], key=lambda e: e.order_key())
    result = attribute(events)
    assert result["origin_rank"] == 1
    links = [(c["via"], c["from"], c["to"], c["calls"]) for c in result["chain"]]
    assert links[0] == ("isend[1->3]@22#0", [1], [3], 1)
    assert ("all_reduce[0,1]@5#0", [1], [0], 3) in links, "three calls of one series make one link"
    grads_back = next(i for i, link in enumerate(links) if link[1:3] == ([3], [1]))
    assert grads_back < links.index(("all_reduce[0,1]@5#0", [1], [0], 3))
    assert "rank 1 -> all_reduce[0,1]@5#0 and 2 more of its series (step 1) -> rank 0" in format_chain(result)


def test_a_receive_alone_still_names_its_source():
    result = attribute([event(1, 0, "comm", "recv[0->1]@0#0.output", phase="communication")])
    assert result["origin_rank"] == 0 and result["origin"] is None


def test_outputs_without_recorded_inputs_are_not_guessed():
    events = [event(r, 1, "comm", "all_reduce[0,1]@0#0.output", phase="communication") for r in (0, 1)]
    assert attribute(events) == {"origin_rank": None, "origin": None, "chain": [],
                                 "unattributed": ["all_reduce[0,1]@0#0"]}


def test_no_collective_involved():
    assert attribute([event(0, 1, "actv", "blocks.0", micro=0)]) is None


def test_ranks_reached_by_an_unattributed_collective_are_not_taken_for_origins():
    """TP2 x PP2 without collectives' inputs: the stage's TP all-reduce spread the inf to both TP ranks, whose
    grads then go back through p2p. Either could have started it: no origin is named."""
    comm = dict(family="comm", phase="communication")
    events = [
        *[event(r, 1, module="all_reduce[2,3]@tp#0.output", call=10, **comm) for r in (2, 3)],
        event(2, 1, module="isend[2->0]@pp#0.input", call=20, **comm),
        event(3, 1, module="isend[3->1]@pp#0.input", call=20, **comm),
    ]
    result = attribute(events)
    assert (result["origin_rank"], result["unattributed"]) == (None, ["all_reduce[2,3]@tp#0"])


def test_a_group_of_one_rank_carries_nothing_across_ranks():
    """Megatron's data-parallel groups of one rank (TP2 x PP2 on 4 processes) reduce only the rank's own values."""
    assert attribute([event(2, 1, "comm", "all_reduce[2]@13#0.output", phase="communication")]) is None
