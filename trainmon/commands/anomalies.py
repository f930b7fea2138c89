"""`trainmon anomalies DIR --top K [--steps A-B]`: the earliest anomalies of a run, across ranks, in the
order of the ordering key (trainmon.anomaly.ordering) (msprobe's anomaly_analyse)."""
from __future__ import annotations

import argparse
import heapq
import itertools
import json
import sys
from pathlib import Path

from trainmon.anomaly.events import AnomalyEvent
from trainmon.anomaly.ordering import order_key
from trainmon.commands.arguments import positive_int
from trainmon.read.database import DbRankReader
from trainmon.read.jsonl import read_jsonl
from trainmon.read.layout import find_run
from trainmon.read.parallel import map_ranks


def parse_step_range(text: str) -> tuple[int, int]:
    """"5" -> (5, 5); "10-20" -> (10, 20), inclusive."""
    first, _, last = text.partition("-")
    try:
        bounds = (int(first), int(last or first))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--steps {text!r}: give a step (7) or an inclusive range (10-20)") from None
    if bounds[0] < 0:
        raise argparse.ArgumentTypeError(f"--steps {text!r}: steps count from 0")
    if bounds[0] > bounds[1]:
        raise argparse.ArgumentTypeError(f"--steps {text!r}: the first step is after the last")
    return bounds


def register(subparsers) -> None:
    parser = subparsers.add_parser("anomalies", help="list a run's earliest anomalies across ranks",
                                   description=__doc__)
    parser.add_argument("dir", help="a run directory (holding rank_<R>/) or the output root (latest run)")
    parser.add_argument("--top", type=positive_int, default=10, metavar="K", help="how many to list (default 10)")
    parser.add_argument("--steps", type=parse_step_range, metavar="A-B", help="only steps A..B (inclusive)")
    parser.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    parser.add_argument("--quiet", action="store_true", help="no progress bar on stderr")
    parser.set_defaults(handler=run)


def rank_top(job: tuple) -> tuple[list[AnomalyEvent], list[str]]:
    """(the `top` earliest anomalies, warnings) of one rank (job: rank directory, top, steps or None).

    They come from the rank's database's anomalies table where it has one, read in step order only as far
    as needed; from anomalies.jsonl for the steps the database lacks.
    """
    rank_dir, top, steps = job
    first, last = steps if steps is not None else (None, None)
    events, warnings = [], []
    db_steps: set[int] = set()
    if rank_dir.db is not None:
        reader = DbRankReader(rank_dir.db)
        try:
            if reader.has_anomalies():
                db_steps = reader.steps()
                events += reader.anomalies(first, last, enough=top)
        finally:
            reader.close()
    if rank_dir.jsonl is not None:
        events += [e for e in read_jsonl(rank_dir.jsonl, warnings.append, skip_step=db_steps.__contains__)
                   if (first is None or e.step >= first) and (last is None or e.step <= last)]
    return heapq.nsmallest(top, events, key=order_key), warnings


def top_anomalies(directory: str, top: int, steps=None, progress: bool = False) -> list[AnomalyEvent]:
    """The `top` earliest anomalies of the run under `directory`, optionally within `steps` (first, last):
    each rank's earliest `top`, read in parallel processes, merged by the ordering key."""
    ranks = map_ranks(rank_top, [(d, top, steps) for d in find_run(Path(directory)).ranks], progress, "anomalies")
    for _, warnings in ranks:
        for message in warnings:
            print(f"trainmon anomalies: warning: {message}", file=sys.stderr)
    return list(itertools.islice(heapq.merge(*(events for events, _ in ranks), key=order_key), top))


def run(args: argparse.Namespace) -> int:
    events = top_anomalies(args.dir, args.top, args.steps, progress=not args.quiet)  # cli.main reports an InputError
    if args.json:
        print(json.dumps([e.to_json() for e in events], indent=1))
        return 0
    if not events:
        print("no anomalies recorded (anomalies.jsonl is written when alert.rules or the sentinel are on)")
        return 0
    for event in events:
        print(("* " if event.first else "  ") + event.describe())
    return 0
