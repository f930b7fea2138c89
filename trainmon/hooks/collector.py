"""Per-step accumulation of device-side statistic records and the step's single host transfer."""
from __future__ import annotations

import logging
from typing import Optional, Sequence

import torch

from trainmon.core import schema
from trainmon.core.defaults import STATS_BATCH_MB
from trainmon.core.records import RecordKey, StepBatch
from trainmon.engine import buffers, paths, stats, stats_fused
from trainmon.hooks import in_graph
from trainmon.engine.accelerator import copy_done_event
from trainmon.engine.slot_table import SlotTable
from trainmon.engine.stats_fused import PLAIN_TENSORS
from trainmon.hooks.tensor_memo import TensorMemo

logger = logging.getLogger("trainmon")


class StepCollector:
    """Gathers the records of one step on the device and ships them to the host in one copy.

    Records are computed on the tensors' device and stay there. On an accelerator every record is folded into its
    key's row of a slot table (`slot_table.SlotTable`) when it is recorded, one launch each (a family's tensors
    recorded together: one launch per dtype): the kernel reads the tensor as it is at the hook, later in-place
    changes on the same stream come after it, and nothing is held. A tensor object recorded again within the step,
    unchanged (same version), has its row merged into the new key's instead of being read again.

    On the CPU, where a call's host work dwarfs the reading of a small tensor, activations (`defer=True`) are
    held until `batch_bytes` of them are pending and then reduced in one batch, because the engine's
    cost per call dwarfs its cost per tensor when a hook brings one or two tensors. The batch stays
    small enough to be reduced while still in the last-level cache, and held tensors keep the
    allocator from reusing their memory for the rest of the step, so larger batches cost more. On the CPU a
    large activation is not held: it is read in its hook by one native call, while its data is still in the
    nearer caches (`stats_cpu.RecordsOnArrival`), and its record joins the next batch's. A
    tensor object recorded twice within a step (a module's output is the next module's input, a block's
    output the next block's) is reduced once, unless it changed in between; only activations get that
    reuse (see `record`).

    A deferred tensor that is modified in place before its batch is reduced would be reported with
    its later values. So the first time a name is recorded it is read at once, and its tensor is
    watched until the next batch: a name whose tensor changed in place by then (a loss scaled in place,
    Megatron's logits in its fused cross-entropy) is read at once from then on, the others are
    deferred. A deferred tensor that changes in place later all the same, or whose data is replaced or freed
    (`_data_address`), has its record dropped, counted in `dropped_in_place`, and its name is read at once
    from then on. Read at once means reduced in its
    hook, or, for a CPU tensor of up to `paths.SNAPSHOT_MAX_BYTES`, copied in its hook and the copy reduced with the
    next batch.
    """

    def __init__(self, eps: float, fields: stats.FieldSet, rank: int, pp_stage: int = 0,
                 batch_bytes: int = STATS_BATCH_MB << 20, shared_events: bool = False):
        self.eps = eps
        # Whether two groups of hooks report the same tensor events (the NaN sentinel beside the activation
        # hooks): only then does call_index_of note each event's index.
        self.shared_events = shared_events
        self.fields = fields  # what each record computes: stats.fields_for_ops
        # zeroed on the host (StepBatch.wait): on the device each records call would launch a kernel for it
        self._unasked = schema.unasked_columns(fields)
        self.rank = rank
        self.pp_stage = pp_stage
        self.batch_bytes = batch_bytes
        self.step = 0
        self.dropped_in_place: dict[str, int] = {}
        self.input_grads_not_recorded: dict[str, int] = {}  # per name: input grads of calls not recorded (module_hooks)
        self._eager_names: set[str] = set()
        self._deferrable_names: set[str] = set()
        self._arrivals = stats.records_on_arrival(eps, fields)
        self._arrival_bytes = self._arrivals.min_bytes  # smaller tensors skip the call
        self._table: Optional[SlotTable] = None  # the accelerator's rows, made at its first record
        self._cpu_as_accelerator = stats_fused.cpu_as_accelerator
        self._reset()

    def _reset(self) -> None:
        self._keys: list[RecordKey] = []
        self._blocks: list[torch.Tensor] = []
        self._scalars: dict[str, object] = {}
        self._flag_keys: list[RecordKey] = []
        self._flags: list[torch.Tensor] = []
        # The per-tensor bookkeeping of a step holds numbers (TensorMemo, parallel lists), not an object per
        # tensor for Python's garbage collector.
        # id -> (version, block, slot) of the deferred tensors recorded this step: the record is row `slot` of
        # `_reduced[block]`, or, where block is ~b (negative), `slot` of batch b (`_batch_blocks`), which a flush
        # reduces without touching these entries. A batch's slots are its held tensors' (from 0), then, as ~a, the
        # records read on arrival (`_arrivals`, row a of theirs).
        self._seen = TensorMemo()
        self._reduced: list[torch.Tensor] = []  # the record rows of each batch reduced this step
        self._batch_blocks: list[int] = []  # per batch reduced this step: its block in _reduced
        self._batch_held: list[int] = []  # per batch reduced this step: its held tensors, whose rows come first
        self._call_index = 0
        self._indexed = TensorMemo()  # call_index_of: (family, name, vpp, micro, id) -> index
        self._pending_keys: list[RecordKey] = []
        self._pending_slots: list[int] = []  # per pending key: index into _pending_tensors
        self._pending_tensors: list[torch.Tensor] = []
        self._pending_versions: list[int] = []  # per pending tensor: its version when recorded
        self._pending_addresses: list[int] = []  # per pending tensor: its _data_address when recorded
        self._pending_bytes = 0
        self._trial: list[tuple[str, torch.Tensor, int, int]] = []  # (name, tensor, version, address), first sight
        self._folded = TensorMemo()  # id -> (version, slot) of the activations folded into the table this step

    def next_call_index(self) -> int:
        """Reserves the ordering position of one hooked event."""
        index = self._call_index
        self._call_index += 1
        return index

    def call_index_of(self, family: str, name: str, vpp_stage: int, micro: Optional[int],
                      tensor: torch.Tensor) -> int:
        """The call index of one tensor event, the same for every hook that reports it: the NaN sentinel and
        the statistic hooks each see a module's output (or grad) and would otherwise reserve one index each.
        Where one group alone reports each event, it asks once per event, and the index is reserved at once."""
        if self.shared_events:
            where = (family, name, vpp_stage, micro, id(tensor))
            index = self._indexed.get(where, tensor)
            if index is not None:
                return index
            self._indexed.put(where, tensor, self._call_index)
        index = self._call_index  # next_call_index, inlined: every tensor event of every hook
        self._call_index += 1
        return index

    def record(self, keys: Sequence[RecordKey], tensors: Sequence[torch.Tensor], defer: bool = False) -> None:
        """Records `tensors` (one per key).

        Without `defer` the tensors are read now, in one batch. That is for weights, grads, optimizer
        state and collectives' buffers, read where the framework has just changed them, often through
        `.data` or a collective, neither of which bumps `_version` (DeepSpeed all-reduces grads through
        `.grad.data`): an earlier record of the same object says nothing about its values now.

        With `defer` (activations and their grads, which frameworks change in place by ordinary ops,
        which bump `_version`) the tensors may be held until the pending batch is reduced, and a tensor
        object recorded with `defer` earlier in the step and unchanged since (same version) reuses that
        record instead of being read again. Tensors a compiled graph lends its hooks are read before the hook
        returns all the same (`_read_graph_buffers`).
        """
        if not tensors:
            return
        table = self._table
        if table is None or tensors[0].device != table.device:
            table = self._table_of(tensors[0])
        if table is not None:
            self._fold(table, keys, tensors, defer)
            return
        if not defer:
            self._reduce_now(list(zip(keys, tensors)))
            return
        if in_graph.graph_buffers():
            self._read_graph_buffers(keys, tensors)
            return
        now = []
        for key, tensor in zip(keys, tensors):
            version = tensor._version
            seen = self._seen.get(id(tensor), tensor)
            if seen is not None and seen[0] == version:  # unchanged since: its record serves
                self._reuse(key, seen[1], seen[2])
                continue
            nbytes = tensor.nbytes
            if nbytes >= self._arrival_bytes:
                row = self._arrivals.take(tensor)
                if row >= 0:                            # read now: its record joins the next batch's
                    self._pending_keys.append(key)
                    self._pending_slots.append(~row)
                    self._seen.put(id(tensor), tensor, (version, ~len(self._batch_blocks), ~row))
                    continue
            self._pending_bytes += nbytes
            if key.name in self._deferrable_names:
                self._hold(key, tensor, tensor, version)
            elif tensor.device.type == "cpu" and nbytes <= paths.SNAPSHOT_MAX_BYTES:
                self._hold(key, tensor.detach().clone(), tensor, version)
                self._watch(key.name, tensor, version)
            else:
                now.append((key, tensor, version))
        if now:
            self._reduce_now([(key, tensor) for key, tensor, _ in now])
            block = len(self._reduced) - 1
            for i, (key, tensor, version) in enumerate(now):
                self._seen.put(id(tensor), tensor, (version, block, i))
                self._watch(key.name, tensor, version)
        if self._pending_bytes >= self.batch_bytes:
            self.flush_pending()

    def _table_of(self, tensor: torch.Tensor) -> Optional[SlotTable]:
        """The slot table of `tensor`'s device, where it is an accelerator (or the CPU taking the accelerators' path,
        `stats_fused.cpu_as_accelerator`) and the first the collector saw; else None."""
        if tensor.is_cpu and not self._cpu_as_accelerator:
            return None
        table = self._table
        if table is not None:
            return table if tensor.device == table.device else None
        device = tensor.device
        if device.type == "meta":
            return None
        self._table = SlotTable(device, self.eps, self.fields)
        return self._table

    def record_one(self, key: RecordKey, tensor: torch.Tensor) -> None:
        """`record([key], [tensor], defer=True)`: an activation's grad, which autograd hands its hook alone."""
        table = self._table
        if table is None or tensor.device != table.device:
            self.record((key,), (tensor,), defer=True)
            return
        slot = self._slot_to_read(table, key, tensor)
        if slot >= 0:
            table.fold((slot,), (tensor,))

    def _fold(self, table: SlotTable, keys: Sequence[RecordKey], tensors: Sequence[torch.Tensor], defer: bool) -> None:
        """Folds the tensors' records into their keys' rows now (deferred ones: see `_slot_to_read`)."""
        if not defer:
            table.fold(table.slots(keys), tensors)
            return
        read_slots, read = [], []
        for key, tensor in zip(keys, tensors):
            slot = self._slot_to_read(table, key, tensor)
            if slot >= 0:
                read_slots.append(slot)
                read.append(tensor)
        if read:
            table.fold(read_slots, read)

    def _slot_to_read(self, table: SlotTable, key: RecordKey, tensor: torch.Tensor) -> int:
        """The row `tensor` is to be read into for `key`; -1 where an activation recorded earlier in the step,
        unchanged since, lends its row instead (where that row holds its record alone)."""
        slot = table.slot(key)
        version = tensor._version
        seen = self._folded.get(id(tensor), tensor)
        if seen is not None and seen[0] == version and table.lend_row(seen[1], slot):
            return -1
        self._folded.put(id(tensor), tensor, (version, slot))
        return slot

    def _read_graph_buffers(self, keys: Sequence[RecordKey], tensors: Sequence[torch.Tensor]) -> None:
        """CPU tensors a compiled graph lends its hooks, whose memory its later kernels may reuse as soon as the hook
        returns, without a version bump: each is read before the hook returns, never held itself nor found again by
        its identity. A large one by one native call on arrival, a small one copied and its copy held for the batch
        (a statistics call of its own costs more than the copy), the others in one call now."""
        now = []
        for key, tensor in zip(keys, tensors):
            if tensor.nbytes >= self._arrival_bytes:
                row = self._arrivals.take(tensor)
                if row >= 0:
                    self._pending_keys.append(key)
                    self._pending_slots.append(~row)
                    continue
            if tensor.device.type == "cpu" and tensor.nbytes <= paths.SNAPSHOT_MAX_BYTES:
                copy = tensor.detach().clone()
                self._pending_bytes += copy.nbytes
                self._hold(key, copy, copy, copy._version)
            else:
                now.append((key, tensor))
        if now:
            self._reduce_now(now)
        if self._pending_bytes >= self.batch_bytes:
            self.flush_pending()

    def _hold(self, key: RecordKey, held: torch.Tensor, tensor: torch.Tensor, version: int) -> None:
        """Holds `held` (`tensor` itself, or a snapshot of it) for the next batch, as the record of `tensor` at
        `version`."""
        slot = len(self._pending_tensors)
        self._pending_tensors.append(held)
        self._pending_versions.append(held._version)
        self._pending_addresses.append(_data_address(held))
        self._pending_keys.append(key)
        self._pending_slots.append(slot)
        self._seen.put(id(tensor), tensor, (version, ~len(self._batch_blocks), slot))

    def _watch(self, name: str, tensor: torch.Tensor, version: int) -> None:
        """Watches a name read at once until the next batch, unless it is known to change in place."""
        if name not in self._eager_names:
            self._trial.append((name, tensor, version, _data_address(tensor)))

    def _reduce_now(self, items: Sequence[tuple[RecordKey, torch.Tensor]]) -> None:
        rows = stats.tensor_records([t for _, t in items], self.eps, self.fields, unasked_zeroed=False)
        self._reduced.append(rows)
        self._add([k for k, _ in items], rows)

    def _reuse(self, key: RecordKey, block: int, slot: int) -> None:
        if block < 0:
            batch = ~block
            if batch == len(self._batch_blocks):  # still pending: share its slot
                self._pending_keys.append(key)
                self._pending_slots.append(slot)
                return
            block = self._batch_blocks[batch]
            if slot < 0:
                slot = self._batch_held[batch] + ~slot
        self._add([key], self._reduced[block].narrow(0, slot, 1))

    def flush_pending(self) -> None:
        """Reduces every pending tensor in one batch, and lets go of the tensors held since the last one.

        Their records stay in `_seen` for the rest of the step, behind a weak reference: an `id` reused by
        another tensor once one has died does not match. The record of a tensor modified in place since it was held
        is dropped; its entry there no longer matches its version. One whose data was replaced or freed is not read
        at all, and its entry there is made to match nothing.
        """
        self._end_trial()
        self._pending_bytes = 0
        if not self._pending_keys:
            return
        pending, versions, addresses = self._pending_tensors, self._pending_versions, self._pending_addresses
        keys, slots = self._pending_keys, self._pending_slots
        self._pending_keys, self._pending_slots, self._pending_tensors = [], [], []
        self._pending_versions, self._pending_addresses = [], []
        modified = {slot for slot, (t, version, address) in enumerate(zip(pending, versions, addresses))
                    if t._version != version or _data_address(t) != address}
        for slot in modified:
            t = pending[slot]
            if _data_address(t) != addresses[slot]:  # replaced or freed: never read (the address may be given back)
                self._seen.put(id(t), t, _NEVER)
                pending[slot] = torch.empty(0, dtype=t.dtype, device=t.device)
        held = len(pending)
        rows = stats.tensor_records(pending, self.eps, self.fields, unasked_zeroed=False) if held else None
        if self._arrivals.taken:                        # records read on arrival
            arrived = self._arrivals.records()
            rows = arrived if rows is None else torch.cat([rows, arrived])
            slots = [slot if slot >= 0 else held + ~slot for slot in slots]
        self._reduced.append(rows)
        self._batch_blocks.append(len(self._reduced) - 1)
        self._batch_held.append(held)
        if modified:
            self._drop_modified([key for key, slot in zip(keys, slots) if slot in modified])
            kept = [i for i, slot in enumerate(slots) if slot not in modified]
            keys, slots = [keys[i] for i in kept], [slots[i] for i in kept]
        if keys:
            if slots != list(range(rows.shape[0])):    # else every row in its key's order, as they are
                rows = rows.index_select(0, buffers.host_values(slots, rows.device))
            self._add(keys, rows)

    def _end_trial(self) -> None:
        """Sorts the names first seen since the last batch into those reduced at once and the deferrable."""
        for name, tensor, version, address in self._trial:
            if tensor._version != version or _data_address(tensor) != address:
                self._eager_names.add(name)
                self._deferrable_names.discard(name)
            elif name not in self._eager_names:
                self._deferrable_names.add(name)
        self._trial = []

    def _drop_modified(self, keys: Sequence[RecordKey]) -> None:
        for key in keys:
            if key.name not in self._eager_names:
                logger.warning("trainmon: %s changed in place, or had its data replaced or freed, before its "
                               "statistics were computed; its record of step %s is dropped (counted in run.json) and "
                               "it is reduced in its hook from now on",
                               key.name, self.step)
            self._eager_names.add(key.name)
            self._deferrable_names.discard(key.name)
            self.dropped_in_place[key.name] = self.dropped_in_place.get(key.name, 0) + 1

    def record_rows(self, keys: Sequence[RecordKey], rows: torch.Tensor) -> None:
        """Adds precomputed (e.g. merged across shards) records, [len(keys), N_FIELDS]."""
        self._add(keys, rows)

    def _add(self, keys: Sequence[RecordKey], rows: torch.Tensor) -> None:
        self._keys.extend(keys)
        self._blocks.append(rows)

    def add_flags(self, keys: Sequence[RecordKey], probes: torch.Tensor) -> None:
        """Adds the NaN sentinel's probes ([len(keys), 2] on the device, see `sentinel`) to the step's transfer."""
        self._flag_keys.extend(keys)
        self._flags.append(probes)

    def any_nonfinite(self) -> Optional[torch.Tensor]:
        """Device bool: whether a record of this step so far counted a NaN or Inf (None before the first)."""
        self.flush_pending()
        table = self._table.any_nonfinite() if self._table is not None and self._table.keys else None
        if not self._blocks:
            return table
        rows = torch.cat([b.reshape(-1, schema.N_FIELDS) for b in self._blocks])
        blocks = (rows[:, schema.INDEX["nans"]] + rows[:, schema.INDEX["infs"]]).gt(0).any()
        return blocks if table is None or table.device != blocks.device else blocks | table

    def add_scalar(self, name: str, value) -> None:
        """A training scalar (loss, lr, ...); a tensor stays on its device until the step's transfer."""
        if isinstance(value, torch.Tensor):
            value = value.detach().reshape(()).to(torch.float64)
        self._scalars[name] = float(value) if not isinstance(value, torch.Tensor) else value

    @property
    def empty(self) -> bool:
        return not self._keys and not self._pending_keys and not self._scalars and not self._flag_keys and \
            (self._table is None or not self._table.keys)

    def finish_step(self) -> StepBatch:
        """Packs the step into one device buffer, starts its single copy to the host, and resets."""
        self.flush_pending()
        tensor_scalars = [(n, v) for n, v in self._scalars.items() if isinstance(v, torch.Tensor)]
        table, table_keys, table_index, table_merges = self._table.step_rows() if self._table is not None else \
            (None, [], None, None)
        batch = StepBatch(step=self.step, rank=self.rank, pp_stage=self.pp_stage, keys=table_keys + self._keys,
                          scalars={n: v for n, v in self._scalars.items() if not isinstance(v, torch.Tensor)},
                          flag_keys=self._flag_keys, unasked=self._unasked, table_index=table_index,
                          table_merges=table_merges)
        # Layout of the host buffer (StepBatch.wait): the slot table's rows, records, sentinel probes, tensor-valued
        # scalars.
        parts = [] if table is None else [table.reshape(-1)]
        parts += [b.reshape(-1) for b in self._blocks] + [f.reshape(-1).to(torch.float64) for f in self._flags] + \
            [v.reshape(1) for _, v in tensor_scalars]
        if parts:
            batch.host, batch.ready = _to_host(torch.cat(parts) if len(parts) > 1 else parts[0])
            batch.host_scalar_names = tuple(n for n, _ in tensor_scalars)
            batch.table_rows = 0 if table is None else table.shape[0]
        if self._table is not None:
            self._table.clear()  # after the copy of its rows, on the same stream
        self._reset()
        return batch


_NEVER = (-1, 0, 0)  # a `_seen` entry no version matches


def _data_address(t: torch.Tensor) -> int:
    """Where a plain tensor's data lies now (0 for a tensor subclass, which has none of its own). A framework that
    replaces a tensor's data (`t.data = ...`: Megatron's deallocated pipeline outputs) or frees its storage
    (`untyped_storage().resize_(0)`: FSDP2's unsharded parameters) moves it, and leaves `_version` as it was."""
    return t.data_ptr() if type(t) in PLAIN_TENSORS else 0


def _to_host(flat: torch.Tensor):
    """The step's one device→host copy: on an accelerator, into pinned memory without blocking, with an
    event the writer waits on before reading (StepBatch.wait); on the CPU the copy is done when it returns."""
    if flat.device.type == "cpu":
        return flat.clone(), None
    host = torch.empty(flat.shape, dtype=flat.dtype, device="cpu", pin_memory=True)
    host.copy_(flat, non_blocking=True)
    return host, copy_done_event(flat.device)
