"""What the post-mortem keeps of one rank: enough for the report, not every record.

The report needs the earliest record, the first appearance of each (rank, module, phase), the count of
records, and the collectives' records (cross_rank traces the origin through them). A rank's summary
holds exactly that, so ranks are summarised in parallel processes and merged by the ordering key, and
memory stays bounded by the report, not by the run.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from trainmon.core.events import AnomalyEvent
from trainmon.core.ordering import order_key
from trainmon.core.records import COMM
from trainmon.read.evidence import rank_evidence, record_identity
from trainmon.read.layout import RankDir


@dataclass
class RankSummary:
    """One rank's part of the report."""

    rank: int
    records: int = 0  # distinct non-finite records
    firsts: list[AnomalyEvent] = field(default_factory=list)  # first of each (module, phase), key order
    # the collectives' non-finite records, but for outputs of calls whose input was non-finite on this rank
    comm: list[AnomalyEvent] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    incomplete: bool = False  # part of a source could not be read: the rank is not known to be clean
    without_inputs: bool = False  # ran with cc_distribution on and cc_pre_hook off


def summarize(rank: int, events: Iterable[AnomalyEvent]) -> RankSummary:
    """The summary of one rank's non-finite events (any order; a record read twice counts once, the
    copy with a call index kept)."""
    chosen: dict[tuple, AnomalyEvent] = {}
    replaced = False  # a copy took the place of one that sorts elsewhere: the kept ones are sorted again
    for event in sorted(events, key=order_key):
        ident = record_identity(event)
        kept = chosen.get(ident)
        if kept is None:
            chosen[ident] = event
        elif kept.call_index is None and event.call_index is not None:
            chosen[ident], replaced = event, True
    out = RankSummary(rank, records=len(chosen))
    seen = set()
    inputs = set()  # (step, micro-step, call) of the collective calls whose input is non-finite here
    for event in sorted(chosen.values(), key=order_key) if replaced else chosen.values():
        if event.family == COMM:
            call, _, tensor = event.module.rpartition(".")  # <call>.input, <call>.output_1, ...
            io = tensor.partition("_")[0]
            where = (event.step, event.micro_step, call)
            # an output after a non-finite input of the same call on this rank tells cross_rank nothing more:
            # the rank is already among the call's sources, so not among the ranks it reached
            if not (io == "output" and where in inputs):
                out.comm.append(event)
            if io == "input":
                inputs.add(where)
        if (event.module, event.phase) not in seen:
            seen.add((event.module, event.phase))
            out.firsts.append(event)
    return out


def summarize_rank_dir(rank_dir: RankDir) -> RankSummary:
    """Reads one rank's evidence and summarises it (run in a worker process for many ranks)."""
    metadata = rank_dir.metadata()
    evidence = rank_evidence(rank_dir, metadata)
    out = summarize(rank_dir.rank, evidence.events)
    out.records = evidence.records  # the events are only those the report needs
    out.sources, out.notes, out.warnings = evidence.sources, evidence.notes, evidence.warnings
    out.incomplete = evidence.incomplete
    cc = metadata.get("config", {}).get("cc_distribution", {})
    out.without_inputs = bool(cc.get("enable") and not cc.get("cc_pre_hook"))
    return out
