"""msprobe's tag scheme, shared by the api and TensorBoard outputs."""
from __future__ import annotations

from typing import Optional

from trainmon.core.records import (ACTIVATION_FAMILIES, GRAD_REDUCED, GRAD_UNREDUCED, RecordKey)

# msprobe names the weight-grad families pre_grad / post_grad in its tags.
_TAG_FAMILY = {GRAD_UNREDUCED: "pre_grad", GRAD_REDUCED: "post_grad"}


def tag_of(key: RecordKey, rank: int) -> str:
    """`{vpp}:{module}.{input|output}:{micro}/rank{R}/{actv|actv_grad}` for activations,
    `{vpp}:{param}/rank{R}/{family}` for the rest (with `:{micro}` when per micro-batch)."""
    return tag_for(key.family, key.name, key.vpp_stage, key.micro_step, rank)


def tag_for(family: str, name: str, vpp_stage: int, micro_step: Optional[int], rank: int) -> str:
    """`tag_of` from the parts of a key (for readers that have no RecordKey)."""
    tag_family = _TAG_FAMILY.get(family, family)
    if family in ACTIVATION_FAMILIES or micro_step is not None:
        return f"{vpp_stage}:{name}:{micro_step}/rank{rank}/{tag_family}"
    return f"{vpp_stage}:{name}/rank{rank}/{tag_family}"


def split_tag(tag: str) -> tuple[str, int]:
    """(family, rank) named by a tag of `tag_of`, e.g. "0:fc.weight/rank3/pre_grad" -> ("grad_unreduced", 3).

    Raises:
        ValueError: `tag` does not end in `/rank<R>/<family>`.
    """
    head, _, family = tag.rpartition("/")
    rank = head.rpartition("/")[2]
    families = {v: k for k, v in _TAG_FAMILY.items()}
    if not rank.startswith("rank") or not rank[4:].isdigit() or not family:
        raise ValueError(f"{tag!r} is not a trainmon/msprobe tag: expected '<vpp>:<name>[:<micro>]/rank<R>/<family>'")
    return families.get(family, family), int(rank[4:])
