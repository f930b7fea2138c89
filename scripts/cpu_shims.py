"""Lets Megatron-Core 0.16.x run on a CPU-only PyTorch build (examples and tests only; never the library).

Megatron hard-codes CUDA in a few places. `apply()` (after importing megatron.core, before
`initialize_model_parallel`) redirects them to the CPU:

- `torch.cuda.current_device()` → "cpu" (GlobalMemoryBuffer in attention allocates on it);
- the CUDA RNG tracker (`model_parallel_cuda_manual_seed`, `_get/_set_cuda_rng_state`) → a CPU generator;
- `torch.cuda.synchronize()` → no-op (pipeline p2p calls it);
- a TorchFunctionMode that rewrites `device="cuda"` to the CPU (the schedules allocate on "cuda") and
  makes `Tensor.type()` report `torch.cuda.*Tensor` (DistributedOptimizer and grad clipping assert it).

Build models with `get_gpt_layer_local_spec()`, `use_cpu_initialization=True` and fusions off.
Pinned to megatron-core 0.16.1: the RNG shim replaces private functions.
"""
import torch
from torch.overrides import TorchFunctionMode

_mode = None


def _is_cuda(device) -> bool:
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True  # an int device means cuda:<int>
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA devices to the CPU in every torch call; `Tensor.type()` reports CUDA types."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        if _is_cuda(kwargs.get("device")):
            kwargs = {**kwargs, "device": "cpu"}
        name = getattr(func, "__name__", "")
        if name == "cuda" and args and isinstance(args[0], torch.Tensor):
            return args[0]
        if name == "to" and len(args) >= 2 and _is_cuda(args[1]):
            args = (args[0], "cpu") + tuple(args[2:])
        if name == "record_stream" and args and isinstance(args[0], torch.Tensor):
            return None
        return func(*args, **kwargs)


def apply() -> None:
    """Installs the shims (once per process)."""
    global _mode
    if _mode is not None:
        return
    import megatron.core.tensor_parallel.random as megatron_random

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    generator = torch.Generator()
    torch.cuda.get_rng_state = lambda *a, **k: generator.get_state()
    torch.cuda.manual_seed = torch.cuda.manual_seed_all = lambda seed: generator.manual_seed(seed)
    megatron_random._get_cuda_rng_state = lambda *a, **k: generator.get_state()
    megatron_random._set_cuda_rng_state = lambda state, *a, **k: generator.set_state(state)
    _mode = CudaToCpuMode()
    _mode.__enter__()
