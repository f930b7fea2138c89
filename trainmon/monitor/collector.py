"""Per-step accumulation of device-side statistic records and the step's single host transfer."""
from __future__ import annotations

import weakref
from typing import Optional, Sequence

import torch

from trainmon.monitor import stats
from trainmon.monitor.records import RecordKey, StepBatch


class StepCollector:
    """Gathers the records of one step on the device and ships them to the host in one copy.

    Hooks call `record()` with tensors; statistics are computed at once on the tensors' device
    (a batch per call) and kept there. A tensor object seen twice in a step (a module's output
    is the next module's input) is reduced once.
    """

    def __init__(self, eps: float, ops: Sequence[str], rank: int, pp_stage: int = 0):
        self.eps = eps
        self.fields = stats.fields_for_ops(ops)
        self.rank = rank
        self.pp_stage = pp_stage
        self.step = 0
        self._reset()

    def _reset(self) -> None:
        self._keys: list[RecordKey] = []
        self._blocks: list[torch.Tensor] = []
        self._scalars: dict[str, object] = {}
        self._flag_keys: list[RecordKey] = []
        self._flags: list[torch.Tensor] = []
        self._seen: dict[int, tuple] = {}
        self._call_index = 0

    def next_call_index(self) -> int:
        """Reserves the ordering position of one hooked event."""
        index = self._call_index
        self._call_index += 1
        return index

    def record(self, keys: Sequence[RecordKey], tensors: Sequence[torch.Tensor], reuse: bool = False) -> None:
        """Computes the records of `tensors` (one per key) and keeps them on the device.

        With `reuse`, a tensor object already reduced this step (same object, same version) reuses
        its record instead of being read again.
        """
        if not tensors:
            return
        if not reuse:
            self._add(keys, stats.tensor_records(tensors, self.eps, self.fields))
            return
        fresh_keys, fresh = [], []
        for key, tensor in zip(keys, tensors):
            cached = self._seen.get(id(tensor))
            if cached is not None and cached[0]() is tensor and cached[1] == tensor._version:
                self._add([key], cached[2])
            else:
                fresh_keys.append(key)
                fresh.append(tensor)
        if not fresh:
            return
        rows = stats.tensor_records(fresh, self.eps, self.fields)
        self._add(fresh_keys, rows)
        for i, tensor in enumerate(fresh):
            self._seen[id(tensor)] = (weakref.ref(tensor), tensor._version, rows[i:i + 1])

    def record_rows(self, keys: Sequence[RecordKey], rows: torch.Tensor) -> None:
        """Adds precomputed (e.g. merged across shards) records, [len(keys), N_FIELDS]."""
        self._add(keys, rows)

    def _add(self, keys: Sequence[RecordKey], rows: torch.Tensor) -> None:
        self._keys.extend(keys)
        self._blocks.append(rows)

    def add_flags(self, keys: Sequence[RecordKey], probes: torch.Tensor) -> None:
        """Adds the NaN sentinel's probes (1-D, one per key, on the device) to the step's transfer."""
        self._flag_keys.extend(keys)
        self._flags.append(probes)

    def any_nonfinite(self) -> Optional[torch.Tensor]:
        """Device bool: whether a record of this step so far counted a NaN or Inf (None before the first)."""
        if not self._blocks:
            return None
        rows = torch.cat([b.reshape(-1, len(stats.FIELDS)) for b in self._blocks])
        return (rows[:, stats.FIELDS.index("nans")] + rows[:, stats.FIELDS.index("infs")]).gt(0).any()

    def add_scalar(self, name: str, value) -> None:
        """A training scalar (loss, lr, ...); a tensor stays on its device until the step's transfer."""
        if isinstance(value, torch.Tensor):
            value = value.detach().reshape(()).to(torch.float64)
        self._scalars[name] = float(value) if not isinstance(value, torch.Tensor) else value

    @property
    def empty(self) -> bool:
        return not self._keys and not self._scalars and not self._flag_keys

    def finish_step(self) -> StepBatch:
        """Packs the step into one device buffer, starts its single copy to the host, and resets."""
        tensor_scalars = [(n, v) for n, v in self._scalars.items() if isinstance(v, torch.Tensor)]
        batch = StepBatch(step=self.step, rank=self.rank, pp_stage=self.pp_stage, keys=self._keys,
                          scalars={n: v for n, v in self._scalars.items() if not isinstance(v, torch.Tensor)},
                          flag_keys=self._flag_keys)
        # Layout of the host buffer (StepBatch.wait): records, sentinel probes, tensor-valued scalars.
        parts = [b.reshape(-1) for b in self._blocks] + [f.to(torch.float64) for f in self._flags] + \
            [v.reshape(1) for _, v in tensor_scalars]
        if parts:
            batch.host, batch.ready = _to_host(torch.cat(parts) if len(parts) > 1 else parts[0])
            batch.host_scalar_names = tuple(n for n, _ in tensor_scalars)
        self._reset()
        return batch


def _to_host(flat: torch.Tensor):
    """The step's one device→host copy; non-blocking into pinned memory on accelerators."""
    on_accelerator = flat.device.type != "cpu"
    host = torch.empty(flat.shape, dtype=flat.dtype, device="cpu", pin_memory=on_accelerator)
    host.copy_(flat, non_blocking=on_accelerator)
    ready = None
    if flat.device.type == "cuda":
        ready = torch.cuda.Event()
        ready.record()
    return host, ready
