"""The `trainmon` command. Each subcommand lives in its own module and registers itself here."""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Optional

from trainmon.commands.arguments import EXIT_BAD_INPUT
from trainmon.config.settings import ConfigError
from trainmon.read.errors import InputError

# The exit status of a command whose reader went away (`trainmon ... | head`): that of a process that
# SIGPIPE ended, as other command-line tools give.
BROKEN_PIPE_STATUS = 141

# Modules that provide `register(subparsers)`; each adds one subcommand with `set_defaults(handler=...)`.
COMMAND_MODULES = (
    "trainmon.commands.demo",
    "trainmon.commands.show",
    "trainmon.commands.convert",
    "trainmon.commands.nan_analyze",
    "trainmon.commands.anomalies",
    "trainmon.commands.export",
    "trainmon.commands.watch",
    "trainmon.commands.plot",
    "trainmon.commands.compare",
    "trainmon.commands.overflow",
    "trainmon.commands.config_check",
    "trainmon.commands.ckpt_compare",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trainmon", description="Numerical-health monitor for model training.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    _remember_parsers(parser)
    return parser


def _remember_parsers(parser: argparse.ArgumentParser) -> None:
    """Each (sub)command's parser becomes its arguments' `command_parser` (the innermost chosen one wins), so that
    an error names the command's own usage."""
    parser.set_defaults(command_parser=parser)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for command in action.choices.values():
                _remember_parsers(command)


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # the command's usage, not the top-level one
        args.command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if getattr(args, "handler", None) is None:
        args.command_parser.print_help(sys.stderr)
        return EXIT_BAD_INPUT
    try:
        return int(args.handler(args) or 0)
    except (InputError, ConfigError) as err:  # bad input: the message names the file (and line or key)
        print(f"trainmon {args.command}: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except BrokenPipeError:
        # the reader closed the pipe: stop quietly; point stdout at devnull so the interpreter's final
        # flush does not fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return BROKEN_PIPE_STATUS


if __name__ == "__main__":
    sys.exit(main())
