"""transformers' Trainer with trainmon's callback, with its own optimizer and with the user's."""
from __future__ import annotations

import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")

from loops.harness import (CONFIG, STEP_FAMILIES, LoopProbe, TinyRegressor, check_healthy,  # noqa: E402
                           check_injected, check_structure, rank_dir_of, read_family, samples)
from trainmon.integrations.transformers import TrainmonCallback  # noqa: E402


class ProbeCallback(transformers.TrainerCallback):
    """Puts the probe's step hook on the torch optimizer under accelerate's wrapper, before trainmon attaches."""

    def __init__(self, probe: LoopProbe):
        self.probe = probe

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        self.probe.attach(optimizer.optimizer)


def run(tmp_path, write_config, user_optimizer: bool, inject=None, compile_backend=None, evaluate=False, **config):
    """Two epochs of the Trainer; with `evaluate`, an evaluation after each. `config`: keys added to `CONFIG`."""
    torch.manual_seed(0)
    model = TinyRegressor()
    probe = LoopProbe(model, inject=inject)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "trainer"), per_device_train_batch_size=2, gradient_accumulation_steps=2,
        num_train_epochs=2, learning_rate=1e-2, max_grad_norm=1.0, logging_steps=1, save_strategy="no",
        eval_strategy="epoch" if evaluate else "no", report_to=[], use_cpu=True, disable_tqdm=True,
        dataloader_num_workers=0, seed=0, torch_compile=compile_backend is not None,
        torch_compile_backend=compile_backend)
    optimizers = (torch.optim.AdamW(model.parameters(), lr=1e-2), None) if user_optimizer else (None, None)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=samples(18), optimizers=optimizers,
                                   eval_dataset=samples(6, seed=1) if evaluate else None,
                                   callbacks=[ProbeCallback(probe), TrainmonCallback(write_config(**CONFIG, **config))])
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


def test_compiled_trainer_with_a_step_interval_and_evaluations_records_the_eager_ones(tmp_path, output_dir,
                                                                                      write_config, monkeypatch):
    """`step_interval: 2` and an evaluation after each epoch, compiled: the steps not collected run a graph without
    trainmon's ops, and the collected ones record what eager mode records. One grad is not seen compiled: that of
    the logits the model's own loss took inside the graph (`docs/guides/compiled.md`)."""
    aot_eager, graphs = torch._dynamo.lookup_backend("aot_eager"), []   # trainmon's ops in each graph compiled
    observe = (torch.ops.trainmon.observe, torch.ops.trainmon.observe.default)

    def counting(graph_module, example_inputs):
        graphs.append(sum(node.target in observe for node in graph_module.graph.nodes))
        return aot_eager(graph_module, example_inputs)

    monkeypatch.setitem(torch._dynamo.backends.registry._COMPILER_FNS, "aot_eager", counting)
    records = []
    for backend in (None, "aot_eager"):
        torch._dynamo.reset()
        run(tmp_path, write_config, False, compile_backend=backend, evaluate=True, step_interval=2)
        rank_dir, read = rank_dir_of(output_dir), {}
        for family in STEP_FAMILIES:
            frame = read_family(rank_dir, family)
            micro = frame.micro_step.fillna(-1) if "micro_step" in frame else [-1] * len(frame)
            read.update({(family, *key): norm for *key, norm in zip(frame.name, frame.step, micro, frame.norm)})
        records.append(read)
        shutil.rmtree(rank_dir.parent)
    eager, compiled = records
    assert 0 in graphs and max(graphs) > 0
    unseen = {key for key in eager if key[:2] == ("actv_grad", ".output_1")}
    assert unseen and set(compiled) == set(eager) - unseen
    assert {key[2] for key in compiled} == {0, 2, 4, 6, 8}
    for key, norm in compiled.items():
        assert norm == pytest.approx(eager[key], rel=1e-4, abs=1e-7), key
