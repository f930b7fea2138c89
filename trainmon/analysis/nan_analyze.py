"""Post-mortem: where did non-finite values first appear in a run, and where did they spread?

Reads of every rank what the report needs, each record once, from the best source present
(`read.evidence`; of a database, a few SQL queries: `read.db_nonfinite`), in parallel processes; keeps
of each rank its summary (`rank_summary`); merges the ranks by the
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

import heapq
from pathlib import Path
from typing import Collection, Optional

from trainmon.analysis.cross_rank import attribute, format_chain
from trainmon.core.events import INPUT_BATCH_ORIGIN, AnomalyEvent, came_with_input_batch, finding
from trainmon.analysis.msprobe_dump import read_dump
from trainmon.core.ordering import order_key, stage_place
from trainmon.analysis.rank_summary import RankSummary, summarize, summarize_rank_dir
from trainmon.core.records import COMM
from trainmon.read.layout import RunDirs, find_run
from trainmon.read.parallel import map_ranks

# The config key that records collectives' inputs, without which a collective's non-finite outputs
# cannot be traced back to the rank that fed it the non-finite values.
INPUTS_KEY = "cc_distribution.cc_pre_hook"


def _summaries(path: Path, progress: bool, ranks: Optional[Collection[int]] = None
               ) -> tuple[str, dict, list[str], list[RankSummary], Optional[RunDirs]]:
    """(run, sources {rank: [files]}, notes, one summary per rank, the run's directories (None for a dump)) of
    an msprobe dump or a trainmon run (only `ranks` of a trainmon run, when given)."""
    dump = read_dump(path)
    if dump:
        by_rank: dict[int, list[AnomalyEvent]] = {}
        for event in dump.events:
            by_rank.setdefault(event.rank, []).append(event)
        summaries = [summarize(rank, events) for rank, events in sorted(by_rank.items())]
        return dump.run, dump.sources, list(dump.notes), summaries, None
    run = find_run(path)
    rank_dirs = [r for r in run.ranks if ranks is None or r.rank in ranks]
    summaries = map_ranks(summarize_rank_dir, rank_dirs, progress, "nan-analyze")
    notes = ([run.note] if run.note else []) + [n for s in summaries for n in s.notes]
    return str(run.path), {str(s.rank): s.sources for s in summaries}, notes, summaries, run


def analyze(path: str | Path, progress: bool = False, ranks: Optional[Collection[int]] = None) -> dict:
    """Analyses a run directory (or the latest run under an output root, or an msprobe dump directory).

    Ranks are summarised in parallel processes (`rank_summary`) and their first appearances merged by
    the ordering key.

    Args:
        path: the run.
        progress: show a progress bar over the ranks on stderr.
        ranks: only these ranks of a trainmon run (the daemon leaves out ranks it cannot read).

    Returns:
        A JSON-ready dict: run, ranks, sources {rank: [files]}, notes, warnings (sources cut short by a
        crash, read up to their last whole record; corrupt parts skipped), incomplete_ranks (the ranks with a
        part that could not be read: a report without NaN or Inf does not make them clean), missing_ranks and
        missing_warning (`RunDirs`'s: ranks of the run without a directory), nonfinite_records, first
        ({rank, step, micro_step, module, phase, tensor, call_index} or None when clean), first_record
        (first plus op, value, rule, family), ties and chain (lists shaped like first), cross_rank
        (`cross_rank.attribute`'s result plus `inputs_not_recorded_on`, the ranks that ran with
        cc_distribution on and cc_pre_hook off; None without collective records).

    Raises:
        InputError: a missing directory, or a truncated or corrupt file (named in the message).
    """
    run, sources, notes, summaries, run_dirs = _summaries(Path(path), progress, ranks)
    # every rank's first appearances, in key order: each rank's list is sorted, so a merge is enough
    firsts = list(heapq.merge(*(s.firsts for s in summaries), key=order_key))
    first: Optional[AnomalyEvent] = firsts[0] if firsts else None
    # the collectives' records, and each rank's earliest other record (the origin's is `first`)
    cross = attribute([e for s in summaries for e in s.comm] + [e for e in firsts if e.family != COMM])
    if cross is not None:
        cross["inputs_not_recorded_on"] = [s.rank for s in summaries if s.without_inputs]
        if cross["origin"] is not None:
            first = next(e for e in firsts if e.where() == cross["origin"])
    ties, chain = [], []
    if first is not None and (cross is None or cross["origin_rank"] is None):
        # a rank's first record at the first's stage place is its earliest, so among `firsts`
        tied_ranks = {first.rank}
        for event in firsts[1:]:
            if stage_place(event) == stage_place(first) and event.rank not in tied_ranks:
                tied_ranks.add(event.rank)
                ties.append(event.where())
    if first is not None:
        chain = [e.where() for e in firsts if (e.rank, e.module, e.phase) != (first.rank, first.module, first.phase)]
    return {
        "run": run,
        "ranks": sorted(int(r) for r in sources),
        "sources": sources,
        "notes": notes,
        "warnings": [w for s in summaries for w in s.warnings],
        "incomplete_ranks": [s.rank for s in summaries if s.incomplete],
        # ranks asked for are all there (or it is an InputError): the missing ones are the run's when none were
        "missing_ranks": run_dirs.missing_ranks if run_dirs and ranks is None else [],
        "missing_warning": run_dirs.missing_warning if run_dirs and ranks is None else None,
        "nonfinite_records": sum(s.records for s in summaries),
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


def describe_place(where: dict) -> str:
    """One place (a `where()` dict) as the report writes it: rank, step, micro-step, module, phase, tensor."""
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
    unread = []  # what may hold a NaN or Inf that was not seen
    if result["incomplete_ranks"]:
        unread.append(f"part of rank(s) {', '.join(map(str, result['incomplete_ranks']))} could not be read")
    if result["missing_ranks"]:
        unread.append(f"rank(s) {', '.join(map(str, result['missing_ranks']))} have no output")
    if first is None and unread:
        lines.append(f"not known to be clean: no NaN or Inf in the records read, but {' and '.join(unread)} (see the "
                     "warnings)")
        return "\n".join(lines)
    if first is None:
        lines.append("clean: no NaN or Inf in any record of this run")
        return "\n".join(lines)
    lines.append(f"first non-finite tensor: {describe_place(first)} "
                 f"[{finding(first['op'], first['value'], first['rule'])}, {first['rule']}]")
    if came_with_input_batch(first):
        lines.append(f"  {INPUT_BATCH_ORIGIN}")
    if result["ties"]:
        lines.append("also non-finite at the same step, micro-step, phase and pipeline stage (order across ranks "
                     "unknown; records of collectives, cc_distribution, would decide):")
        lines += [f"  {describe_place(t)}" for t in result["ties"]]
    cross = result["cross_rank"]
    if cross is not None:
        lines.append("spread across ranks through collectives:")
        lines += [f"  {line}" for line in format_chain(cross)]
        lines += _unattributed_lines(cross)
    chain = result["chain"]
    lines.append(f"then reached {len(chain)} more module/phase place(s), in order:" if chain
                 else "it reached no other module")
    lines += [f"  {i}. {describe_place(c)}" for i, c in enumerate(chain[:chain_lines], 1)]
    if len(chain) > chain_lines:
        lines.append(f"  ... {len(chain) - chain_lines} more (all of them with --json)")
    lines.append(f"{result['nonfinite_records']} non-finite record(s) in all")
    return "\n".join(lines)
