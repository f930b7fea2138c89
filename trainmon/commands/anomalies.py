"""`trainmon anomalies DIR --top K [--steps A-B]`: the earliest anomalies of a run, across ranks, in the
order of the ordering key (trainmon.anomaly.ordering) (msprobe's anomaly_analyse)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from trainmon.anomaly.events import AnomalyEvent
from trainmon.anomaly.processor import ANOMALIES_FILE
from trainmon.anomaly.run_inputs import InputError, find_run, rank_dirs, read_jsonl


def parse_step_range(text: str) -> tuple[int, int]:
    """"5" -> (5, 5); "10-20" -> (10, 20), inclusive."""
    first, _, last = text.partition("-")
    try:
        bounds = (int(first), int(last or first))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--steps {text!r}: give a step (7) or an inclusive range (10-20)") from None
    if bounds[0] > bounds[1]:
        raise argparse.ArgumentTypeError(f"--steps {text!r}: the first step is after the last")
    return bounds


def register(subparsers) -> None:
    parser = subparsers.add_parser("anomalies", help="list a run's earliest anomalies across ranks",
                                   description=__doc__)
    parser.add_argument("dir", help="a run directory (holding rank_<R>/) or the output root (latest run)")
    parser.add_argument("--top", type=int, default=10, metavar="K", help="how many to list (default 10)")
    parser.add_argument("--steps", type=parse_step_range, metavar="A-B", help="only steps A..B (inclusive)")
    parser.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    parser.set_defaults(handler=run)


def top_anomalies(directory: str, top: int, steps=None) -> list[AnomalyEvent]:
    """The `top` earliest anomalies of the run under `directory`, optionally within `steps` (first, last)."""
    run_dir, _ = find_run(Path(directory))
    events = []
    for rank_dir in rank_dirs(run_dir).values():
        path = rank_dir / ANOMALIES_FILE
        if path.exists():
            events += read_jsonl(path)
    if steps is not None:
        events = [e for e in events if steps[0] <= e.step <= steps[1]]
    return sorted(events, key=AnomalyEvent.order_key)[:top]


def run(args: argparse.Namespace) -> int:
    try:
        events = top_anomalies(args.dir, args.top, args.steps)
    except InputError as err:
        print(f"trainmon anomalies: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([e.to_json() for e in events], indent=1))
        return 0
    if not events:
        print("no anomalies recorded (anomalies.jsonl is written when alert.rules or the sentinel are on)")
        return 0
    for event in events:
        print(("* " if event.first else "  ") + event.describe())
    return 0
