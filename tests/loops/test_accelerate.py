"""A plain accelerate loop: prepare(), accumulate(), backward(); the optimizer is accelerate's wrapper."""
from __future__ import annotations

import pytest
import torch

accelerate = pytest.importorskip("accelerate")

from loops.harness import CONFIG, LoopProbe, TinyRegressor, check_healthy, check_injected, samples  # noqa: E402
from trainmon import TrainerMon  # noqa: E402


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """accelerate keeps its state per process; each run starts its own."""
    yield
    accelerate.state.AcceleratorState._reset_state(True)
    accelerate.state.GradientState._reset_state()


def run(write_config, inject=None):
    torch.manual_seed(0)
    model = TinyRegressor()
    probe = LoopProbe(model, inject=inject)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    probe.attach(optimizer)
    accelerator = accelerate.Accelerator(gradient_accumulation_steps=2, cpu=True)
    loader = torch.utils.data.DataLoader(samples(18), batch_size=2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    monitor = TrainerMon(write_config(**CONFIG)).set_monitor(model, optimizer=optimizer, grad_acc_steps=2)
    for _ in range(2):
        for batch in loader:
            with accelerator.accumulate(model):
                loss = model(batch["x"], batch["labels"])["loss"]
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad()
    monitor.stop()
    return probe


def test_accelerate_loop_healthy(output_dir, write_config):
    probe = run(write_config)
    check_healthy(output_dir, probe)  # the prepared loader ends each epoch on a 1-batch step


def test_accelerate_loop_injected_inf(output_dir, write_config, capsys):
    run(write_config, inject="hidden")
    check_injected(output_dir, "hidden", capsys)
