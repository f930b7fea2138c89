"""`trainmon csv2tb`, `trainmon csv2db`, `trainmon db2tb`: convert a run's output between formats;
`trainmon stream2db`: monitor.db beside each rank's records.stream, after a job on a network filesystem."""
from __future__ import annotations

import argparse
import sqlite3
import sys

from trainmon import conversions
from trainmon.commands.arguments import add_quiet
from trainmon.commands.notices import warn

_COMMANDS = {
    "csv2tb": ("CSV files (trainmon's or msprobe's) to TensorBoard event files", "csv"),
    "csv2db": ("CSV files (trainmon's or msprobe's) to monitor.db databases", "csv"),
    "db2tb": ("monitor.db databases to TensorBoard event files", "db"),
}


def register(subparsers) -> None:
    for name, (summary, _) in _COMMANDS.items():
        parser = subparsers.add_parser(name, help=f"convert {summary}",
                                       description=f"Converts {summary}; writes <out>/rank_<R>/ per rank.")
        parser.add_argument("src", help="run directory (holding rank_<R>/), a rank directory, or msprobe's output "
                                        "directory (holding <time>-rank<R>-<uuid>/)")
        parser.add_argument("out", help="output directory")
        add_quiet(parser)
        parser.add_argument("--overwrite", action="store_true",
                            help="write into a non-empty output directory, replacing its rank_<R> directories")
        parser.set_defaults(handler=run, conversion=name)
    parser = subparsers.add_parser("stream2db", help="write monitor.db beside each rank's records.stream",
                                   description="Writes rank_<R>/monitor.db from rank_<R>/records.stream (what the db "
                                               "format writes on a network filesystem), after the job.")
    parser.add_argument("src", help="run directory (holding rank_<R>/) or a rank directory")
    parser.add_argument("--force", action="store_true",
                        help="also ranks whose stream is not whole (corrupt, cut mid-frame, or without its end frame: "
                             "a job killed or still writing); each is named on stderr")
    parser.set_defaults(handler=run_stream_to_db)


def run_stream_to_db(args: argparse.Namespace) -> int:
    try:
        ranks = conversions.stream_to_db(args.src, args.force, lambda line: warn(args, line))
    except (OSError, ValueError, sqlite3.Error) as err:
        print(f"trainmon stream2db: {err}", file=sys.stderr)
        return 2
    print(f"trainmon stream2db: monitor.db written for rank(s) {', '.join(map(str, ranks)) or 'none'}")
    return 0 if ranks else 1


def _progress_bar(items, total, description):
    from tqdm import tqdm
    return tqdm(items, total=total, desc=description, unit="step")


def run(args: argparse.Namespace) -> int:
    progress = conversions.no_progress if args.quiet else _progress_bar
    source = _COMMANDS[args.conversion][1]
    try:
        if args.conversion == "csv2db":
            steps = conversions.csv_to_db(args.src, args.out, progress=progress, overwrite=args.overwrite)
        else:
            steps = conversions.to_tensorboard(args.src, args.out, source=source, progress=progress,
                                               overwrite=args.overwrite)
    except (OSError, ValueError, sqlite3.Error) as err:
        print(f"trainmon {args.conversion}: {err}", file=sys.stderr)
        return 2
    print(f"trainmon {args.conversion}: {steps} steps written to {args.out}")
    return 0
