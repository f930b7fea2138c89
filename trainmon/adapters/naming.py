"""The names trainmon writes for modules and parameters: the wrappers folded into what they wrap (`squash_name`,
torch.compile's `_orig_mod`), and global numbers (frameworks number a rank's layers and experts from 0: pipeline
stages, expert-parallel ranks, so the adapters add the rank's offset to write the number that means the same on
every rank)."""
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


# Name components of wrappers that `squash_name` folds into the module they wrap.
_WRAPPER_COMPONENTS = frozenset({"module", "_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})


def compiled_name(name: str) -> str:
    """`name` without torch.compile's `_orig_mod` components: a compiled module is named as the one it wraps."""
    return name if "_orig_mod" not in name else ".".join(p for p in name.split(".") if p != "_orig_mod")


def display_name(name: str, squash: bool) -> str:
    """The name written for module or parameter `name`: without torch.compile's components, and with `squash`
    without any wrapper's."""
    name = compiled_name(name)
    if not squash:
        return name
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_COMPONENTS)
