"""Warnings the commands print on stderr beside their output (which goes on)."""
from __future__ import annotations

import argparse
import sys
from typing import Optional


def warn(args: argparse.Namespace, warning: Optional[str]) -> None:
    """Prints `warning` (e.g. `RunDirs.missing_warning`) as `trainmon COMMAND: warning: ...`; nothing for None.
    `--quiet` does not hide it: it hides progress bars only."""
    if warning:
        print(f"trainmon {args.command}: warning: {warning}", file=sys.stderr)
