"""`trainmon overflow DIR`: the first module whose output saturated or went non-finite, and whether it
computed the overflow, inherited it (from upstream or the data), or the overflow was internal; with the
rate of optimizer updates that loss scaling skipped.

Exit status: 0 nothing saturated or non-finite, 1 found, 2 bad input (also: nothing found, but part of the run
could not be read)."""
from __future__ import annotations

import argparse
import json

from trainmon.commands.arguments import EXIT_BAD_INPUT, EXIT_CLEAN, EXIT_FOUND, add_json, add_ranks, add_steps
from trainmon.commands.notices import warn
from trainmon.read.layout import find_run


def register(subparsers) -> None:
    parser = subparsers.add_parser("overflow", help="classify the first saturated or non-finite module of a run",
                                   description=__doc__)
    parser.add_argument("dir", help="a run directory (holding rank_<R>/) or the output root (latest run)")
    add_steps(parser)
    add_ranks(parser)
    add_json(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from trainmon.analysis.overflow import analyze, format_report

    result = analyze(args.dir, args.steps, args.ranks)  # cli.main reports an InputError
    warn(args, result["missing_warning"])
    streams = find_run(args.dir).stream_findings(args.ranks)
    for stream in streams:
        for warning in stream.warnings:
            warn(args, warning)
    result["incomplete"] = any(stream.lost for stream in streams)
    # what was not read may hold what was not found: a missing rank, a part of a stream
    unread = result["incomplete"] or result["missing_ranks"]
    text = format_report(result)
    if unread and not result["modules"]:
        text += "\nnot known to be clean: part of the run could not be read (see the warnings)"
    print(json.dumps(result, indent=1, default=str) if args.json else text)
    if result["modules"]:
        return EXIT_FOUND
    return EXIT_BAD_INPUT if unread else EXIT_CLEAN
