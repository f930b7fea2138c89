"""Weight-gradient capture during backward: `grad_unreduced`, the core's default capture point.

In ACCUMULATED mode the accumulated grad is recorded once per step, at the end of the last
micro-batch's backward, before any reduction. A step with fewer backward passes than `grad_acc_steps`
(the end of an epoch, a data loader that ran out) is recorded when the optimizer step starts
(`at_update`), from the grads the last backward pass accumulated. In PER_MICRO_BATCH mode (`monitor_mbs_grad`, or a
framework that reduces during backward) every micro-batch's own contribution is recorded (the grad
a backward pass adds, not the running sum). Adapters with their own capture point record through
`record_pieces` too, per step or per micro-batch as their `unreduced_capture` says.
"""
from __future__ import annotations

import torch

from trainmon.hooks.hook_group import Hooks
from trainmon.adapters.base import PER_MICRO_BATCH, WatchedParam
from trainmon.core.records import GRAD_UNREDUCED
from trainmon.hooks.shard_merge import record_pieces
from trainmon.hooks.state import HookState


def _queue_end_of_backward(callback) -> None:
    torch.autograd.Variable._execution_engine.queue_callback(callback)


class BackwardPasses:
    """Counts backward passes in `state.backward_micro`, the micro-step of per-micro-batch records.

    A hook running inside a backward pass calls `seen()`; the first call of a pass queues one callback
    that runs when the pass ends: it runs `at_end`, then advances the count.
    """

    def __init__(self, state: HookState, at_end=None):
        self.state = state
        self._at_end = at_end
        self._queued = False

    def seen(self) -> None:
        if not self._queued:
            self._queued = True
            _queue_end_of_backward(self.state.guarded("weight grads", self._end))

    def _end(self) -> None:
        self._queued = False
        if self._at_end is not None:
            self._at_end()
        self.state.backward_micro += 1


class GradHooks(Hooks):

    collects = "unreduced weight grads (grad_unreduced)"
    def __init__(self, state: HookState, params: list[WatchedParam], mode: str):
        self.state = state
        self.params = params
        self.per_micro_batch = mode == PER_MICRO_BATCH
        self._handles: list = []
        self._pending: list[WatchedParam] = []  # accumulated in the running backward pass
        self._unrecorded: list[WatchedParam] = []  # accumulated by the last pass, not yet recorded
        self._recorded_step = None
        self._backward = BackwardPasses(state, self._end_of_backward)

    def install(self) -> None:
        for watched in self.params:
            item = f"weight grad of {watched.name}"
            if self.per_micro_batch:
                hook = self.state.guarded(item, self._make_contribution_hook(watched))
                self._handles.append(watched.param.register_hook(hook))
            else:
                hook = self.state.guarded(item, self._make_accumulated_hook(watched))
                self._handles.append(watched.param.register_post_accumulate_grad_hook(hook))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._pending.clear()
        self._unrecorded.clear()

    def _end_of_backward(self) -> None:
        self._unrecorded, self._pending = self._pending, []
        if self.state.backward_micro == self.state.grad_acc_steps - 1:
            self.at_update()

    def at_update(self) -> None:
        """Records the accumulated grads not recorded yet (called when the optimizer step starts)."""
        watched, self._unrecorded = self._unrecorded, []
        if self._recorded_step == self.state.collector.step:
            return  # more backward passes than grad_acc_steps: the step's record is taken
        self._recorded_step = self.state.collector.step
        grads = [(w, w.param.grad) for w in watched if w.param.grad is not None]
        if grads:
            self._record([w for w, _ in grads], [g for _, g in grads], micro=None)

    def _make_accumulated_hook(self, watched: WatchedParam):
        state = self.state

        def post_accumulate_hook(param):
            if not state.collecting:
                return
            self._backward.seen()
            self._pending.append(watched)

        return post_accumulate_hook

    def _make_contribution_hook(self, watched: WatchedParam):
        state = self.state

        def contribution_hook(grad):
            if not state.collecting:
                return None
            self._backward.seen()
            # The contribution is freed after accumulation, so it is reduced now rather than batched.
            self._record([watched], [grad], micro=state.backward_micro)
            return None

        return contribution_hook

    def _record(self, watched: list[WatchedParam], grads: list[torch.Tensor], micro) -> None:
        record_pieces(self.state, GRAD_UNREDUCED, watched, grads, micro=micro)


class AdapterGradCapture(Hooks):
    """Unreduced grads from the adapter's own capture point (a DDP communication hook, a grad-buffer sync,
    FSDP2's unsharded parameters); with `per_micro_batch` each record is the running backward pass's.

    Without it, the capture point is meant to see a step's accumulated grads once, at its last micro-batch (DDP
    under `no_sync`). One that comes before the step's last micro-batch shows that the framework reduces every
    micro-batch (DDP with gradient accumulation and no `no_sync`): that step's captures are recorded each under
    its micro-step, not twice under none."""

    collects = "unreduced weight grads (grad_unreduced)"

    def __init__(self, state: HookState, adapter, params: list[WatchedParam], per_micro_batch: bool = False):
        self.state = state
        self.adapter = adapter
        self.params = params
        self._backward = BackwardPasses(state) if per_micro_batch else None
        self._reduced_each_micro_batch = None  # the step whose captures came before its last micro-batch

    def install(self) -> None:
        self.adapter.install_unreduced(self.params, self.state.guarded("unreduced weight grads", self._record))

    def remove(self) -> None:
        self.adapter.remove()

    def _record(self, watched, pieces, over=None) -> None:
        if not self.state.collecting:
            return
        micro = None
        if self._backward is not None:
            self._backward.seen()
            micro = self.state.backward_micro
        else:
            state, step = self.state, self.state.collector.step
            micro_step = state.forward_micro(watched[0].vpp_stage) if watched else 0
            if micro_step < state.grad_acc_steps - 1:
                self._reduced_each_micro_batch = step
            if self._reduced_each_micro_batch == step:
                micro = micro_step
        record_pieces(self.state, GRAD_UNREDUCED, watched, pieces, over=over, micro=micro)
