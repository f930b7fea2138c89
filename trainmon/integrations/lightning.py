"""trainmon for Lightning: `lightning.Trainer(..., callbacks=[TrainmonCallback("monitor_config.json")])`.

The callback attaches when fitting starts to the LightningModule and its (first) optimizer, with the
Trainer's `accumulate_grad_batches`, and writes the module tree (`module_struct.json`, for TensorBoard's structure
view); Lightning's `LightningOptimizer` and its `step(closure)` are handled
by the monitor itself, in automatic and manual optimization. Sanity checks and validation run in eval mode
without grad, so they are no training micro-steps. The loss a training step returns is logged as `loss`, and the
first optimizer's learning rate as `lr`, at the step they belong to; monitoring stops when fitting ends.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
from lightning.pytorch.callbacks import Callback

from trainmon.trainer_mon import TrainerMon

logger = logging.getLogger("trainmon")


class TrainmonCallback(Callback):
    """Monitors a `lightning.Trainer` fit with the config at `config`.

    Args:
        config: path of the monitor's JSON config (msprobe monitor keys).
    """

    def __init__(self, config: str):
        self.config = config
        self.monitor: Optional[TrainerMon] = None
        self._batch_step = 0

    def on_fit_start(self, trainer, pl_module):
        optimizers = trainer.optimizers
        if len(optimizers) != 1:
            logger.warning("trainmon: the LightningModule has %s optimizers; the first one's steps are monitored",
                           len(optimizers))
        self.monitor = TrainerMon(self.config).set_monitor(
            pl_module, optimizer=optimizers[0] if optimizers else None,
            grad_acc_steps=trainer.accumulate_grad_batches, start_iteration=trainer.global_step)
        if self.monitor.active:
            self.monitor.save_structure()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.monitor is not None:
            self._batch_step = self.monitor.step  # the step this micro-batch's grads go into

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.monitor is None or not self.monitor.active:
            return
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            self.monitor.log_scalar("loss", loss.detach(), step=self._batch_step)
        if trainer.optimizers:
            self.monitor.log_scalar("lr", trainer.optimizers[0].param_groups[0]["lr"], step=self._batch_step)

    def on_fit_end(self, trainer, pl_module):
        if self.monitor is not None:
            self.monitor.stop()

    def on_exception(self, trainer, pl_module, exception):
        self.on_fit_end(trainer, pl_module)
