"""The daemon's state file, `<logdir>/watch_state.json`: how far it exported, where its event file ends,
and its alert. Written atomically (a temporary file, then a rename) after each poll, so a daemon killed
at any point restarts from a consistent state."""
from __future__ import annotations

import json
import os
from pathlib import Path

from trainmon.core.layout import WATCH_STATE_FILE
from trainmon.read.errors import InputError

VERSION = 2  # 2: the view's runs in directories of their own (max, min, median, nonfinite_elements)


def load_state(logdir: Path) -> dict:
    """The saved state ({} when there is none).

    Raises:
        InputError: the file is there but is not this daemon's state (naming it).
    """
    path = logdir / WATCH_STATE_FILE
    if not path.exists():
        return {}
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise InputError.at(path, f"not a readable state file ({err}); delete it to export again from the start")
    if not isinstance(state, dict) or state.get("version") != VERSION:
        raise InputError.at(path, f"not a version {VERSION} state file of trainmon watch; delete it to export "
                                  "again from the start")
    return state


def save_state(logdir: Path, state: dict) -> None:
    path = logdir / WATCH_STATE_FILE
    temporary = path.with_suffix(".tmp")
    with open(temporary, "w", encoding="utf-8") as fh:
        fh.write(json.dumps({"version": VERSION, **state}))  # dumps: the C encoder (dump to a file is not)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(temporary, path)
