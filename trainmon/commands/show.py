"""`trainmon show DIR`: a run's statistics as a table, filtered by tag, step, family and rank."""
from __future__ import annotations

import argparse
import json
import math
import sqlite3
import sys

from trainmon.commands.arguments import add_json, add_ranks, add_steps, non_negative_int
from trainmon.commands.notices import warn
from trainmon.read import open_run


def register(subparsers) -> None:
    parser = subparsers.add_parser("show", help="print a run's statistics as a table", description=__doc__)
    parser.add_argument("dir", help="run directory (holding rank_<R>/), a rank directory, or msprobe's output")
    parser.add_argument("--tag", help="only tags containing this text, e.g. 'layers.0.mlp' or '/rank0/post_grad'")
    add_steps(parser, "--step")  # --step 10:20, the earlier spelling, still works
    parser.add_argument("--family", help="only this family, e.g. actv, grad_reduced, exp_avg")
    add_ranks(parser)
    parser.add_argument("--ops", help="comma-separated figures to show (default: all)")
    parser.add_argument("--scalars", action="store_true", help="show the training scalars (loss, lr, ...) instead")
    parser.add_argument("--source", choices=("auto", "db", "csv"), default="auto",
                        help="read monitor.db or the CSV files (default: the database when present)")
    parser.add_argument("--max-rows", type=non_negative_int, default=200, help="rows printed at most (default 200; 0: all)")
    add_json(parser, help="print the rows as a JSON list of objects (every row: --max-rows does not apply)")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    try:
        with open_run(args.dir, args.source) as monitor_run:
            for warning in [monitor_run.missing_warning, *monitor_run.stream_warnings]:
                warn(args, warning)
            if args.scalars:
                table = monitor_run.scalars(steps=args.steps)
                if args.ranks:
                    table = table[table["rank"].isin(args.ranks)]
            else:
                table = monitor_run.records(family=args.family, steps=args.steps, ranks=args.ranks)
                if args.tag and not table.empty:
                    table = table[table["tag"].str.contains(args.tag, regex=False)]
                ops = monitor_run.ops(monitor_run.ranks[0])
                columns = ["rank", "tag", "step"] + (args.ops.split(",") if args.ops else ops)
                missing = [c for c in columns if c not in table.columns]
                if missing and not table.empty:
                    print(f"trainmon show: the run has no figure {', '.join(missing)}; --ops takes: {', '.join(ops)}",
                          file=sys.stderr)
                    return 2
                table = table[[c for c in columns if c in table.columns]]
    except (OSError, ValueError, sqlite3.Error) as err:
        print(f"trainmon show: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([{k: _json_value(v) for k, v in row.items()} for row in table.to_dict(orient="records")]))
        return 1 if table.empty else 0
    if table.empty:
        print("no matching records")
        return 1
    shown = table if args.max_rows == 0 else table.head(args.max_rows)
    print(shown.to_string(index=False))
    if len(shown) < len(table):
        print(f"... {len(table) - len(shown)} more rows (--max-rows 0 shows all)")
    return 0


def _json_value(value):
    """A figure for JSON: NaN and +-Inf as the strings "nan", "inf", "-inf" (JSON has no such numbers)."""
    return str(value) if isinstance(value, float) and not math.isfinite(value) else value
