"""trainmon for transformers' `Trainer`: `Trainer(..., callbacks=[TrainmonCallback("monitor_config.json")])`.

The callback attaches at train begin to the model and optimizer the Trainer hands its callbacks (the
Trainer's own or the user's `optimizers=(opt, sched)`, wrapped by accelerate: the wrapper is taken off),
with the Trainer's gradient accumulation; writes the module tree (`module_struct.json`, for TensorBoard's structure
view); logs the Trainer's `loss`, `grad_norm` and `learning_rate` at the step they belong to; and stops at train end.
"""
from __future__ import annotations

from typing import Optional

from transformers import TrainerCallback

from trainmon.trainer_mon import TrainerMon

LOGGED = ("loss", "grad_norm", "learning_rate")


class TrainmonCallback(TrainerCallback):
    """Monitors a `transformers.Trainer` run with the config at `config`.

    Args:
        config: path of the monitor's JSON config (msprobe monitor keys).
    """

    def __init__(self, config: str):
        self.config = config
        self.monitor: Optional[TrainerMon] = None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.monitor = TrainerMon(self.config).set_monitor(
            model, optimizer=optimizer, grad_acc_steps=args.gradient_accumulation_steps,
            start_iteration=state.global_step)
        if self.monitor.active:
            self.monitor.save_structure()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.monitor is None or not self.monitor.active or state.global_step == 0:
            return
        for name in LOGGED:
            value = (logs or {}).get(name)
            if isinstance(value, (int, float)):
                # The Trainer logs after it counted the step: the figures belong to the step just applied.
                self.monitor.log_scalar(name, value, step=state.global_step - 1)

    def on_train_end(self, args, state, control, **kwargs):
        if self.monitor is not None:
            self.monitor.stop()
