"""Module names of one codebase in the terms of another: the `--map` file of `trainmon compare`."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from trainmon.read.errors import InputError


class NameMap:
    """Renames dotted names of run B to those of run A by their longest matching prefix.

    The file is a JSON object `{"<name in B>": "<name in A>", ...}`; a key matches whole dotted
    components (`layers.1` renames `layers.1.mlp`, never `layers.10`).
    """

    def __init__(self, mapping: Optional[dict] = None):
        self._mapping = dict(sorted((mapping or {}).items(), key=lambda kv: -len(kv[0])))

    @classmethod
    def load(cls, path: Optional[str]) -> "NameMap":
        """The map of `path` (an empty map for None).

        Raises:
            InputError: the file cannot be read or is not a JSON object of strings.
        """
        if path is None:
            return cls()
        try:
            mapping = json.loads(Path(path).read_text(encoding="utf-8"))
        except OSError as err:
            raise InputError.at(Path(path), f"cannot read the name map: {err.strerror or err}") from None
        except json.JSONDecodeError as err:
            raise InputError.at(Path(path), f"not JSON: {err.msg}", err.lineno) from None
        if not isinstance(mapping, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                    for k, v in mapping.items()):
            raise InputError.at(Path(path), 'must be a JSON object of names, {"<name in B>": "<name in A>"}')
        return cls(mapping)

    def __call__(self, name: str) -> str:
        for old, new in self._mapping.items():
            if name == old or name.startswith(old + "."):
                return new + name[len(old):]
        return name
