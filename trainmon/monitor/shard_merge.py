"""Records of parameter pieces, merged across the ranks that hold the pieces.

Each rank reduces its local pieces to mergeable records (one `tensor_records` call), puts the
identity record where it holds nothing, and one `all_gather` of the small [n, N_FIELDS] record tensor per
call gives every rank the records of all pieces, which merge exactly to the full parameter's:
sums for count/nans/infs/zeros/sum/sumsq, min of mins, max of maxes (stats.merge_records). Whole
tensors are never gathered.
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
    """Records `pieces[i]` (this rank's piece of `params[i]`, or None) as `family`.

    Without `group` the pieces are whole tensors: None pieces are skipped. With `group` every rank of
    it must call this with the same params in the same order (it runs one collective), and the
    records written are the merged ones of the full parameters.
    """
    collector = state.collector
    if group is None or dist.get_world_size(group) == 1:
        kept = [(w, t) for w, t in zip(params, pieces) if t is not None]
        if kept:
            keys = [_key(collector, family, w, t, micro) for w, t in kept]
            collector.record(keys, [t for _, t in kept])
        return
    if not params:
        return
    # Every rank gathers on the device the group's backend needs, whether or not it holds pieces.
    device = collective_device(group)
    rows = piece_records(state, pieces, device)
    ranks = dist.get_world_size(group)
    # Concatenated along dim 0: the layout every backend accepts (gloo rejects a stacked output).
    gathered = torch.empty((ranks * rows.shape[0], rows.shape[1]), dtype=rows.dtype, device=device)
    with not_monitored():  # trainmon's own collective is not part of the training's communication
        _all_gather_single(gathered, rows, group)
    # A rank that holds nothing of a parameter (not even an empty piece, see adapters.base) labels it with
    # the dtype of the pieces it does hold (one family's pieces share a dtype: fp32 main params, fp32
    # moments), so every rank writes the same. Only a rank holding nothing of any of them falls back to the
    # parameter's dtype.
    some = next((t for t in pieces if t is not None), None)
    keys = [_key(collector, family, w, t if t is not None else some, micro) for w, t in zip(params, pieces)]
    collector.record_rows(keys, merge_gathered(gathered.view(ranks, *rows.shape)))


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
