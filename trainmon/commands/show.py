"""`trainmon show DIR`: a run's statistics as a table, filtered by tag, step, family and rank."""
from __future__ import annotations

import argparse
import sqlite3
import sys

from trainmon.commands.arguments import non_negative_int
from trainmon.commands.notices import warn
from trainmon.read import open_run


def parse_steps(text: str):
    """"7" -> 7, "10:20" -> (10, 20) inclusive, "10:" -> (10, None), ":20" -> (None, 20)."""
    try:
        if ":" not in text:
            return int(text)
        first, last = text.split(":", 1)
        return (int(first) if first else None, int(last) if last else None)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--step {text!r}: give a step (7) or an inclusive range (10:20, 10:, :20)")


def register(subparsers) -> None:
    parser = subparsers.add_parser("show", help="print a run's statistics as a table", description=__doc__)
    parser.add_argument("dir", help="run directory (holding rank_<R>/), a rank directory, or msprobe's output")
    parser.add_argument("--tag", help="only tags containing this text, e.g. 'layers.0.mlp' or '/rank0/post_grad'")
    parser.add_argument("--step", type=parse_steps, help="a step (7) or an inclusive range (10:20)")
    parser.add_argument("--family", help="only this family, e.g. actv, grad_reduced, exp_avg")
    parser.add_argument("--rank", type=non_negative_int, action="append", help="only this rank (repeatable)")
    parser.add_argument("--ops", help="comma-separated figures to show (default: all)")
    parser.add_argument("--scalars", action="store_true", help="show the training scalars (loss, lr, ...) instead")
    parser.add_argument("--source", choices=("auto", "db", "csv"), default="auto",
                        help="read monitor.db or the CSV files (default: the database when present)")
    parser.add_argument("--max-rows", type=non_negative_int, default=200, help="rows printed at most (default 200; 0: all)")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    try:
        with open_run(args.dir, args.source) as monitor_run:
            warn("show", monitor_run.missing_warning)
            if args.scalars:
                table = monitor_run.scalars(steps=args.step)
                if args.rank:
                    table = table[table["rank"].isin(args.rank)]
            else:
                table = monitor_run.records(family=args.family, steps=args.step, ranks=args.rank)
                if args.tag and not table.empty:
                    table = table[table["tag"].str.contains(args.tag, regex=False)]
                columns = ["rank", "tag", "step"] + (args.ops.split(",") if args.ops else
                                                     monitor_run.ops(monitor_run.ranks[0]))
                missing = [c for c in columns if c not in table.columns]
                if missing and not table.empty:
                    print(f"trainmon show: no column {missing}; available: {list(table.columns)}", file=sys.stderr)
                    return 2
                table = table[[c for c in columns if c in table.columns]]
    except (OSError, ValueError, sqlite3.Error) as err:
        print(f"trainmon show: {err}", file=sys.stderr)
        return 2
    if table.empty:
        print("no matching records")
        return 1
    shown = table if args.max_rows == 0 else table.head(args.max_rows)
    print(shown.to_string(index=False))
    if len(shown) < len(table):
        print(f"... {len(table) - len(shown)} more rows (--max-rows 0 shows all)")
    return 0
