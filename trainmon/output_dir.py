"""The output directory of a conversion, an export or the daemon: created and checked, and what a second run
replaces removed."""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from trainmon.core.layout import TRAINMON_RANK_DIR
from trainmon.read.errors import InputError


def make_output_dir(out: Path) -> None:
    """Creates `out` (and its parents) if needed.

    Raises:
        InputError: `out` cannot be created (a file in its way, a read-only place) or is not writable.
    """
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise InputError.at(out, f"cannot create the output directory ({err.strerror or err})") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise InputError.at(out, "the output directory is not writable")


def prepare_output(src: Path, out: Path, overwrite: bool, replaced: re.Pattern = TRAINMON_RANK_DIR) -> None:
    """Checks that `out` may be written and creates it, and with `overwrite` removes the directories it holds whose
    names `replaced` matches (by default the rank directories a conversion writes).

    Raises:
        InputError: `out` is not empty and `overwrite` is off, `out` holds the source (or is in it), or it cannot
            be created or written.
    """
    source, target = src.resolve(), out.resolve()
    if source == target or source.is_relative_to(target) or target.is_relative_to(source):
        raise InputError.at(out, f"the output directory overlaps the source {src}; write somewhere else")
    if out.exists() and not out.is_dir():
        raise InputError.at(out, "not a directory")
    make_output_dir(out)
    if not overwrite:
        if any(out.iterdir()):
            raise InputError.at(out, "the output directory is not empty; choose another, or pass --overwrite to "
                                     "replace what it holds")
        return
    for child in out.iterdir():
        if child.is_dir() and replaced.match(child.name):
            shutil.rmtree(child)
