"""The device-agnostic path: the step's host copy on any accelerator, the device of the record collective
for every backend torch knows, and graph capture asked of the accelerator in use. No accelerator is needed: a
stand-in device plays one."""
import threading
import time
import types

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from trainmon.engine import stats
from trainmon.engine.accelerator import collective_device, collective_device_type, stream_capturing
from trainmon.hooks.collector import StepCollector
from trainmon.core.records import RecordKey

# ---------------------------------------------------------------------------------------- the host copy
COPY_DELAY_S = 0.3


class _Stream:
    """The stand-in device's one stream: the copies issued on it and not yet known to be done."""

    def __init__(self):
        self.issued: list[threading.Thread] = []


class _Event:
    """Like torch.Event: complete once the work issued on the recorded stream before `record()` is."""

    def __init__(self, device=None, **kwargs):
        self.device = device
        self.awaited: list[threading.Thread] = []

    def record(self, stream=None):
        self.awaited = list((stream or STREAM).issued)

    def synchronize(self):
        for copy in self.awaited:
            copy.join()


STREAM = _Stream()


class LateDeviceTensor(torch.Tensor):
    """A tensor on a stand-in accelerator ("xpu") whose copies to the host land COPY_DELAY_S after they are
    issued, as a non-blocking copy on a real accelerator does; other ops run on the CPU values it wraps."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, values: torch.Tensor):
        tensor = torch.Tensor._make_wrapper_subclass(cls, values.shape, dtype=values.dtype,
                                                     device=torch.device("xpu"))
        tensor.values = values
        return tensor

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.copy_.default and not isinstance(args[0], cls):
            host, source = args[0], args[1].values

            def land():
                time.sleep(COPY_DELAY_S)
                host.copy_(source)

            copy = threading.Thread(target=land)
            STREAM.issued.append(copy)
            copy.start()
            return host
        out = func(*tree_map(lambda a: a.values if isinstance(a, cls) else a, args), **kwargs)
        return tree_map(lambda o: cls(o) if isinstance(o, torch.Tensor) else o, out)


class PinnedIsPlain(TorchFunctionMode):
    """No pinned allocator without an accelerator: "pinned" buffers are plain ones here, filled with -1 so
    a read before the copy lands shows."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.empty and kwargs.pop("pin_memory", False):
            return torch.full(args[0] if len(args) == 1 else args, -1.0, **kwargs)
        return func(*args, **kwargs)


def test_the_host_copy_is_waited_for_on_any_accelerator(monkeypatch):
    """The writer reads a step's figures only once its copy to the host has landed, whatever the device."""
    monkeypatch.setattr(torch, "Event", _Event)
    monkeypatch.setattr(torch.accelerator, "current_stream", lambda device=None: STREAM)
    rows = stats.tensor_records([torch.tensor([1.0, -2.0, 0.0, 4.0])], 1e-8, frozenset(stats.FIELDS))
    collector = StepCollector(1e-8, stats.fields_for_ops(stats.OPS), rank=0)
    collector.record_rows([RecordKey("actv", "layer.output", 0, 0, 0, (4,), "torch.float32")],
                          LateDeviceTensor(rows))
    collector.add_scalar("loss", LateDeviceTensor(torch.tensor(2.5, dtype=torch.float64)))
    with PinnedIsPlain():
        batch = collector.finish_step()
    batch.wait()  # what the writer thread calls before it reads
    np.testing.assert_array_equal(batch.values, rows.numpy())
    assert batch.scalars == {"loss": 2.5}


def test_on_the_cpu_the_copy_is_done_at_once():
    collector = StepCollector(1e-8, stats.fields_for_ops(stats.OPS), rank=0)
    rows = stats.tensor_records([torch.tensor([3.0, 4.0])], 1e-8, frozenset(stats.FIELDS))
    collector.record_rows([RecordKey("actv", "x", 0, 0, 0, (2,), "torch.float32")], rows)
    batch = collector.finish_step()
    assert batch.ready is None
    np.testing.assert_array_equal(batch.wait().values, rows.numpy())


# -------------------------------------------------------------------------------- the record collective
@pytest.fixture
def plugins(monkeypatch):
    """The registry as `dist.Backend.register_backend(..., devices=[...])` leaves it: torch_npu registers
    hccl for npu, Habana's plugin hccl for hpu."""

    def register(backend: str, device_type: str):
        monkeypatch.setitem(dist.Backend.default_device_backend_map, device_type, backend)
        monkeypatch.setitem(dist.Backend.backend_capability, backend, [device_type])

    return register


# backend as dist.get_backend returns it, the group's device types (None: unknown), the device it needs
CASES = [
    ("nccl", [torch.device("cuda")], "cuda"),
    ("nccl", None, "cuda"),
    ("xccl", [torch.device("xpu")], "xpu"),
    ("xccl", None, "xpu"),
    ("gloo", [torch.device("cuda"), torch.device("cpu")], "cpu"),  # gloo takes CUDA tensors too, through the host
    ("gloo", None, "cpu"),
    ("mpi", [torch.device("cpu"), torch.device("cuda")], "cpu"),
    ("mpi", None, "cpu"),
    ("ucc", None, "cpu"),
    ("fake", None, "cpu"),
    ("undefined", None, "cpu"),
    ("cpu:gloo,cuda:nccl", [torch.device("cpu"), torch.device("cuda")], "cuda"),
    ("cuda:nccl,cpu:gloo", None, "cuda"),
    ("cpu:gloo,cuda:gloo", None, "cpu"),
    ("cpu:gloo,xpu:xccl", None, "xpu"),
    ("cpu:gloo", None, "cpu"),
]


@pytest.mark.parametrize("backend,device_types,expected", CASES)
def test_collective_device_of_every_backend(backend, device_types, expected):
    assert collective_device_type(backend, device_types) == expected


def test_every_backend_torch_knows_is_covered():
    assert set(dist.Backend.backend_list) <= {backend for backend, _, _ in CASES}


@pytest.mark.parametrize("device_type", ["npu", "hpu"])
def test_hccl_needs_the_device_its_plugin_registered(plugins, device_type):
    plugins("hccl", device_type)
    assert collective_device_type("hccl", [device_type]) == device_type
    assert collective_device_type("hccl", None) == device_type
    assert collective_device_type(f"cpu:gloo,{device_type}:hccl", None) == device_type


def test_hccl_before_its_plugin_registers_follows_the_groups_device_types():
    """Before `import torch_npu` the registry says nothing of hccl; a group's own device types still do."""
    assert collective_device_type("hccl", None) == "cpu"
    assert collective_device_type("hccl", ["npu"]) == "npu"


def test_collective_device_reads_the_groups_backend_and_device_types(monkeypatch):
    class Group:
        def __init__(self, backend, device_types):
            self.backend, self._device_types = backend, device_types

    monkeypatch.setattr(dist, "get_backend", lambda group: group.backend)
    assert collective_device(Group("nccl", [torch.device("cuda")])) == torch.device("cuda")
    assert collective_device(Group("gloo", [torch.device("cuda"), torch.device("cpu")])) == torch.device("cpu")


# ---------------------------------------------------------------------------------------- graph capture
class _CapturingAccelerator:
    """A stand-in for an accelerator's torch module (`torch.npu`), whose stream capture the test turns on."""

    def __init__(self, initialized: bool = True):
        self.initialized, self.capturing = initialized, False

    def is_initialized(self) -> bool:
        return self.initialized

    def is_current_stream_capturing(self) -> bool:
        return self.capturing


def test_graph_capture_is_asked_of_the_accelerator_in_use(monkeypatch):
    """An NPU's capture stops the hooks as CUDA's does: the query goes to the current accelerator's module, and
    not to CUDA's, which on an NPU machine is not the one capturing."""
    npu = _CapturingAccelerator()
    monkeypatch.setattr(torch, "npu", npu, raising=False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator",
                        lambda check_available=False: types.SimpleNamespace(type="npu"))
    assert stream_capturing() is False
    npu.capturing = True
    assert stream_capturing() is True
    npu.initialized = False                         # a device not initialised captures nothing
    assert stream_capturing() is False
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda check_available=False: None)
    assert stream_capturing() is False              # no accelerator: CUDA's module is not asked either
