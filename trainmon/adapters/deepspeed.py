"""DeepSpeed ZeRO 1/2/3 and BF16_Optimizer: pieces from the local partitions, mapped to parameter names.

ZeRO 1/2 and BF16_Optimizer keep one flat fp32 partition per param group and rank; each model
parameter's `_hp_mapping` (DeepSpeed's fragment bookkeeping) holds its fragment's address in that
partition and views of the fp32 weight (`hp_fragment`) and, between backward and step, the reduced grad
(`get_lp_grad_fragment`); the inner optimizer's state of the partition, narrowed to that address, gives
the fragment's moments. ZeRO-3 keeps the same per parameter
(`ds_id`, `grad_position`), padded at the end of the last rank's partition. All of these are views:
nothing is copied or gathered, and the pieces' records merge across the group ZeRO partitions them over:
the data-parallel group, or for the experts of a DeepSpeed MoE layer their expert data-parallel group, each
expert-parallel rank recording its own experts under their global numbers (`deepspeed_moe`).

A monitor step is one call of the ZeRO optimizer's `step()` (what `engine.step()` runs at the end of
an accumulation cycle). Reduced grads are what the inner torch optimizer consumes: the flat partition's
`.grad` at the parameter's fragment address, when the inner step that updates that partition starts,
after DeepSpeed has unscaled and clipped it (ZeRO 1/2 step once per param group, ZeRO-3 once per
sub-group, each preparing that partition's grads just before). A step DeepSpeed skips (a non-finite
grad norm, an fp16 overflow) never reaches the inner step: its grads are read where DeepSpeed decides
to skip, before it clears them (`_update_scale(overflow)`; BF16_Optimizer's `clear_hp_grads`), as
`safe_get_full_grad` sees them. Weights and moments are read when the step returns.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from trainmon.adapters.base import (ACCUMULATED, PER_MICRO_BATCH, AdamPiece, InnerSteps, WatchedParam,
                                            data_parallel_coordinates)
from trainmon.adapters.deepspeed_moe import ExpertNumbering
from trainmon.adapters.patching import patch_attribute


def is_deepspeed_optimizer(optimizer) -> bool:
    return type(optimizer).__module__.startswith("deepspeed.runtime.")


class DeepSpeedAdapter:
    """Args: optimizer, the ZeRO optimizer (or BF16_Optimizer) that `deepspeed.initialize` returned; chunks, the
    monitored model (its MoE layers' experts get global numbers)."""

    def __init__(self, optimizer, chunks: list[torch.nn.Module]):
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
        # Which call of the inner step consumes each parameter's grads: ZeRO 1/2 step param group i in
        # call i; ZeRO-3 sub-group i in call i; BF16_Optimizer steps all groups in one call.
        groups = getattr(optimizer, "bit16_groups", None)
        self._call_of = {id(p): i for i, group in enumerate(groups) for p in group} if groups is not None else {}
        self.experts = ExpertNumbering(chunks)

    def describe(self) -> dict:
        coordinates = data_parallel_coordinates(self.shard_group)
        if self.experts.coordinates:  # one expert group per expert-parallel size; the first one's
            coordinates.update(next(iter(self.experts.coordinates.values())))
        return coordinates

    def pp_stage(self) -> int:
        return 0

    def rename(self, vpp_stage: int, name: str) -> str:
        return self.experts.rename(name)

    def prepare(self, params: list[WatchedParam]) -> list[WatchedParam]:
        over = (self.shard_group,)
        if not self.zero3:
            return [dataclasses.replace(w, merge_over=(self._partition_group(w.param),)) for w in params]
        out = []
        rank = dist.get_rank(self.shard_group)
        for w in params:
            p = w.param
            per_rank = p.ds_tensor.ds_numel
            # Elements of this rank's partition that belong to the parameter (the rest is padding).
            self._valid[id(p)] = max(0, min(per_rank, p.ds_numel - rank * per_rank))
            self._call_of[id(p)] = self._grad_position(p)[0]
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
        return [self._consumed_grad(w.param) for w in params]

    def _consumed_grad(self, param):
        """The parameter's fragment of the flat fp32 grad the inner optimizer steps with, or None where
        this rank holds none of it or that partition's grads are not prepared now."""
        if self.zero3:
            group_index, offset, numel = self._grad_position(param)
            flat = self.optimizer.fp32_partitioned_groups_flat[group_index].grad
            return self._z3(param, flat.narrow(0, offset, numel)) if flat is not None else None
        mapping = getattr(param, "_hp_mapping", None)
        if mapping is None:
            return None
        flat = self._flat_partition(mapping.param_group_index).grad
        address = mapping.hp_fragment_address
        return flat.narrow(0, address.start, address.numel) if flat is not None else None

    def inner_steps(self, params):
        return InnerSteps([self.inner], [self._call_of.get(id(w.param), 0) for w in params])

    def skipped_grads(self, params):
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

    def watch_skips(self, on_skip):
        opt = self.optimizer
        if not hasattr(opt, "_update_scale"):  # BF16_Optimizer zeroes its fp32 grads where it skips
            clear_hp_grads = opt.clear_hp_grads

            def clear_after_reading(*args, **kwargs):
                on_skip()  # the core ignores the call after an update (it also clears the grads then)
                return clear_hp_grads(*args, **kwargs)

            return patch_attribute(opt, "clear_hp_grads", clear_after_reading)
        update_scale = opt._update_scale  # ZeRO 1/2/3 pass the skip decision here, before clearing grads

        def update_scale_after_reading(has_overflow=False, *args, **kwargs):
            if has_overflow:
                on_skip()
            return update_scale(has_overflow, *args, **kwargs)

        return patch_attribute(opt, "_update_scale", update_scale_after_reading)

    def clipping(self, step_result):
        max_norm = getattr(self.optimizer, "clip_grad", 0.0)
        norm = getattr(self.optimizer, "_global_grad_norm", None)  # before clipping, unscaled
        return (norm, max_norm) if max_norm and norm is not None else None

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
            # Read from the inner optimizer's state at the fragment's address, not from the mapping's
            # `optim_fragment`: DeepSpeed links that once, after the first param group's first step, so every
            # later param group (experts' `moe` groups among them) has none.
            mapping = getattr(param, "_hp_mapping", None)
            if mapping is None:
                return None
            state = self.inner.state.get(self._flat_partition(mapping.param_group_index), {})
            if "exp_avg" not in state:
                return None
            address = mapping.hp_fragment_address
            moments = [state[key].narrow(0, address.start, address.numel) for key in ("exp_avg", "exp_avg_sq")]
            group = self.inner.param_groups[mapping.param_group_index]
        return AdamPiece(moments[0], moments[1], state["step"], tuple(group["betas"]), group["eps"])

    def _partition_group(self, param):
        """The group ZeRO 1/2 partitions the parameter's param group over: the expert data-parallel group for
        experts (DeepSpeed's `moe` param groups), the data-parallel group for the rest."""
        per_group = getattr(self.optimizer, "real_dp_process_group", None)
        call = self._call_of.get(id(param))
        return per_group[call] if per_group is not None and call is not None else self.shard_group

    def _flat_partition(self, group_index: int) -> torch.Tensor:
        flats = getattr(self.optimizer, "single_partition_of_fp32_groups", None)
        if flats is None:  # BF16_Optimizer
            flats = self.optimizer.fp32_groups_flat_partition
        return flats[group_index]

    def _grad_position(self, param) -> tuple:
        """(sub-group, offset, elements) of the parameter's grad in ZeRO-3's flat fp32 partition."""
        return self.optimizer.grad_position[self.optimizer.get_param_id(param)]

    def _z3(self, param, local):
        """The parameter's elements of this rank's partition; empty (but of the partition's dtype, which
        labels the record) where the rank holds only padding."""
        return local.narrow(0, 0, self._valid[id(param)]) if local is not None else None
