"""Records of parameter pieces, merged across the ranks that hold the pieces.

Each rank reduces its local pieces to mergeable records (one `tensor_records` call), puts the
identity record where it holds nothing, and one `all_gather` of the small [n, N_FIELDS] record tensor
of every family recorded at one point of the step (`PieceRecords`), per process group the parameters
merge over, gives every rank the records of all pieces, which merge exactly to the full parameter's:
sums for count/nans/infs/zeros/sum/sumsq, min of mins, max of maxes (buffers.merge_records). Whole
tensors are never gathered.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from trainmon.core import schema
from trainmon.engine import buffers, records
from trainmon.engine.accelerator import collective_device
from trainmon.adapters.base import WatchedParam
from trainmon.hooks.collectives import not_monitored
from trainmon.core.records import RecordKey, record_key
from trainmon.hooks.state import HookState

def identity_record(device, dtype=torch.float64) -> torch.Tensor:
    """The record of no elements: merging it with any record leaves that record unchanged."""
    return buffers.host_values(schema.IDENTITY, torch.device(device), dtype)


def piece_records(state: HookState, pieces: Sequence[Optional[torch.Tensor]], device) -> torch.Tensor:
    """[len(pieces), N_FIELDS] records of the pieces; the identity record where a piece is None."""
    collector = state.collector
    present = [i for i, t in enumerate(pieces) if t is not None]
    rows = identity_record(device).expand(len(pieces), -1).clone()
    if present:
        local = records.tensor_records([pieces[i] for i in present], collector.eps, collector.fields)
        rows[buffers.host_values(present, torch.device(device))] = local.to(device=device, dtype=rows.dtype)
    return rows


def record_pieces(state: HookState, family: str, params: Sequence[WatchedParam],
                  pieces: Sequence[Optional[torch.Tensor]], over: Optional[tuple] = None, micro=None) -> None:
    """Records `pieces[i]` (this rank's piece of `params[i]`, or None) as `family`, merged across the groups
    `over` (None: not merged; see `PieceRecords`)."""
    records = PieceRecords(state, params, micro, over=over or ())
    records.add(family, pieces)
    records.commit()


class PieceRecords:
    """Records several families of pieces of `params`, each parameter's merged across its process groups.

    A parameter's groups are `over` when given, else its own `merge_over`; groups of one rank are left
    out. Parameters with no group left hold whole tensors, recorded as they are added (None pieces are
    skipped). The others are reduced to local records when added (so their tensors may be freed at once),
    and `commit()` merges them: for each distinct tuple of groups, in the order the parameters first name
    it, one `all_gather` per group carries every family added. Every rank of a group must therefore add
    the same families of the same params in the same order. The records written are the merged ones of
    the full parameters.
    """

    def __init__(self, state: HookState, params: Sequence[WatchedParam], micro=None, over: Optional[tuple] = None):
        self.state, self.params, self.micro = state, params, micro
        multi_rank: dict = {}  # a parameter's groups → those of more than one rank
        self._groups = []
        for groups in (w.merge_over if over is None else over for w in params):
            if groups not in multi_rank:
                multi_rank[groups] = tuple(g for g in groups if g is not None and dist.get_world_size(g) > 1)
            self._groups.append(multi_rank[groups])
        self._merges: dict[tuple, _Merge] = {}
        for index, groups in enumerate(self._groups):
            if groups:
                self._merges.setdefault(groups, _Merge(groups)).indices.append(index)

    def add(self, family: str, pieces: Sequence[Optional[torch.Tensor]]) -> None:
        collector = self.state.collector
        for merge in self._merges.values():
            # Every rank gathers on the device the group's backend needs, whether or not it holds pieces.
            merge.rows.append(piece_records(self.state, [pieces[i] for i in merge.indices], merge.device))
        # A rank that holds nothing of a parameter (not even an empty piece, see adapters.base) labels it
        # with the dtype of the pieces it does hold (one family's pieces share a dtype: fp32 main params,
        # fp32 moments), so every rank writes the same. Only a rank holding nothing of any of them falls
        # back to the parameter's dtype.
        some = next((t for t in pieces if t is not None), None)
        whole_keys, whole = [], []
        for w, t, groups in zip(self.params, pieces, self._groups):  # call indices in the order of params
            if groups:
                self._merges[groups].keys.append(_key(collector, family, w, t if t is not None else some, self.micro))
            elif t is not None:
                whole_keys.append(_key(collector, family, w, t, self.micro))
                whole.append(t)
        if whole:
            collector.record(whole_keys, whole)

    def commit(self) -> None:
        """Merges the records added so far across their groups and adds them to the step."""
        for merge in self._merges.values():
            if merge.rows:
                self.state.collector.record_rows(merge.keys, merge.gathered())
                merge.keys, merge.rows = [], []


class _Merge:
    """The parameters whose pieces merge across one tuple of groups, and their records added so far."""

    def __init__(self, groups: tuple):
        self.groups = groups
        self.device = collective_device(groups[0])
        self.indices: list[int] = []
        self.keys: list[RecordKey] = []
        self.rows: list[torch.Tensor] = []

    def gathered(self) -> torch.Tensor:
        """The rows merged across each group in turn: over a product of groups (tensor × data parallel),
        the first merge leaves every rank with its row's record, which the next merges with the others'."""
        rows = torch.cat(self.rows) if len(self.rows) > 1 else self.rows[0]
        for group in self.groups:
            ranks = dist.get_world_size(group)
            # Concatenated along dim 0: the layout every backend accepts (gloo rejects a stacked output).
            gathered = torch.empty((ranks * rows.shape[0], rows.shape[1]), dtype=rows.dtype, device=rows.device)
            with not_monitored():  # trainmon's own collective is not part of the training's communication
                _all_gather_single(gathered, rows, group)
            rows = buffers.merge_records(gathered.view(ranks, *rows.shape))
        return rows


def _all_gather_single(output: torch.Tensor, local: torch.Tensor, group) -> None:
    # torch 2.13 deprecates all_gather_into_tensor (a FutureWarning on every call, on every rank) in favour
    # of all_gather_single, the same collective, which earlier releases do not have.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, local, group=group)


def _key(collector, family: str, watched: WatchedParam, piece, micro) -> RecordKey:
    shape = watched.shape if watched.shape is not None else tuple(watched.param.shape)
    dtype = piece.dtype if piece is not None else watched.param.dtype
    return record_key(family, watched.name, watched.vpp_stage, micro, collector.next_call_index(),
                      tuple(shape), dtype)
