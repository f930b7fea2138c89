"""The records of tensors on any device, through the kernels that serve that device: on an accelerator where Triton
runs, the record kernels the step's slot table uses (`folding`), one launch per dtype into fresh rows; elsewhere the
engine's CPU path and torch kernels (`stats.tensor_records`). For records outside a step's collection: parameter
pieces merged across ranks, checkpoints, config-check digests, tensor dumps."""
from __future__ import annotations

import logging
from typing import Sequence

import torch

from trainmon.core import schema
from trainmon.engine import buffers, folding, stats, stats_fused

logger = logging.getLogger("trainmon")

_folders: dict = {}                             # (device, eps, fields, saturation) -> its Triton folder, or None


def tensor_records(tensors: Sequence[torch.Tensor], eps: float, fields: frozenset[str]) -> torch.Tensor:
    """float64 `[len(tensors), N_FIELDS]` records on the tensors' (shared) device, the fields not asked for 0; see
    `stats.tensor_records`."""
    folder = _triton_folder(tensors[0].device, eps, fields) if tensors else None
    if folder is None:
        return stats.tensor_records(tensors, eps, fields)
    device = tensors[0].device
    with torch.no_grad():
        table = buffers.host_values(schema.IDENTITY, device, torch.float64).repeat(len(tensors), 1)
        try:
            folder.fold(table, list(range(len(tensors))), tensors)
        except Exception as exc:                # monitoring never takes training down
            logger.warning("trainmon: the Triton record kernel failed on %s (%s: %s); the torch kernels read the "
                           "records from now on", device.type, type(exc).__name__, exc)
            _folders[_key(device, eps, fields)] = None
            return stats.tensor_records(tensors, eps, fields)
        unasked = schema.unasked_columns(fields)
        if unasked:
            table[:, list(unasked)] = 0.0
    return table


def _key(device: torch.device, eps: float, fields: frozenset[str]) -> tuple:
    saturation = (fields.sat_threshold, fields.sat_dtype) if isinstance(fields, stats.FieldSet) else None
    return device, eps, frozenset(fields), saturation


def _triton_folder(device: torch.device, eps: float, fields: frozenset[str]):
    """The Triton folder of `device`, made once; None where the torch kernels serve (the CPU, unless it stands for
    an accelerator: `stats_fused.cpu_as_accelerator`; a device Triton does not read)."""
    if device.type == "meta" or (device.type == "cpu" and not stats_fused.cpu_as_accelerator):
        return None
    key = _key(device, eps, fields)
    if key not in _folders:
        sat = fields if isinstance(fields, stats.FieldSet) else stats.FieldSet(fields)
        folder = folding.folder_for(device, eps, sat)
        _folders[key] = folder if isinstance(folder, folding.TritonFolder) else None
    return _folders[key]
