"""torch.distributed.checkpoint directories (also Megatron-Core's `torch_dist` dist-checkpointing format):
every tensor is stored with its global shape, so each is read whole, one at a time, in this process."""
from __future__ import annotations

import pickle
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from trainmon.ckpt.safe_load import RestrictedUnpickler
from trainmon.read.errors import InputError

METADATA = ".metadata"


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

    def names(self) -> list[str]:
        return list(self._tensors)

    def tensor(self, name: str) -> torch.Tensor:
        meta = self._tensors[name]
        out = {name: torch.empty(meta.size, dtype=meta.properties.dtype)}
        try:
            with warnings.catch_warnings():  # reading in one process is the intent, not a fallback
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.load(out, storage_reader=_Reader(self.path), no_dist=True)
        except Exception as err:  # torch wraps a storage failure in CheckpointException
            raise InputError.at(self.path, f"cannot read tensor {name!r} ({str(err).strip()[:300]})") from None
        return out[name]
