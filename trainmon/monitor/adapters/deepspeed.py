"""DeepSpeed ZeRO 1/2/3 and BF16_Optimizer: pieces from the local partitions, mapped to parameter names.

ZeRO 1/2 and BF16_Optimizer keep one flat fp32 partition per param group and rank; each model
parameter's `_hp_mapping` (DeepSpeed's fragment bookkeeping) holds views of its fragment in that
partition: the fp32 weight (`hp_fragment`), the optimizer state (`optim_fragment`) and, between
backward and step, the reduced grad (`get_lp_grad_fragment`). ZeRO-3 keeps the same per parameter
(`ds_id`), padded at the end of the last rank's partition. All of these are views: nothing is copied
or gathered, and the pieces' records merge across the data-parallel group.

A monitor step is one call of the ZeRO optimizer's `step()` (what `engine.step()` runs at the end of
an accumulation cycle); reduced grads are read when it starts, before clipping (as
`safe_get_full_grad` sees them), weights and moments when it returns.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from trainmon.monitor.adapters.base import (ACCUMULATED, PER_MICRO_BATCH, AdamPiece, WatchedParam,
                                            data_parallel_coordinates)


def is_deepspeed_optimizer(optimizer) -> bool:
    return type(optimizer).__module__.startswith("deepspeed.runtime.")


class DeepSpeedAdapter:
    """Args: optimizer, the ZeRO optimizer (or BF16_Optimizer) that `deepspeed.initialize` returned."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.inner = optimizer.optimizer
        self.zero3 = hasattr(optimizer, "fp32_partitioned_groups_flat")
        self.name = f"deepspeed ({type(optimizer).__name__})"
        self.shard_group = optimizer.dp_process_group
        # ZeRO-2/3 (and ZeRO-1 with overlap_comm) reduce grads in hooks during backward, after which the
        # accumulated unreduced grad no longer exists: each backward pass's contribution is recorded.
        reduces_in_backward = self.zero3 or bool(getattr(optimizer, "_grad_acc_hooks", None))
        self.unreduced_capture = PER_MICRO_BATCH if reduces_in_backward else ACCUMULATED
        self._valid = {}

    def describe(self) -> dict:
        return data_parallel_coordinates(self.shard_group)

    def pp_stage(self) -> int:
        return 0

    def rename(self, vpp_stage: int, name: str) -> str:
        return name

    def prepare(self, params: list[WatchedParam]) -> list[WatchedParam]:
        over = (self.shard_group,)
        if not self.zero3:
            return [dataclasses.replace(w, merge_over=over) for w in params]
        out = []
        rank = dist.get_rank(self.shard_group)
        for w in params:
            p = w.param
            per_rank = p.ds_tensor.ds_numel
            # Elements of this rank's partition that belong to the parameter (the rest is padding).
            self._valid[id(p)] = max(0, min(per_rank, p.ds_numel - rank * per_rank))
            out.append(WatchedParam(w.name, p, w.vpp_stage, tuple(p.ds_shape), over))
        return out

    def install_unreduced(self, params, record) -> None:
        raise AssertionError("the DeepSpeed adapter uses the core's grad hooks")

    def remove(self) -> None:
        pass

    def step_owner(self):
        return self.optimizer

    # ------------------------------------------------------------------------------- pieces
    def reduced_grads(self, params):
        if self.zero3:
            return [self._z3(w.param, self.optimizer.get_local_fp32_grad_for_param(w.param)) for w in params]
        out = []
        for w in params:
            mapping = getattr(w.param, "_hp_mapping", None)
            if mapping is None:
                out.append(None)
                continue
            grad = mapping.get_lp_grad_fragment(w.param._index_in_param_group).reshape(-1)
            address = mapping.lp_fragment_address
            if grad.numel() == w.param.numel():
                # BF16_Optimizer keeps the whole accumulated grad on every rank: only the fragment counts.
                grad = grad.narrow(0, address.start, address.numel)
            out.append(grad)
        return out

    def main_params(self, params):
        if self.zero3:
            return [self._z3(w.param, self.optimizer.get_local_fp32_param(w.param)) for w in params]
        return [m.hp_fragment if (m := getattr(w.param, "_hp_mapping", None)) is not None else None
                for w in params]

    def adam_pieces(self, params):
        return [self._adam_piece(w.param) for w in params]

    def _adam_piece(self, param):
        if self.zero3:
            group_index = self.optimizer.grad_position[self.optimizer.get_param_id(param)][0]
            flat = self.optimizer.fp32_partitioned_groups_flat[group_index]
            state = self.inner.state.get(flat, {})
            if "exp_avg" not in state:
                return None
            moments = [self._z3(param, self.optimizer.get_local_fp32_param(param, key))
                       for key in ("exp_avg", "exp_avg_sq")]
            group = self.inner.param_groups[self.optimizer.sub_group_to_group_id[group_index]]
        else:
            mapping = getattr(param, "_hp_mapping", None)
            fragments = (mapping.optim_fragment or {}) if mapping is not None else {}
            if "exp_avg" not in fragments:
                return None
            moments = [fragments["exp_avg"], fragments["exp_avg_sq"]]
            group = self.inner.param_groups[mapping.param_group_index]
            state = self.inner.state[self._flat_partition(mapping.param_group_index)]
        return AdamPiece(moments[0], moments[1], state["step"], tuple(group["betas"]), group["eps"])

    def _flat_partition(self, group_index: int) -> torch.Tensor:
        flats = getattr(self.optimizer, "single_partition_of_fp32_groups", None)
        if flats is None:  # BF16_Optimizer
            flats = self.optimizer.fp32_groups_flat_partition
        return flats[group_index]

    def _z3(self, param, local):
        """The parameter's elements of this rank's partition; empty (but of the partition's dtype, which
        labels the record) where the rank holds only padding."""
        return local.narrow(0, 0, self._valid[id(param)]) if local is not None else None
