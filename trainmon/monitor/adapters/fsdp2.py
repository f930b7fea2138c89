"""FSDP2 (`torch.distributed.fsdp.fully_shard`): parameters, grads and Adam state are DTensors sharded on dim 0.

Each rank's pieces are the DTensors' local shards (`to_local()`: views, no copy), merged across the
mesh's process group into the full parameter's records. Only a 1-D mesh (plain FSDP) is supported.

Unreduced grads are not recorded: FSDP2 reduce-scatters the unsharded grads of a whole parameter group
from one flat buffer inside its post-backward, and offers no public point between the unsharded
per-parameter grads and that collective.
"""
from __future__ import annotations

import torch

from trainmon.monitor.adapters.base import NOT_RECORDED, PlainAdapter, data_parallel_coordinates


def is_fsdp2(chunks) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(c, FSDPModule) for c in chunks)


def _local(tensor):
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class FSDP2Adapter(PlainAdapter):
    """Args: optimizer (a torch optimizer over the sharded parameters), chunks (the fully_shard-ed model chunks)."""

    def __init__(self, optimizer: torch.optim.Optimizer, chunks):
        super().__init__(optimizer, unreduced_capture=NOT_RECORDED, name="fsdp2")
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
        return [type(w)(w.name, w.param, w.vpp_stage, tuple(w.param.shape)) for w in params]

    def reduced_grads(self, params):
        return [_local(g) if (g := w.param.grad) is not None else None for w in params]

    def main_params(self, params):
        return [_local(w.param.detach()) for w in params]

    def adam_pieces(self, params):
        pieces = super().adam_pieces(params)
        return [type(p)(_local(p.exp_avg), _local(p.exp_avg_sq), _local(p.step), p.betas, p.eps)
                if p is not None else None for p in pieces]
