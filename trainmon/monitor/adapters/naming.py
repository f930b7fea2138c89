"""Global numbers in names: frameworks number a rank's layers and experts from 0 (pipeline stages, expert-
parallel ranks), so the adapters add the rank's offset to write the number that means the same on every rank."""
from __future__ import annotations

import re
from functools import lru_cache


@lru_cache(maxsize=None)
def _pattern(container: str) -> re.Pattern:
    return re.compile(rf"(^|\.){re.escape(container)}\.(\d+)(?=\.|$)")


def renumber(name: str, container: str, offset: int) -> str:
    """`name` with `offset` added to the index after each `<container>.` (`layers.0` → `layers.2`)."""
    if not offset:
        return name
    return _pattern(container).sub(lambda m: f"{m.group(1)}{container}.{int(m.group(2)) + offset}", name)
