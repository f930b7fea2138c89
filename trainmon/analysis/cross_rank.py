"""Cross-rank attribution: which rank a NaN/Inf started on, read from the collectives' records.

A `comm` record's name identifies the same call on every rank (collective_ops: op, group, sequence
number within the step; p2p: source, destination). Over the non-finite records of a run:

- a collective whose input was non-finite on some ranks and whose output was non-finite on others
  was the way from the former to the latter (inputs are recorded with `cc_pre_hook`);
- a send whose tensor was non-finite carried it to the receiving rank (a pipeline stage's bad output
  reaching the next stage), and a non-finite receive blames its source even when the send was not
  recorded.

Calls are followed in causal order: a call happens at once on every rank taking part, so the calls are
ordered to keep each rank's own order of them (its call indices). A rank that passes on non-finite
values without having received them through an earlier call is an origin; a collective whose non-finite
outputs no recorded input explains is unattributed, and its ranks are not taken for origins (they got
the values from somewhere). The result names the origin
rank's earliest non-finite record and the chain rank → call → ranks, where consecutive calls of one
series (same op and group, same ranks on either side) form one link.
"""
from __future__ import annotations

import heapq
import math
from collections import defaultdict
from typing import Optional, Sequence

from trainmon.core.events import AnomalyEvent
from trainmon.core.ordering import order_key
from trainmon.core.collective_ops import P2P, parse_comm_name
from trainmon.core.records import COMM


def _call_key(step: int, parsed: dict) -> tuple:
    if parsed["op"] in P2P:
        return (step, "p2p", parsed["group"], parsed["src"], parsed["dst"], parsed["seq"])
    return (step, parsed["op"], parsed["group"], parsed["seq"])


def _calls(events: Sequence[AnomalyEvent]) -> list[dict]:
    """The calls with non-finite records; `at` holds each taking part rank's position of the call."""
    calls: dict[tuple, dict] = {}
    names: dict[str, Optional[dict]] = {}  # a call's name recurs on every rank and, often, every step
    for position, event in enumerate(events):
        if event.family != COMM:
            continue
        parsed = names[event.module] if event.module in names else names.setdefault(event.module,
                                                                                     parse_comm_name(event.module))
        if parsed is None or len(parsed["ranks"]) == 1:  # a group of one rank moves nothing between ranks
            continue
        key = _call_key(event.step, parsed)
        name = event.module.rsplit(".", 1)[0]
        call = calls.setdefault(key, {"step": event.step, "name": name, "series": name.rsplit("#", 1)[0],
                                      "sources": set(), "reached": set(), "p2p": parsed["op"] in P2P, "at": {}})
        if call["p2p"] and event.rank == parsed["src"]:
            # A p2p call is named by its send, whichever end's record sorts first.
            call["name"], call["series"] = name, name.rsplit("#", 1)[0]
        index = math.inf if event.call_index is None else event.call_index
        call["at"].setdefault(event.rank, (event.step, index, position))
        if call["p2p"]:
            # Either end of a p2p record tells both ends: the data went from src to dst.
            call["sources"].add(parsed["src"])
            call["reached"].add(parsed["dst"])
        elif parsed["io"] == "input":
            call["sources"].add(event.rank)
        else:
            call["reached"].add(event.rank)
    return list(calls.values())


def _causal_order(calls: list[dict]) -> list[dict]:
    """`calls` in an order that keeps every rank's own order of them (a topological merge)."""
    per_rank = defaultdict(list)
    for i, call in enumerate(calls):
        for rank, position in call["at"].items():
            per_rank[rank].append((position, i))
    after = defaultdict(list)  # call -> the calls that directly follow it on one of its ranks
    waiting = [0] * len(calls)  # per call: on how many ranks an earlier call is still unplaced
    for sequence in per_rank.values():
        sequence.sort()
        for (_, earlier), (_, later) in zip(sequence, sequence[1:]):
            after[earlier].append(later)
            waiting[later] += 1
    ready = [(min(call["at"].values()), i) for i, call in enumerate(calls) if not waiting[i]]
    heapq.heapify(ready)
    ordered = []
    while ready:
        _, i = heapq.heappop(ready)
        ordered.append(i)
        for later in after[i]:
            waiting[later] -= 1
            if not waiting[later]:
                heapq.heappush(ready, (min(calls[later]["at"].values()), later))
    # Records whose call indices disagree (e.g. CSV rows, which have none) cannot all be placed: they
    # follow in the order of their first record.
    placed = set(ordered)
    ordered += sorted((i for i in range(len(calls)) if i not in placed), key=lambda i: min(calls[i]["at"].values()))
    return [calls[i] for i in ordered]


def attribute(events: Sequence[AnomalyEvent]) -> Optional[dict]:
    """The origin of the non-finite values and their spread, from the collectives among `events`.

    Args:
        events: non-finite records of every rank, in any order (they are taken in the ordering key's).

    Returns:
        None when no collective carried non-finite values; else {origin_rank, origin (the `where()` of
        that rank's earliest non-finite record, None if it has none besides collectives), chain
        [{step, from, via, to, calls}] (`via` names the first of `calls` consecutive calls of one
        series), unattributed [call names whose non-finite outputs have no recorded
        non-finite input: record inputs with cc_pre_hook]}.
    """
    events = sorted(events, key=order_key)
    calls = [c for c in _calls(events) if c["reached"] - c["sources"] or c["p2p"]]
    if not calls:
        return None
    reached_by: dict[int, str] = {}
    origins: list[int] = []
    chain, unattributed = [], []
    for call in _causal_order(calls):
        if not call["sources"]:
            # Its ranks got non-finite values from an unknown rank: none of them is taken for an origin.
            unattributed.append(call["name"])
            for rank in call["reached"]:
                reached_by.setdefault(rank, call["name"])
            continue
        for rank in sorted(call["sources"]):
            if rank not in reached_by and rank not in origins:
                origins.append(rank)
        newly = sorted(call["reached"] - call["sources"])
        for rank in newly:
            reached_by.setdefault(rank, call["name"])
        link = {"step": call["step"], "from": sorted(call["sources"]), "via": call["name"], "to": newly, "calls": 1}
        last = chain[-1] if chain else None
        if last and (last["step"], last["from"], last["to"], last["series"]) == (
                link["step"], link["from"], link["to"], call["series"]):
            last["calls"] += 1
        else:
            chain.append(link | {"series": call["series"]})
    for link in chain:
        del link["series"]
    if not origins:
        return {"origin_rank": None, "origin": None, "chain": chain, "unattributed": unattributed}
    origin_rank = origins[0]
    own = next((e for e in events if e.rank == origin_rank and e.family != COMM), None)
    return {"origin_rank": origin_rank, "origin": own.where() if own else None, "chain": chain,
            "unattributed": unattributed}


def format_chain(result: dict) -> list[str]:
    """Report lines: `rank A -> <call> (step S) -> rank B, C`."""
    return [f"rank {','.join(map(str, link['from']))} -> {link['via']}"
            f"{f' and {n - 1} more of its series' if (n := link['calls']) > 1 else ''} (step {link['step']}) -> "
            f"rank {','.join(map(str, link['to'])) or '(none new)'}" for link in result["chain"]]
