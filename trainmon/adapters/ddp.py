"""torch.nn.parallel.DistributedDataParallel: unreduced grads from a DDP communication hook.

DDP copies each grad into a bucket and all-reduces the bucket during backward, so the grads are
read in a communication hook, when the bucket is complete and before its all-reduce: under
`no_sync` accumulation that is the accumulated grad of the step. After backward every rank holds
the same reduced grads, weights and moments: those are whole tensors (the plain adapter's).

DDP accepts one communication hook per model and cannot unregister it, so after `remove()` the hook
stays and does exactly what DDP's default reduction does (divide by the group size, all-reduce).
"""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from trainmon.adapters.base import ADAPTER, PER_MICRO_BATCH, PlainAdapter, data_parallel_coordinates

logger = logging.getLogger("trainmon")


class DDPAdapter(PlainAdapter):
    """Args: optimizer (a torch optimizer), ddp (the DistributedDataParallel model)."""

    def __init__(self, optimizer: torch.optim.Optimizer, ddp: torch.nn.parallel.DistributedDataParallel):
        has_hook = bool(getattr(ddp, "_comm_hooks", None))
        if has_hook:
            logger.warning("trainmon: the DDP model already has a communication hook; unreduced grads are "
                           "recorded per micro-batch, before accumulation")
        super().__init__(optimizer, unreduced_capture=PER_MICRO_BATCH if has_hook else ADAPTER, name="ddp")
        self.ddp = ddp
        self._by_param: dict = {}
        self._record = None

    def describe(self) -> dict:
        return data_parallel_coordinates(self.ddp.process_group)

    def install_unreduced(self, params, record) -> None:
        self._by_param = {id(w.param): w for w in params}
        self._record = record
        if getattr(self.ddp, "_trainmon_hook", None) is None:
            self.ddp._trainmon_hook = _MonitoredAllReduce(self.ddp.process_group)
            self.ddp.register_comm_hook(self.ddp.process_group, self.ddp._trainmon_hook)
        self.ddp._trainmon_hook.observer = self._observe

    def remove(self) -> None:
        hook = getattr(self.ddp, "_trainmon_hook", None)
        if hook is not None:
            hook.observer = None
        self._record = None

    def _observe(self, bucket: dist.GradBucket) -> None:
        watched = [(self._by_param.get(id(p)), g) for p, g in zip(bucket.parameters(), bucket.gradients())]
        watched = [(w, g) for w, g in watched if w is not None]
        if watched:
            self._record([w for w, _ in watched], [g for _, g in watched], None)


class _MonitoredAllReduce:
    """DDP's default reduction with an observer that sees the bucket's grads first."""

    def __init__(self, process_group):
        self.process_group = process_group
        self.observer = None
        # DDP reads the hook's name for its logs.
        self.__name__ = self.__qualname__ = "trainmon_allreduce_hook"

    def __call__(self, state, bucket):  # unannotated: DDP rejects a string annotation
        if self.observer is not None:
            self.observer(bucket)
        return allreduce_hook(self.process_group, bucket)
