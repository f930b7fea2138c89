"""Cross-rank attribution: which rank a NaN/Inf started on, read from the collectives' records.

A `comm` record's name identifies the same call on every rank (collective_ops: op, group, sequence
number within the step; p2p: source, destination). Over the non-finite records of a run:

- a collective whose input was non-finite on some ranks and whose output was non-finite on others
  was the way from the former to the latter (inputs are recorded with `cc_pre_hook`);
- a send whose tensor was non-finite carried it to the receiving rank (a pipeline stage's bad output
  reaching the next stage), and a non-finite receive blames its source even when the send was not
  recorded.

Calls are followed in step order; a rank that passes on non-finite values without having received them
through an earlier call is an origin. The result names the origin rank's earliest non-finite record
and the chain rank → call → ranks.
"""
from __future__ import annotations

from typing import Optional, Sequence

from trainmon.anomaly.events import AnomalyEvent
from trainmon.monitor.collective_ops import P2P, parse_comm_name
from trainmon.monitor.records import COMM


def _call_key(step: int, parsed: dict) -> tuple:
    if parsed["op"] in P2P:
        return (step, "p2p", parsed["group"], parsed["src"], parsed["dst"], parsed["seq"])
    return (step, parsed["op"], parsed["group"], parsed["seq"])


def _calls(events: Sequence[AnomalyEvent]) -> list[dict]:
    """The calls with non-finite records, in the order their first record appears in `events`."""
    calls: dict[tuple, dict] = {}
    for event in events:
        parsed = parse_comm_name(event.module) if event.family == COMM else None
        if parsed is None:
            continue
        key = _call_key(event.step, parsed)
        call = calls.setdefault(key, {"step": event.step, "name": event.module.rsplit(".", 1)[0],
                                      "sources": set(), "reached": set(), "p2p": parsed["op"] in P2P})
        if call["p2p"]:
            # Either end of a p2p record tells both ends: the data went from src to dst.
            call["sources"].add(parsed["src"])
            call["reached"].add(parsed["dst"])
        elif parsed["io"] == "input":
            call["sources"].add(event.rank)
        else:
            call["reached"].add(event.rank)
    return list(calls.values())


def attribute(events: Sequence[AnomalyEvent]) -> Optional[dict]:
    """The origin of the non-finite values and their spread, from the collectives among `events`.

    Args:
        events: non-finite records of every rank, ordered by the ordering key (earliest first).

    Returns:
        None when no collective carried non-finite values; else {origin_rank, origin (the `where()` of
        that rank's earliest non-finite record, None if it has none besides collectives), chain
        [{step, from, via, to}], unattributed [call names whose non-finite outputs have no recorded
        non-finite input: record inputs with cc_pre_hook]}.
    """
    calls = [c for c in _calls(events) if c["reached"] - c["sources"] or c["p2p"]]
    if not calls:
        return None
    calls.sort(key=lambda c: c["step"])  # stable: within a step, the order of first appearance
    reached_by: dict[int, str] = {}
    origins: list[int] = []
    chain, unattributed = [], []
    for call in calls:
        if not call["sources"]:
            unattributed.append(call["name"])
            continue
        for rank in sorted(call["sources"]):
            if rank not in reached_by and rank not in origins:
                origins.append(rank)
        newly = sorted(call["reached"] - call["sources"])
        for rank in newly:
            reached_by.setdefault(rank, call["name"])
        chain.append({"step": call["step"], "from": sorted(call["sources"]), "via": call["name"], "to": newly})
    if not origins:
        return {"origin_rank": None, "origin": None, "chain": chain, "unattributed": unattributed}
    origin_rank = origins[0]
    own = next((e for e in events if e.rank == origin_rank and e.family != COMM), None)
    return {"origin_rank": origin_rank, "origin": own.where() if own else None, "chain": chain,
            "unattributed": unattributed}


def format_chain(result: dict) -> list[str]:
    """Report lines: `rank A -> <call> (step S) -> rank B, C`."""
    return [f"rank {','.join(map(str, link['from']))} -> {link['via']} (step {link['step']}) -> "
            f"rank {','.join(map(str, link['to'])) or '(none new)'}" for link in result["chain"]]
