"""Lets Megatron-Core 0.16.x run on a CPU-only PyTorch build (examples and tests only; never the library).

Megatron hard-codes CUDA in a few places. `apply()` (after importing megatron.core, before
`initialize_model_parallel`) redirects them to the CPU:

- `torch.cuda.current_device()` → "cpu" (GlobalMemoryBuffer in attention allocates on it);
- the CUDA RNG tracker (`model_parallel_cuda_manual_seed`, `_get/_set_cuda_rng_state`) → a CPU generator;
- `torch.cuda.synchronize()` → no-op (pipeline p2p calls it);
- CUDA streams and events → one host "stream" whose waits and events are no-ops (MoE's alltoall token
  dispatcher copies its split sizes to the host on a side stream);
- that dispatcher's host copy turns split sizes into numpy arrays only for CUDA tensors, and the collective
  wants sequences: on the CPU the tensors become arrays too;
- MoE's router gating refers to TransformerEngine's `te_general_gemm`, undefined without TE → None (torch.mm);
- a TorchFunctionMode that rewrites `device="cuda"` to the CPU (the schedules allocate on "cuda") and
  makes `Tensor.type()` report `torch.cuda.*Tensor` (DistributedOptimizer and grad clipping assert it).

Build models with `get_gpt_layer_local_spec()`, `use_cpu_initialization=True` and fusions off.
Pinned to megatron-core 0.16.1: the RNG shim replaces private functions.
"""
import torch
from torch.overrides import TorchFunctionMode

_mode = None


class _HostStream:
    """The only stream of a CPU: work is done when its call returns, so waiting and events are no-ops."""

    def wait_stream(self, other) -> None:
        pass

    def record_event(self, event=None):
        return self

    def synchronize(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


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
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    host_stream = _HostStream()
    torch.cuda.Stream = torch.cuda.current_stream = lambda *a, **k: host_stream
    torch.cuda.stream = lambda stream=None: host_stream
    generator = torch.Generator()
    torch.cuda.get_rng_state = lambda *a, **k: generator.get_state()
    torch.cuda.manual_seed = torch.cuda.manual_seed_all = lambda seed: generator.manual_seed(seed)
    megatron_random._get_cuda_rng_state = lambda *a, **k: generator.get_state()
    megatron_random._set_cuda_rng_state = lambda state, *a, **k: generator.set_state(state)
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    move_to_cpu = moe_utils.maybe_move_tensor_to_cpu

    def move_to_host(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return move_to_cpu(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = move_to_host
    _mode = CudaToCpuMode()
    _mode.__enter__()
