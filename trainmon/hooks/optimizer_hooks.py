"""Optimizer-step capture: `grad_reduced`, `param_origin` before the update; `param_updated`, Adam
moments, bias-corrected update/ratio and grad/momentum sign agreement after it; the framework's
clipping as scalars.

Every `step()` of the adapter's step owner is one monitor step: the end of it closes the step. A
torch optimizer gets step pre/post hooks; any other object (a framework's optimizer wrapper such as
DeepSpeed's or Megatron's, an optimizer-like object) gets its bound `step` wrapped on the instance,
which `remove()` undoes. The tensors come from the adapter as this rank's pieces, merged across each
parameter's groups (`WatchedParam.merge_over`).

What the step consumes is read when the update is about to use it, so after loss-scale unscaling and
clipping: when `step(closure)` is given a closure (Lightning runs the last micro-batch's forward and
backward, and clipping, in it), right after the closure's first call returns; inside a framework's
wrapper, when the inner torch optimizer's step that consumes a parameter's grad starts (step pre-hooks
on it); otherwise when `step()` starts. A step the framework skips for a non-finite grad never reaches
its inner step: those grads are read where the framework skips, or when its step returns, so a skipped
step still records the NaN or Inf that made it skip.
"""
from __future__ import annotations

import functools
import logging
from typing import Callable, Optional, Sequence

import torch

from trainmon.hooks.hook_group import Hooks
from trainmon.adapters.base import AdamPiece, TrainingAdapter, WatchedParam
from trainmon.core.records import (ADAM_RATIO, ADAM_UPDATE, EXP_AVG, EXP_AVG_SQ, GRAD_REDUCED,
                                      MG_DIRECTION, PARAM_ORIGIN, PARAM_UPDATED)
from trainmon.adapters.patching import patch_attribute
from trainmon.hooks.shard_merge import PieceRecords
from trainmon.hooks.state import HookState

logger = logging.getLogger("trainmon")

# Scalars of a step the framework's optimizer clipped: its total grad norm before clipping, and the factor
# min(1, max_norm / (norm + 1e-6)) by which every grad_reduced record was scaled.
GRAD_NORM_PRECLIP, GRAD_CLIP_COEF = "grad_norm_preclip", "grad_clip_coef"


class OptimizerHooks(Hooks):

    collects = "the optimizer step"
    required = True

    def __init__(self, state: HookState, adapter: TrainingAdapter, params: list[WatchedParam],
                 *, reduced_grads: bool, params_before_after: bool, moments: bool, update_ratio: bool,
                 sign_agreement: bool, end_step: Callable[[], None], before_update: Sequence[Callable] = ()):
        self.state = state
        self.adapter = adapter
        self.params = params
        self.reduced_grads = reduced_grads
        self.params_before_after = params_before_after
        self.moments = moments
        self.update_ratio = update_ratio
        self.sign_agreement = sign_agreement
        self.end_step = end_step
        self.before_update = tuple(before_update)
        self._handles: list = []
        self._restore = None
        self._undo_skip_watch = None
        self._warned_no_moments = False
        self._grad_signs: list = []
        self._inner = None  # the adapter's InnerSteps, or None: grads are read when the owner's step starts
        self._in_step = False  # a collected step of the owner is running
        self._inner_calls = 0  # inner step() calls so far in this step
        self._unread: list[int] = []  # params whose consumed grads this step has not read yet

    def install(self) -> None:
        owner = self.adapter.step_owner()
        self._inner = self.adapter.inner_steps(self.params)
        if self._inner is not None:
            inner_pre = self.state.guarded("optimizer step (inner)", self._before_inner_step)
            for optimizer in self._inner.optimizers:
                self._handles.append(optimizer.register_step_pre_hook(lambda *_: inner_pre()))
            self._undo_skip_watch = self.adapter.watch_skips(self.state.guarded("skipped step", self._on_skip))
        before = self.state.guarded("optimizer step (before)", self._before_update)

        def pre_step(optimizer, args, kwargs):
            if not self.state.collecting:
                return None
            closure_first = _with_closure_then(before, args, kwargs)
            if closure_first is None:
                before()
            return closure_first

        # torch's hook dicts exist only where Optimizer.__init__ ran (not in accelerate's wrapper, say).
        if isinstance(owner, torch.optim.Optimizer) and hasattr(owner, "_optimizer_step_pre_hooks"):
            self._handles.append(owner.register_step_pre_hook(pre_step))
            # The end of a step must not be skipped by a failure of the statistics after the update.
            self._handles.append(owner.register_step_post_hook(self._after_step))
            return
        original = getattr(owner, "step", None)
        if not callable(original):
            raise TypeError(f"{type(owner).__name__} has no step() method to end a monitor step")

        @functools.wraps(original)
        def monitored_step(*args, **kwargs):
            args, kwargs = pre_step(owner, args, kwargs) or (args, kwargs)
            result = None
            try:
                result = original(*args, **kwargs)
                return result
            finally:
                self._after_step(owner, args, kwargs, result)

        self._restore = patch_attribute(owner, "step", monitored_step)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._restore is not None:
            self._restore()
            self._restore = None
        if self._undo_skip_watch is not None:
            self._undo_skip_watch()
            self._undo_skip_watch = None

    def _records(self) -> PieceRecords:
        """Where one point of the step records its families: one collective for all of them."""
        return PieceRecords(self.state, self.params)

    def _before_update(self) -> None:
        self.state.collector.flush_pending()  # release the held activations before the update
        for callback in self.before_update:
            callback()
        self._in_step, self._inner_calls = True, 0
        self._unread = list(range(len(self.params)))
        self._grad_signs = [None] * len(self.params)
        if self._inner is None:
            self._read_consumed(self._unread, self.adapter.reduced_grads)

    def _before_inner_step(self) -> None:
        """An inner step is about to consume the grads of the params it is due to (the same on every rank)."""
        if not (self._in_step and self.state.collecting):
            return
        call, self._inner_calls = self._inner_calls, self._inner_calls + 1
        due = [i for i in self._unread if self._inner.call_of[i] == call]
        if due:
            self._read_consumed(due, self.adapter.reduced_grads)

    def _on_skip(self) -> None:
        """The framework skips this step before any inner step: its grads are read before it clears them."""
        if self._in_step and self.state.collecting and self._inner_calls == 0 and self._unread:
            self._read_consumed(self._unread, self.adapter.skipped_grads)

    def _read_consumed(self, indices: list[int], read) -> None:
        """Records grad_reduced (and keeps the grads' signs) and param_origin of params[indices], the grads
        from `read(params)`."""
        chosen = set(indices)
        self._unread = [i for i in self._unread if i not in chosen]
        if not (self.reduced_grads or self.sign_agreement or self.params_before_after):
            return
        params = [self.params[i] for i in indices]
        records = PieceRecords(self.state, params)
        if self.reduced_grads or self.sign_agreement:
            grads = read(params)
            if self.reduced_grads:
                records.add(GRAD_REDUCED, grads)
            if self.sign_agreement:
                # Frameworks free or reuse the reduced grads during their step: only the signs are kept.
                for i, g in zip(indices, grads):
                    self._grad_signs[i] = torch.sign(g) if g is not None else None
        if self.params_before_after:
            records.add(PARAM_ORIGIN, self.adapter.main_params(params))
        records.commit()

    def _after_step(self, optimizer, args, kwargs, result=None) -> None:
        try:
            if self.state.collecting:
                self.state.guarded("optimizer step (after)", self._collect_after_step)(result)
        finally:
            self._in_step = False
            self.end_step()

    def _collect_after_step(self, result) -> None:
        if self._in_step and self._unread:  # no inner step consumed them: the framework skipped this step
            self._read_consumed(self._unread, self.adapter.skipped_grads)
        if self._inner is not None and self._inner_calls:
            self._record_clipping(result)
        records = self._records()
        if self.params_before_after:
            records.add(PARAM_UPDATED, self.adapter.main_params(self.params))
        self._record_adam_state(records)
        records.commit()

    def _record_clipping(self, result) -> None:
        clipping = self.adapter.clipping(result)
        if clipping is None:
            return
        norm, max_norm = clipping
        collector = self.state.collector
        if isinstance(norm, torch.Tensor):
            norm = norm.detach().float().clone()  # the framework may reuse it
            collector.add_scalar(GRAD_CLIP_COEF, torch.clamp(max_norm / (norm + 1e-6), max=1.0))
        else:
            collector.add_scalar(GRAD_CLIP_COEF, min(1.0, max_norm / (norm + 1e-6)))
        collector.add_scalar(GRAD_NORM_PRECLIP, norm)

    def _record_adam_state(self, records: PieceRecords) -> None:
        if not (self.moments or self.update_ratio or self.sign_agreement):
            return
        pieces = self.adapter.adam_pieces(self.params)
        if not pieces:
            return
        # Where pieces merge across ranks, every rank takes part, whatever it holds.
        if not any(w.merge_over for w in self.params) and all(p is None for p in pieces):
            if not self._warned_no_moments:
                self._warned_no_moments = True
                logger.warning("trainmon: the optimizer keeps no Adam moments (exp_avg, exp_avg_sq); "
                               "mv_distribution, ur_distribution and mg_direction record nothing")
            return
        if self.moments:
            records.add(EXP_AVG, [p and p.exp_avg for p in pieces])
            records.add(EXP_AVG_SQ, [p and p.exp_avg_sq for p in pieces])
        if self.update_ratio:
            updates, ratios = zip(*[_adam_update_and_ratio(p) if p is not None else (None, None) for p in pieces])
            records.add(ADAM_UPDATE, list(updates))
            records.add(ADAM_RATIO, list(ratios))
        if self.sign_agreement:
            signs, self._grad_signs = self._grad_signs, []
            records.add(MG_DIRECTION, [(sign == torch.sign(p.exp_avg)).float()
                                       if p is not None and sign is not None else None
                                       for p, sign in zip(pieces, signs)])


def _with_closure_then(callback: Callable[[], None], args: tuple, kwargs: dict) -> Optional[tuple]:
    """(args, kwargs) of a `step(closure)` call with the closure replaced by one that runs `callback` after
    its first call returns; None when the call has no closure."""
    if callable(kwargs.get("closure")):
        return args, {**kwargs, "closure": _then(kwargs["closure"], callback)}
    if args and callable(args[0]):
        return (_then(args[0], callback),) + tuple(args[1:]), kwargs
    return None


def _then(closure: Callable, callback: Callable[[], None]) -> Callable:
    called = False

    @functools.wraps(closure)
    def closure_then_callback(*args, **kwargs):
        nonlocal called
        result = closure(*args, **kwargs)
        if not called:  # an optimizer that re-evaluates (LBFGS) consumes the first call's grads first
            called = True
            callback()
        return result

    return closure_then_callback


def _adam_update_and_ratio(piece: AdamPiece):
    """Bias-corrected m̂/(√v̂+ε) and m̂/√v̂ of one piece (0 where both moments are 0).

    A step on the moments' device (capturable or fused Adam) is used there, where reading it would wait for
    the device; one on the host (torch's Adam keeps a CPU step beside accelerator moments) is read as a number,
    where copying it to the device would wait for the copy.
    """
    beta1, beta2 = piece.betas
    m, v, step = piece.exp_avg, piece.exp_avg_sq, piece.step
    if isinstance(step, torch.Tensor) and step.device == m.device:
        step = step.to(dtype=torch.float32)
        m_hat = m / (1 - torch.pow(beta1, step))
        v_hat_sqrt = torch.sqrt(v / (1 - torch.pow(beta2, step)))
    else:
        step = float(step)
        m_hat = m / (1 - beta1 ** step)
        v_hat_sqrt = torch.sqrt(v / (1 - beta2 ** step))
    # 0/0 where no grad has reached an element yet (an embedding's unused rows): its ratio is 0, not a NaN the
    # monitor would report; a NaN or Inf in the moments themselves still reaches the ratio
    ratio = torch.where((m_hat == 0) & (v_hat_sqrt == 0), 0.0, m_hat / v_hat_sqrt)
    return m_hat / (v_hat_sqrt + piece.eps), ratio
