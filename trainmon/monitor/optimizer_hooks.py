"""Optimizer-step capture: `grad_reduced`, `param_origin` before the update; `param_updated`, Adam
moments, bias-corrected update/ratio and grad/momentum sign agreement after it.

Every `optimizer.step()` is one monitor step: the post-step hook closes the step.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch

from trainmon.monitor.grad_hooks import WatchedParam
from trainmon.monitor.records import (ADAM_RATIO, ADAM_UPDATE, EXP_AVG, EXP_AVG_SQ, GRAD_REDUCED,
                                      MG_DIRECTION, PARAM_ORIGIN, PARAM_UPDATED, RecordKey)
from trainmon.monitor.state import HookState

logger = logging.getLogger("trainmon")


class OptimizerHooks:
    def __init__(self, state: HookState, optimizer: torch.optim.Optimizer, params: list[WatchedParam],
                 *, reduced_grads: bool, params_before_after: bool, moments: bool, update_ratio: bool,
                 sign_agreement: bool, end_step: Callable[[], None]):
        self.state = state
        self.optimizer = optimizer
        self.params = params
        self.reduced_grads = reduced_grads
        self.params_before_after = params_before_after
        self.moments = moments
        self.update_ratio = update_ratio
        self.sign_agreement = sign_agreement
        self.end_step = end_step
        self._handles: list = []
        self._group_of = {}
        self._warned_no_moments = False

    def install(self) -> None:
        self._group_of = {id(p): group for group in self.optimizer.param_groups for p in group["params"]}
        self._handles.append(self.optimizer.register_step_pre_hook(
            self.state.guarded("optimizer step (before)", self._before_step)))
        # The end of a step must not be skipped by a failure of the statistics after the update.
        self._handles.append(self.optimizer.register_step_post_hook(self._after_step))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _record(self, family: str, watched: list[WatchedParam], tensors: list[torch.Tensor]) -> None:
        if not tensors:
            return
        collector = self.state.collector
        keys = [RecordKey(family, w.name, w.vpp_stage, None, collector.next_call_index(),
                          tuple(t.shape), str(t.dtype)) for w, t in zip(watched, tensors)]
        collector.record(keys, tensors)

    def _before_step(self, optimizer, args, kwargs) -> None:
        if not self.state.collecting:
            return
        if self.reduced_grads:
            with_grad = [w for w in self.params if w.param.grad is not None]
            self._record(GRAD_REDUCED, with_grad, [w.param.grad for w in with_grad])
        if self.params_before_after:
            self._record(PARAM_ORIGIN, self.params, [w.param.detach() for w in self.params])

    def _after_step(self, optimizer, args, kwargs) -> None:
        try:
            if self.state.collecting:
                self.state.guarded("optimizer step (after)", self._collect_after_step)()
        finally:
            self.end_step()

    def _collect_after_step(self) -> None:
        if self.params_before_after:
            self._record(PARAM_UPDATED, self.params, [w.param.detach() for w in self.params])
        if not (self.moments or self.update_ratio or self.sign_agreement):
            return
        with_state = [w for w in self.params if "exp_avg" in self.optimizer.state.get(w.param, {})]
        if not with_state:
            if not self._warned_no_moments:
                self._warned_no_moments = True
                logger.warning("trainmon: %s keeps no Adam moments (exp_avg, exp_avg_sq); "
                               "mv_distribution, ur_distribution and mg_direction record nothing",
                               type(self.optimizer).__name__)
            return
        states = [self.optimizer.state[w.param] for w in with_state]
        exp_avg = [s["exp_avg"] for s in states]
        exp_avg_sq = [s["exp_avg_sq"] for s in states]
        if self.moments:
            self._record(EXP_AVG, with_state, exp_avg)
            self._record(EXP_AVG_SQ, with_state, exp_avg_sq)
        if self.update_ratio:
            update, ratio = self._adam_update_and_ratio(with_state, states, exp_avg, exp_avg_sq)
            self._record(ADAM_UPDATE, with_state, update)
            self._record(ADAM_RATIO, with_state, ratio)
        if self.sign_agreement:
            with_grad = [(w, m) for w, m in zip(with_state, exp_avg) if w.param.grad is not None]
            agree = [(torch.sign(w.param.grad) == torch.sign(m)).float() for w, m in with_grad]
            self._record(MG_DIRECTION, [w for w, _ in with_grad], agree)

    def _adam_update_and_ratio(self, watched, states, exp_avg, exp_avg_sq):
        """Bias-corrected m̂/(√v̂+ε) and m̂/√v̂, with each param group's betas and eps.

        The bias correction is computed from the state's step tensor on its own device, so no
        value is read on the host.
        """
        updates, ratios = [], []
        for w, s, m, v in zip(watched, states, exp_avg, exp_avg_sq):
            group = self._group_of.get(id(w.param), self.optimizer.defaults)
            beta1, beta2 = group["betas"]
            step = s["step"] if isinstance(s["step"], torch.Tensor) else torch.tensor(float(s["step"]))
            step = step.to(device=m.device, dtype=torch.float32)
            m_hat = m / (1 - torch.pow(beta1, step))
            v_hat_sqrt = torch.sqrt(v / (1 - torch.pow(beta2, step)))
            updates.append(m_hat / (v_hat_sqrt + group["eps"]))
            ratios.append(m_hat / v_hat_sqrt)
        return updates, ratios
