"""A module and the wrappers around it (checkpoint wrappers, DDP, torch.compile's `_orig_mod`) are one place when
`squash_name` folds their names together: each call is recorded once there, with what the unwrapped model's
run records."""
import collections

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

from training import make_model, run_steps
from trainmon import TrainerMon
from trainmon.read import open_run

CONFIG = {"all_xy": True, "xy_distribution": True, "ops": ["norm", "min", "max"], "format": ["db"],
          "squash_name": True}
RECORD = ["rank", "family", "vpp_stage", "name", "shape", "dtype", "step", "micro_step"]  # one record per call


def records(output_dir) -> "pandas.DataFrame":
    with open_run(output_dir, source="db") as run:
        return run.records()


def repeated(frame) -> list:
    """The (tag, rank, step, micro-step) places written more than once."""
    places = collections.Counter(tuple(str(v) for v in row) for row in frame[RECORD].itertuples(index=False))
    return sorted(place for place, count in places.items() if count > 1)


def by_place(frame) -> dict:
    return {(r.family, r.name, r.step, r.micro_step): (r.norm, r.min, r.max) for r in frame.itertuples()}


def blocks(impl=None) -> nn.Sequential:
    """Two Linear-GELU blocks, each in a checkpoint wrapper with `impl`; the same weights either way."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.GELU()) for _ in range(2)])
    if impl is not None:
        model = nn.Sequential(*[checkpoint_wrapper(block, checkpoint_impl=impl) for block in model])
    return model


def train_blocks(write_config, model, steps=2):
    """`steps` SGD steps of `model` on the same inputs every run; returns the monitor."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(write_config(**CONFIG))
    monitor.set_monitor(model, optimizer=optimizer)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        model(torch.randn(4, 8, generator=gen).requires_grad_()).pow(2).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    monitor.stop()
    return monitor


@pytest.fixture
def reference(tmp_path, monkeypatch, write_config):
    """The records of a run of the unwrapped model, written where the wrapped run does not write."""

    def run(make, train):
        monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "reference"))
        return records(train(write_config, make()).output_dir)

    return run


@pytest.mark.parametrize("impl", [CheckpointImpl.NO_REENTRANT, CheckpointImpl.REENTRANT], ids=lambda i: i.name)
def test_a_checkpoint_wrapped_block_is_recorded_once_as_the_block_itself(output_dir, write_config, reference, impl):
    unwrapped = reference(blocks, train_blocks)
    wrapped = records(train_blocks(write_config, blocks(impl)).output_dir)
    assert repeated(wrapped) == []
    assert {"0.output", "1.input"} <= set(wrapped.name)
    assert set(wrapped.family) == {"actv", "actv_grad"}
    want, got = by_place(unwrapped), by_place(wrapped)
    assert got.keys() == want.keys()
    for place, figures in got.items():
        assert figures == pytest.approx(want[place], rel=1e-6), place
    if impl is CheckpointImpl.NO_REENTRANT:  # its forward runs once, in the training forward: the same order
        order = ["family", "name", "step", "micro_step"]
        assert wrapped.sort_values(["step", "call_index"])[order].values.tolist() == \
            unwrapped.sort_values(["step", "call_index"])[order].values.tolist()


@pytest.fixture
def one_rank_group():
    """A process group of this one process (gloo), as DDP needs one."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def train_gpt(write_config, model, steps=2):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    monitor = TrainerMon(write_config(**CONFIG))
    monitor.set_monitor(model, optimizer=optimizer, grad_acc_steps=2)
    run_steps(model, optimizer, steps, grad_acc_steps=2)
    monitor.stop()
    return monitor


WRAPS = {
    "ddp": lambda model: nn.parallel.DistributedDataParallel(model),
    "checkpointed_blocks_in_ddp": lambda model: nn.parallel.DistributedDataParallel(_checkpointed_layers(model)),
    # torch.compile's `_orig_mod`, inside DDP and around it
    "compiled_in_ddp": lambda model: nn.parallel.DistributedDataParallel(torch.compile(model, backend="aot_eager")),
    "ddp_compiled": lambda model: torch.compile(nn.parallel.DistributedDataParallel(model), backend="aot_eager"),
}


def _checkpointed_layers(model):
    for i, layer in enumerate(model.layers):
        model.layers[i] = checkpoint_wrapper(layer)
    return model


@pytest.mark.slow
@pytest.mark.parametrize("wrap", WRAPS)
def test_a_ddp_model_is_recorded_once_as_the_model_itself(output_dir, write_config, reference, one_rank_group, wrap):
    torch._dynamo.reset()
    unwrapped = reference(make_model, train_gpt)
    wrapped = records(train_gpt(write_config, WRAPS[wrap](make_model())).output_dir)
    assert repeated(wrapped) == []
    assert {".output", "layers.1.output", "layers.1.input"} <= set(wrapped.name)
    want, got = by_place(unwrapped), by_place(wrapped)
    assert got.keys() == want.keys()
    for place, figures in got.items():
        assert figures == pytest.approx(want[place], rel=1e-5, abs=1e-7), place


def test_the_sentinel_probes_a_wrapped_module_once(output_dir, write_config):
    from trainmon.hooks.sentinel import NanSentinel

    model = blocks(CheckpointImpl.NO_REENTRANT)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    monitor = TrainerMon(write_config(sentinel=True, format=["db"], squash_name=True))
    monitor.set_monitor(model, optimizer=optimizer)
    sentinel = next(group for group in monitor._hooks if isinstance(group, NanSentinel))
    names = [name for name, _, _ in sentinel.modules]
    monitor.stop()
    assert len(names) == len(set(names)) and "0" in names


@pytest.mark.parametrize("no_sync", [False, True])
def test_ddp_unreduced_grads_are_one_record_a_step_or_one_a_micro_batch(output_dir, write_config, one_rank_group,
                                                                         no_sync):
    """Under `no_sync` DDP reduces a step's accumulated grads once: one record a step. Without it, it reduces every
    micro-batch: one record a micro-batch, under its micro-step, never two under none."""
    import contextlib

    from training import batches
    from trainmon.demo import lm_loss

    model = nn.parallel.DistributedDataParallel(make_model())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    monitor = TrainerMon(write_config(wg_distribution=True, ops=["norm"], format=["db"]))
    monitor.set_monitor(model, optimizer=optimizer, grad_acc_steps=2)
    data = batches()
    for _ in range(2):
        for micro in range(2):
            quiet = model.no_sync() if no_sync and micro == 0 else contextlib.nullcontext()
            with quiet:
                tokens, labels = next(data)
                (lm_loss(model, tokens, labels) / 2).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    monitor.stop()
    frame = records(monitor.output_dir)
    unreduced = frame[frame.family == "grad_unreduced"]
    assert repeated(unreduced) == [] and len(unreduced)
    micro_steps = set(unreduced.micro_step.fillna(-1).astype(int))
    assert micro_steps == ({-1} if no_sync else {0, 1})
