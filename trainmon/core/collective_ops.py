"""Which tensors of each torch.distributed collective and p2p op are its inputs and outputs, and how
records of them are named so that the same call can be found on every rank of its group.

A collective's name is `<op>[<group ranks>]@<group name>#<seq>`, with `seq` counting the calls on that
process group within the step (every member calls the group's collectives in the same order, so the
numbers agree across ranks) and the group name (torch's, the same on every rank) telling apart groups
of the same ranks. A p2p op's name is `<op>[<src>-><dst>]@<group name>#<seq>`, counted per direction,
so a send and the matching receive carry the same `[src->dst]@g#seq`. Tensor suffix: `.input` /
`.output`, with `_<i>` when the op takes a list.
"""
from __future__ import annotations

import re
from typing import Callable, NamedTuple, Optional


class OpSpec(NamedTuple):
    inputs: Callable[[dict], list]
    outputs: Callable[[dict], list]


def _one(key):
    return lambda a: [a[key]]


def _many(key):
    return lambda a: list(a[key] or [])


# Arguments as bound to the torch 2.x signatures (inspect.signature(...).bind + apply_defaults).
COLLECTIVES: dict[str, OpSpec] = {
    "all_reduce": OpSpec(_one("tensor"), _one("tensor")),
    "broadcast": OpSpec(_one("tensor"), _one("tensor")),
    "reduce": OpSpec(_one("tensor"), _one("tensor")),
    "all_gather": OpSpec(_one("tensor"), _many("tensor_list")),
    "all_gather_into_tensor": OpSpec(_one("input_tensor"), _one("output_tensor")),
    "reduce_scatter": OpSpec(_many("input_list"), _one("output")),
    "reduce_scatter_tensor": OpSpec(_one("input"), _one("output")),
    "gather": OpSpec(_one("tensor"), _many("gather_list")),
    "scatter": OpSpec(_many("scatter_list"), _one("tensor")),
    "all_to_all": OpSpec(_many("input_tensor_list"), _many("output_tensor_list")),
    "all_to_all_single": OpSpec(_one("input"), _one("output")),
    "all_reduce_coalesced": OpSpec(_many("tensors"), _many("tensors")),
    # torch >= 2.13 names the flat-tensor ops *_single (FSDP2 calls them); the others' older spellings
    "all_gather_single": OpSpec(_one("input_tensor"), _one("output_tensor")),
    "reduce_scatter_single": OpSpec(_one("input"), _one("output")),
    "_all_gather_base": OpSpec(_one("input_tensor"), _one("output_tensor")),
    "_reduce_scatter_base": OpSpec(_one("input"), _one("output")),
}
# p2p ops: whether the tensor is sent (an input) or received (an output).
SENDS = ("send", "isend")
RECEIVES = ("recv", "irecv")
P2P = SENDS + RECEIVES
BATCH_P2P = "batch_isend_irecv"
ALL_OPS = tuple(COLLECTIVES) + P2P + (BATCH_P2P,)

_NAME = re.compile(r"^(?P<op>\w+)\[(?P<group>[^\]]*)\]@(?P<group_name>[^#]*)#(?P<seq>\d+)"
                   r"\.(?P<io>input|output)(?:_(?P<index>\d+))?$")


def compact_ranks(ranks) -> str:
    """Global ranks as `a-b` (consecutive), `a-b:s` (stride s) or `a,b,c`: short even for big groups."""
    ranks = list(ranks)
    if len(ranks) > 2:
        stride = ranks[1] - ranks[0]
        if stride > 0 and all(b - a == stride for a, b in zip(ranks, ranks[1:])):
            return f"{ranks[0]}-{ranks[-1]}" + ("" if stride == 1 else f":{stride}")
    return ",".join(str(r) for r in ranks)


def expand_ranks(text: str) -> list[int]:
    """Inverse of compact_ranks."""
    if not text:
        return []
    if "-" in text and "," not in text:
        span, _, stride = text.partition(":")
        first, last = (int(x) for x in span.split("-"))
        return list(range(first, last + 1, int(stride or 1)))
    return [int(x) for x in text.split(",")]


def collective_name(op: str, ranks_text: str, group_name: str, seq: int) -> str:
    return f"{op}[{ranks_text}]@{group_name}#{seq}"


def p2p_name(op: str, src: int, dst: int, group_name: str, seq: int) -> str:
    return f"{op}[{src}->{dst}]@{group_name}#{seq}"


def tensor_names(base: str, io: str, count: int) -> list[str]:
    return [f"{base}.{io}"] if count == 1 else [f"{base}.{io}_{i}" for i in range(count)]


def parse_comm_name(name: str) -> Optional[dict]:
    """{op, ranks (global; for p2p [src, dst]), src, dst (p2p only), group, seq, io, index} of a `comm`
    record name, or None when `name` is not one."""
    match = _NAME.match(name)
    if match is None:
        return None
    out = {"op": match["op"], "group": match["group_name"], "seq": int(match["seq"]), "io": match["io"],
           "index": int(match["index"]) if match["index"] is not None else None}
    group = match["group"]
    if "->" in group:
        src, dst = group.split("->")
        out.update(src=int(src), dst=int(dst), ranks=[int(src), int(dst)])
    else:
        out["ranks"] = expand_ranks(group)
    return out
