"""Range-checked numeric arguments: argparse rejects them with exit status 2 and a message naming the flag."""
from __future__ import annotations

import argparse
from typing import Callable


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
