"""Records of parameter pieces, merged across the ranks that hold the pieces.

Each rank reduces its local pieces to mergeable records (one `tensor_records` call), puts the
identity record where it holds nothing, and one `all_gather` of the small [n, N_FIELDS] record tensor
of every family recorded at one point of the step (`PieceRecords`) gives every rank the records of
all pieces, which merge exactly to the full parameter's: sums for count/nans/infs/zeros/sum/sumsq,
min of mins, max of maxes (stats.merge_records). Whole tensors are never gathered.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from trainmon.monitor import schema, stats
from trainmon.monitor.accelerator import collective_device
from trainmon.monitor.adapters.base import WatchedParam
from trainmon.monitor.collectives import not_monitored
from trainmon.monitor.records import RecordKey
from trainmon.monitor.state import HookState

def identity_record(device, dtype=torch.float64) -> torch.Tensor:
    """The record of no elements: merging it with any record leaves that record unchanged."""
    return torch.tensor(schema.IDENTITY, dtype=dtype, device=device)


def merge_gathered(gathered: torch.Tensor) -> torch.Tensor:
    """[ranks, n, N_FIELDS] → [n, N_FIELDS]: the schema's merge rules over the first dimension, for all n
    at once."""
    merged = gathered.sum(dim=0)
    for column in schema.MIN_COLUMNS:
        merged[:, column] = gathered[:, :, column].amin(dim=0)
    for column in schema.MAX_COLUMNS:
        merged[:, column] = gathered[:, :, column].amax(dim=0)
    return merged


def piece_records(state: HookState, pieces: Sequence[Optional[torch.Tensor]], device) -> torch.Tensor:
    """[len(pieces), N_FIELDS] records of the pieces; the identity record where a piece is None."""
    collector = state.collector
    present = [i for i, t in enumerate(pieces) if t is not None]
    rows = identity_record(device).expand(len(pieces), -1).clone()
    if present:
        local = stats.tensor_records([pieces[i] for i in present], collector.eps, collector.fields)
        rows[torch.tensor(present, device=device)] = local.to(device=device, dtype=rows.dtype)
    return rows


def record_pieces(state: HookState, family: str, params: Sequence[WatchedParam],
                  pieces: Sequence[Optional[torch.Tensor]], group=None, micro=None) -> None:
    """Records `pieces[i]` (this rank's piece of `params[i]`, or None) as `family` (see `PieceRecords`)."""
    records = PieceRecords(state, params, group, micro)
    records.add(family, pieces)
    records.commit()


class PieceRecords:
    """Records several families of pieces of `params`, merged across `group` in one collective.

    Without `group` the pieces are whole tensors, recorded as they are added (None pieces are skipped).
    With `group` each family's pieces are reduced to local records when added (so its tensors may be
    freed at once), and `commit()` runs one `all_gather` for every family added: every rank of the
    group must add the same families of the same params in the same order. The records written are
    the merged ones of the full parameters.
    """

    def __init__(self, state: HookState, params: Sequence[WatchedParam], group=None, micro=None):
        self.state, self.params, self.micro = state, params, micro
        self.group = group if group is not None and dist.get_world_size(group) > 1 else None
        self._keys: list[RecordKey] = []
        self._rows: list[torch.Tensor] = []

    def add(self, family: str, pieces: Sequence[Optional[torch.Tensor]]) -> None:
        collector = self.state.collector
        if self.group is None:
            kept = [(w, t) for w, t in zip(self.params, pieces) if t is not None]
            if kept:
                collector.record([_key(collector, family, w, t, self.micro) for w, t in kept], [t for _, t in kept])
            return
        if not self.params:
            return
        # Every rank gathers on the device the group's backend needs, whether or not it holds pieces.
        self._rows.append(piece_records(self.state, pieces, collective_device(self.group)))
        # A rank that holds nothing of a parameter (not even an empty piece, see adapters.base) labels it
        # with the dtype of the pieces it does hold (one family's pieces share a dtype: fp32 main params,
        # fp32 moments), so every rank writes the same. Only a rank holding nothing of any of them falls
        # back to the parameter's dtype.
        some = next((t for t in pieces if t is not None), None)
        self._keys += [_key(collector, family, w, t if t is not None else some, self.micro)
                       for w, t in zip(self.params, pieces)]

    def commit(self) -> None:
        """Merges the records added so far across the group and adds them to the step."""
        if not self._rows:
            return
        rows = torch.cat(self._rows) if len(self._rows) > 1 else self._rows[0]
        ranks = dist.get_world_size(self.group)
        # Concatenated along dim 0: the layout every backend accepts (gloo rejects a stacked output).
        gathered = torch.empty((ranks * rows.shape[0], rows.shape[1]), dtype=rows.dtype, device=rows.device)
        with not_monitored():  # trainmon's own collective is not part of the training's communication
            _all_gather_single(gathered, rows, self.group)
        self.state.collector.record_rows(self._keys, merge_gathered(gathered.view(ranks, *rows.shape)))
        self._keys, self._rows = [], []


def _all_gather_single(output: torch.Tensor, local: torch.Tensor, group) -> None:
    # torch 2.13 deprecates all_gather_into_tensor (a FutureWarning on every call, on every rank) in favour
    # of all_gather_single, the same collective, which earlier releases do not have.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, local, group=group)


def _key(collector, family: str, watched: WatchedParam, piece, micro) -> RecordKey:
    shape = watched.shape if watched.shape is not None else tuple(watched.param.shape)
    dtype = piece.dtype if piece is not None else watched.param.dtype
    return RecordKey(family, watched.name, watched.vpp_stage, micro, collector.next_call_index(),
                     tuple(shape), str(dtype))
