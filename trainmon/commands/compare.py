"""`trainmon compare A B`: where two runs part ways.

Two runs (monitor output): their statistic records, aligned by (family, name, step, micro-step, rank),
the first divergent record in execution order and the most divergent ones. Two tensor dumps (trainmon's
`dump` config block, or msprobe dump directories): per tensor cosine, RMSE, max abs/rel error, the first
tensor beyond the thresholds, its call stack and both statistic records.

Exit status: 0 the runs agree (every record, or tensor, on both sides and within tolerance), 1 they
differ, 2 bad input.
"""
from __future__ import annotations

import argparse
import json
import sys

from trainmon.commands.arguments import (EXIT_BAD_INPUT, EXIT_CLEAN, EXIT_FOUND, add_json, add_ranks,
                                         add_steps, positive_int)
from trainmon.commands.notices import warn


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{value} is below 0")
    return value


def register(subparsers) -> None:
    from trainmon.compare.thresholds import DEFAULT_ATOL, DEFAULT_COSINE, DEFAULT_MAX_ABS, DEFAULT_RTOL

    parser = subparsers.add_parser("compare", help="compare two runs' statistics, or two tensor dumps",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("a", help="run A: a run directory, or a dump directory (trainmon's or msprobe's)")
    parser.add_argument("b", help="run B, of the same kind as A")
    add_ranks(parser, help="compare only these ranks (--rank 3, or --ranks 3 5)")
    add_steps(parser, help="only these steps: 7, or an inclusive range 10-20 (10- and -20 leave an end open); "
                           "a range holding no step of a run is an error")
    parser.add_argument("--rtol", type=non_negative_float, default=DEFAULT_RTOL,
                        help=f"records: relative tolerance per op (default {DEFAULT_RTOL:g}); dumps: the relative "
                             "tolerance of the within-tolerance fraction")
    parser.add_argument("--atol", type=non_negative_float, default=DEFAULT_ATOL,
                        help=f"absolute tolerance (default {DEFAULT_ATOL:g})")
    parser.add_argument("--map", metavar="FILE", help='JSON {"<module in B>": "<module in A>"}: renames B\'s names')
    parser.add_argument("--top", type=positive_int, default=10, metavar="K",
                        help="most divergent records listed (default 10)")
    parser.add_argument("--cosine", type=non_negative_float, default=DEFAULT_COSINE,
                        help=f"dumps: a tensor diverges below this cosine similarity (default {DEFAULT_COSINE})")
    parser.add_argument("--max-abs", type=non_negative_float, default=DEFAULT_MAX_ABS,
                        help=f"dumps: ... and above this max absolute error (default {DEFAULT_MAX_ABS})")
    add_json(parser)
    parser.add_argument("-o", "--output", metavar="FILE", help="write one CSV row per aligned record (or tensor)")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from trainmon.compare.dumps import is_dump

    if is_dump(args.a) or is_dump(args.b):
        from trainmon.compare import tensors  # imports torch: only for dumps
        summary, write_rows, text = tensors.compare_command(args)
    else:
        summary, write_rows, text = _compare_runs(args)
    if args.output:
        try:
            with open(args.output, "w", newline="", encoding="utf-8") as fh:
                write_rows(fh)
        except OSError as err:
            print(f"trainmon compare: cannot write {args.output}: {err.strerror or err}", file=sys.stderr)
            return EXIT_BAD_INPUT
    print(json.dumps(summary, indent=1) if args.json else text())
    if summary["agree"]:
        return EXIT_CLEAN
    # records that could not be read may be all that differs
    return EXIT_BAD_INPUT if summary.get("unread") and summary["first_divergent"] is None else EXIT_FOUND


def _compare_runs(args: argparse.Namespace):
    from trainmon.compare.names import NameMap
    from trainmon.compare.records import align, check_steps, execution_order, rank_pairs
    from trainmon.compare.report import format_report, summarize, write_csv
    from trainmon.read import coverage, open_run

    name_map = NameMap.load(args.map)
    with open_run(args.a) as run_a, open_run(args.b) as run_b:
        for warning in dict.fromkeys(run_a.stream_warnings + run_b.stream_warnings):  # once, when A and B are one run
            warn(args, warning)
        ranks = rank_pairs(run_a, run_b, args.ranks)
        check_steps((run_a, run_b), ranks, args.steps)
        records = execution_order(list(align(run_a, run_b, ranks, args.steps, name_map, args.rtol, args.atol)))
        if not records:  # neither run collected a record there: nothing agrees or differs
            coverage.require_records(run_a, ranks, args.steps)
        unread = list(dict.fromkeys(str(run.path) for run in (run_a, run_b) if run.incomplete))
        summary = summarize(records, str(run_a.path), str(run_b.path), ranks, args.rtol, args.atol, args.top, unread)
    return summary, lambda fh: write_csv(records, fh), lambda: format_report(summary)
