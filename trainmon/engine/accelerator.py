"""What trainmon needs from an accelerator, for any device torch knows: CUDA, Ascend NPU, XPU, and others.

Nothing here names a device type: the device comes from the tensors themselves or from the process
group's backend, and the backend→device knowledge from torch's own registry, which device plugins extend
when the user imports them (`import torch_npu` registers `npu` and `hccl`).
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def copy_done_event(device: torch.device):
    """An event recorded on `device`'s current stream, the one a copy issued just before runs on:
    its `synchronize()` returns once that copy has landed."""
    if hasattr(torch, "accelerator"):
        event = torch.Event(device=device)
        event.record(torch.accelerator.current_stream(device))
    else:  # torch < 2.6: the device module's own event (torch.cuda, torch.npu, torch.xpu)
        module = getattr(torch, device.type)
        event = module.Event()
        event.record(module.current_stream(device))
    return event


def collective_device_type(backend: str, device_types=None) -> str:
    """The device type whose tensors a collective must use on a group whose backend is `backend`.

    Args:
        backend: `dist.get_backend(group)`: a name ("nccl", "hccl", "xccl", "gloo", "mpi", ...) or one
            backend per device type ("cpu:gloo,cuda:nccl").
        device_types: the device types the group has backends for (`group._device_types`), when known.

    A backend that cannot take CPU tensors (nccl, xccl, hccl: torch's registry says which) needs its own
    device. Where every backend of the group takes CPU tensors (gloo, mpi, ucc, also for CUDA tensors),
    the CPU is the one device they all handle.
    """
    if ":" in backend:
        by_device = dict(pair.split(":", 1) for pair in backend.split(","))
    else:
        types = device_types or dist.Backend.backend_capability.get(backend, ["cpu"])
        by_device = {getattr(t, "type", t): backend for t in types}
    for device_type, name in by_device.items():
        if device_type != "cpu" and "cpu" not in dist.Backend.backend_capability.get(name, ()):
            return device_type
    return "cpu" if "cpu" in by_device else next(iter(by_device))


def collective_device(group) -> torch.device:
    """The device that collectives on `group` need; an accelerator without an index, which tensors
    made on it resolve to its current device (the one the framework set for this rank)."""
    return torch.device(collective_device_type(dist.get_backend(group), getattr(group, "_device_types", None)))


def stream_capturing() -> bool:
    """Whether the current stream of the accelerator in use is being captured into a graph (CUDA graphs, an NPU's
    graph capture): what is launched then runs at each replay, not now. torch has no device-generic query; the
    accelerator's own module answers (`torch.cuda`, `torch.npu`, ...): the current accelerator's from torch 2.6,
    else CUDA's and the device plugin's. One that is not initialised captures nothing. One function, no helper:
    hooks ask it under a compiled module's call, where Dynamo would compile any frame it called (see
    `hooks.in_graph`)."""
    if hasattr(torch, "accelerator"):
        accelerator = torch.accelerator.current_accelerator()
        backends = () if accelerator is None else (getattr(torch, accelerator.type, None),)
    else:
        backends = (torch.cuda, getattr(torch, torch._C._get_privateuse1_backend_name(), None))
    for backend in backends:
        initialized = getattr(backend, "is_initialized", None)
        capturing = getattr(backend, "is_current_stream_capturing", None)
        if initialized is not None and capturing is not None and initialized() and capturing():
            return True
    return False
