"""A step's records on an accelerator: one row per record key in a table on the device, filled by one launch per
record and copied to the host whole, once a step.

Each record key gets a row the first time it is seen and keeps it on later steps, so a model whose keys repeat
from step to step allocates nothing after its first step. A step starts with every row empty (the schema's
identity record); a fold merges a tensor's record into its key's row on the device (`folding`), so a key recorded
twice in a step holds the merge of both, and a tensor recorded again under another key (a module's output is the
next module's input) has its row merged into the other's instead of being read again, where that row holds its
record alone (`lend_row`). At the step's end the host gets the whole table in one copy, with the rows of the keys
that step touched, in the order they were first touched.

Those merges of rows (two of every three records where a module's output is the next one's input) launch nothing:
they are noted, and the host makes them in order after the step's copy (`StepBatch.wait`). A fold into a row noted as
the source of a merge has the merges noted so far made on the device first, so that each merge reads its source as
it was when the merge was noted.
"""
from __future__ import annotations

import logging
from typing import Optional, Sequence

import numpy as np
import torch

from trainmon.core import schema
from trainmon.core.records import RecordKey
from trainmon.engine import buffers, folding, stats

logger = logging.getLogger("trainmon")

_FIRST_ROWS = 256


class SlotTable:
    """The record rows of one device, and the folder that fills them."""

    def __init__(self, device: torch.device, eps: float, fields: stats.FieldSet):
        self.device = device
        self.folder = folding.folder_for(device, eps, fields)
        self._eps, self._fields = eps, fields
        self._slots: dict[RecordKey, int] = {}
        self._touched_in: list[int] = []            # per slot: the step count when it was last touched
        self._steps = 1                             # steps begun, this one included
        self.keys: list[RecordKey] = []             # this step's keys, first touch first
        self.rows: list[int] = []                   # their slots
        self._merges: list[tuple[int, int]] = []    # (source, target) rows noted this step, for the host to merge
        self._sources: set[int] = set()             # their source rows
        self._filled: set[int] = set()              # rows that took a record this step
        self._mixed: set[int] = set()               # of those, rows that took more than one
        with torch.inference_mode(False):           # usable in and out of the mode
            self._empty = buffers.host_values(schema.IDENTITY, device, torch.float64).repeat(_FIRST_ROWS, 1)
            self.table = self._empty.clone()

    def slot(self, key: RecordKey) -> int:
        """The row of `key`, noted as touched this step (a new key gets a row of its own)."""
        slot = self._slots.get(key)
        if slot is None:
            slot = self._new_slot(key)
        if self._touched_in[slot] != self._steps:
            self._touched_in[slot] = self._steps
            self.keys.append(key)
            self.rows.append(slot)
        return slot

    def slots(self, keys: Sequence[RecordKey]) -> list[int]:
        """The rows of `keys` (`slot` of each)."""
        return [self.slot(key) for key in keys]

    def _new_slot(self, key: RecordKey) -> int:
        slot = self._slots[key] = len(self._slots)
        self._touched_in.append(0)
        if slot == self.table.shape[0]:             # grown on the step that first needs it: later steps fit
            with torch.inference_mode(False):
                self._empty = self._empty.repeat(2, 1)
                grown = self._empty.clone()
                grown[:slot] = self.table
                self.table = grown
        return slot

    def fold(self, slots: Sequence[int], tensors: Sequence[torch.Tensor]) -> None:
        """Folds each tensor's record into its slot's row."""
        if self._sources and not self._sources.isdisjoint(slots):
            self._merge_now()
        self._note_filled(slots)
        try:
            self.folder.fold(self.table, slots, tensors)
        except Exception as exc:                    # monitoring never takes training down
            self._retire(exc)
            self.folder.fold(self.table, slots, tensors)

    def lend_row(self, source: int, target: int) -> bool:
        """Row `source`'s record serves `target` too (the same tensor, recorded under a second key), where `source`
        holds that record alone this step (or is `target`): noted, for the host to merge after the step's copy.
        False where it holds more: the tensor is then read into `target`."""
        if source in self._mixed:
            return False
        if source != target:
            self._merges.append((source, target))
            self._sources.add(source)
            self._note_filled((target,))
        return True

    def _note_filled(self, slots: Sequence[int]) -> None:
        filled = self._filled
        for slot in slots:
            if slot in filled:
                self._mixed.add(slot)
            else:
                filled.add(slot)

    def _merge_now(self) -> None:
        """The merges noted so far, made on the device now: a fold is about to change a row they read."""
        merges, self._merges, self._sources = self._merges, [], set()
        for source, target in merges:
            try:
                self.folder.merge_row(self.table, source, target)
            except Exception as exc:
                self._retire(exc)
                self.folder.merge_row(self.table, source, target)

    def _retire(self, exc: BaseException) -> None:
        if isinstance(self.folder, folding.TorchFolder):
            raise exc
        logger.warning("trainmon: the Triton record kernel failed on %s (%s: %s); the torch kernels fold the records "
                       "from now on", self.device.type, type(exc).__name__, exc)
        self.folder = folding.TorchFolder(self.device, self._eps, self._fields)

    def any_nonfinite(self) -> torch.Tensor:
        """Device bool: whether a row of this step so far counted a NaN or an Inf (untouched rows count none)."""
        return (self.table.select(1, schema.INDEX["nans"]) + self.table.select(1, schema.INDEX["infs"])).gt(0).any()

    def step_rows(self) -> tuple[Optional[torch.Tensor], list[RecordKey], Optional[np.ndarray], Optional[np.ndarray]]:
        """(the rows in use, on the device; this step's keys; their rows; the (source, target) rows the host merges
        after the copy, in order, or None), or (None, [], None, None) where the step touched none. `clear` empties the
        rows once their copy to the host is under way."""
        if not self.keys:
            return None, [], None, None
        merges = np.array(self._merges, dtype=np.int64) if self._merges else None
        return self.table.narrow(0, 0, len(self._slots)), self.keys, np.array(self.rows, dtype=np.int64), merges

    def clear(self) -> None:
        """Starts the next step: every row empty again (after the copy of this step's rows, on the same stream)."""
        if self.keys:
            used = len(self._slots)
            self.table.narrow(0, 0, used).copy_(self._empty.narrow(0, 0, used))
        self.keys, self.rows = [], []
        self._merges, self._sources = [], set()
        self._filled, self._mixed = set(), set()
        self._steps += 1
