"""The one error of the read layer: a run, or one of its files, cannot be read."""
from __future__ import annotations

from pathlib import Path
from typing import Optional


class InputError(ValueError):
    """Bad or missing input; the message names the file (and the line, where there is one).

    Commands print it and exit with status 2; a post-mortem never silently reports from half the data.
    """

    def __init__(self, message: str, path: Optional[Path] = None, line: Optional[int] = None):
        super().__init__(message)
        self.path = path
        self.line = line

    @classmethod
    def at(cls, path: Path, reason: str, line: Optional[int] = None) -> "InputError":
        """An error whose message starts with `path` (and `, line N`)."""
        where = f"{path}, line {line}" if line is not None else f"{path}"
        return cls(f"{where}: {reason}", path, line)
