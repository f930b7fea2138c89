"""`trainmon anomalies DIR --top K [--steps A-B]`: the earliest anomalies of a run, across ranks, in the
order of the ordering key (trainmon.core.ordering) (msprobe's anomaly_analyse)."""
from __future__ import annotations

import argparse
import heapq
import itertools
import json
import sys
from pathlib import Path

from trainmon.core.events import AnomalyEvent
from trainmon.core.ordering import order_key
from trainmon.commands.arguments import add_json, add_quiet, add_ranks, add_steps, positive_int
from trainmon.read.database import DbRankReader
from trainmon.read.jsonl import read_jsonl
from trainmon.read import Run, coverage
from trainmon.read.layout import find_run
from trainmon.read.parallel import map_ranks


def register(subparsers) -> None:
    parser = subparsers.add_parser("anomalies", help="list a run's earliest anomalies across ranks",
                                   description=__doc__)
    parser.add_argument("dir", help="a run directory (holding rank_<R>/) or the output root (latest run)")
    parser.add_argument("--top", type=positive_int, default=10, metavar="K", help="how many to list (default 10)")
    add_steps(parser)
    add_ranks(parser)
    add_json(parser, help="print a JSON list instead of a table")
    add_quiet(parser)
    parser.set_defaults(handler=run)


def rank_top(job: tuple) -> tuple[list[AnomalyEvent], list[str]]:
    """(the `top` earliest anomalies, warnings) of one rank (job: rank directory, top, steps or None).

    They come from the rank's database's anomalies table where it has one, read in step order only as far
    as needed; from anomalies.jsonl for the steps the database lacks. (A rank's record stream holds no
    anomalies: what could not be read of it is said, and takes none away.)
    """
    rank_dir, top, steps = job
    first, last = steps if steps is not None else (None, None)
    events, warnings = [], []
    db_steps: set[int] = set()
    in_db = False  # the anomalies table holds every line of anomalies.jsonl
    if rank_dir.db is not None:
        reader = DbRankReader(rank_dir.db)
        try:
            if reader.has_anomalies():
                db_steps = reader.steps()
                events += reader.anomalies(first, last, enough=top)
                in_db = rank_dir.jsonl is not None and reader.holds_lines_of(rank_dir.jsonl)
        finally:
            reader.close()
        stream = rank_dir.stream_findings()
        warnings += stream.warnings if stream is not None else []
    if rank_dir.jsonl is not None and not in_db:
        events += [e for e in read_jsonl(rank_dir.jsonl, warnings.append, skip_step=db_steps.__contains__)
                   if (first is None or e.step >= first) and (last is None or e.step <= last)]
    return heapq.nsmallest(top, events, key=order_key), warnings


def top_anomalies(directory: str, top: int, steps=None, progress: bool = False, ranks=None) -> list[AnomalyEvent]:
    """The `top` earliest anomalies of the run under `directory`, optionally within `steps` (first, last) and
    of `ranks` only: each rank's earliest `top`, read in parallel processes, merged by the ordering key.

    Raises:
        InputError: bad input, one of `ranks` is not in the run, or `steps` holds no step of the run.
    """
    run_dirs = find_run(Path(directory))
    rank_dirs = run_dirs.only(ranks)
    if run_dirs.missing_warning:
        print(f"trainmon anomalies: warning: {run_dirs.missing_warning}", file=sys.stderr)
    if steps is not None:
        with Run(run_dirs.path) as run:
            coverage.check_steps(run, [d.rank for d in rank_dirs], steps)
    found = map_ranks(rank_top, [(d, top, steps) for d in rank_dirs], progress, "anomalies")
    for _, warnings in found:
        for message in warnings:
            print(f"trainmon anomalies: warning: {message}", file=sys.stderr)
    return list(itertools.islice(heapq.merge(*(events for events, _ in found), key=order_key), top))


def run(args: argparse.Namespace) -> int:
    # cli.main reports an InputError
    events = top_anomalies(args.dir, args.top, args.steps, progress=not args.quiet, ranks=args.ranks)
    if args.json:
        print(json.dumps([e.to_json() for e in events], indent=1))
        return 0
    if not events:
        where = " in the steps and ranks asked for" if args.steps or args.ranks else ""
        print(f"no anomalies{where}: {_what_looked(args.dir)}")
        return 0
    for event in events:
        print(("* " if event.first else "  ") + event.describe())
    return 0


def _what_looked(directory: str) -> str:
    """What looked for anomalies in the run, from its first rank's run.json."""
    ranks = find_run(Path(directory)).ranks
    config = ranks[0].metadata().get("config", {}) if ranks else {}
    rules = [r.get("rule_name") for r in config.get("alert", {}).get("rules", []) if isinstance(r, dict)]
    lookers = ([f"alert.rules ({', '.join(map(str, rules))})"] if rules else []) + \
        (["the sentinel"] if config.get("sentinel") else [])
    if lookers:
        return f"{' and '.join(lookers)} found none"
    return "the run had neither alert.rules nor the sentinel on, so none were looked for"
