"""`trainmon export RUN OUT [--format parquet]`: every record of a run as a Hive-partitioned Parquet dataset."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from trainmon import export
from trainmon.output_dir import prepare_output
from trainmon.commands.arguments import add_quiet, add_ranks
from trainmon.commands.notices import warn
from trainmon.read.layout import find_run


def register(subparsers) -> None:
    parser = subparsers.add_parser("export", help="write a run's records as a Parquet dataset", description=__doc__)
    parser.add_argument("src", help="run directory (holding rank_<R>/), a rank directory, or msprobe's output")
    parser.add_argument("out", help="output directory (family=<family>/rank=<rank>/part-0.parquet)")
    parser.add_argument("--format", choices=("parquet",), default="parquet", help="the dataset's format")
    parser.add_argument("--overwrite", action="store_true",
                        help="write into a non-empty output directory, replacing its family=<family> directories")
    add_ranks(parser, help="only these ranks (--rank 3, or --ranks 3 5)")
    add_quiet(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    try:
        export.check_pyarrow()
    except ImportError as err:
        print(f"trainmon export: {err}", file=sys.stderr)
        return 2
    run = find_run(args.src)  # cli.main reports an InputError
    run.only(args.ranks)  # a rank the run lacks is an InputError, before the output is prepared
    for warning in [run.missing_warning] + [w for stream in run.stream_findings(args.ranks) for w in stream.warnings]:
        warn(args, warning)
    prepare_output(run.path, Path(args.out), args.overwrite, export.PARTITION_DIR)
    records = export.export(args.src, args.out, progress=not args.quiet, ranks=args.ranks)
    print(f"trainmon export: {records} records written to {args.out}")
    return 0
