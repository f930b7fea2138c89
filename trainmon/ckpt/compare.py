"""`ckpt-compare`: every parameter of two checkpoints, merged to full tensors, compared one at a time."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

from trainmon.ckpt.detect import open_checkpoint
from trainmon.ckpt.metrics import compare_tensors


def compare_checkpoints(path_a: str | Path, path_b: str | Path,
                        rename_a: Optional[Callable[[str], str]] = None) -> dict[str, Any]:
    """{"a", "b", "summary", "parameters", "only_in_a", "only_in_b"}; `rename_a` maps A's names to B's."""
    a, b = open_checkpoint(path_a), open_checkpoint(path_b)
    rename = rename_a or (lambda name: name)
    a_names = {rename(name): name for name in a.names()}
    b_names = set(b.names())
    common = [name for name in a_names if name in b_names]
    parameters = {}
    for name in common:  # one parameter of each side in memory at a time
        parameters[name] = compare_tensors(a.tensor(a_names[name]), b.tensor(name))
        if a_names[name] != name:
            parameters[name]["name_a"] = a_names[name]
    identical = sum(1 for p in parameters.values() if p["identical"])
    only_a = sorted(a_names[n] for n in a_names if n not in b_names)
    only_b = sorted(n for n in b_names if n not in a_names)
    return {"a": {"path": str(path_a), "format": a.kind, "read": str(a.path)},
            "b": {"path": str(path_b), "format": b.kind, "read": str(b.path)},
            "summary": {"compared": len(parameters), "identical": identical, "differ": len(parameters) - identical,
                        "only_in_a": len(only_a), "only_in_b": len(only_b)},
            "parameters": parameters, "only_in_a": only_a, "only_in_b": only_b}
