"""`ckpt-compare`: every parameter of two checkpoints, merged to full tensors, compared one at a time."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

from trainmon.ckpt.detect import open_checkpoint
from trainmon.ckpt.metrics import compare_tensors


def compare_checkpoints(path_a: str | Path, path_b: str | Path,
                        rename_b: Optional[Callable[[str], str]] = None) -> dict[str, Any]:
    """{"a", "b", "summary", "parameters", "only_in_a", "only_in_b"}; `rename_b` maps B's names to A's."""
    a, b = open_checkpoint(path_a), open_checkpoint(path_b)
    rename = rename_b or (lambda name: name)
    b_names = {rename(name): name for name in b.names()}
    a_names = a.names()
    parameters = {}
    for name in (n for n in a_names if n in b_names):  # one parameter of each side in memory at a time
        parameters[name] = compare_tensors(a.tensor(name), b.tensor(b_names[name]))
        if b_names[name] != name:
            parameters[name]["name_b"] = b_names[name]
    identical = sum(1 for p in parameters.values() if p["identical"])
    only_a = sorted(n for n in a_names if n not in b_names)
    only_b = sorted(b_names[n] for n in b_names if n not in parameters)
    return {"a": {"path": str(path_a), "format": a.kind, "read": str(a.path)},
            "b": {"path": str(path_b), "format": b.kind, "read": str(b.path)},
            "summary": {"compared": len(parameters), "identical": identical, "differ": len(parameters) - identical,
                        "only_in_a": len(only_a), "only_in_b": len(only_b)},
            "parameters": parameters, "only_in_a": only_a, "only_in_b": only_b}
