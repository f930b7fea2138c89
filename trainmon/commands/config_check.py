"""`trainmon config-check capture|compare`: record what makes a job the job it is, and compare two records.

Exit status of compare: 0 when every check passes (or was not recorded), 1 when a check fails, 2 on bad input.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from trainmon.commands.arguments import EXIT_CLEAN, EXIT_FOUND, add_json
from trainmon.read.errors import InputError


def register(subparsers) -> None:
    parser = subparsers.add_parser("config-check", help="capture or compare what defines a training job",
                                   description=__doc__)
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    capture = sub.add_parser("capture", help="write a pack of this machine's environment, packages and the "
                                             "hyperparameters of launch scripts and YAML files")
    capture.add_argument("--script", action="append", default=[], help="shell launch script (repeatable)")
    capture.add_argument("--yaml", action="append", default=[], help="YAML config (repeatable)")
    capture.add_argument("-o", "--output", required=True, help="the pack to write (a .zip file)")
    capture.set_defaults(handler=run_capture)
    compare = sub.add_parser("compare", help="compare two packs: pass/fail per check, exit 1 when one fails")
    compare.add_argument("pack_a", help="a pack (.zip) or a job's directory of rank_<R>.zip packs")
    compare.add_argument("pack_b", help="the pack to compare with")
    compare.add_argument("-o", "--output", metavar="DIR", help="write <check>.csv and result.json to DIR")
    compare.add_argument("--overwrite", action="store_true", help="replace the result files in an existing DIR")
    add_json(compare, help="print the result as one JSON object (result.json's content) instead of the table")
    compare.set_defaults(handler=run_compare)


def run_capture(args: argparse.Namespace) -> int:
    from trainmon.config_check.capture import static_members  # imports torch: only when capturing
    from trainmon.config_check.pack import write_pack

    output = Path(args.output)
    if output.suffix != ".zip":
        raise InputError.at(output, "the pack is a zip file: give a name ending in .zip")
    path = write_pack(output, None, 1, static_members(scripts=args.script, yamls=args.yaml))
    print(f"config-check pack written to {path}")
    return 0


def run_compare(args: argparse.Namespace) -> int:
    from trainmon.config_check.checks import FAIL, pair_packs, run_checks
    from trainmon.config_check.pack import read_packs
    from trainmon.config_check.report import prepare_directory, print_summary, result_summary, write_details

    packs_a, packs_b = read_packs(args.pack_a), read_packs(args.pack_b)
    results = run_checks(pair_packs(packs_a, packs_b, args.pack_a, args.pack_b))
    packs = {"a": str(args.pack_a), "b": str(args.pack_b)}
    if args.output:
        directory = Path(args.output)
        prepare_directory(directory, args.overwrite)
        write_details(directory, results, packs)
    if args.json:
        print(json.dumps(result_summary(results, packs), indent=1, default=str))
    else:
        print_summary(results, sys.stdout)
    return EXIT_FOUND if any(r.status == FAIL for r in results) else EXIT_CLEAN
