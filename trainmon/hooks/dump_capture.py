"""Capture for `alert.dump` and the `dump` block: host copies of a module's tensors, taken on the training
thread while the tensors still exist, at most `max_bytes` in all; each tensor beyond its share is cut to its
first elements (flattened) and the description says so. The writer thread writes them
(`trainmon.writers.tensor_files`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from trainmon.core.defaults import DUMP_MB_PER_STEP


@dataclass
class DumpRequest:
    """Host copies of one module's tensors at the first anomaly of a rank."""

    rank: int
    step: int
    micro_step: int
    module: str
    phase: str
    tensors: dict = field(default_factory=dict)  # name -> contiguous CPU tensor
    described: dict = field(default_factory=dict)  # name -> {shape, dtype, stored_elements, nans, infs}


def host_copy(tensor: torch.Tensor, keep: int, non_blocking: bool = True) -> torch.Tensor:
    """A host copy of the first `keep` elements of `tensor` (its own shape when all are kept, else flat).

    On an accelerator with `non_blocking` the copy goes into pinned memory without blocking the
    training thread; whoever reads it first waits for an event recorded after it
    (`accelerator.copy_done_event`).
    """
    flat = tensor.detach().reshape(-1)
    part = flat[:keep]
    if part.device.type == "cpu" or not non_blocking:
        host = part.to("cpu", copy=True)  # the training thread may change the tensor in place later
    else:
        host = torch.empty(part.shape, dtype=part.dtype, pin_memory=True)
        host.copy_(part, non_blocking=True)
    return host.reshape(tensor.shape) if keep == flat.numel() else host


def capture(request: DumpRequest, tensors: list[tuple[str, torch.Tensor]], max_bytes: int = DUMP_MB_PER_STEP << 20) -> None:
    """Copies `tensors` to the host into `request`, each within an equal share of `max_bytes`."""
    share = max_bytes // max(1, len(tensors))
    for name, tensor in tensors:
        flat = tensor.detach().reshape(-1)
        keep = min(flat.numel(), max(1, share // max(1, flat.element_size())))
        host = host_copy(tensor, keep, non_blocking=False)  # read below, on this thread
        request.tensors[name] = host
        floating = host.is_floating_point()
        request.described[name] = {
            "shape": list(tensor.shape), "dtype": str(tensor.dtype), "stored_elements": keep,
            "truncated": keep < flat.numel(),
            "nans_in_stored": int(torch.isnan(host).sum()) if floating else 0,
            "infs_in_stored": int(torch.isinf(host).sum()) if floating else 0,
        }
