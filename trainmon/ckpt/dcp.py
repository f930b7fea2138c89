"""torch.distributed.checkpoint directories (also Megatron-Core's `torch_dist` dist-checkpointing format):
every tensor is stored with its global shape, so each is read whole, one at a time, in this process.

Megatron-Core (a `metadata.json` naming `torch_dist`) stores each transformer-layer parameter stacked over
all layers (`decoder.layers.mlp.linear_fc1.weight`, dim 0 = global layer number); they are offered per
layer (`decoder.layers.3.mlp.linear_fc1.weight`), as the legacy layout and the model name them."""
from __future__ import annotations

import json
import pickle
import re
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from trainmon.ckpt.safe_load import RestrictedUnpickler
from trainmon.read.errors import InputError

METADATA = ".metadata"
MEGATRON_METADATA = "metadata.json"
_STACKED = re.compile(r"^((?:.*\.)?layers)\.(\D.*)$")  # `layers.` followed by no layer number


class _Reader(dcp.FileSystemReader):
    """FileSystemReader whose metadata is unpickled with only torch's checkpoint classes allowed."""

    def read_metadata(self, *args, **kwargs):
        path = Path(self.path) / METADATA
        try:
            with open(path, "rb") as f:
                metadata = RestrictedUnpickler(f, ("torch.distributed.checkpoint.",)).load()
        except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ValueError) as err:
            raise InputError.at(path, f"not a readable torch.distributed.checkpoint metadata file ({err})") from None
        metadata.storage_meta = metadata.storage_meta or dcp.metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class DistCheckpoint:
    kind = "torch.distributed.checkpoint"

    def __init__(self, path: Path):
        self.path = path
        self._metadata = _Reader(path).read_metadata().state_dict_metadata
        self._tensors = {k: v for k, v in self._metadata.items() if isinstance(v, TensorStorageMetadata)}
        if not self._tensors:
            raise InputError.at(path / METADATA, "the checkpoint holds no tensors")
        self._layer_of: dict[str, tuple[str, int]] = {}  # per-layer name -> (stacked key, layer)
        if _is_megatron(path):
            for key, meta in self._tensors.items():
                match = _STACKED.match(key)
                if match and len(meta.size) > 1:
                    self._layer_of.update({f"{match.group(1)}.{i}.{match.group(2)}": (key, i)
                                           for i in range(meta.size[0])})
        stacked = {key for key, _ in self._layer_of.values()}
        self._names = [n for n in self._tensors if n not in stacked] + list(self._layer_of)
        self._cached: tuple[str, torch.Tensor] = ("", torch.empty(0))  # the last stacked tensor read

    def names(self) -> list[str]:
        return self._names

    def tensor(self, name: str) -> torch.Tensor:
        if name not in self._layer_of:
            return self._read(name)
        key, layer = self._layer_of[name]
        if self._cached[0] != key:  # names come stack by stack: one stack in memory at a time
            self._cached = (key, self._read(key))
        return self._cached[1][layer]

    def _read(self, name: str) -> torch.Tensor:
        meta = self._tensors[name]
        out = {name: torch.empty(meta.size, dtype=meta.properties.dtype)}
        try:
            with warnings.catch_warnings():  # reading in one process is the intent, not a fallback
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.load(out, storage_reader=_Reader(self.path), no_dist=True)
        except Exception as err:  # torch wraps a storage failure in CheckpointException
            raise InputError.at(self.path, f"cannot read tensor {name!r} ({str(err).strip()[:300]})") from None
        return out[name]


def _is_megatron(path: Path) -> bool:
    try:
        return json.loads((path / MEGATRON_METADATA).read_text()).get("sharded_backend") == "torch_dist"
    except (OSError, ValueError, AttributeError):
        return False
