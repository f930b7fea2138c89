"""The command line's shared options, spelled and parsed the same on every command.

Bad values are rejected by argparse with exit status 2 and a message naming the flag. Exit statuses of
the commands that judge a run or a pair of runs (docs/reference/exit-codes.md): 0 agree or clean, 1 differ or
found, 2 bad input.
"""
from __future__ import annotations

import argparse
from typing import Callable, Optional

# The exit statuses of compare, ckpt-compare, config-check compare, nan-analyze and overflow.
EXIT_CLEAN = 0  # the runs agree; no NaN/Inf or overflow
EXIT_FOUND = 1  # the runs differ; a NaN/Inf or overflow was found
EXIT_BAD_INPUT = 2  # a bad argument, config or file (argparse uses 2 as well)


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse `type` for an integer >= `low`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is below {low}; give an integer >= {low}")
        return value

    parse.__name__ = f"integer >= {low}"  # argparse names the type in its messages
    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)

STEPS_HELP = "only these steps: 7, or an inclusive range 10-20 (10- and -20 leave an end open)"


def step_range(text: str) -> tuple[Optional[int], Optional[int]]:
    """An argparse `type` for `--steps`: "7" -> (7, 7), "10-20" -> (10, 20) inclusive, "10-" -> (10, None),
    "-20" -> (None, 20). The colon of `show --step 10:20`, the earlier spelling, is read as the dash."""
    first, sep, last = text.strip().replace(":", "-").partition("-")
    try:
        bounds = (int(first) if first else None, int(last) if last else None) if sep else (int(first), int(first))
    except ValueError:
        bounds = None
    if bounds is None or bounds == (None, None):
        raise argparse.ArgumentTypeError(f"{text!r}: give a step (7) or an inclusive range (10-20, 10-, -20)")
    if bounds[0] is not None and bounds[1] is not None and bounds[0] > bounds[1]:
        raise argparse.ArgumentTypeError(f"{text!r}: the first step is after the last")
    return bounds


step_range.__name__ = "step range"


def add_steps(parser: argparse.ArgumentParser, *aliases: str, help: str = STEPS_HELP) -> None:
    """`--steps A-B` (dest `steps`): (first, last), either end None when open."""
    parser.add_argument("--steps", *aliases, dest="steps", type=step_range, metavar="A-B", help=help)


def add_ranks(parser: argparse.ArgumentParser, help: str = "only these ranks (--rank 3 --rank 5, or --ranks 3 5)"
              ) -> None:
    """`--rank R` (repeatable) and `--ranks R [R ...]`, the same option (dest `ranks`: a list, or None)."""
    parser.add_argument("--rank", "--ranks", dest="ranks", type=non_negative_int, nargs="+", action="extend",
                        metavar="R", help=help)


def add_json(parser: argparse.ArgumentParser, help: str = "print one JSON object instead of the report") -> None:
    parser.add_argument("--json", action="store_true", help=help)


def add_quiet(parser: argparse.ArgumentParser) -> None:
    """`--quiet`, on the commands that show a progress bar."""
    parser.add_argument("--quiet", action="store_true", help="no progress bar on stderr (warnings are still printed)")
