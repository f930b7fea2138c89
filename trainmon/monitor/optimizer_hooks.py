"""Optimizer-step capture: `grad_reduced`, `param_origin` before the update; `param_updated`, Adam
moments, bias-corrected update/ratio and grad/momentum sign agreement after it.

Every `step()` of the adapter's step owner is one monitor step: the end of it closes the step. A
torch optimizer gets step pre/post hooks; a framework's optimizer wrapper (DeepSpeed, Megatron) that
is not a torch optimizer gets its bound `step` wrapped on the instance, which `remove()` undoes.
The tensors come from the adapter as this rank's pieces, merged across its shard group.
"""
from __future__ import annotations

import functools
import logging
from typing import Callable

import torch

from trainmon.monitor.adapters.base import AdamPiece, TrainingAdapter, WatchedParam
from trainmon.monitor.records import (ADAM_RATIO, ADAM_UPDATE, EXP_AVG, EXP_AVG_SQ, GRAD_REDUCED,
                                      MG_DIRECTION, PARAM_ORIGIN, PARAM_UPDATED)
from trainmon.monitor.patching import patch_attribute
from trainmon.monitor.shard_merge import record_pieces
from trainmon.monitor.state import HookState

logger = logging.getLogger("trainmon")


class OptimizerHooks:
    def __init__(self, state: HookState, adapter: TrainingAdapter, params: list[WatchedParam],
                 *, reduced_grads: bool, params_before_after: bool, moments: bool, update_ratio: bool,
                 sign_agreement: bool, end_step: Callable[[], None]):
        self.state = state
        self.adapter = adapter
        self.params = params
        self.reduced_grads = reduced_grads
        self.params_before_after = params_before_after
        self.moments = moments
        self.update_ratio = update_ratio
        self.sign_agreement = sign_agreement
        self.end_step = end_step
        self._handles: list = []
        self._restore = None
        self._warned_no_moments = False
        self._grad_signs: list = []

    def install(self) -> None:
        owner = self.adapter.step_owner()
        before = self.state.guarded("optimizer step (before)", self._before_step)
        if isinstance(owner, torch.optim.Optimizer):
            self._handles.append(owner.register_step_pre_hook(before))
            # The end of a step must not be skipped by a failure of the statistics after the update.
            self._handles.append(owner.register_step_post_hook(self._after_step))
            return
        original = owner.step

        @functools.wraps(original)
        def monitored_step(*args, **kwargs):
            before(owner, args, kwargs)
            try:
                return original(*args, **kwargs)
            finally:
                self._after_step(owner, args, kwargs)

        self._restore = patch_attribute(owner, "step", monitored_step)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._restore is not None:
            self._restore()
            self._restore = None

    def _record(self, family: str, pieces: list) -> None:
        record_pieces(self.state, family, self.params, pieces, group=self.adapter.shard_group)

    def _before_step(self, optimizer, args, kwargs) -> None:
        if not self.state.collecting:
            return
        self.state.collector.flush_pending()  # release the held activations before the update
        if self.reduced_grads or self.sign_agreement:
            grads = self.adapter.reduced_grads(self.params)
            if self.reduced_grads:
                self._record(GRAD_REDUCED, grads)
            if self.sign_agreement:
                # Frameworks free or reuse the reduced grads during their step: only the signs are kept.
                self._grad_signs = [torch.sign(g) if g is not None else None for g in grads]
        if self.params_before_after:
            self._record(PARAM_ORIGIN, self.adapter.main_params(self.params))

    def _after_step(self, optimizer, args, kwargs) -> None:
        try:
            if self.state.collecting:
                self.state.guarded("optimizer step (after)", self._collect_after_step)()
        finally:
            self.end_step()

    def _collect_after_step(self) -> None:
        if self.params_before_after:
            self._record(PARAM_UPDATED, self.adapter.main_params(self.params))
        if not (self.moments or self.update_ratio or self.sign_agreement):
            return
        pieces = self.adapter.adam_pieces(self.params)
        if not pieces:
            return
        if self.adapter.shard_group is None and all(p is None for p in pieces):
            if not self._warned_no_moments:
                self._warned_no_moments = True
                logger.warning("trainmon: the optimizer keeps no Adam moments (exp_avg, exp_avg_sq); "
                               "mv_distribution, ur_distribution and mg_direction record nothing")
            return
        if self.moments:
            self._record(EXP_AVG, [p and p.exp_avg for p in pieces])
            self._record(EXP_AVG_SQ, [p and p.exp_avg_sq for p in pieces])
        if self.update_ratio:
            updates, ratios = zip(*[_adam_update_and_ratio(p) if p is not None else (None, None) for p in pieces])
            self._record(ADAM_UPDATE, list(updates))
            self._record(ADAM_RATIO, list(ratios))
        if self.sign_agreement:
            signs, self._grad_signs = self._grad_signs, []
            self._record(MG_DIRECTION, [(sign == torch.sign(p.exp_avg)).float()
                                        if p is not None and sign is not None else None
                                        for p, sign in zip(pieces, signs)])


def _adam_update_and_ratio(piece: AdamPiece):
    """Bias-corrected m̂/(√v̂+ε) and m̂/√v̂ of one piece.

    The bias correction is computed from the state's step tensor on its own device, so no value is
    read on the host.
    """
    beta1, beta2 = piece.betas
    m, v, step = piece.exp_avg, piece.exp_avg_sq, piece.step
    step = step if isinstance(step, torch.Tensor) else torch.tensor(float(step))
    step = step.to(device=m.device, dtype=torch.float32)
    m_hat = m / (1 - torch.pow(beta1, step))
    v_hat_sqrt = torch.sqrt(v / (1 - torch.pow(beta2, step)))
    return m_hat / (v_hat_sqrt + piece.eps), m_hat / v_hat_sqrt
