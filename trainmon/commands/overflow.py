"""`trainmon overflow DIR`: the first module whose output saturated or went non-finite, and whether it
computed the overflow, inherited it (from upstream or the data), or the overflow was internal; with the
rate of optimizer updates that loss scaling skipped."""
from __future__ import annotations

import argparse
import json

from trainmon.commands.compare import parse_step_range


def register(subparsers) -> None:
    parser = subparsers.add_parser("overflow", help="classify the first saturated or non-finite module of a run",
                                   description=__doc__)
    parser.add_argument("dir", help="a run directory (holding rank_<R>/) or the output root (latest run)")
    parser.add_argument("--steps", type=parse_step_range, help="only these steps: 7 or 10-20 (inclusive)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from trainmon.anomaly.overflow import analyze, format_report

    result = analyze(args.dir, args.steps)  # cli.main reports an InputError
    print(json.dumps(result, indent=1, default=str) if args.json else format_report(result))
    return 0
