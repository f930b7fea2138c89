"""Post-mortem: where did non-finite values first appear in a run, and where did they spread?

Reads every rank's non-finite records once, from the best source present (`read.evidence`), sorts the non-finite records by the
ordering key (`ordering`: step, micro-step, phase, pipeline stage, call index, rank) and reports the
earliest one (`first`), and the chain: the first appearance of each other (rank, module, phase), in key
order. Across ranks, when collectives' records carried the non-finite values (`cc_distribution`), the
rank they started on is found from them (`cross_rank`) and `first` is that rank's earliest record;
without them, the key decides, and the other ranks non-finite at the same stage place (step,
micro-step, phase, stage) are listed as `ties`, not guessed. Collectives whose non-finite outputs no
recorded input explains are named, with the config key that records their inputs when that was off.

CSV files carry no call index (`call_index` is reported as null): within their stage place their rows
follow the indexed records, in file order. A record that two sources hold is reported once, from a
source that has its call index.

msprobe dump directories (`step<N>/rank<R>/dump.json`) are read instead when `path` is one
(msprobe_dump), with the same report.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from trainmon.anomaly.cross_rank import attribute, format_chain
from trainmon.anomaly.events import INPUT_BATCH_ORIGIN, AnomalyEvent, came_with_input_batch
from trainmon.anomaly.msprobe_dump import read_dump
from trainmon.anomaly.ordering import order_key, stage_place
from trainmon.read.evidence import rank_evidence, record_identity
from trainmon.read.layout import find_run

# The config key that records collectives' inputs, without which a collective's non-finite outputs
# cannot be traced back to the rank that fed it the non-finite values.
INPUTS_KEY = "cc_distribution.cc_pre_hook"


def _dedupe(ordered: list[AnomalyEvent]) -> list[AnomalyEvent]:
    """One event per tensor record, in key order; of a record read from several sources, the copy that
    has a call index (the database's or anomalies.jsonl's, not a CSV row's) is kept."""
    chosen: dict[tuple, AnomalyEvent] = {}
    for event in ordered:
        ident = record_identity(event)
        kept = chosen.get(ident)
        if kept is None or (kept.call_index is None and event.call_index is not None):
            chosen[ident] = event
    return sorted(chosen.values(), key=order_key)


def _read_run(path: Path) -> tuple[str, dict, list[str], list[str], list[AnomalyEvent], list[int]]:
    """(run directory, sources {rank: [files]}, notes, warnings, events, ranks that did not record
    collectives' inputs) of a trainmon run or output root."""
    run = find_run(path)
    notes = [run.note] if run.note else []
    sources, everything, without_inputs, warnings = {}, [], [], []
    for rank_dir in run.ranks:
        metadata = rank_dir.metadata()
        evidence = rank_evidence(rank_dir, metadata)
        sources[str(rank_dir.rank)] = evidence.sources
        notes += evidence.notes
        warnings += evidence.warnings
        everything += evidence.events
        cc = metadata.get("config", {}).get("cc_distribution", {})
        if cc.get("enable") and not cc.get("cc_pre_hook"):
            without_inputs.append(rank_dir.rank)
    return str(run.path), sources, notes, warnings, everything, without_inputs


def analyze(path: str | Path) -> dict:
    """Analyses a run directory (or the latest run under an output root, or an msprobe dump directory).

    Returns:
        A JSON-ready dict: run, ranks, sources {rank: [files]}, notes, warnings (sources cut short by a
        crash, read up to their last whole record), nonfinite_records, first
        ({rank, step, micro_step, module, phase, tensor, call_index} or None when clean), first_record
        (first plus op, value, rule, family), ties and chain (lists shaped like first), cross_rank
        (`cross_rank.attribute`'s result plus `inputs_not_recorded_on`, the ranks that ran with
        cc_distribution on and cc_pre_hook off; None without collective records).

    Raises:
        InputError: a missing directory, or a truncated or corrupt file (named in the message).
    """
    dump = read_dump(Path(path))
    run, sources, notes, warnings, everything, without_inputs = (
        (dump.run, dump.sources, dump.notes, [], dump.events, []) if dump else _read_run(Path(path)))
    ordered = _dedupe(sorted(everything, key=order_key))
    first: Optional[AnomalyEvent] = ordered[0] if ordered else None
    cross = attribute(ordered)
    if cross is not None:
        cross["inputs_not_recorded_on"] = without_inputs
        if cross["origin"] is not None:
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
        "warnings": warnings,
        "nonfinite_records": len(ordered),
        "first": first.where() if first else None,
        "first_record": ({**first.where(), "op": first.op, "value": _json_value(first.value), "rule": first.rule,
                          "family": first.family} if first else None),
        "ties": ties,
        "chain": chain,
        "cross_rank": cross,
    }


def _unattributed_lines(cross: dict) -> list[str]:
    """What the report could not trace: collectives with non-finite outputs and no non-finite input, by series
    (op and group; the calls of one series differ only in their sequence number)."""
    names = cross["unattributed"]
    if not names:
        return []
    series: dict[str, int] = {}
    for name in names:
        key = name.rsplit("#", 1)[0]
        series[key] = series.get(key, 0) + 1
    listed = ", ".join(f"{key} ({count} call{'s' if count > 1 else ''})" for key, count in series.items())
    lines = [f"could not attribute {len(names)} collective call(s) with non-finite outputs, as no non-finite input "
             f"of theirs was recorded: {listed}"]
    missing = cross["inputs_not_recorded_on"]
    if missing:
        lines.append(f"  rank(s) {', '.join(map(str, missing))} did not record collectives' inputs: set "
                     f"{INPUTS_KEY} to true (the default) to attribute them")
    return lines


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
    lines += [f"warning: {w}" for w in result["warnings"]]
    first = result["first_record"]
    if first is None:
        lines.append("clean: no NaN or Inf in any record of this run")
        return "\n".join(lines)
    lines.append(f"first non-finite tensor: {_place(first)} [{first['op']}={first['value']}, {first['rule']}]")
    if came_with_input_batch(first):
        lines.append(f"  {INPUT_BATCH_ORIGIN}")
    if result["ties"]:
        lines.append("also non-finite at the same step, micro-step, phase and pipeline stage (order across ranks "
                     "unknown; records of collectives, cc_distribution, would decide):")
        lines += [f"  {_place(t)}" for t in result["ties"]]
    cross = result["cross_rank"]
    if cross is not None:
        lines.append("spread across ranks through collectives:")
        lines += [f"  {line}" for line in format_chain(cross)]
        lines += _unattributed_lines(cross)
    chain = result["chain"]
    lines.append(f"then reached {len(chain)} more module/phase place(s), in order:" if chain
                 else "it reached no other module")
    lines += [f"  {i}. {_place(c)}" for i, c in enumerate(chain[:chain_lines], 1)]
    if len(chain) > chain_lines:
        lines.append(f"  ... {len(chain) - chain_lines} more (all of them with --json)")
    lines.append(f"{result['nonfinite_records']} non-finite record(s) in all")
    return "\n".join(lines)
