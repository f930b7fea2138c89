"""The `trainmon` command."""
from __future__ import annotations

import argparse
import sys
from typing import Optional


def _demo(args: argparse.Namespace, rest: list[str]) -> int:
    from trainmon import demo
    return demo.main(rest)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trainmon", description="Numerical-health monitor for model training.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = sub.add_parser("demo", help="train a small GPT-style model with monitoring and show where the output is",
                          add_help=False)
    demo.set_defaults(handler=_demo)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if getattr(args, "handler", None) is None:
        parser.print_help()
        return 0 if not rest else 2
    return args.handler(args, rest)


if __name__ == "__main__":
    sys.exit(main())
