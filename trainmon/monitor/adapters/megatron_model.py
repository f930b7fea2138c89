"""What a Megatron-Core model tells the monitor, whatever optimizer trains it.

Megatron numbers each pipeline stage's (and virtual chunk's) layers from 0, so stage 1's `decoder.layers.0`
of a 4-layer PP2 model is global layer 2; `parallel_state` knows the stage and the rank's coordinates; and
Megatron's DistributedDataParallel accumulates grads in grad buffers (`main_grad`, with `.grad` set to None)
that its bucket groups reduce. Both Megatron adapters (Megatron's optimizer, and a torch optimizer on a
Megatron model, as in Megatron-Core's quick-start) take these from here.
"""
from __future__ import annotations

import functools
import re
from typing import Callable, Optional

import torch

from trainmon.monitor.adapters.base import ADAPTER, WatchedParam, group_coordinates
from trainmon.monitor.patching import patch_attribute

_LAYER = re.compile(r"(^|\.)layers\.(\d+)(?=\.|$)")


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


class MegatronPlacement:
    """Names, pipeline stage and parallel coordinates of Megatron-Core model chunks (one per virtual stage)."""

    def __init__(self, chunks: list[torch.nn.Module]):
        from megatron.core import parallel_state

        self.ps = parallel_state
        self.chunks = chunks
        self._layer_offsets = [_layer_offset(chunk) for chunk in chunks]

    def describe(self) -> dict:
        import torch.distributed as dist

        ps = self.ps
        return {"global_rank": dist.get_rank(), "world_size": dist.get_world_size(),
                "tp": group_coordinates(ps.get_tensor_model_parallel_group()),
                "pp": group_coordinates(ps.get_pipeline_model_parallel_group()),
                "dp": group_coordinates(ps.get_data_parallel_group()),
                "vpp": {"size": len(self.chunks)}}

    def pp_stage(self) -> int:
        return self.ps.get_pipeline_model_parallel_rank()

    def rename(self, vpp_stage: int, name: str) -> str:
        """`layers.<i>` with the global layer number."""
        offset = self._layer_offsets[vpp_stage]
        if not offset:
            return name
        return _LAYER.sub(lambda m: f"{m.group(1)}layers.{int(m.group(2)) + offset}", name)


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
        group: the group over which the pieces merge, or None.
    """

    unreduced_capture = ADAPTER

    def __init__(self, chunks: list[torch.nn.Module], piece: Callable[[torch.nn.Parameter], torch.Tensor],
                 group: Optional[object]):
        self.chunks = chunks
        self.piece = piece
        self.group = group
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

        @functools.wraps(original)
        def start_grad_sync(*args, **kwargs):
            # A handle still pending means this call is a no-op (the collective was already started).
            if bucket_group.grad_reduce_handle is None:
                record(members, [self.piece(w.param) for w in members], self.group)
            return original(*args, **kwargs)

        self._restores.append(patch_attribute(bucket_group, "start_grad_sync", start_grad_sync))

    def remove(self) -> None:
        for restore in self._restores:
            restore()
        self._restores.clear()
