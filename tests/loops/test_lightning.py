"""Lightning's Trainer with trainmon's callback: automatic optimization with accumulation, clipping, a sanity
check and validation; and manual optimization."""
from __future__ import annotations

import logging
import shutil

import pytest
import torch
from torch._dynamo.utils import counters

pl = pytest.importorskip("lightning.pytorch")

from loops.harness import (CONFIG, LoopProbe, TinyRegressor, check_healthy, check_injected,  # noqa: E402
                           check_structure, rank_dir_of, read_family, samples)
from trainmon.hooks import in_graph  # noqa: E402
from trainmon.integrations.lightning import TrainmonCallback
from trainmon import TrainerMon  # noqa: E402


class Regression(pl.LightningModule):
    def __init__(self, manual: bool = False):
        super().__init__()
        self.net = TinyRegressor()
        self.automatic_optimization = not manual

    def forward(self, x, labels):
        return self.net(x, labels)["loss"]

    def training_step(self, batch, batch_idx):
        loss = self(batch["x"], batch["labels"])
        if self.automatic_optimization:
            return loss
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(loss)
        self.clip_gradients(optimizer, gradient_clip_val=1.0)
        optimizer.step()
        return loss

    def validation_step(self, batch, batch_idx):
        return self(batch["x"], batch["labels"])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class ProbeCallback(pl.Callback):
    """Puts the probe's step hook on the torch optimizer, before trainmon attaches."""

    def __init__(self, probe: LoopProbe):
        self.probe = probe

    def on_fit_start(self, trainer, pl_module):
        self.probe.attach(trainer.optimizers[0])


def run(write_config, manual=False, inject=None, compile_backend=None):
    torch.manual_seed(0)
    module = Regression(manual)
    probe = LoopProbe(module, inject=inject)
    if compile_backend is not None:
        module = torch.compile(module, backend=compile_backend)
    loader = torch.utils.data.DataLoader(samples(18), batch_size=2)
    validation = torch.utils.data.DataLoader(samples(6, seed=1), batch_size=2)
    trainer = pl.Trainer(max_epochs=2, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=2,
                         accumulate_grad_batches=1 if manual else 2, gradient_clip_val=None if manual else 1.0,
                         callbacks=[ProbeCallback(probe), TrainmonCallback(write_config(**CONFIG))])
    trainer.fit(module, loader, validation)
    return probe


@pytest.fixture(autouse=True)
def quiet_lightning():
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)


def test_automatic_optimization_with_accumulation_clipping_and_validation(output_dir, write_config, monkeypatch):
    logged = []
    log_scalar = TrainerMon.log_scalar
    monkeypatch.setattr(TrainerMon, "log_scalar", lambda self, name, value, step=None:
                        logged.append((name, value, step)) or log_scalar(self, name, value, step))
    probe = run(write_config)
    check_healthy(output_dir, probe)  # 9 batches an epoch, accumulation 2: each epoch ends on a 1-batch step
    check_structure(output_dir, probe.model)
    lr = [(step, value) for name, value, step in logged if name == "lr"]
    assert len(lr) == 18 and {value for _, value in lr} == {1e-2}
    assert sorted({step for step, _ in lr}) == list(range(10))  # 5 optimizer steps an epoch, 2 epochs


def test_manual_optimization(output_dir, write_config):
    probe = run(write_config, manual=True)
    check_healthy(output_dir, probe, short_last_step=False)


def test_injected_inf(output_dir, write_config, capsys):
    run(write_config, inject="net.hidden")
    check_injected(output_dir, "net.hidden", capsys)


def test_compiled_module(output_dir, write_config, capsys, caplog):
    """A LightningModule handed to `fit` compiled (Lightning compiles its forward and training_step): the records
    are those of eager mode, the grads of activations inside the compiled region included; and so is the named
    fault. One grad is not collected, and one message says so: that of the logits `net` returns beside the loss it
    computed from them (the compiled backward adds the loss's part inside its graph, where no hook sees it)."""
    torch._dynamo.reset()
    counters.clear()
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        probe = run(write_config, compile_backend="aot_eager")
    assert counters["stats"]["unique_graphs"] >= 1
    said = [r.getMessage() for r in caplog.records if "not collected" in r.getMessage()]
    assert said == [f"trainmon: {in_graph.OUTPUT_USED_REFUSED}"]
    check_healthy(output_dir, probe)
    assert set(read_family(rank_dir_of(output_dir), "actv_grad").name) == {
        ".output", "net.output_0", "net.head.output", "net.head.input", "net.hidden.output",
        "net.hidden.input", "net.act.output", "net.act.input", "net.inp.output"}
    for run_dir in output_dir.iterdir():  # a second run beside it: the fault is its own
        shutil.rmtree(run_dir)
    torch._dynamo.reset()
    run(write_config, inject="net.hidden", compile_backend="aot_eager")
    check_injected(output_dir, "net.hidden", capsys)
