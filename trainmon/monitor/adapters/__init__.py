"""Framework adapters: chosen from the actual model and optimizer objects, never from what is importable."""
from __future__ import annotations

import logging

import torch

from trainmon.monitor.adapters.base import (ACCUMULATED, ADAPTER, ADAPTER_PER_MICRO_BATCH, NOT_RECORDED,
                                            PER_MICRO_BATCH, AdamPiece, PlainAdapter, TrainingAdapter, WatchedParam)

logger = logging.getLogger("trainmon")

__all__ = ["ACCUMULATED", "ADAPTER", "ADAPTER_PER_MICRO_BATCH", "NOT_RECORDED", "PER_MICRO_BATCH", "AdamPiece",
           "PlainAdapter", "TrainingAdapter", "WatchedParam", "select_adapter"]


def select_adapter(chunks: list[torch.nn.Module], optimizer) -> TrainingAdapter:
    """The adapter for these model chunks and this optimizer; logs which one it is and why.

    Optimizer wrappers of training loops (accelerate, Lightning) are taken off first. An optimizer of a
    kind no adapter knows is monitored as a plain one: its `step()` ends a step, weights and grads are
    read from the model, and Adam moments only where it keeps them as torch optimizers do.
    """
    from trainmon.monitor.adapters.deepspeed import DeepSpeedAdapter, is_deepspeed_optimizer

    from trainmon.monitor.adapters.megatron import MegatronAdapter, is_megatron_optimizer
    from trainmon.monitor.adapters.unwrap import unwrap_optimizer

    optimizer, wrappers = unwrap_optimizer(optimizer)
    if wrappers:
        logger.info("trainmon: the optimizer step is %s.step(), inside %s", type(optimizer).__name__,
                    " > ".join(wrappers))
    if is_deepspeed_optimizer(optimizer):
        adapter = DeepSpeedAdapter(optimizer)
        reason = f"the optimizer is DeepSpeed's {type(optimizer).__name__}"
    elif is_megatron_optimizer(optimizer):
        adapter = MegatronAdapter(optimizer, chunks)
        reason = f"the optimizer is Megatron-Core's {type(optimizer).__name__}"
    elif isinstance(optimizer, torch.optim.Optimizer):
        from trainmon.monitor.adapters.fsdp2 import FSDP2Adapter, is_fsdp2

        ddp = next((c for c in chunks if isinstance(c, torch.nn.parallel.DistributedDataParallel)), None)
        if is_fsdp2(chunks):
            adapter = FSDP2Adapter(optimizer, chunks)
            reason = "the model is sharded with fully_shard (FSDP2)"
        elif ddp is not None:
            from trainmon.monitor.adapters.ddp import DDPAdapter

            adapter = DDPAdapter(optimizer, ddp)
            reason = "the model is wrapped in DistributedDataParallel"
        else:
            adapter = PlainAdapter(optimizer)
            reason = f"a torch optimizer ({type(optimizer).__name__}) on a plain module"
    else:
        adapter = PlainAdapter(optimizer)
        reason = (f"{type(optimizer).__module__}.{type(optimizer).__name__} is no optimizer trainmon knows: its "
                  "step() ends a step, weights and grads are read from the model")
    logger.info("trainmon: %s adapter (%s); unreduced grads: %s", adapter.name, reason, adapter.unreduced_capture)
    return adapter
