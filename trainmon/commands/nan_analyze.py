"""`trainmon nan-analyze DIR`: where NaN/Inf first appeared in a run, and where it spread."""
from __future__ import annotations

import argparse
import json
import sys

from trainmon.anomaly.nan_analyze import analyze, format_report


def register(subparsers) -> None:
    parser = subparsers.add_parser("nan-analyze", help="name the first NaN/Inf of a run and its spread",
                                   description=__doc__)
    parser.add_argument("dir", help="a run directory (holding rank_<R>/), the output root (latest run), or an "
                                    "msprobe dump directory (step<N>/rank<R>/dump.json)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    parser.add_argument("--quiet", action="store_true", help="no progress bar on stderr")
    parser.add_argument("-o", "--output", metavar="FILE", help="write the output to FILE instead of stdout")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    result = analyze(args.dir, progress=not args.quiet)  # cli.main reports an InputError
    text = json.dumps(result, indent=1) if args.json else format_report(result)
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
