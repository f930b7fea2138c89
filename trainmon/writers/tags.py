"""msprobe's tag scheme, shared by the api and TensorBoard outputs."""
from __future__ import annotations

from trainmon.monitor.records import (ACTIVATION_FAMILIES, GRAD_REDUCED, GRAD_UNREDUCED, RecordKey)

# msprobe names the weight-grad families pre_grad / post_grad in its tags.
_TAG_FAMILY = {GRAD_UNREDUCED: "pre_grad", GRAD_REDUCED: "post_grad"}


def tag_of(key: RecordKey, rank: int) -> str:
    """`{vpp}:{module}.{input|output}:{micro}/rank{R}/{actv|actv_grad}` for activations,
    `{vpp}:{param}/rank{R}/{family}` for the rest (with `:{micro}` when per micro-batch)."""
    family = _TAG_FAMILY.get(key.family, key.family)
    if key.family in ACTIVATION_FAMILIES or key.micro_step is not None:
        return f"{key.vpp_stage}:{key.name}:{key.micro_step}/rank{rank}/{family}"
    return f"{key.vpp_stage}:{key.name}/rank{rank}/{family}"
