"""FSDP2 (`torch.distributed.fsdp.fully_shard`): parameters, grads and Adam state are DTensors sharded on dim 0.

Each rank's pieces are the DTensors' local shards (`to_local()`: views, no copy), merged across the
mesh's process group into the full parameter's records. Only a 1-D mesh (plain FSDP) is supported.

Unreduced grads are read from FSDP2's unsharded parameters. This relies on FSDP2 behaviour that is not
a public API: an FSDP module's pre-forward (a prepended forward pre-hook) all-gathers its parameter
group and puts each parameter's unsharded `nn.Parameter` on the modules in place of the sharded
DTensor, the same object every step after the first all-gather; autograd accumulates this rank's local
grad into it, and FSDP's post-backward reads that grad, reduce-scatters it and clears it. So a forward
pre-hook on every FSDP module, which runs after FSDP's, finds the unsharded parameters, and a tensor hook
on each (registered once; again if FSDP ever replaces it) sees every backward pass's grad of it before
accumulation: this rank's whole unreduced grad of that micro-batch, recorded under its micro-step.
With `set_requires_gradient_sync(False)` FSDP accumulates micro-batches before one reduce-scatter; the
records are still each micro-batch's own grad, and the reduce-scattered grad is their sum.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
from torch.distributed.tensor import DTensor

from trainmon.adapters.base import (ADAPTER_PER_MICRO_BATCH, PlainAdapter, WatchedParam,
                                    data_parallel_coordinates, local_shard)


def is_fsdp2(chunks) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(c, FSDPModule) for c in chunks)


class FSDP2Adapter(PlainAdapter):
    """Args: optimizer (a torch optimizer over the sharded parameters), chunks (the fully_shard-ed model chunks)."""

    def __init__(self, optimizer: torch.optim.Optimizer, chunks):
        super().__init__(optimizer, unreduced_capture=ADAPTER_PER_MICRO_BATCH, name="fsdp2")
        self.chunks = chunks
        self._pre_forward_handles: list = []
        self._places: list[_Place] = []
        meshes = {id(p.device_mesh): p.device_mesh for c in chunks for p in c.parameters()
                  if hasattr(p, "device_mesh")}
        if len(meshes) != 1 or next(iter(meshes.values())).ndim != 1:
            raise ValueError("set_monitor: FSDP2 models are supported on one 1-D device mesh (fully_shard without "
                             f"HSDP); this model uses {len(meshes)} mesh(es) of dims "
                             f"{[m.ndim for m in meshes.values()]}")
        self.shard_group = next(iter(meshes.values())).get_group()

    def describe(self) -> dict:
        return data_parallel_coordinates(self.shard_group)

    def prepare(self, params):
        params = super().prepare(params)
        return [type(w)(w.name, w.param, w.vpp_stage, tuple(w.param.shape), (self.shard_group,)) for w in params]

    def install_unreduced(self, params, record) -> None:
        from torch.distributed.fsdp import FSDPModule

        watched = {id(w.param): w for w in params}
        for chunk in self.chunks:
            for module in chunk.modules():
                if not isinstance(module, FSDPModule):
                    continue
                places = _places_managed_by(module, watched)
                if places:
                    self._places += places
                    self._pre_forward_handles.append(module.register_forward_pre_hook(
                        functools.partial(_hook_unsharded, places, record)))

    def remove(self) -> None:
        for handle in self._pre_forward_handles:
            handle.remove()
        for place in self._places:
            place.unhook()
        self._pre_forward_handles.clear()
        self._places.clear()

    def reduced_grads(self, params):
        return [local_shard(g) if (g := w.param.grad) is not None else None for w in params]

    def main_params(self, params):
        return [local_shard(w.param.detach()) for w in params]

    def adam_pieces(self, params):
        pieces = super().adam_pieces(params)
        return [type(p)(local_shard(p.exp_avg), local_shard(p.exp_avg_sq), local_shard(p.step), p.betas, p.eps)
                if p is not None else None for p in pieces]


@dataclass
class _Place:
    """Where a watched parameter sits on a module, and the unsharded parameter hooked there."""

    module: torch.nn.Module
    attribute: str
    watched: WatchedParam
    hooked: Optional[torch.nn.Parameter] = None
    handle: object = None

    def unhook(self) -> None:
        if self.handle is not None:
            self.handle.remove()
        self.hooked = self.handle = None


def _places_managed_by(fsdp_module: torch.nn.Module, watched: dict) -> list[_Place]:
    """The watched parameters of `fsdp_module`'s own group: those under it outside nested FSDP modules.

    A parameter shared by several modules is taken at its first place (FSDP puts the same unsharded
    parameter on all of them), so its grad is recorded once.
    """
    from torch.distributed.fsdp import FSDPModule

    places, seen, stack = [], set(), [fsdp_module]
    while stack:
        module = stack.pop()
        for attribute, param in module.named_parameters(recurse=False):
            w = watched.get(id(param))
            if w is not None and id(param) not in seen:
                seen.add(id(param))
                places.append(_Place(module, attribute, w))
        stack.extend(c for c in module.children() if not isinstance(c, FSDPModule))
    return places


def _hook_unsharded(places: list[_Place], record, module, args) -> None:
    for place in places:
        param = getattr(place.module, place.attribute)
        # Still sharded (FSDP did not unshard this group), already hooked, or frozen: nothing to do.
        if isinstance(param, DTensor) or param is place.hooked or not param.requires_grad:
            continue
        place.unhook()
        place.hooked = param
        place.handle = param.register_hook(functools.partial(_record_grad, record, [place.watched]))


def _record_grad(record, watched: list[WatchedParam], grad: torch.Tensor) -> None:
    record(watched, [grad], None)
