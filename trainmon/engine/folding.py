"""Folding records into slot-table rows on an accelerator: one launch per tensor, or per family of tensors.

A folder reads tensors and folds each one's record into its row of a table (`slot_table.SlotTable`): the Triton
kernels of `fold_kernels` where Triton runs on the device (CUDA, ROCm, XPU, Ascend NPUs with Triton-Ascend; the CPU
only under `TRITON_INTERPRET=1`), else the engine's torch kernels (`stats.tensor_records`) and a merge into the
rows, which launch a dozen kernels a call but run on any device. A Triton launch that fails hands its folder's
work to the torch kernels for good, with one message: monitoring never takes training down.

What a hooked call costs the host here: the tensor's address, length and layout, the kernel's launch. The
constants a launch needs (thresholds, workspace, counters, the enabled flag) live on the device, made once.
"""
from __future__ import annotations

import importlib.util
import logging
import os
from typing import Optional, Sequence

import torch

from trainmon.core import schema
from trainmon.engine import buffers, stats
from trainmon.engine.stats_fused import PLAIN_TENSORS

logger = logging.getLogger("trainmon")

_METADATA_KEPT = 16                             # `fold_many` launches whose metadata stays on the device
# Device types whose tensors Triton reads (Ascend's `npu` where Triton-Ascend is installed).
_TRITON_DEVICES = ("cuda", "xpu", "npu")


def triton_reads(device: torch.device) -> bool:
    """Whether the Triton kernels can read tensors of `device` here."""
    if importlib.util.find_spec("triton") is None:
        return False
    if device.type == "cpu":
        return os.environ.get("TRITON_INTERPRET") == "1"
    if device.type == "npu":
        return importlib.util.find_spec("triton.backends.ascend") is not None
    return device.type in _TRITON_DEVICES


class TorchFolder:
    """Folds with the engine's torch kernels: any device, a dozen launches a call."""

    def __init__(self, device: torch.device, eps: float, fields: stats.FieldSet):
        self.device, self.eps, self.fields = device, eps, fields

    def fold(self, table: torch.Tensor, slots: Sequence[int], tensors: Sequence[torch.Tensor]) -> None:
        if len(set(slots)) < len(slots):            # a row twice in one call: one at a time, each merged in turn
            for slot, tensor in zip(slots, tensors):
                self.fold(table, [slot], [tensor])
            return
        records = stats.tensor_records(tensors, self.eps, self.fields, unasked_zeroed=False)
        index = buffers.host_values(slots, self.device)
        merged = buffers.merge_records(torch.stack([table.index_select(0, index), records.to(table.device)]))
        table.index_copy_(0, index, merged)

    def merge_row(self, table: torch.Tensor, source: int, target: int) -> None:
        table[target] = buffers.merge_records(table[[target, source]])


class TritonFolder:
    """Folds with the Triton kernels: one launch per tensor (`fold_one`), or per dtype for contiguous tensors
    read together (`fold_many`)."""

    def __init__(self, device: torch.device, eps: float, fields: stats.FieldSet, kernels=None):
        """`kernels`: the module of the Triton kernels, `fold_kernels` unless given (a benchmark counts launches)."""
        if kernels is None:
            from trainmon.engine import fold_kernels as kernels
        self._kernels = kernels
        self.device, self.eps, self.fields = device, eps, fields
        with torch.inference_mode(False):           # usable in and out of the mode
            self.flag = torch.ones(1, dtype=torch.int32, device=device)
            self._work = torch.empty(kernels.MAX_PROGRAMS * schema.N_FIELDS, dtype=torch.float64, device=device)
            self._counters = torch.zeros(1, dtype=torch.int32, device=device)
        self._bounds: dict = {}                     # dtype -> [zeros threshold, saturation threshold] on the device
        self._subclasses = TorchFolder(device, eps, fields)  # a tensor subclass dispatches its own reads
        self._metadata_kept: dict = {}              # `_fold_many`'s metadata, by its values
        self._accumulation = {torch.float64: kernels.tl.float64}
        self._many_dtype = {torch.float32: kernels.tl.float32, torch.float64: kernels.tl.float64,
                            torch.bfloat16: kernels.tl.bfloat16, torch.float16: kernels.tl.float16}

    def _bounds_of(self, dtype: torch.dtype) -> torch.Tensor:
        bounds = self._bounds.get(dtype)
        if bounds is None:
            with torch.inference_mode(False):
                bounds = self._bounds[dtype] = buffers.host_values(
                    [stats.zeros_threshold(dtype, self.eps), stats.saturation_threshold(dtype, self.fields)],
                    self.device, torch.float64)
        return bounds

    def fold(self, table: torch.Tensor, slots: Sequence[int], tensors: Sequence[torch.Tensor]) -> None:
        """Each tensor's record folded into its row: contiguous tensors of one dtype in one launch, the others one
        launch each."""
        if len(tensors) == 1 and type(tensors[0]) in PLAIN_TENSORS:
            self._fold_one(table, slots[0], tensors[0])
            return
        groups: dict = {}
        for slot, tensor in zip(slots, tensors):
            if type(tensor) not in PLAIN_TENSORS:
                self._subclasses.fold(table, [slot], [tensor])
            elif tensor.is_contiguous() and tensor.dtype in self._many_dtype:
                groups.setdefault(tensor.dtype, []).append((slot, tensor))
            else:
                self._fold_one(table, slot, tensor)
        for dtype, members in groups.items():
            if len(members) == 1:
                self._fold_one(table, *members[0])
            else:
                self._fold_many(table, dtype, members)

    def _fold_one(self, table: torch.Tensor, slot: int, tensor: torch.Tensor) -> None:
        n = tensor.numel()
        if n == 0:
            return                                  # the row keeps the empty record
        kernels = self._kernels
        layout = _collapsed(tensor)
        if layout is None:                          # more than four dimensions that do not merge
            tensor, layout = tensor.contiguous(), ((1, 1, 1), (0, 0, 0, 1))
        (s1, s2, s3), (t0, t1, t2, t3) = layout
        programs = min(-(-n // kernels.BLOCK), kernels.MAX_PROGRAMS)
        kernels.fold_one_kernel[(programs,)](
            tensor, n, s1, s2, s3, t0, t1, t2, t3, table, slot, self._bounds_of(tensor.dtype), self._work,
            self._counters, self.flag, ACC=self._accumulation.get(tensor.dtype, kernels.tl.float32),
            CONTIGUOUS=tensor.is_contiguous(), BLOCK_=kernels.BLOCK,
            WIDEST=kernels.MAX_PROGRAMS)

    def _fold_many(self, table: torch.Tensor, dtype: torch.dtype, members: list) -> None:
        kernels = self._kernels
        addresses, lengths, slots, firsts, spans, owners = [], [], [], [], [], []
        programs = 0
        for index, (slot, tensor) in enumerate(members):
            n = tensor.numel()
            if n == 0:
                continue
            span = min(-(-n // kernels.BLOCK), kernels.MANY_PROGRAMS)
            addresses.append(tensor.data_ptr())
            lengths.append(n)
            slots.append(slot)
            firsts.append(programs)
            spans.append(span)
            owners.extend([len(addresses) - 1] * span)
            programs += span
        if not programs:
            return
        tensors = len(addresses)
        meta = self._metadata(addresses + lengths + slots + firsts + spans + owners)
        work, counters = self._room(programs, tensors)
        kernels.fold_many_kernel[(programs,)](
            meta, meta[tensors:], meta[2 * tensors:], meta[3 * tensors:], meta[4 * tensors:], meta[5 * tensors:],
            table, self._bounds_of(dtype), work, counters, self.flag, DTYPE=self._many_dtype[dtype],
            ACC=self._accumulation.get(dtype, kernels.tl.float32), BLOCK_=kernels.BLOCK,
            WIDEST=kernels.MANY_PROGRAMS)

    def _metadata(self, values: list[int]) -> torch.Tensor:
        """`values` on the device: a family's parameters, Adam moments and (mostly) grads lie where they lay the step
        before, so the last few are kept, and a family whose tensors have not moved costs no copy."""
        key = tuple(values)
        meta = self._metadata_kept.pop(key, None)
        if meta is None:
            with torch.inference_mode(False):
                meta = buffers.host_values(values, self.device)
            if len(self._metadata_kept) >= _METADATA_KEPT:
                self._metadata_kept.pop(next(iter(self._metadata_kept)))
        self._metadata_kept[key] = meta             # the most recent last
        return meta

    def _room(self, programs: int, tensors: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The workspace's first `programs` partial rows and `tensors` counters, grown as needed (counters are left
        at 0 by every launch)."""
        if self._work.numel() < programs * schema.N_FIELDS:
            self._work = torch.empty(programs * schema.N_FIELDS * 2, dtype=torch.float64, device=self.device)
        if self._counters.numel() < tensors:
            self._counters = torch.zeros(tensors * 2, dtype=torch.int32, device=self.device)
        return self._work, self._counters

    def merge_row(self, table: torch.Tensor, source: int, target: int) -> None:
        self._kernels.merge_row_kernel[(1,)](table, source, target, self.flag)


def _collapsed(t: torch.Tensor) -> Optional[tuple[tuple, tuple]]:
    """((s1, s2, s3), (t0, t1, t2, t3)): `t`'s elements as four dimensions of sizes (., s1, s2, s3) and strides
    t0..t3, dimensions of size 1 dropped and those that follow each other in memory merged; None where more than
    four remain."""
    sizes, strides = [], []
    for size, stride in zip(t.shape, t.stride()):
        if size == 1:
            continue
        if sizes and strides[-1] == stride * size:
            sizes[-1] *= size
            strides[-1] = stride
        else:
            sizes.append(size)
            strides.append(stride)
    if len(sizes) > 4:
        return None
    pad = 4 - len(sizes)
    sizes, strides = [1] * pad + sizes, [0] * pad + strides
    return (sizes[1], sizes[2], sizes[3]), (strides[0], strides[1], strides[2], strides[3])


def folder_for(device: torch.device, eps: float, fields: stats.FieldSet):
    """The folder of `device`: Triton's where it reads the device's tensors, else the torch kernels'."""
    if triton_reads(device):
        try:
            return TritonFolder(device, eps, fields)
        except Exception as exc:                    # a Triton that does not import or set up on this machine
            logger.warning("trainmon: the Triton record kernels are not available on %s (%s: %s); the torch kernels "
                           "fold the records", device.type, type(exc).__name__, exc)
    return TorchFolder(device, eps, fields)
