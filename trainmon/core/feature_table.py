"""The values the one-value families hold (msprobe's L2 features, the MoE load), and which way each goes wrong.

A record of these families is named `<module>.<value>` (trainmon.core.records.FEATURE_FAMILIES); the view summarises
each value by its worst over the modules of a layer and over the ranks: the smallest where a fall is the failure
(an attention or router entropy collapsing, a weight losing rank), else the largest.
"""
from __future__ import annotations

from typing import NamedTuple

from trainmon.core.records import ATTENTION_HOOK, LINEAR_HOOK, MOE_LOAD, MOE_ROUTER_LOGIT_HOOK, MOE_ROUTER_WEIGHT_HOOK


class Value(NamedTuple):
    name: str
    low_is_worse: bool
    doc: str


VALUES: dict[str, tuple[Value, ...]] = {
    ATTENTION_HOOK: (Value("entropy", True, "mean entropy of a causal attention row (head 0 of sequence 0)"),
                     Value("softmax_max", False, "mean of the rows' largest attention probability"),
                     Value("max_logit", False, "largest causal attention logit, QKᵀ/√d")),
    LINEAR_HOOK: (Value("sr", True, "stable rank, ‖W‖_F / kernel_norm"),
                  Value("kernel_norm", False, "largest singular value (three power iterations)")),
    MOE_ROUTER_WEIGHT_HOOK: (Value("router_weight_similarity", False,
                                   "mean cosine similarity of the experts' router weights"),),
    MOE_ROUTER_LOGIT_HOOK: (Value("per_token_expert_entropy", True,
                                  "mean entropy of a token's softmax over the experts"),),
    MOE_LOAD: (Value("imbalance", False, "largest expert load over the mean load"),
               Value("idle_experts", False, "experts that received no token"),
               Value("dropped_tokens", False, "routes dropped by the experts' capacity"),
               Value("router_entropy", True, "mean entropy of a token's softmax over the experts")),
}


def names(family: str) -> tuple[str, ...]:
    return tuple(value.name for value in VALUES[family])


def low_is_worse(family: str, name: str) -> bool:
    return any(v.name == name and v.low_is_worse for v in VALUES.get(family, ()))
