"""A checkpoint seen as full, named parameters: `names()` and `tensor(name)`, one parameter at a time.

Formats: plain `torch.save` state dicts and safetensors here; Megatron's legacy layout (megatron.py),
torch.distributed.checkpoint directories (dcp.py) and DeepSpeed's (deepspeed.py) beside.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Mapping, Protocol

import torch

from trainmon.ckpt import safe_load
from trainmon.read.errors import InputError

# Keys under which trainers nest the model's state dict in a checkpoint file.
MODEL_KEYS = ("model", "module", "state_dict", "model_state_dict")


class Source(Protocol):
    kind: str
    path: Path

    def names(self) -> list[str]:
        """Every parameter's full name."""

    def tensor(self, name: str) -> torch.Tensor:
        """The full (merged) parameter."""


def flat_tensors(tree: Mapping, prefix: str = "") -> Iterable[tuple[str, torch.Tensor]]:
    """(dotted name, tensor) of the tensors in nested mappings; other values are skipped."""
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, torch.Tensor):
            yield name, value
        elif isinstance(value, Mapping):
            yield from flat_tensors(value, name + ".")


def model_state(obj: Any, path: Path) -> Mapping:
    """The model's state dict inside a loaded checkpoint (unwrapping MODEL_KEYS)."""
    if not isinstance(obj, Mapping):
        raise InputError.at(path, f"holds a {type(obj).__name__}, not a state dict")
    for key in MODEL_KEYS:
        if isinstance(obj.get(key), Mapping) and not any(isinstance(v, torch.Tensor) for v in obj.values()):
            return model_state(obj[key], path)
    return obj


class TorchFile:
    """A `torch.save` state dict (memory-mapped: a parameter is read from disk when asked for)."""

    kind = "torch"

    def __init__(self, path: Path):
        self.path = path
        self._tensors = dict(flat_tensors(model_state(safe_load.load(path), path)))
        if not self._tensors:
            raise InputError.at(path, "holds no tensors")

    def names(self) -> list[str]:
        return list(self._tensors)

    def tensor(self, name: str) -> torch.Tensor:
        return self._tensors[name]


class SafetensorsFiles:
    """One `.safetensors` file or a directory of them (sharded Hugging Face checkpoints)."""

    kind = "safetensors"

    def __init__(self, path: Path):
        try:
            from safetensors import SafetensorError, safe_open
        except ImportError:
            raise InputError.at(path, "reading safetensors needs the safetensors package (pip install "
                                      "safetensors)") from None
        self.path = path
        files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
        self._where: dict[str, Path] = {}
        for file in files:
            try:
                with safe_open(str(file), framework="pt") as handle:
                    self._where.update({key: file for key in handle.keys()})
            except (SafetensorError, OSError) as err:
                raise InputError.at(file, f"not a readable safetensors file ({err})") from None
        self._open = safe_open

    def names(self) -> list[str]:
        return list(self._where)

    def tensor(self, name: str) -> torch.Tensor:
        with self._open(str(self._where[name]), framework="pt") as handle:
            return handle.get_tensor(name)
