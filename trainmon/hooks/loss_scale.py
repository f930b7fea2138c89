"""Loss-scale events as training scalars: the scale, and how many optimizer updates overflow skipped.

Loss scaling hides an overflowed step by skipping it; frequent skips are what users see, so trainmon
records them as a rate instead of leaving them silent. Scalars (names in trainmon.analysis.overflow):
`loss_scale` (the scale of the latest update), `amp_skipped_steps` and `amp_updates` (running totals).

- torch.amp `GradScaler` (also `torch.cuda.amp`'s): `update()` is wrapped while monitoring; it reads the
  inf checks `step()` already made, as device tensors (no host synchronisation of its own). A skipped
  update applies no optimizer step, so its scalars land in the next monitor step; the totals stay exact.
- DeepSpeed's fp16 optimizer (`cur_scale`, `overflow`) and Megatron's (`grad_scaler.scale`, `found_inf`)
  are read at the end of each monitor step when the optimizer given to `set_monitor` has them (both call
  their optimizer's `step()` on a skipped update too, so every update is a monitor step).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from trainmon.hooks.hook_group import Hooks
from trainmon.adapters.patching import patch_attribute

LOSS_SCALE, SKIPPED, UPDATES = "loss_scale", "amp_skipped_steps", "amp_updates"


class LossScaleWatch(Hooks):
    """Records loss-scale scalars through `log_scalar(name, value)`; `install`/`remove` like other hooks.

    `guard(item, fn)` is HookState.guarded: a scaler of an unexpected shape turns these scalars off, once,
    and never training.
    """

    collects = "loss scale"

    def __init__(self, log_scalar: Callable[[str, object], None], guard: Callable[[str, Callable], Callable],
                 optimizer=None):
        self._log = log_scalar
        self._optimizer = optimizer
        self._skipped: Optional[torch.Tensor] = None
        self._updates = 0
        self._restore: Optional[Callable[[], None]] = None
        self._before_update = guard("loss-scale events", self._read_grad_scaler)
        self._read_framework = guard("loss-scale events", self._read_framework_scaler)

    def install(self) -> None:
        original = torch.amp.GradScaler.update
        watch = self

        def update(scaler, new_scale=None):
            if new_scale is None and getattr(scaler, "_enabled", False):
                watch._before_update(scaler)
            return original(scaler, new_scale)

        self._restore = patch_attribute(torch.amp.GradScaler, "update", update)

    def remove(self) -> None:
        if self._restore is not None:
            self._restore()
            self._restore = None

    def _read_grad_scaler(self, scaler) -> None:
        found = [f for state in scaler._per_optimizer_states.values() for f in state["found_inf_per_device"].values()]
        if not found or scaler._scale is None:
            return
        skipped = torch.stack([f.to(scaler._scale.device).reshape(()) for f in found]).sum().gt(0).float()
        self._count(scaler._scale.detach().clone(), skipped)  # update() changes the scale in place

    def _count(self, scale, skipped) -> None:
        self._skipped = skipped if self._skipped is None else self._skipped + skipped
        self._updates += 1
        self._log(LOSS_SCALE, scale)
        self._log(SKIPPED, self._skipped)
        self._log(UPDATES, float(self._updates))

    def step_finished(self, collected: bool) -> None:
        """Reads a framework's loss scaler at the end of a monitor step (DeepSpeed, Megatron), if any."""
        if self._optimizer is not None:
            self._read_framework()

    def _read_framework_scaler(self) -> None:
        opt = self._optimizer
        grad_scaler = getattr(opt, "grad_scaler", None)                # Megatron
        if grad_scaler is not None and getattr(grad_scaler, "scale", None) is not None:
            found_inf = getattr(opt, "found_inf", None)  # set by the step's unscale-and-check
            if isinstance(found_inf, torch.Tensor):
                self._count(grad_scaler.scale.detach().clone(), found_inf.detach().reshape(()).gt(0).float())
            else:
                self._log(LOSS_SCALE, grad_scaler.scale.detach().clone())
            return
        scale = getattr(opt, "cur_scale", None)                        # DeepSpeed fp16
        if scale is None and getattr(opt, "loss_scaler", None) is not None:
            scale = getattr(opt.loss_scaler, "cur_scale", None)
        if scale is not None:
            self._count(float(scale), torch.tensor(float(bool(getattr(opt, "overflow", False)))))
