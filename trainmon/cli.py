"""The `trainmon` command. Each subcommand lives in its own module and registers itself here."""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional

# Modules that provide `register(subparsers)`; each adds one subcommand with `set_defaults(handler=...)`.
COMMAND_MODULES = (
    "trainmon.demo",
    "trainmon.commands.show",
    "trainmon.commands.convert",
    "trainmon.commands.nan_analyze",
    "trainmon.commands.anomalies",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trainmon", description="Numerical-health monitor for model training.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "handler", None) is None:
        parser.print_help()
        return 0
    return int(args.handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
