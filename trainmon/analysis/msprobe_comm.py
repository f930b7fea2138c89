"""The `Distributed.<op>.<n>.forward` entries of an msprobe dump.json as trainmon `comm` records, so that
cross_rank can follow NaN/Inf from rank to rank through them.

What msprobe's dump.json format records of a distributed call: `input_args`/`input_kwargs` are its
arguments before the call and `output` is the same arguments (args, then kwargs values) after it, so an
in-place collective's result is there; arguments whose content before the call means nothing (receive
buffers, gather outputs) are written as null. A process group argument is
`{"type": "torch.ProcessGroup", "group_ranks": [...], "group_id": "<hash of the ranks>"}`, an int is
`{"type": "int", "value": v}`, and batch_isend_irecv's list holds
`{"class_type": "torch.distributed.P2POp", "tensor", "op", "peer", "group_id"}`.

Record names are collective_ops' names: `<op>[<group ranks>]@<group>#<seq>` with the recorded group_id
as group, and `seq` counting the calls of that op on that group within the step (every member makes them
in the same order); p2p `<op>[<src>-><dst>]@<group>#<seq>`, counted per direction. A call that names no
group ran on torch's default group, whose ranks dump.json does not hold: its group is `default` and its
ranks are left empty rather than guessed.
"""
from __future__ import annotations

import inspect
from typing import Optional

from trainmon.core.collective_ops import (BATCH_P2P, COLLECTIVES, P2P, SENDS, collective_name, compact_ranks,
                                             p2p_name, tensor_names)

DEFAULT_GROUP = "default"
# Older names msprobe still hooks, with the argument order of their successors.
_ALIASES = {"_all_gather_base": "all_gather_into_tensor", "_reduce_scatter_base": "reduce_scatter_tensor"}
_GAPS = {
    "no_group": "{n} distributed call(s) name no process group (torch's default group), whose ranks dump.json "
                "does not hold: they are matched across ranks by op and call order, with ranks shown as []",
    "no_peer": "{n} p2p call(s) (e.g. {where}) name no peer rank that dump.json records: they are left out of "
               "the cross-rank attribution",
    "batch_receive": "{n} batch_isend_irecv receive(s) (e.g. {where}): msprobe records their buffers before the "
                     "data arrives, so only the sent tensors of batch_isend_irecv are used",
}


def known_op(api: str) -> Optional[str]:
    """trainmon's name of a distributed api msprobe hooked, or None when it is not a collective or p2p op."""
    op = _ALIASES.get(api, api)
    return op if op in COLLECTIVES or op in P2P or op == BATCH_P2P else None


def is_tensor(value) -> bool:
    """Whether a dump.json value is a tensor's statistics."""
    return isinstance(value, dict) and ("Max" in value or "Min" in value)


class CommNamer:
    """Names the distributed calls of one rank's step, in dump.json order; collects what the dump lacks."""

    def __init__(self, rank: int):
        self.rank = rank
        self._seq: dict[tuple, int] = {}
        self.gaps: list[tuple[str, str]] = []  # (reason, where)

    def records(self, op: str, entry: dict, where: str) -> list[tuple[str, dict]]:
        """(record name, tensor statistics) of one call of `op` (see `known_op`); `where` names the entry
        in notes."""
        if op == BATCH_P2P:
            return self._batch(entry, where)
        before, after = _bind(op, entry)
        ranks, group = _group(before.get("group"))
        if op in COLLECTIVES:
            if ranks is None and group == DEFAULT_GROUP:
                self.gaps.append(("no_group", where))
            base = collective_name(op, compact_ranks(ranks or []), group, self._next(op, group))
            inputs = [t for t in COLLECTIVES[op].inputs(before) if is_tensor(t)]
            outputs = [t for t in COLLECTIVES[op].outputs(after) if is_tensor(t)]
            return _named(base, "input", inputs) + _named(base, "output", outputs)
        sends = op in SENDS
        peer = _peer(before, "dst" if sends else "src", ranks)
        if peer is None:
            self.gaps.append(("no_peer", where))
            return []
        src, dst = (self.rank, peer) if sends else (peer, self.rank)
        base = p2p_name(op, src, dst, group, self._next("p2p", group, src, dst))
        # The sent tensor is as it was before the call; the received one only after it.
        io, tensor = ("input", before.get("tensor")) if sends else ("output", after.get("tensor"))
        return _named(base, io, [tensor] if is_tensor(tensor) else [])

    def _batch(self, entry: dict, where: str) -> list[tuple[str, dict]]:
        ops = (entry.get("input_args") or [None])[0]
        named = []
        for p2p in ops if isinstance(ops, list) else []:
            if not isinstance(p2p, dict):
                continue
            sends, peer = p2p.get("op") in SENDS, _int(p2p.get("peer"))
            if peer is None:
                self.gaps.append(("no_peer", where))
                continue
            src, dst = (self.rank, peer) if sends else (peer, self.rank)
            group = str(p2p.get("group_id") or DEFAULT_GROUP)
            # Receives still take their number, so that both ends of a direction count alike.
            base = p2p_name("isend" if sends else "irecv", src, dst, group, self._next("p2p", group, src, dst))
            if not sends:
                self.gaps.append(("batch_receive", where))
            elif is_tensor(p2p.get("tensor")):
                named += _named(base, "input", [p2p["tensor"]])
        return named

    def _next(self, *key) -> int:
        seq = self._seq.get(key, 0)
        self._seq[key] = seq + 1
        return seq


def gap_notes(gaps: list[tuple[str, str]]) -> list[str]:
    """One report note per kind of gap, with its count and first place."""
    notes = []
    for reason, text in _GAPS.items():
        places = [where for kind, where in gaps if kind == reason]
        if places:
            notes.append("msprobe dump: " + text.format(n=len(places), where=places[0]))
    return notes


def _named(base: str, io: str, tensors: list[dict]) -> list[tuple[str, dict]]:
    return list(zip(tensor_names(base, io, len(tensors)), tensors)) if tensors else []


def _bind(op: str, entry: dict) -> tuple[dict, dict]:
    """{parameter name: recorded value} before and after the call, by torch's signature of `op`."""
    import torch.distributed as dist  # here: reading a dump without collectives needs no torch

    args, kwargs = entry.get("input_args") or [], entry.get("input_kwargs") or {}
    after = entry.get("output") or []
    try:
        names = list(inspect.signature(getattr(dist, op)).parameters)
    except (AttributeError, TypeError, ValueError):  # a torch build without this op
        names = []
    before = dict.fromkeys(names) | dict(zip(names, args)) | dict(kwargs)
    after = dict.fromkeys(names) | dict(zip(names, after[:len(args)])) | dict(zip(kwargs, after[len(args):]))
    return before, after


def _group(value) -> tuple[Optional[list[int]], str]:
    """(global ranks or None, group id) of a recorded process group argument."""
    if isinstance(value, dict) and value.get("type") == "torch.ProcessGroup":
        ranks = value.get("group_ranks")
        ranks = ranks if isinstance(ranks, list) and all(isinstance(r, int) for r in ranks) else None
        return ranks, str(value.get("group_id") or "unrecorded")
    return None, DEFAULT_GROUP


def _peer(bound: dict, key: str, ranks: Optional[list[int]]) -> Optional[int]:
    """The global peer rank: `dst`/`src`, or `group_dst`/`group_src` (a rank within the group)."""
    peer = _int(bound.get(key))
    if peer is not None:
        return peer
    local = _int(bound.get(f"group_{key}"))
    return ranks[local] if local is not None and ranks and 0 <= local < len(ranks) else None


def _int(value) -> Optional[int]:
    if isinstance(value, dict) and value.get("type") == "int":
        value = value.get("value")
    return value if isinstance(value, int) and not isinstance(value, bool) else None
