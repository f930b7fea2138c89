"""`trainmon nan-analyze DIR`: where NaN/Inf first appeared in a run, and where it spread."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from trainmon.anomaly import overflow
from trainmon.anomaly.msprobe_dump import read_dump
from trainmon.anomaly.nan_analyze import analyze, format_report
from trainmon.commands.notices import warn


def register(subparsers) -> None:
    parser = subparsers.add_parser("nan-analyze", help="name the first NaN/Inf of a run and its spread",
                                   description=__doc__)
    parser.add_argument("dir", help="a run directory (holding rank_<R>/), the output root (latest run), or an "
                                    "msprobe dump directory (step<N>/rank<R>/dump.json)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    parser.add_argument("--quiet", action="store_true", help="no progress bar on stderr")
    parser.add_argument("--overflow", action="store_true",
                        help="also classify the first saturated or non-finite module (computed here, inherited, "
                             "internal), as `trainmon overflow` does; reads the records up to the first non-finite "
                             "step once more")
    parser.add_argument("-o", "--output", metavar="FILE", help="write the output to FILE instead of stdout")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    result = analyze(args.dir, progress=not args.quiet)  # cli.main reports an InputError
    warn("nan-analyze", result["missing_warning"])
    result["overflow"] = _overflow(args.dir, result) if args.overflow else None
    text = json.dumps(result, indent=1, default=str) if args.json else format_report(result)
    if result["overflow"] and not args.json:
        text += "\noverflow analysis (saturated or non-finite, up to the first non-finite step):\n" + "\n".join(
            "  " + line for line in overflow.format_report(result["overflow"]).splitlines()[1:])
    if args.output:
        try:
            with open(args.output, "w", encoding="utf-8") as fh:
                fh.write(text + "\n")
        except OSError as err:
            print(f"trainmon nan-analyze: cannot write {args.output}: {err.strerror or err}", file=sys.stderr)
            return 2
    else:
        print(text)
    return 0


def _overflow(path: str, result: dict):
    """The overflow classification of a trainmon run up to its first non-finite step (None for msprobe
    dumps, and for a clean run, which it would have to read whole)."""
    if result["first"] is None or read_dump(Path(path)):
        return None
    return overflow.analyze(path, (None, result["first"]["step"]))
