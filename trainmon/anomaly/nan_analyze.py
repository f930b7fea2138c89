"""Post-mortem: where did non-finite values first appear in a run, and where did they spread?

Reads every rank's `anomalies.jsonl`, `monitor.db` and CSV files, sorts the non-finite records by the
ordering key (`ordering`: step, micro-step, phase, pipeline stage, call index, rank) and reports the
earliest one (`first`), and the chain: the first appearance of each other (rank, module, phase), in key
order. Across ranks, when collectives' records carried the non-finite values (`cc_distribution`), the
rank they started on is found from them (`cross_rank`) and `first` is that rank's earliest record;
without them, the key decides, and the other ranks non-finite at the same stage place (step,
micro-step, phase, stage) are listed as `ties`, not guessed.

CSV files carry no call index (`call_index` is reported as null): within their stage place their rows
follow the indexed records, in file order. A record read from several sources is reported once, from
a source that has its call index.

msprobe dump directories (`step<N>/rank<R>/dump.json`) are read instead when `path` is one
(msprobe_dump), with the same report.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from trainmon.anomaly.cross_rank import attribute, format_chain
from trainmon.anomaly.events import AnomalyEvent
from trainmon.anomaly.msprobe_dump import read_dump
from trainmon.anomaly.ordering import order_key, stage_place
from trainmon.anomaly.run_inputs import find_run, rank_dirs, rank_events, read_metadata


def _dedupe(ordered: list[AnomalyEvent]) -> list[AnomalyEvent]:
    """One event per tensor record, in key order; of a record read from several sources, the copy that
    has a call index (the database's or anomalies.jsonl's, not a CSV row's) is kept."""
    chosen: dict[tuple, AnomalyEvent] = {}
    for event in ordered:
        ident = (event.rank, event.step, event.micro_step, event.vpp_stage, event.family, event.module,
                 event.tensor)
        kept = chosen.get(ident)
        if kept is None or (kept.call_index is None and event.call_index is not None):
            chosen[ident] = event
    return sorted(chosen.values(), key=order_key)


def _read_run(path: Path) -> tuple[str, dict, list[str], list[AnomalyEvent]]:
    """(run directory, sources {rank: [files]}, notes, events) of a trainmon run or output root."""
    run_dir, note = find_run(path)
    notes = [note] if note else []
    sources, everything = {}, []
    for rank, directory in rank_dirs(run_dir).items():
        metadata = read_metadata(directory)
        events, used, rank_notes = rank_events(rank, directory, metadata)
        sources[str(rank)] = used
        notes += rank_notes
        everything += events
    return str(run_dir), sources, notes, everything


def analyze(path: str | Path) -> dict:
    """Analyses a run directory (or the latest run under an output root, or an msprobe dump directory).

    Returns:
        A JSON-ready dict: run, ranks, sources {rank: [files]}, notes, nonfinite_records, first
        ({rank, step, micro_step, module, phase, tensor, call_index} or None when clean), first_record
        (first plus op, value, rule, family), ties and chain (lists shaped like first), cross_rank
        (`cross_rank.attribute`'s result, or None without collective records).

    Raises:
        InputError: a missing directory, or a truncated or corrupt file (named in the message).
    """
    run, sources, notes, everything = read_dump(Path(path)) or _read_run(Path(path))
    ordered = _dedupe(sorted(everything, key=order_key))
    first: Optional[AnomalyEvent] = ordered[0] if ordered else None
    cross = attribute(ordered)
    if cross is not None and cross["origin"] is not None:
        first = next(e for e in ordered if e.where() == cross["origin"])
    ties, chain, reached = [], [], set()
    if first is not None and (cross is None or cross["origin_rank"] is None):
        tied_ranks = {first.rank}
        for event in ordered[1:]:
            if stage_place(event) == stage_place(first) and event.rank not in tied_ranks:
                tied_ranks.add(event.rank)
                ties.append(event.where())
    if first is not None:
        reached.add((first.rank, first.module, first.phase))
        for event in ordered:
            place = (event.rank, event.module, event.phase)
            if place not in reached:
                reached.add(place)
                chain.append(event.where())
    return {
        "run": run,
        "ranks": sorted(int(r) for r in sources),
        "sources": sources,
        "notes": notes,
        "nonfinite_records": len(ordered),
        "first": first.where() if first else None,
        "first_record": ({**first.where(), "op": first.op, "value": _json_value(first.value), "rule": first.rule,
                          "family": first.family} if first else None),
        "ties": ties,
        "chain": chain,
        "cross_rank": cross,
    }


def _json_value(value: float):
    return value if value == value and abs(value) != float("inf") else str(value)


def _place(where: dict) -> str:
    micro = "" if where["micro_step"] is None else f" micro-step {where['micro_step']}"
    call = "" if where["call_index"] is None else f" (call {where['call_index']})"
    return (f"rank {where['rank']} step {where['step']}{micro}: {where['module'] or '<root>'} "
            f"{where['phase']} {where['tensor']}{call}")


def format_report(result: dict, chain_lines: int = 20) -> str:
    """The human-readable report of an `analyze` result."""
    lines = [f"run: {result['run']}",
             "sources: " + "; ".join(f"rank {r}: {', '.join(s) or 'nothing readable'}"
                                     for r, s in result["sources"].items())]
    lines += [f"note: {n}" for n in result["notes"]]
    first = result["first_record"]
    if first is None:
        lines.append("clean: no NaN or Inf in any record of this run")
        return "\n".join(lines)
    lines.append(f"first non-finite tensor: {_place(first)} [{first['op']}={first['value']}, {first['rule']}]")
    if result["ties"]:
        lines.append("also non-finite at the same step, micro-step, phase and pipeline stage (order across ranks "
                     "unknown; records of collectives, cc_distribution, would decide):")
        lines += [f"  {_place(t)}" for t in result["ties"]]
    if result["cross_rank"] is not None:
        lines.append("spread across ranks through collectives:")
        lines += [f"  {line}" for line in format_chain(result["cross_rank"])]
    chain = result["chain"]
    lines.append(f"then reached {len(chain)} more module/phase place(s), in order:" if chain
                 else "it reached no other module")
    lines += [f"  {i}. {_place(c)}" for i, c in enumerate(chain[:chain_lines], 1)]
    if len(chain) > chain_lines:
        lines.append(f"  ... {len(chain) - chain_lines} more (all of them with --json)")
    lines.append(f"{result['nonfinite_records']} non-finite record(s) in all")
    return "\n".join(lines)
