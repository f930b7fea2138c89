"""Framework adapters: chosen from the actual model and optimizer objects, never from what is importable."""
from __future__ import annotations

import logging

import torch

from trainmon.adapters.base import (ACCUMULATED, ADAPTER, ADAPTER_PER_MICRO_BATCH, NOT_RECORDED,
                                            PER_MICRO_BATCH, AdamPiece, PlainAdapter, TrainingAdapter, WatchedParam)

logger = logging.getLogger("trainmon")

__all__ = ["ACCUMULATED", "ADAPTER", "ADAPTER_PER_MICRO_BATCH", "NOT_RECORDED", "PER_MICRO_BATCH", "AdamPiece",
           "PlainAdapter", "TrainingAdapter", "WatchedParam", "select_adapter"]


def select_adapter(chunks: list[torch.nn.Module], optimizer) -> TrainingAdapter:
    """The adapter for these model chunks and this optimizer; logs which one it is and why.

    Optimizer wrappers of training loops (accelerate, Lightning) are taken off first. An optimizer of a
    kind no adapter knows is monitored as a plain one: its `step()` ends a step, weights and grads are
    read from the model, and Adam moments only where it keeps them as torch optimizers do. A Megatron-Core
    model trained by any optimizer but Megatron's is recognised from its modules and parallel_state: its
    names, pipeline stage and coordinates are Megatron's, its grads and state as that optimizer keeps them.
    """
    from trainmon.adapters.deepspeed import DeepSpeedAdapter, is_deepspeed_optimizer

    from trainmon.adapters.megatron import MegatronAdapter, is_megatron_optimizer
    from trainmon.adapters.unwrap import unwrap_optimizer

    optimizer, wrappers = unwrap_optimizer(optimizer)
    if wrappers:
        logger.info("trainmon: the optimizer step is %s.step(), inside %s", type(optimizer).__name__,
                    " > ".join(wrappers))
    if is_deepspeed_optimizer(optimizer):
        adapter = DeepSpeedAdapter(optimizer, chunks)
        reason = f"the optimizer is DeepSpeed's {type(optimizer).__name__}"
    elif is_megatron_optimizer(optimizer):
        adapter = MegatronAdapter(optimizer, chunks)
        reason = f"the optimizer is Megatron-Core's {type(optimizer).__name__}"
    else:
        adapter, reason = _on_megatron_model(*_torch_side_adapter(optimizer, chunks), chunks)
    logger.info("trainmon: %s adapter (%s); unreduced grads: %s", adapter.name, reason, adapter.unreduced_capture)
    return adapter


def _torch_side_adapter(optimizer, chunks: list[torch.nn.Module]):
    """(adapter, reason) for an optimizer that is neither DeepSpeed's nor Megatron's, from the model's wrapper."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        return PlainAdapter(optimizer), (
            f"{type(optimizer).__module__}.{type(optimizer).__name__} is no optimizer trainmon knows: its step() "
            "ends a step, weights and grads are read from the model")
    from trainmon.adapters.fsdp2 import FSDP2Adapter, is_fsdp2

    ddp = next((c for c in chunks if isinstance(c, torch.nn.parallel.DistributedDataParallel)), None)
    if is_fsdp2(chunks):
        return FSDP2Adapter(optimizer, chunks), "the model is sharded with fully_shard (FSDP2)"
    if ddp is not None:
        from trainmon.adapters.ddp import DDPAdapter

        return DDPAdapter(optimizer, ddp), "the model is wrapped in DistributedDataParallel"
    return PlainAdapter(optimizer), f"a torch optimizer ({type(optimizer).__name__}), no DDP or FSDP2 wrapper"


def _on_megatron_model(adapter, reason: str, chunks: list[torch.nn.Module]):
    """A Megatron-Core model trained by an optimizer that is not Megatron's still names global layers and its
    pipeline stage: the torch-side adapter, placed on the model (FSDP2 shards are left as they are)."""
    from trainmon.adapters.fsdp2 import FSDP2Adapter

    if isinstance(adapter, FSDP2Adapter):
        return adapter, reason
    from trainmon.adapters.megatron_model import megatron_module, parallel_state_initialized

    module = megatron_module(chunks)
    if module is None:
        return adapter, reason
    if not parallel_state_initialized():
        return adapter, (f"{reason}; the model has Megatron-Core modules ({module}) but parallel_state is not "
                         "initialised, so names stay as the chunks give them")
    from trainmon.adapters.megatron_torch import TorchOptimizerOnMegatron

    return TorchOptimizerOnMegatron(adapter, chunks), (
        f"{reason}; the model is Megatron-Core's ({module}, parallel_state initialised): global layer names, "
        "pipeline stage and coordinates from it")
