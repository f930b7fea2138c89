"""Warnings the commands print on stderr beside their output (which goes on)."""
from __future__ import annotations

import sys
from typing import Optional


def warn(command: str, warning: Optional[str]) -> None:
    """Prints `warning` (e.g. `RunDirs.missing_warning`) as `trainmon COMMAND: warning: ...`; nothing for None."""
    if warning:
        print(f"trainmon {command}: warning: {warning}", file=sys.stderr)
