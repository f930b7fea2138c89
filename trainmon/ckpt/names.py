"""Name mapping across layouts: a JSON file of {regular expression: replacement} that renames B's names in A's
terms (the direction of `trainmon compare --map`, whose plain dotted prefixes it extends to patterns)."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable

from trainmon.read.errors import InputError


def load_mapping(path: str | Path) -> Callable[[str], str]:
    """A renaming function from a mapping file: the first pattern that matches a whole name replaces it
    (`\\1` refers to groups); a name no pattern matches keeps its name."""
    path = Path(path)
    try:
        table = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise InputError.at(path, f"not a readable JSON mapping ({err})") from None
    if not isinstance(table, dict) or not all(isinstance(v, str) for v in table.values()):
        raise InputError.at(path, 'a mapping is a JSON object {"pattern": "replacement", ...}')
    try:
        rules = [(re.compile(pattern), replacement) for pattern, replacement in table.items()]
    except re.error as err:
        raise InputError.at(path, f"bad regular expression ({err})") from None

    def rename(name: str) -> str:
        for pattern, replacement in rules:
            if pattern.fullmatch(name):
                return pattern.sub(replacement, name, count=1)
        return name
    return rename
