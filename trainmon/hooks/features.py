"""msprobe's L2 features, computed on the tensors' device without a host synchronisation.

The formulas are msprobe 26.2's (`msprobe/pytorch/monitor/features.py`), so that a feature means what it means
there; they differ only where msprobe waits for the host (`.item()`, `if tensor > 0`), which becomes a `where`
with the same result, and in two choices said below (the power iteration's start vector and its products).

- Attention (`attention_features`): from one head of one sequence, as msprobe reads it (head 0 of batch element
  0), the causal QKᵀ/√d; the mean per query of the entropy of its softmax row and of the row's largest
  probability (`entropy`, `softmax_max`), and the largest logit (`max_logit`, trainmon's: the logit growth that
  precedes attention entropy collapse).
- A linear weight (`stable_rank`): its largest singular value by three power iterations on WᵀW (`kernel_norm`)
  and ‖W‖_F / kernel_norm (`sr`; both 0 for a zero weight).
- A router's weight (`router_weight_similarity`): the mean cosine similarity of the experts' weight vectors.
- A router's logits (`per_token_expert_entropy`): the mean over tokens of the entropy of their softmax over experts.
"""
from __future__ import annotations

import functools
import math

import torch

from trainmon.core import feature_table
from trainmon.core.records import ATTENTION_HOOK, LINEAR_HOOK, MOE_ROUTER_LOGIT_HOOK, MOE_ROUTER_WEIGHT_HOOK

# The features of each hook of `l2_targets`, in the order a hook's values come.
ATTENTION_FEATURES = feature_table.names(ATTENTION_HOOK)
LINEAR_FEATURES = feature_table.names(LINEAR_HOOK)
ROUTER_WEIGHT_FEATURES = feature_table.names(MOE_ROUTER_WEIGHT_HOOK)
ROUTER_LOGIT_FEATURES = feature_table.names(MOE_ROUTER_LOGIT_HOOK)
# msprobe draws the power iteration's start from the global generator at every call, which changes the training's
# random stream; this start is drawn once per module from a generator of its own seeded with this, so a change of
# `kernel_norm` from step to step is the weight's, not the draw's (msprobe's call after torch.manual_seed(this)
# draws the same vector).
POWER_ITERATION_SEED = 0
POWER_ITERATIONS = 3  # msprobe's max_eigenvalue


def qk_head(q: torch.Tensor, k: torch.Tensor, order: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The [s, d] q and k of head 0 of batch element 0, in layout `order` ("s,b,h,d" or "b,s,h,d")."""
    if order == "s,b,h,d":
        return q[:, 0, 0, :], k[:, 0, 0, :]
    return q[0, :, 0, :], k[0, :, 0, :]


@functools.lru_cache(maxsize=16)
def _causal(n: int, device: torch.device) -> torch.Tensor:
    """The [n, n] lower-triangular mask (cached: made once per sequence length and device)."""
    return torch.ones(n, n, dtype=torch.bool, device=device).tril()


def attention_features(q: torch.Tensor, k: torch.Tensor, order: str) -> torch.Tensor:
    """fp32 [entropy, softmax_max, max_logit] of the causal attention of head 0 of batch element 0."""
    qh, kh = qk_head(q, k, order)
    qkt = torch.matmul(qh.float(), kh.float().t()) / q.shape[-1] ** 0.5
    keep = _causal(qkt.shape[1], qkt.device)
    max_logit = qkt.masked_fill(~keep[: qkt.shape[0]], -math.inf).amax()
    shifted = (qkt - qkt.amax(dim=1, keepdim=True)).masked_fill(~keep[: qkt.shape[0]], -math.inf)
    p = torch.softmax(shifted, dim=1)
    softmax_max = p.amax(dim=1).mean()
    log_p = torch.where(p > 0, torch.log(p), torch.zeros((), device=p.device))
    entropy = (-(p * log_p).sum(dim=1)).mean()
    return torch.stack([entropy, softmax_max, max_logit])


def power_iteration_start(columns: int, device: torch.device) -> torch.Tensor:
    """The unit start vector of `stable_rank` for a weight of `columns` columns (see POWER_ITERATION_SEED)."""
    start = torch.randn(columns, generator=torch.Generator().manual_seed(POWER_ITERATION_SEED))
    return (start / start.norm()).to(device)


def stable_rank(weight: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """fp32 [sr, kernel_norm] of a 2-D weight. msprobe multiplies by the matrix WᵀW; here W and Wᵀ are applied in
    turn (the same vectors up to rounding, without a columns² product)."""
    w = weight.detach().float()
    u = start
    estimate = torch.zeros((), device=w.device)
    for _ in range(POWER_ITERATIONS):
        v = torch.mv(w.t(), torch.mv(w, u))
        estimate = torch.dot(v, u)
        norm = v.norm()
        # msprobe stops with 0 once W u is 0: u stays 0 here, and so do the later estimates
        u = torch.where(norm > 0, v / norm.clamp_min(torch.finfo(v.dtype).tiny), torch.zeros_like(v))
    kernel_norm = estimate.clamp_min(0).sqrt()
    sr = torch.where(kernel_norm > 0, torch.linalg.vector_norm(w) / kernel_norm, torch.zeros_like(kernel_norm))
    return torch.stack([sr, kernel_norm])


def expert_axis_first(weight: torch.Tensor) -> bool:
    """Whether a router weight holds one expert per row (nn.Linear's [experts, hidden]): msprobe takes the shorter
    dimension for the experts."""
    return weight.shape[0] < weight.shape[1]


@functools.lru_cache(maxsize=16)
def _upper(n: int, device: torch.device) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool, device=device).triu(1)


def router_weight_similarity(weight: torch.Tensor) -> torch.Tensor:
    """fp32 [mean cosine similarity of the experts' weight vectors] (0 with fewer than 2 experts)."""
    w = weight.detach().float()
    w = w.t() if expert_axis_first(w) else w  # [hidden, experts]
    experts = w.shape[1]
    if experts < 2:
        return torch.zeros(1, device=w.device)
    unit = torch.nn.functional.normalize(w, p=2, dim=0)
    return (unit.t() @ unit)[_upper(experts, w.device)].mean().reshape(1)


def per_token_expert_entropy(logits: torch.Tensor) -> torch.Tensor:
    """fp32 [mean over tokens of the entropy of the softmax over the last dimension] (experts masked with -inf
    count 0, as in msprobe)."""
    flat = logits.detach().float().reshape(-1, logits.shape[-1])
    gates = torch.softmax(flat, dim=-1)
    entropy = -torch.nansum(gates * torch.log(gates), dim=-1)
    return (entropy.sum() / max(flat.shape[0], 1)).reshape(1)
