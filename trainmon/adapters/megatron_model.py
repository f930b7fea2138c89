"""What a Megatron-Core model tells the monitor, whatever optimizer trains it.

Megatron numbers each pipeline stage's (and virtual chunk's) layers from 0, so stage 1's `decoder.layers.0`
of a 4-layer PP2 model is global layer 2; likewise each expert-parallel rank numbers its experts from 0, so
with 4 experts on EP2 rank 1's `local_experts.0` is global expert 2 (the index Megatron's checkpoints give
it). `parallel_state` knows the stage and the rank's coordinates, dense and expert; and Megatron's
DistributedDataParallel accumulates grads in grad buffers (`main_grad`, with `.grad` set to None) that its
bucket groups reduce (experts' in bucket groups of their own). Both Megatron adapters (Megatron's
optimizer, and a torch optimizer on a Megatron model, as in Megatron-Core's quick-start) take these from here.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from trainmon.adapters.base import ADAPTER, WatchedParam, group_coordinates
from trainmon.adapters.naming import renumber
from trainmon.adapters.patching import patch_attribute



def megatron_module(chunks: list[torch.nn.Module]) -> Optional[str]:
    """The class name of the chunks' first Megatron-Core module, or None when they hold none."""
    for chunk in chunks:
        for module in chunk.modules():
            if type(module).__module__.startswith("megatron.core"):
                return type(module).__name__
    return None


def parallel_state_initialized() -> bool:
    from megatron.core import parallel_state

    return parallel_state.model_parallel_is_initialized()


def _layer_offset(chunk: torch.nn.Module) -> int:
    """Global index of the chunk's first transformer layer (`layer_number` is global and 1-based)."""
    for name, module in chunk.named_modules():
        if name.endswith("layers.0") and hasattr(module, "layer_number"):
            return module.layer_number - 1
    return 0


def _local_experts(chunk: torch.nn.Module) -> int:
    """Experts per MoE layer on this rank (Megatron's SequentialMLP keeps them in `local_experts`), or 0."""
    return next((len(module.local_experts) for module in chunk.modules()
                 if isinstance(getattr(module, "local_experts", None), torch.nn.ModuleList)), 0)


def is_expert(param: torch.nn.Parameter) -> bool:
    """Megatron marks the parameters of experts split by expert parallelism `allreduce=False` (their grads are
    reduced over the expert data-parallel group, not the data-parallel one)."""
    return not getattr(param, "allreduce", True)


@dataclass(frozen=True)
class ParallelAxes:
    """How one kind of parameter (dense, or expert) is split and replicated on this rank."""

    tp_group: object
    tp_rank: int
    tp_size: int
    dp_rank: int
    merge_over: tuple  # the groups over which this rank's pieces merge into the whole parameter's records

    @staticmethod
    def dense(ps) -> "ParallelAxes":
        return ParallelAxes(ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank(),
                            ps.get_tensor_model_parallel_world_size(), ps.get_data_parallel_rank(),
                            (ps.get_tensor_and_data_parallel_group(),))

    @staticmethod
    def expert(ps) -> "ParallelAxes":
        # Megatron-Core 0.16 has no expert tensor-and-data-parallel group: merge over one, then the other.
        tp_group = ps.get_expert_tensor_parallel_group()
        return ParallelAxes(tp_group, ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size(),
                            ps.get_expert_data_parallel_rank(), (tp_group, ps.get_expert_data_parallel_group()))


class MegatronPlacement:
    """Names, pipeline stage, parallel coordinates and parallel axes of Megatron-Core model chunks (one per
    virtual stage)."""

    def __init__(self, chunks: list[torch.nn.Module]):
        from megatron.core import parallel_state

        self.ps = parallel_state
        self.chunks = chunks
        self._layer_offsets = [_layer_offset(chunk) for chunk in chunks]
        ep_rank = parallel_state.get_expert_model_parallel_rank()
        self._expert_offsets = [ep_rank * _local_experts(chunk) for chunk in chunks]
        self._dense = ParallelAxes.dense(parallel_state)
        self._expert = ParallelAxes.expert(parallel_state)

    def axes(self, param: torch.nn.Parameter) -> ParallelAxes:
        return self._expert if is_expert(param) else self._dense

    def describe(self) -> dict:
        import torch.distributed as dist

        ps = self.ps
        out = {"global_rank": dist.get_rank(), "world_size": dist.get_world_size(),
               "tp": group_coordinates(ps.get_tensor_model_parallel_group()),
               "pp": group_coordinates(ps.get_pipeline_model_parallel_group()),
               "dp": group_coordinates(ps.get_data_parallel_group()),
               "vpp": {"size": len(self.chunks)}}
        if ps.get_expert_model_parallel_world_size() > 1:
            out.update(ep=group_coordinates(ps.get_expert_model_parallel_group()),
                       etp=group_coordinates(ps.get_expert_tensor_parallel_group()),
                       edp=group_coordinates(ps.get_expert_data_parallel_group()))
        return out

    def pp_stage(self) -> int:
        return self.ps.get_pipeline_model_parallel_rank()

    def rename(self, vpp_stage: int, name: str) -> str:
        """`layers.<i>` with the global layer number, `local_experts.<j>` with the global expert number."""
        name = renumber(name, "layers", self._layer_offsets[vpp_stage])
        return renumber(name, "local_experts", self._expert_offsets[vpp_stage])


def bucket_groups(chunks: list[torch.nn.Module]) -> list:
    """The grad-buffer bucket groups of chunks wrapped in Megatron's DistributedDataParallel (else none)."""
    return [group for chunk in chunks
            for group in getattr(chunk, "bucket_groups", []) + getattr(chunk, "expert_parallel_bucket_groups", [])]


class GradBufferCapture:
    """Unreduced grads of Megatron's DDP: each bucket group's `main_grad`s when it starts its grad sync (the
    accumulated local grad, before scaling and before the data-parallel collective).

    Args:
        chunks: the DDP-wrapped model chunks.
        piece: this rank's piece of a parameter's `main_grad` (the grad itself, or an empty tensor where
            another rank counts it).
        merge_over: the groups over which a parameter's pieces merge (one bucket group holds dense
            parameters or experts, never both), or None: not merged.
    """

    unreduced_capture = ADAPTER

    def __init__(self, chunks: list[torch.nn.Module], piece: Callable[[torch.nn.Parameter], torch.Tensor],
                 merge_over: Optional[Callable[[torch.nn.Parameter], tuple]] = None):
        self.chunks = chunks
        self.piece = piece
        self.merge_over = merge_over
        self._restores: list = []

    def install_unreduced(self, params: list[WatchedParam], record) -> None:
        watched = {id(w.param): w for w in params}
        for bucket_group in bucket_groups(self.chunks):
            members = [watched[id(p)] for bucket in bucket_group.buckets for p in bucket.params_list
                       if id(p) in watched]
            if members:
                self._wrap_start_grad_sync(bucket_group, members, record)

    def _wrap_start_grad_sync(self, bucket_group, members: list[WatchedParam], record) -> None:
        original = bucket_group.start_grad_sync
        over = self.merge_over(members[0].param) if self.merge_over is not None else None

        @functools.wraps(original)
        def start_grad_sync(*args, **kwargs):
            # A handle still pending means this call is a no-op (the collective was already started).
            if bucket_group.grad_reduce_handle is None:
                record(members, [self.piece(w.param) for w in members], over)
            return original(*args, **kwargs)

        self._restores.append(patch_attribute(bucket_group, "start_grad_sync", start_grad_sync))

    def remove(self) -> None:
        for restore in self._restores:
            restore()
        self._restores.clear()
