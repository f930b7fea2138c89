"""The output directory of a conversion or an export: checked, and what a second run replaces removed."""
from __future__ import annotations

import re
import shutil
from pathlib import Path

from trainmon.core.layout import TRAINMON_RANK_DIR
from trainmon.read.errors import InputError



def prepare_output(src: Path, out: Path, overwrite: bool, replaced: re.Pattern = TRAINMON_RANK_DIR) -> None:
    """Checks that `out` may be written, and with `overwrite` removes the directories it holds whose
    names `replaced` matches (by default the rank directories a conversion writes).

    Raises:
        InputError: `out` is not empty and `overwrite` is off, or `out` holds the source (or is in it).
    """
    source, target = src.resolve(), out.resolve()
    if source == target or source.is_relative_to(target) or target.is_relative_to(source):
        raise InputError.at(out, f"the output directory overlaps the source {src}; write somewhere else")
    if not out.exists():
        return
    if not out.is_dir():
        raise InputError.at(out, "not a directory")
    if not overwrite:
        if any(out.iterdir()):
            raise InputError.at(out, "the output directory is not empty; choose another, or pass --overwrite to "
                                     "replace what it holds")
        return
    for child in out.iterdir():
        if child.is_dir() and replaced.match(child.name):
            shutil.rmtree(child)
