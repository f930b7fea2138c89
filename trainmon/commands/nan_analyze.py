"""`trainmon nan-analyze DIR`: where NaN/Inf first appeared in a run, and where it spread.

Exit status: 0 clean (no NaN or Inf), 1 found, 2 bad input (also: none found, but part of the run could not be
read or has no output; a run without a statistic record)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from trainmon.analysis import overflow
from trainmon.analysis.msprobe_dump import read_dump
from trainmon.analysis.nan_analyze import analyze, format_report
from trainmon.commands.arguments import EXIT_BAD_INPUT, EXIT_CLEAN, EXIT_FOUND, add_json, add_quiet, add_ranks
from trainmon.commands.notices import warn
from trainmon.read import Run, coverage
from trainmon.read.layout import find_run


def register(subparsers) -> None:
    parser = subparsers.add_parser("nan-analyze", help="name the first NaN/Inf of a run and its spread",
                                   description=__doc__)
    parser.add_argument("dir", help="a run directory (holding rank_<R>/), the output root (latest run), or an "
                                    "msprobe dump directory (step<N>/rank<R>/dump.json)")
    add_json(parser)
    add_quiet(parser)
    add_ranks(parser, help="only these ranks of a trainmon run (--rank 3, or --ranks 3 5)")
    parser.add_argument("--overflow", action="store_true",
                        help="also classify the first saturated or non-finite module (computed here, inherited, "
                             "internal), as `trainmon overflow` does; reads the records up to the first non-finite "
                             "step once more")
    parser.add_argument("-o", "--output", metavar="FILE", help="write the output to FILE instead of stdout")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if args.ranks and not read_dump(Path(args.dir)):
        find_run(args.dir).only(args.ranks)  # a rank the run lacks is an InputError
    result = analyze(args.dir, progress=not args.quiet, ranks=args.ranks)  # cli.main reports an InputError
    warn(args, result["missing_warning"])
    unread = result["incomplete_ranks"] or result["missing_ranks"]
    if result["first"] is None and not unread and not read_dump(Path(args.dir)):
        with Run(args.dir) as run:  # no record at all is not clean
            coverage.require_records(run, args.ranks or run.ranks)
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
            return EXIT_BAD_INPUT
    else:
        print(text)
    if result["first"] is not None:
        return EXIT_FOUND
    return EXIT_BAD_INPUT if unread else EXIT_CLEAN


def _overflow(path: str, result: dict):
    """The overflow classification of a trainmon run up to its first non-finite step (None for msprobe
    dumps, and for a clean run, which it would have to read whole)."""
    if result["first"] is None or read_dump(Path(path)):
        return None
    return overflow.analyze(path, (None, result["first"]["step"]))

