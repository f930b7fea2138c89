"""Weight-gradient capture during backward: `grad_unreduced`.

Without `monitor_mbs_grad` the accumulated grad is recorded once per step, at the end of the last
micro-batch's backward, before any reduction. With it, every micro-batch's own contribution is
recorded (the grad a backward pass adds, not the running sum).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from trainmon.monitor.records import GRAD_UNREDUCED, RecordKey
from trainmon.monitor.state import HookState


@dataclass(frozen=True)
class WatchedParam:
    name: str
    param: torch.nn.Parameter
    vpp_stage: int


def _queue_end_of_backward(callback) -> None:
    torch.autograd.Variable._execution_engine.queue_callback(callback)


class GradHooks:
    def __init__(self, state: HookState, params: list[WatchedParam], per_micro_batch: bool):
        self.state = state
        self.params = params
        self.per_micro_batch = per_micro_batch
        self._handles: list = []
        self._pending: list[WatchedParam] = []
        self._callback_queued = False

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

    def _ensure_end_of_backward(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            _queue_end_of_backward(self.state.guarded("weight grads", self._end_of_backward))

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        state = self.state
        pending, self._pending = self._pending, []
        if pending:
            grads = [(w, w.param.grad) for w in pending if w.param.grad is not None]
            self._record([w for w, _ in grads], [g for _, g in grads], micro=None)
        state.backward_micro += 1

    def _make_accumulated_hook(self, watched: WatchedParam):
        state = self.state

        def post_accumulate_hook(param):
            if not state.collecting:
                return
            self._ensure_end_of_backward()
            if state.backward_micro == state.grad_acc_steps - 1:
                self._pending.append(watched)

        return post_accumulate_hook

    def _make_contribution_hook(self, watched: WatchedParam):
        state = self.state

        def contribution_hook(grad):
            if not state.collecting:
                return None
            self._ensure_end_of_backward()
            # The contribution is freed after accumulation, so it is reduced now rather than batched.
            self._record([watched], [grad], micro=state.backward_micro)
            return None

        return contribution_hook

    def _record(self, watched: list[WatchedParam], grads: list[torch.Tensor], micro) -> None:
        if not grads:
            return
        collector = self.state.collector
        keys = [RecordKey(GRAD_UNREDUCED, w.name, w.vpp_stage, micro, collector.next_call_index(),
                          tuple(g.shape), str(g.dtype)) for w, g in zip(watched, grads)]
        collector.record(keys, grads)
