"""transformers' Trainer with trainmon's callback, with its own optimizer and with the user's."""
from __future__ import annotations

import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")

from loops.harness import (CONFIG, LoopProbe, TinyRegressor, check_healthy, check_injected,  # noqa: E402
                           check_structure, samples)
from trainmon.integrations.transformers import TrainmonCallback  # noqa: E402


class ProbeCallback(transformers.TrainerCallback):
    """Puts the probe's step hook on the torch optimizer under accelerate's wrapper, before trainmon attaches."""

    def __init__(self, probe: LoopProbe):
        self.probe = probe

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        self.probe.attach(optimizer.optimizer)


def run(tmp_path, write_config, user_optimizer: bool, inject=None, compile_backend=None):
    torch.manual_seed(0)
    model = TinyRegressor()
    probe = LoopProbe(model, inject=inject)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "trainer"), per_device_train_batch_size=2, gradient_accumulation_steps=2,
        num_train_epochs=2, learning_rate=1e-2, max_grad_norm=1.0, logging_steps=1, save_strategy="no",
        report_to=[], use_cpu=True, disable_tqdm=True, dataloader_num_workers=0, seed=0,
        torch_compile=compile_backend is not None, torch_compile_backend=compile_backend)
    optimizers = (torch.optim.AdamW(model.parameters(), lr=1e-2), None) if user_optimizer else (None, None)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=samples(18), optimizers=optimizers,
                                   callbacks=[ProbeCallback(probe), TrainmonCallback(write_config(**CONFIG))])
    trainer.train()
    return trainer, probe


@pytest.mark.parametrize("user_optimizer", [False, True], ids=["trainer_optimizer", "user_optimizer"])
def test_trainer_healthy(tmp_path, output_dir, write_config, user_optimizer):
    _, probe = run(tmp_path, write_config, user_optimizer)
    check_healthy(output_dir, probe)  # 18 samples, batch 2, accumulation 2: each epoch ends on a 1-batch step
    check_structure(output_dir, probe.model)


@pytest.mark.parametrize("user_optimizer", [False, True], ids=["trainer_optimizer", "user_optimizer"])
def test_trainer_injected_inf(tmp_path, output_dir, write_config, capsys, user_optimizer):
    run(tmp_path, write_config, user_optimizer, inject="hidden")
    check_injected(output_dir, "hidden", capsys)


def test_compiled_trainer(tmp_path, output_dir, write_config, capsys):
    """`torch_compile=True`: the Trainer compiles the model; the records and the named fault are the eager ones."""
    torch._dynamo.reset()
    trainer, probe = run(tmp_path, write_config, False, compile_backend="aot_eager")
    assert isinstance(trainer.model_wrapped, torch._dynamo.eval_frame.OptimizedModule)
    check_healthy(output_dir, probe)
    for rank_dir in output_dir.iterdir():  # a second run beside it: the fault is its own
        shutil.rmtree(rank_dir)
    torch._dynamo.reset()
    run(tmp_path, write_config, False, inject="hidden", compile_backend="aot_eager")
    check_injected(output_dir, "hidden", capsys)
