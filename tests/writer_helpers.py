"""Shared by the writer tests: a monitored training run, TensorBoard read-back, a sink that waits."""
from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

import torch

from training import make_model, run_steps
from trainmon import TrainerMon
from trainmon.writers.base import Sink

OPS = ["min", "max", "norm", "mean", "zeros", "nans", "infs"]
FULL = dict(targets={}, all_xy=True, xy_distribution=True, wg_distribution=True, param_distribution=True,
            mv_distribution=True, ops=OPS, ndigits=17)


def monitored(write_config, steps=3, grad_acc_steps=2, on_step=None, stop=True, **config):
    """Trains `steps` steps under a TrainerMon with FULL + `config`; `on_step(monitor, step)` before each step()."""
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    monitor = TrainerMon(write_config(**{**FULL, **config}))
    monitor.set_monitor(model, optimizer=optimizer, grad_acc_steps=grad_acc_steps)
    hook = None if on_step is None else (lambda step: on_step(monitor, step))
    losses = run_steps(model, optimizer, steps, grad_acc_steps, on_step=hook)
    if stop:
        monitor.stop()
    return monitor, losses


def tensorboard_scalars(logdir) -> dict:
    """{(tag, step): value} of every scalar under `logdir`, read by TensorBoard itself; a scalar of a run in a
    subdirectory (the view's max/min/median lines) is keyed "run/tag", as TensorBoard's run selector shows it."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logdir = Path(logdir)
    found = {}
    for run_dir in sorted({event_file.parent for event_file in logdir.rglob("*tfevents*")}):
        events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
        events.Reload()
        run = run_dir.relative_to(logdir).as_posix()
        for tag in events.Tags()["scalars"]:
            name = tag if run == "." else f"{run}/{tag}"
            found.update({(name, e.step): e.value for e in events.Scalars(tag)})
    return found


def integrity(path) -> str:
    with sqlite3.connect(path) as conn:
        return conn.execute("PRAGMA integrity_check").fetchone()[0]


class GatedSink(Sink):
    """A slow sink: every write waits until the test opens the gate."""

    name = "gated"

    def __init__(self):
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.steps: list[int] = []

    def write(self, batch) -> None:
        self.entered.set()
        self.gate.wait()
        self.steps.append(batch.step)
