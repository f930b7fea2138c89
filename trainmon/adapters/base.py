"""What the monitor core needs from a training framework, and the plain-PyTorch answer to it.

The core (grad hooks, optimizer hooks, the shard merge) never looks at framework objects. An adapter
maps the framework's own bookkeeping (DDP buckets, ZeRO partitions, Megatron grad buffers, FSDP
DTensors) onto four questions, each answered per watched parameter with *this rank's piece* of a
tensor, or None when the rank holds nothing of it. A rank that holds a duplicate another rank counts
(or only padding) gives an empty tensor of the tensor's dtype: it adds nothing to the merged record and
labels it as the counting rank does.

- which tensor is the reduced gradient the optimizer consumes (after loss-scale unscaling and clipping),
  and in which call of the inner torch optimizer's step it is consumed,
- which tensor is the (main, fp32 when kept) weight,
- which tensors are the Adam moments, with the step and hyper-parameters to bias-correct them,
- where the gradient is seen before its reduction.

A parameter's reduced-grad piece and its Adam-moment pieces cover the same elements, in the same order
(`mg_direction` compares them element by element).

When pieces are shards, a parameter's `merge_over` names the process groups whose ranks' pieces make
up the whole parameter (the groups of one parameter, one after another, span a product of groups such
as tensor × data parallel); the core merges the pieces' records across them (see `shard_merge`), never
the tensors. Parameters may merge over different groups: Megatron's experts over the expert groups,
the rest over the dense ones.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Callable, Optional, Protocol, Sequence

import torch

# How the core captures unreduced grads when the adapter has no capture point of its own:
ACCUMULATED = "accumulated"  # the accumulated grad, at the end of the last micro-batch's backward
PER_MICRO_BATCH = "per_micro_batch"  # each backward pass's contribution, before accumulation
ADAPTER = "adapter"  # the adapter's own capture point (install_unreduced), once per step
# The adapter's own capture point, called in every backward pass: the core records under its micro-step.
ADAPTER_PER_MICRO_BATCH = "adapter, per micro-batch"
NOT_RECORDED = "not recorded"  # the framework offers no point where they can be seen (said once at set-up)


@dataclass(frozen=True)
class WatchedParam:
    """A model parameter as the monitor names it.

    `shape` is the full parameter's shape when the local tensor is a shard (else None: use the tensor's).
    `merge_over` holds the process groups across which this rank's pieces merge into the whole parameter's
    records, in the order they are merged (empty: every rank holds the whole tensor). The adapter's
    `prepare` sets both.
    """

    name: str
    param: torch.nn.Parameter
    vpp_stage: int
    shape: Optional[tuple] = None
    merge_over: tuple = ()


@dataclass(frozen=True)
class AdamPiece:
    """This rank's piece of one parameter's Adam state, with what bias correction needs."""

    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: object  # tensor or number
    betas: tuple
    eps: float


# What an adapter's capture point calls: records `pieces[i]` (this rank's piece of `params[i]`, or None)
# as unreduced grads, merged across the process groups of the third argument (a tuple; None: not merged).
UnreducedRecorder = Callable[[Sequence[WatchedParam], Sequence[Optional[torch.Tensor]], Optional[tuple]], None]


class TrainingAdapter(Protocol):
    """The narrow interface between the monitor core and one training framework."""

    name: str
    unreduced_capture: str  # ACCUMULATED, PER_MICRO_BATCH, ADAPTER, ADAPTER_PER_MICRO_BATCH or NOT_RECORDED

    def describe(self) -> dict:
        """Parallel coordinates of this rank (global rank, tp/pp/dp/vpp ranks, group ranks) for run.json."""

    def pp_stage(self) -> int:
        """This rank's pipeline stage (0 without pipeline parallelism)."""

    def rename(self, vpp_stage: int, name: str) -> str:
        """The name written for a module or parameter of chunk `vpp_stage` (e.g. global layer numbers)."""

    def prepare(self, params: list[WatchedParam]) -> list[WatchedParam]:
        """Returns `params` with full shapes and merge groups filled in where the local tensors are shards."""

    def install_unreduced(self, params: list[WatchedParam], record: UnreducedRecorder) -> None:
        """Installs the capture point of unreduced grads (only when unreduced_capture is ADAPTER or
        ADAPTER_PER_MICRO_BATCH)."""

    def remove(self) -> None:
        """Undoes install_unreduced."""

    def step_owner(self):
        """The object whose `step()` is one monitor step (a torch optimizer, or a framework's wrapper)."""

    def reduced_grads(self, params: Sequence[WatchedParam]) -> list[Optional[torch.Tensor]]:
        """This rank's pieces of the grads the update consumes (unscaled and clipped), read when the inner
        step that consumes them starts (the step owner's own step when there is no inner one)."""

    def inner_steps(self, params: Sequence[WatchedParam]) -> Optional["InnerSteps"]:
        """The torch optimizers inside the step owner whose step consumes the grads, and in which of their
        calls each parameter's grad is consumed; None when the step owner is that optimizer itself."""

    def skipped_grads(self, params: Sequence[WatchedParam]) -> list[Optional[torch.Tensor]]:
        """This rank's pieces of the grads of a step the framework skips (a non-finite grad or norm), as
        it holds them when it skips: at its skip point (`watch_skips`), or when its step returns."""

    def watch_skips(self, on_skip: Callable[[], None]) -> Callable[[], None]:
        """Calls `on_skip()` where the framework skips a step, before it clears the grads; returns the undo."""

    def clipping(self, step_result) -> Optional[tuple]:
        """(total grad norm before clipping, max norm) of a step the framework's optimizer clipped, from
        that optimizer and what its `step()` returned; None where it does not clip."""

    def main_params(self, params: Sequence[WatchedParam]) -> list[Optional[torch.Tensor]]:
        """This rank's pieces of the weights the optimizer updates."""

    def adam_pieces(self, params: Sequence[WatchedParam]) -> list[Optional[AdamPiece]]:
        """This rank's pieces of the Adam moments, read just after the optimizer step."""


@dataclass(frozen=True)
class InnerSteps:
    """Where grads are consumed inside a framework's step: `optimizers` (torch optimizers; their step()
    calls are counted together, from 0, within one step of the step owner) and `call_of[i]`, the call
    that consumes parameter i's grad. Every rank makes the same calls, so records merge in step."""

    optimizers: Sequence[torch.optim.Optimizer]
    call_of: Sequence[int]


def no_skip_point(on_skip: Callable[[], None]) -> Callable[[], None]:
    """`watch_skips` of a framework whose skipped grads are still there when its step returns."""
    return lambda: None


@dataclass
class PlainAdapter:
    """Plain PyTorch: whole tensors on every rank (single process, or replicated weights and grads).

    Args:
        optimizer: a torch optimizer keeping per-parameter state, or any object with a `step()`: Adam
            moments are read where it keeps them as torch optimizers do (`state`, `param_groups`).
        unreduced_capture: how the core captures unreduced grads.
    """

    optimizer: torch.optim.Optimizer
    unreduced_capture: str = ACCUMULATED
    name: str = "plain"
    _group_of: dict = field(default_factory=dict)

    def describe(self) -> dict:
        return data_parallel_coordinates(None)

    def pp_stage(self) -> int:
        return 0

    def rename(self, vpp_stage: int, name: str) -> str:
        return name

    def prepare(self, params: list[WatchedParam]) -> list[WatchedParam]:
        groups = getattr(self.optimizer, "param_groups", None) or ()
        self._group_of = {id(p): g for g in groups for p in g.get("params", ())}
        return params

    def install_unreduced(self, params, record) -> None:
        raise AssertionError(f"{self.name} adapter has no own capture point")

    def remove(self) -> None:
        pass

    def step_owner(self):
        return self.optimizer

    def reduced_grads(self, params):
        return [w.param.grad for w in params]

    def inner_steps(self, params):
        return None

    def skipped_grads(self, params):
        return self.reduced_grads(params)

    def watch_skips(self, on_skip):
        return no_skip_point(on_skip)

    def clipping(self, step_result):
        return None

    def main_params(self, params):
        return [w.param.detach() for w in params]

    def adam_pieces(self, params):
        states = getattr(self.optimizer, "state", None)
        if not isinstance(states, Mapping):
            return [None] * len(params)
        out = []
        for w in params:
            state = states.get(w.param, {})
            if "exp_avg" not in state:
                out.append(None)
                continue
            group = self._group_of.get(id(w.param), self.optimizer.defaults)
            out.append(AdamPiece(state["exp_avg"], state["exp_avg_sq"], state["step"], tuple(group["betas"]),
                                 group["eps"]))
        return out


def data_parallel_coordinates(group) -> dict:
    """Global rank and world size, and this rank's place in `group` (the world when None)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return {"global_rank": 0, "world_size": 1, "dp": {"rank": 0, "size": 1, "ranks": [0]}}
    return {"global_rank": dist.get_rank(), "world_size": dist.get_world_size(), "dp": group_coordinates(group)}


def group_coordinates(group) -> dict:
    """{rank, size, ranks} of this process in `group` (global ranks in `ranks`)."""
    import torch.distributed as dist

    return {"rank": dist.get_rank(group), "size": dist.get_world_size(group),
            "ranks": list(dist.get_process_group_ranks(group or dist.group.WORLD))}


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's piece of `tensor`: a DTensor's local shard (a view, no copy), any other tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor
