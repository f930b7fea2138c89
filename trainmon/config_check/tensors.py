"""Digests of tensors (a content hash plus the statistic engine's figures) and of the random generators."""
from __future__ import annotations

import hashlib
import random
from typing import Any, Iterable

import torch

from trainmon.engine import records, stats
from trainmon.core.derive import derive_ops

DIGEST_OPS = ("norm", "mean", "min", "max", "nans", "infs")
_FIELDS = stats.fields_for_ops(DIGEST_OPS)


def tensor_hash(tensor: torch.Tensor) -> str:
    """sha256 of the tensor's dtype, shape and bytes (one tensor copied to the host at a time)."""
    data = tensor.detach().contiguous().cpu()
    digest = hashlib.sha256(f"{data.dtype}{tuple(data.shape)}".encode())
    if data.numel():
        digest.update(data.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def digests(named: Iterable[tuple[str, torch.Tensor]]) -> list[dict[str, Any]]:
    """One row per tensor: name, dtype, shape, sha256 and DIGEST_OPS from the statistic engine."""
    rows = []
    for name, tensor in named:
        tensor = _local(tensor)
        row = {"name": name, "dtype": str(tensor.dtype).replace("torch.", ""), "shape": list(tensor.shape),
               "sha256": tensor_hash(tensor)}
        if tensor.is_floating_point() and tensor.dtype in (torch.float32, torch.float16, torch.bfloat16,
                                                           torch.float64):
            record = records.tensor_records([tensor.detach()], 0.0, _FIELDS)[0].cpu()
            row.update(derive_ops(record, DIGEST_OPS, _FIELDS))
        elif tensor.numel():  # token ids, masks: the engine takes floating tensors only
            as_float = tensor.detach().double()
            row.update(norm=float(as_float.norm()), mean=float(as_float.mean()), min=float(as_float.min()),
                       max=float(as_float.max()), nans=0.0, infs=0.0)
        rows.append(row)
    return rows


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's own elements: a DTensor's local shard, a ZeRO-3 parameter's partition (its `data` is empty
    between steps)."""
    if hasattr(tensor, "to_local"):
        return tensor.to_local()
    return getattr(tensor, "ds_tensor", tensor)


def flat_tensors(value: Any, prefix: str) -> Iterable[tuple[str, torch.Tensor]]:
    """The tensors inside nested args/kwargs, named by their position (`input.0`, `kwargs.labels`)."""
    if isinstance(value, torch.Tensor):
        yield prefix, value
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from flat_tensors(item, f"{prefix}.{i}")
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from flat_tensors(item, f"{prefix}.{key}")


def _bytes_hash(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def random_states() -> dict[str, Any]:
    """Seeds and state hashes of Python's, numpy's and torch's generators (CPU and the accelerator's)."""
    out: dict[str, Any] = {"python.state": _bytes_hash(repr(random.getstate()).encode()),
                           "torch.cpu.seed": torch.initial_seed(),
                           "torch.cpu.state": _bytes_hash(torch.get_rng_state().numpy().tobytes())}
    try:
        import numpy
        kind, keys, position, *_ = numpy.random.get_state()
        out["numpy.state"] = _bytes_hash(keys.tobytes() + str((kind, position)).encode())
    except ImportError:
        pass
    accelerator = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
    if accelerator is not None:  # whatever device torch runs on (cuda, npu, xpu, ...), named by torch
        module = torch.get_device_module(accelerator.type)
        if module.is_initialized() if hasattr(module, "is_initialized") else True:
            out[f"torch.{accelerator.type}.seed"] = module.initial_seed()
            out[f"torch.{accelerator.type}.state"] = _bytes_hash(module.get_rng_state().cpu().numpy().tobytes())
    return out
