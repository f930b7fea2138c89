"""Megatron-Core: DistributedDataParallel grad buffers and Megatron optimizers (DistributedOptimizer too).

- Unreduced grads are the `main_grad`s (views into the grad buffer) when a bucket group starts its
  grad sync: the accumulated local grad, before scaling and before the data-parallel collective.
- Reduced grads are what the inner torch optimizer consumes: the fp32 main params' `.grad` when its step
  starts, after Megatron has copied them from `main_grad`, unscaled them and clipped them (it prepares and
  clips every chained optimizer's grads before stepping any). Under DistributedOptimizer the main param
  is this data-parallel rank's range of the parameter, so that range is the piece. A step skipped for a
  non-finite grad (found_inf under loss scaling) never reaches the inner step: its grads, unscaled, are
  read when Megatron's step returns. `clipping` gives the norm that step() returns and `clip_grad`.
- Main params and Adam state come from the optimizer: the fp32 main param (a shard under
  DistributedOptimizer, mapped back by its range map) and the inner torch optimizer's state of it.
- Names, the pipeline stage, coordinates and the unreduced-grad capture are the model's (`megatron_model`).
- Tensor-parallel shards merge across the TP group; TP duplicates (layer norms) count on TP rank 0
  only; without DistributedOptimizer the data-parallel replicas count on DP rank 0 only. Pieces
  therefore merge over the tensor-and-data-parallel group of the pipeline stage. The ranks that do not
  count a tensor pass an empty piece of it, so every rank labels the record with the tensor's dtype.
- Experts (parameters Megatron marks `allreduce=False` under expert parallelism) have groups of their
  own (`megatron_model.ParallelAxes`): each expert-parallel rank holds other experts, split over the
  expert TP group and replicated (or, under DistributedOptimizer, sharded) over the expert DP group, so
  their pieces merge over those two groups, and each rank records its own experts.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from trainmon.adapters.base import ADAPTER, AdamPiece, InnerSteps, WatchedParam, no_skip_point
from trainmon.adapters.megatron_model import GradBufferCapture, MegatronPlacement


def is_megatron_optimizer(optimizer) -> bool:
    return type(optimizer).__module__.startswith("megatron.core.optimizer")


@dataclass(frozen=True)
class _Location:
    """Where the optimizer keeps one model parameter."""

    main: torch.Tensor  # fp32 main param (a flat shard under DistributedOptimizer)
    inner: torch.optim.Optimizer
    group: dict
    grad_range: Optional[tuple]  # (start, end) of main_grad.view(-1) that this rank owns, or None: all of it
    counts: bool  # whether this rank's piece counts (`MegatronAdapter._locate`)


class MegatronAdapter(MegatronPlacement):
    """Args: optimizer (what get_megatron_optimizer returned), chunks (the DDP-wrapped model chunks)."""

    unreduced_capture = ADAPTER

    def __init__(self, optimizer, chunks: list[torch.nn.Module]):
        super().__init__(chunks)
        self.optimizer = optimizer
        self.optimizers = list(getattr(optimizer, "chained_optimizers", [optimizer]))
        self.distributed = any(type(o).__name__ == "DistributedOptimizer" for o in self.optimizers)
        self.name = "megatron ({})".format(", ".join(type(o).__name__ for o in self.optimizers))
        self._where: dict[int, _Location] = {}
        self._buffers = GradBufferCapture(chunks, lambda p: _counted(p.main_grad, self._counts_tp(p)),
                                          lambda p: (self.axes(p).tp_group,))

    # ------------------------------------------------------------------------------ mapping
    def prepare(self, params: list[WatchedParam]) -> list[WatchedParam]:
        self._where = {}
        for opt in self.optimizers:
            self._map_optimizer(opt)
        out = []
        for w in params:
            axes = self.axes(w.param)
            shape = list(w.param.shape)
            if getattr(w.param, "tensor_model_parallel", False):
                shape[w.param.partition_dim] *= axes.tp_size
            out.append(WatchedParam(w.name, w.param, w.vpp_stage, tuple(shape), axes.merge_over))
        return out

    def _map_optimizer(self, opt) -> None:
        inner = opt.optimizer
        group_of = {id(p): g for g in inner.param_groups for p in g["params"]}
        kind = type(opt).__name__
        if kind == "DistributedOptimizer":
            for model_param, (gi, go) in opt.model_param_group_index_map.items():
                main = inner.param_groups[gi]["params"][go]
                param_range = opt._get_model_param_range_map(model_param)["param"]
                self._locate(model_param, main, inner, inner.param_groups[gi], (param_range.start, param_range.end))
        elif kind == "Float16OptimizerWithFloat16Params":
            for model_group, main_group in zip(opt.float16_groups, opt.fp32_from_float16_groups):
                for model_param, main in zip(model_group, main_group):
                    self._locate(model_param, main, inner, group_of[id(main)], None)
            for group in opt.fp32_from_fp32_groups:
                for p in group:
                    self._locate(p, p, inner, group_of[id(p)], None)
        elif kind == "FP32Optimizer":
            for group in inner.param_groups:
                for p in group["params"]:
                    self._locate(p, p, inner, group, None)
        else:
            raise ValueError(f"set_monitor: Megatron optimizer {kind} is not supported; supported are "
                             "DistributedOptimizer, Float16OptimizerWithFloat16Params and FP32Optimizer")

    def _counts_tp(self, param) -> bool:
        """TP shards all count; a TP duplicate counts on (expert) TP rank 0 only."""
        return bool(getattr(param, "tensor_model_parallel", False)) or self.axes(param).tp_rank == 0

    def _locate(self, param, main: torch.Tensor, inner, group: dict, grad_range: Optional[tuple]) -> None:
        """Notes where the optimizer keeps `param`, and whether this rank's piece of it counts: whole replicas on
        every (expert) DP rank (no DistributedOptimizer) count on its DP rank 0 only."""
        counts = self._counts_tp(param) and (grad_range is not None or self.axes(param).dp_rank == 0)
        self._where[id(param)] = _Location(main, inner, group, grad_range, counts)

    # ------------------------------------------------------------------------------- pieces
    def step_owner(self):
        return self.optimizer

    def reduced_grads(self, params):
        out = []
        for w in params:
            where = self._where.get(id(w.param))
            grad = where.main.grad if where is not None else None
            out.append(_counted(grad, where.counts) if grad is not None else None)
        return out

    def inner_steps(self, params):
        inner = [o.optimizer for o in self.optimizers if getattr(o, "optimizer", None) is not None]
        return InnerSteps(inner, [0] * len(params))

    def skipped_grads(self, params):
        return self.reduced_grads(params)

    def watch_skips(self, on_skip):
        return no_skip_point(on_skip)

    def clipping(self, step_result):
        max_norm = getattr(getattr(self.optimizer, "config", None), "clip_grad", 0.0)
        if not max_norm or not isinstance(step_result, tuple) or len(step_result) < 2:
            return None
        applied, norm = step_result[0], step_result[1]  # (update applied, grad norm, zeros in grads)
        return (norm, max_norm) if applied and norm is not None else None

    def main_params(self, params):
        return [_counted(where.main, where.counts)
                if (where := self._where.get(id(w.param))) is not None else None for w in params]

    def adam_pieces(self, params):
        out = []
        for w in params:
            where = self._where.get(id(w.param))
            state = where.inner.state.get(where.main, {}) if where is not None else {}
            if "exp_avg" not in state:
                out.append(None)
                continue
            out.append(AdamPiece(_counted(state["exp_avg"], where.counts), _counted(state["exp_avg_sq"], where.counts),
                                 state["step"], tuple(where.group["betas"]), where.group["eps"]))
        return out

    # ---------------------------------------------------------------------- unreduced grads
    def install_unreduced(self, params, record) -> None:
        self._buffers.install_unreduced(params, record)

    def remove(self) -> None:
        self._buffers.remove()


def _counted(tensor: torch.Tensor, counts: bool) -> torch.Tensor:
    """`tensor` where this rank counts it; else an empty tensor of its dtype, which adds nothing to the
    merged record but gives it the label that the counting rank gives it."""
    return tensor if counts else tensor.new_empty(0)
