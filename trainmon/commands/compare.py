"""`trainmon compare A B`: where two runs part ways.

Two runs (monitor output): their statistic records, aligned by (family, name, step, micro-step, rank),
the first divergent record in execution order and the most divergent ones. Two tensor dumps (trainmon's
`dump` config block, or msprobe dump directories): per tensor cosine, RMSE, max abs/rel error, the first
tensor beyond the thresholds, its call stack and both statistic records.
"""
from __future__ import annotations

import argparse
import json
import sys

from trainmon.commands.arguments import non_negative_int


def parse_step_range(text: str) -> tuple[int, int]:
    """"7" -> (7, 7), "10-20" -> (10, 20) inclusive."""
    try:
        first, _, last = text.partition("-")
        return int(first), int(last or first)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--steps {text!r}: give a step (7) or an inclusive range (10-20)") from None


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{value} is below 0")
    return value


def register(subparsers) -> None:
    from trainmon.compare.records import DEFAULT_ATOL, DEFAULT_RTOL
    from trainmon.compare.tensors import DEFAULT_COSINE, DEFAULT_MAX_ABS

    parser = subparsers.add_parser("compare", help="compare two runs' statistics, or two tensor dumps",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("a", help="run A: a run directory, or a dump directory (trainmon's or msprobe's)")
    parser.add_argument("b", help="run B, of the same kind as A")
    parser.add_argument("--rank", type=non_negative_int, help="compare only this rank")
    parser.add_argument("--steps", type=parse_step_range, help="only these steps: 7 or 10-20 (inclusive)")
    parser.add_argument("--rtol", type=non_negative_float, default=DEFAULT_RTOL,
                        help=f"records: relative tolerance per op (default {DEFAULT_RTOL:g}); dumps: the relative "
                             "tolerance of the within-tolerance fraction")
    parser.add_argument("--atol", type=non_negative_float, default=DEFAULT_ATOL,
                        help=f"absolute tolerance (default {DEFAULT_ATOL:g})")
    parser.add_argument("--map", metavar="FILE", help='JSON {"<module in B>": "<module in A>"}: renames B\'s names')
    parser.add_argument("--top", type=non_negative_int, default=10, help="most divergent records listed (default 10)")
    parser.add_argument("--cosine", type=non_negative_float, default=DEFAULT_COSINE,
                        help=f"dumps: a tensor diverges below this cosine similarity (default {DEFAULT_COSINE})")
    parser.add_argument("--max-abs", type=non_negative_float, default=DEFAULT_MAX_ABS,
                        help=f"dumps: ... and above this max absolute error (default {DEFAULT_MAX_ABS})")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    parser.add_argument("-o", "--output", metavar="FILE", help="write one CSV row per aligned record (or tensor)")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from trainmon.compare import tensors

    if tensors.is_dump(args.a) or tensors.is_dump(args.b):
        summary, write_rows, text = tensors.compare_command(args)
    else:
        summary, write_rows, text = _compare_runs(args)
    if args.output:
        try:
            with open(args.output, "w", newline="", encoding="utf-8") as fh:
                write_rows(fh)
        except OSError as err:
            print(f"trainmon compare: cannot write {args.output}: {err.strerror or err}", file=sys.stderr)
            return 2
    print(json.dumps(summary, indent=1) if args.json else text())
    return 0


def _compare_runs(args: argparse.Namespace):
    from trainmon.compare.names import NameMap
    from trainmon.compare.records import align, execution_order, rank_pairs
    from trainmon.compare.report import format_report, summarize, write_csv
    from trainmon.read import open_run

    name_map = NameMap.load(args.map)
    with open_run(args.a) as run_a, open_run(args.b) as run_b:
        ranks = rank_pairs(run_a, run_b, args.rank)
        records = execution_order(list(align(run_a, run_b, ranks, args.steps, name_map, args.rtol, args.atol)))
        summary = summarize(records, str(run_a.path), str(run_b.path), ranks, args.rtol, args.atol, args.top)
    return summary, lambda fh: write_csv(records, fh), lambda: format_report(summary)
