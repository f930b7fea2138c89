"""What the engine's kernels share: chunks of a tensor of any strides, reused scratch buffers, small host values
copied to a device without blocking, and the merge of records by the schema's rules."""
from __future__ import annotations

import threading

import torch

from trainmon.core import schema


def chunks(x: torch.Tensor, cap: int):
    """Views covering every element of ``x`` once, each with at most ``cap`` elements (any strides)."""
    n = x.numel()
    if n <= cap:
        yield x
    elif x.is_contiguous():
        flat = x.view(-1)
        for i in range(0, n, cap):
            yield flat[i:i + cap]
    else:
        inner = n // x.shape[0]
        if inner <= cap:
            step = cap // inner
            for i in range(0, x.shape[0], step):
                yield x[i:i + step]
        else:
            for i in range(x.shape[0]):
                yield from chunks(x[i], cap)


_TLS = threading.local()


def workspace(device: torch.device, dtype: torch.dtype, cap: int):
    """Two flat scratch buffers of ``cap`` elements in the tensor's own dtype.  Cached per thread on
    CPU (avoids page-faulting fresh buffers every call); fresh from the caching allocator elsewhere."""
    if device.type != "cpu":
        return torch.empty(cap, dtype=dtype, device=device), torch.empty(cap, dtype=dtype, device=device)
    cache = _TLS.__dict__.setdefault("ws", {})
    ws = cache.get(dtype)
    if ws is None or ws[0].numel() < cap:
        with torch.inference_mode(False):            # a normal tensor works in and out of the mode
            ws = cache[dtype] = (torch.empty(cap, dtype=dtype), torch.empty(cap, dtype=dtype))
    return ws


def host_values(values, dev: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """Small host-known metadata on ``dev``: pinned + non_blocking on accelerators, so no stream
    synchronisation (a pageable host->device copy, which `torch.tensor(values, device=...)` makes, blocks)."""
    t = torch.tensor(values, dtype=dtype, device=dev if dev.type in ("cpu", "meta") else "cpu")
    return t if t.device == dev else t.pin_memory().to(dev, non_blocking=True)


def merge_records(records: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Records merged over `dim` by the schema's merge rules (counts and sums add, min of mins, max of maxes):
    ``[k, N_FIELDS]`` -> ``[N_FIELDS]``, or any ``[..., N_FIELDS]`` without `dim`. Any device, no sync."""
    if records.dim() < 2 or records.shape[-1] != schema.N_FIELDS or not -records.dim() <= dim < records.dim() - 1:
        raise ValueError(f"merge_records expects records [..., {schema.N_FIELDS}] merged over a dimension before the "
                         f"last, got {tuple(records.shape)} and dim {dim}")
    dim %= records.dim()
    r = records.to(torch.float64)
    out = r.sum(dim)                                # the min and max columns are replaced below
    if r.shape[dim] == 0:
        return out.copy_(host_values(schema.IDENTITY, r.device, torch.float64))
    for columns, reduce in ((schema.MIN_COLUMNS, torch.amin), (schema.MAX_COLUMNS, torch.amax)):
        for column in columns:
            out.select(-1, column).copy_(reduce(r.select(-1, column), dim))
    return out
