"""TrainerMon behaviour on a real training loop: numerics, hooks, step gating, api, teardown."""
import copy
import gc
import json
import logging
import os
import sqlite3
import time
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from test_csv_output import FULL, OPS, read_family
from training import batches, make_model, run_steps
from op_log import Ops
from trainmon import TrainerMon
from trainmon.demo import lm_loss
from trainmon.read import open_run

pd = pytest.importorskip("pandas")  # the reader the CSV files are checked with (the `db` extra)


def train(write_config, steps=3, grad_acc_steps=1, model=None, start_iteration=0, **config):
    model = model or make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    monitor = TrainerMon(write_config(**config))
    monitor.set_monitor(model, optimizer=optimizer, grad_acc_steps=grad_acc_steps, start_iteration=start_iteration)
    losses = run_steps(model, optimizer, steps, grad_acc_steps)
    return monitor, model, optimizer, losses


def test_losses_bit_identical_with_and_without_monitor(output_dir, write_config):
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    plain = run_steps(model, optimizer, 5, grad_acc_steps=2)
    monitor, _, _, monitored = train(write_config, steps=5, grad_acc_steps=2, **FULL, ur_distribution=True,
                                     mg_direction=True)
    monitor.stop()
    assert monitored == plain


def _count_ops(write_config, monitored: bool, steps: int):
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    monitor = None
    if monitored:
        # every per-step collection: the full tier, Adam's update and ratio, sign agreement, the sentinel
        monitor = TrainerMon(write_config(**FULL, ur_distribution=True, mg_direction=True, sentinel=True))
        monitor.set_monitor(model, optimizer=optimizer, grad_acc_steps=2)
    from trainmon.demo import lm_loss
    from training import batches
    data = batches()
    counter = Ops()
    with counter:
        for _ in range(steps):
            for _ in range(2):
                tokens, labels = next(data)
                (lm_loss(model, tokens, labels) / 2).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    if monitor:
        monitor.stop()
    return counter.counts


def test_no_host_sync_in_hooks_and_one_transfer_per_step(output_dir, write_config, monkeypatch):
    from trainmon.hooks import collector

    transfers = []
    to_host = collector._to_host
    monkeypatch.setattr(collector, "_to_host", lambda flat: transfers.append(flat.numel()) or to_host(flat))
    steps = 3
    plain = _count_ops(write_config, False, steps)
    monitored = _count_ops(write_config, True, steps)
    assert monitored.get("aten._local_scalar_dense", 0) == plain.get("aten._local_scalar_dense", 0)
    # the step's single device→host copy carries every record of the step
    assert len(transfers) == steps and all(n > 1000 for n in transfers)
    for forbidden in ("to another device", "aten.item"):
        assert monitored.get(forbidden, 0) == plain.get(forbidden, 0), forbidden


def test_the_adam_update_copies_no_step_to_the_moments_device():
    """A step kept on the host beside moments on another device (torch's Adam on an accelerator) is read as a
    number, where a copy to the device would wait; a step on the moments' device is used there. Both give the
    bias-corrected update and ratio."""
    from trainmon.adapters.base import AdamPiece
    from trainmon.hooks.optimizer_hooks import _adam_update_and_ratio

    g = torch.Generator().manual_seed(0)
    m, v = torch.randn(50, generator=g), torch.rand(50, generator=g)
    betas, eps = (0.9, 0.999), 1e-8
    m_hat, v_hat = m / (1 - 0.9 ** 3), v / (1 - 0.999 ** 3)
    for step in (torch.tensor(3.0), 3):             # a tensor step's correction is computed in fp32: 1 - 0.999^3
        update, ratio = _adam_update_and_ratio(AdamPiece(m, v, step, betas, eps))   # keeps 4-5 digits
        torch.testing.assert_close(update, m_hat / (v_hat.sqrt() + eps), rtol=1e-4, atol=0)
        torch.testing.assert_close(ratio, m_hat / v_hat.sqrt(), rtol=1e-4, atol=0)
    host_step, copied = torch.tensor(3.0), []

    class StepCopies(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ == "_to_copy" and args[0] is host_step:
                copied.append((kwargs or {}).get("device"))
            return func(*args, **(kwargs or {}))

    with StepCopies():                              # moments on another device than the host's step
        update, _ = _adam_update_and_ratio(AdamPiece(m.to("meta"), v.to("meta"), host_step, betas, eps))
    assert update.device.type == "meta" and not copied, copied


def _hook_census(model, optimizer):
    counts = []
    for module in model.modules():
        counts += [len(module._forward_hooks), len(module._forward_pre_hooks), len(module._backward_hooks),
                   len(module._backward_pre_hooks), "forward" in module.__dict__]
    for p in model.parameters():
        counts += [len(p._post_accumulate_grad_hooks or {}), len(p._backward_hooks or {})]
    counts += [len(optimizer._optimizer_step_pre_hooks), len(optimizer._optimizer_step_post_hooks)]
    return counts


def test_stop_removes_every_hook_and_training_continues_unchanged(output_dir, write_config):
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = _hook_census(model, optimizer)
    config = {**FULL, "monitor_mbs_grad": True, "stack_info": True}
    with TrainerMon(write_config(**config)) as monitor:
        monitor.set_monitor(model, optimizer=optimizer)
        assert _hook_census(model, optimizer) != before
        run_steps(model, optimizer, 2)
    assert _hook_census(model, optimizer) == before
    assert not any(p._backward_hooks for p in model.parameters())
    # the rest of the run trains exactly as an unmonitored one
    reference = make_model()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    run_steps(reference, ref_opt, 2)
    assert run_steps(model, optimizer, 2) == run_steps(reference, ref_opt, 2)
    monitor.stop()  # a second stop is harmless


def test_step_gating(output_dir, write_config):
    monitor, *_ = train(write_config, steps=8, **{**FULL, "xy_distribution": False},
                        start_step=1, step_interval=2, collect_times=2)
    monitor.stop()
    assert sorted(set(read_family(monitor.output_dir, "grad_reduced").step)) == [1, 3]


def test_start_iteration_numbers_steps_from_there(output_dir, write_config):
    monitor, *_ = train(write_config, steps=3, start_iteration=10, wg_distribution=True, start_step=11, ops=OPS)
    monitor.stop()
    assert sorted(set(read_family(monitor.output_dir, "grad_reduced").step)) == [11, 12]


def test_module_ranks_excluding_this_rank_records_nothing_and_says_so(output_dir, write_config, caplog):
    with caplog.at_level("WARNING", logger="trainmon"):
        monitor, *_ = train(write_config, steps=2, **FULL, module_ranks=[1])
        monitor.stop()
    assert sorted(os.listdir(monitor.output_dir)) == ["run.json"]
    said = [r.getMessage() for r in caplog.records if "module_ranks" in r.getMessage()]
    assert said == ["trainmon: module_ranks [1] does not list rank 0, this job's only process: no statistics are "
                    "written"]


def test_dynamic_on_off_without_touching_the_users_file(output_dir, write_config, monkeypatch):
    monkeypatch.setenv("DYNAMIC_MONITOR", "true")
    config = {**FULL, "xy_distribution": False, "dynamic_on": False}
    path = write_config(**config)
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    monitor = TrainerMon(path)
    monitor.set_monitor(model, optimizer=optimizer)

    def rewrite(dynamic_on):
        with open(path, "w") as f:
            json.dump({**config, "strict": True, "dynamic_on": dynamic_on}, f)
        later = time.time_ns() + 10_000_000
        os.utime(path, ns=(later, later))
        return open(path).read()

    run_steps(model, optimizer, 2)            # steps 0, 1: off
    written = rewrite(True)                   # applied at the end of step 2 → steps 3, 4 collected
    run_steps(model, optimizer, 3)
    rewrite(False)                            # applied at the end of step 5 → nothing after
    run_steps(model, optimizer, 3)
    monitor.stop()
    assert sorted(set(read_family(monitor.output_dir, "grad_reduced").step)) == [3, 4, 5]
    state = json.loads((monitor.output_dir / "dynamic_state.json").read_text())
    assert state["dynamic_on"] is False and state["applied_at_step"] == 6
    assert json.loads(open(path).read())["dynamic_on"] is False and written  # only we wrote it


def test_a_dynamic_config_says_its_set_up_warnings_once_and_what_changed(output_dir, write_config, monkeypatch,
                                                                         caplog):
    """Each dynamic change installs the hooks again: what the set-up says is said once, and anew only where the new
    config says something else."""
    monkeypatch.setenv("DYNAMIC_MONITOR", "true")
    config = {**FULL, "dynamic_on": True, "module_ranks": [1], "alert": {"dump": True}}
    path = write_config(**config)
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def rewrite(**changed):
        with open(path, "w") as f:
            json.dump({**config, **changed}, f)
        later = time.time_ns() + 10_000_000
        os.utime(path, ns=(later, later))

    with caplog.at_level("WARNING", logger="trainmon"):
        monitor = TrainerMon(path)
        monitor.set_monitor(model, optimizer=optimizer)
        for changed in ({"dynamic_on": False}, {"dynamic_on": True}, {"module_ranks": [2]}):
            run_steps(model, optimizer, 2)
            rewrite(**changed)
        run_steps(model, optimizer, 2)
        monitor.stop()
    said = [r.getMessage() for r in caplog.records if any(key in r.getMessage() for key in ("module_ranks", "alert"))]
    assert said == [
        'trainmon: alert.dump saves tensors found by the NaN sentinel; add "sentinel": true to the config to get dumps',
        "trainmon: module_ranks [1] does not list rank 0, this job's only process: no statistics are written",
        "trainmon: module_ranks [2] does not list rank 0, this job's only process: no statistics are written"]
    state = json.loads((monitor.output_dir / "dynamic_state.json").read_text())
    assert state["applied_at_step"] == 7                     # the last change, written after step 5, was applied


def test_targets_select_modules_and_tuple_elements(output_dir, write_config):
    targets = {"layers.0": {"input": "tuple[1]:0", "output": "tensor"}, "head": {}}
    monitor, *_ = train(write_config, steps=1, targets=targets, xy_distribution=True, ops=OPS)
    monitor.stop()
    assert set(read_family(monitor.output_dir, "actv").name) == {
        "layers.0.input", "layers.0.output", "head.input", "head.output"}
    assert set(read_family(monitor.output_dir, "actv_grad").name) == {
        "layers.0.input", "layers.0.output", "head.input", "head.output"}


class Pair(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        return h, 2 * h


class PairNet(torch.nn.Module):
    """`pair` returns two activations; the loss gives them grads of 1 and 3 everywhere."""

    def __init__(self):
        super().__init__()
        self.pair = Pair()

    def forward(self, x):
        a, b = self.pair(x)
        return a.sum() + 3 * b.sum()


def test_output_and_output_grad_selectors_pick_their_own_leaves(output_dir, write_config):
    torch.manual_seed(0)
    model = PairNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # the weights stay: the output is recomputed below
    targets = {"pair": {"output": "tuple[2]:0", "output_grad": "tuple[2]:1"}}
    monitor = TrainerMon(write_config(targets=targets, xy_distribution=True, ops=["mean", "norm"]))
    monitor.set_monitor(model, optimizer=optimizer)
    x = torch.randn(2, 4)
    model(x).backward()
    optimizer.step()
    monitor.stop()
    with torch.no_grad():
        first = model.pair.lin(x)
    actv = read_family(monitor.output_dir, "actv").set_index("name")
    grads = read_family(monitor.output_dir, "actv_grad").set_index("name")
    assert set(actv.index) == {"pair.input", "pair.output"} and set(grads.index) == {"pair.output"}
    # The output record is of the first element (not twice it), the output-grad record of the second (3, not 1).
    assert actv.loc["pair.output", "norm"] == pytest.approx(torch.linalg.vector_norm(first).item(), rel=1e-5)
    assert actv.loc["pair.output", "mean"] == pytest.approx(first.mean().item(), rel=1e-5, abs=1e-6)
    assert grads.loc["pair.output", "mean"] == pytest.approx(3.0)
    assert grads.loc["pair.output", "norm"] == pytest.approx(3.0 * 8 ** 0.5)


class Shared(torch.nn.Module):
    """Calls one module twice and takes an integer mask."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x, mask):
        return self.lin(self.lin(x)) * mask


def test_repeated_calls_and_non_float_inputs(output_dir, write_config):
    model = Shared()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(write_config(all_xy=True, xy_distribution=True, ops=OPS))
    monitor.set_monitor(model, optimizer=optimizer)
    x = torch.randn(2, 4)
    model(x, torch.ones(2, 4, dtype=torch.int64)).sum().backward()
    optimizer.step()
    monitor.stop()
    actv = read_family(monitor.output_dir, "actv")
    assert set(actv.name) == {".input_0", ".output", "lin.input", "lin.output", "lin#1.input", "lin#1.output"}
    assert not actv[["nans"]].isna().any().any() and (actv.nans == 0).all()


def test_param_targets_match_whole_dotted_components(output_dir, write_config):
    model = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(11)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    monitor = TrainerMon(write_config(targets={"1": {}}, wg_distribution=True, ops=OPS))
    monitor.set_monitor(model, optimizer=optimizer)
    model(torch.randn(3, 2)).sum().backward()
    optimizer.step()
    monitor.stop()
    assert set(read_family(monitor.output_dir, "grad_reduced").name) == {"1.weight", "1.bias"}


def test_api_metrics_match_the_csv(output_dir, write_config):
    monitor, model, *_ = train(write_config, steps=2, **{**FULL, "format": ["csv", "api"]})
    wgrad = monitor.generate_wgrad_metrics()
    xy = monitor.generate_xy_metrics()
    params = monitor.generate_param_metrics()
    mv = monitor.generate_mv_metrics()
    monitor.stop()
    grads = read_family(monitor.output_dir, "grad_reduced")
    row = grads[(grads.name == "head.weight") & (grads.step == 1)].iloc[0]
    figures = wgrad["0:head.weight/rank0/post_grad"]
    assert figures["norm"] == pytest.approx(row["norm"], rel=1e-12)
    assert "0:head.weight/rank0/pre_grad" in wgrad
    assert "0:layers.0.mlp.output:0/rank0/actv" in xy and "0:layers.0.mlp.output:0/rank0/actv_grad" in xy
    assert "0:head.weight/rank0/param_updated" in params and "0:head.weight/rank0/exp_avg_sq" in mv
    updated = params["0:head.weight/rank0/param_updated"]["norm"]
    assert updated == pytest.approx(float(model.head.weight.detach().double().norm()), rel=1e-6)


def test_print_struct_and_stack_info(output_dir, write_config):
    monitor, *_ = train(write_config, steps=2, print_struct=True, stack_info=True, xy_distribution=True,
                        ops=OPS)
    monitor.stop()
    struct = json.loads((monitor.output_dir / "module_struct.json").read_text())
    assert struct["0:head"]["class"] == "Linear" and struct["0:head"]["parameters"]["weight"] == [64, 32]
    stacks = json.loads((monitor.output_dir / "stack_info.json").read_text())
    assert any("test_trainer_mon.py" in frame for frame in stacks["0:layers.1.mlp"])


def test_a_failing_hook_is_logged_once_and_training_goes_on(output_dir, write_config, monkeypatch, caplog):
    from trainmon.hooks import module_hooks

    original = module_hooks.ActivationHooks._record_activations

    def broken(self, collector, family, watched, *args):
        if watched.name == "layers.1.mlp":
            raise RuntimeError("boom")
        return original(self, collector, family, watched, *args)

    monkeypatch.setattr(module_hooks.ActivationHooks, "_record_activations", broken)
    with caplog.at_level(logging.ERROR, logger="trainmon"):
        monitor, _, _, losses = train(write_config, steps=3, **{**FULL, "strict": False})
        monitor.stop()
    assert len(losses) == 3
    messages = [r.getMessage() for r in caplog.records if "layers.1.mlp" in r.getMessage()]
    assert len(messages) == 1 and "training continues" in messages[0]
    names = set(read_family(monitor.output_dir, "actv").name)
    assert "layers.0.mlp.output" in names and "layers.1.mlp.0.output" in names
    assert "layers.1.mlp.output" not in names and "layers.1.mlp.input" not in names


def _records_of_a_loop_that_skips_a_failed_forward(write_config, monkeypatch, fail: bool) -> tuple[dict, list]:
    """Records of 4 steps of 2 micro-steps, by (family, name, step, micro-step, call index), and whether the input of
    the failed call is still alive after them (before the monitor stops); with `fail`, the first forward of step 1
    raises an out-of-memory error in the first Linear of `layers.1.mlp`, which the loop catches, and it goes on."""
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    monitor = TrainerMon(write_config(**{**FULL, "format": ["db"], "sentinel": True}))
    monitor.set_monitor(model, optimizer=optimizer, grad_acc_steps=2)
    armed, failed_inputs, linear = [False], [], torch.nn.functional.linear

    def out_of_memory(x, weight, bias=None):
        if armed[0] and weight is model.layers[1].mlp[0].weight:
            armed[0] = False
            failed_inputs.append(weakref.ref(x))
            raise torch.OutOfMemoryError("injected")
        return linear(x, weight, bias)

    monkeypatch.setattr(torch.nn.functional, "linear", out_of_memory)
    data = batches()
    for step in range(4):
        for micro in range(2):
            tokens, labels = next(data)
            if fail and (step, micro) == (1, 0):
                armed[0] = True
                with pytest.raises(torch.OutOfMemoryError):
                    lm_loss(model, tokens, labels)
            (lm_loss(model, tokens, labels) / 2).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    gc.collect()
    kept = [ref() is not None for ref in failed_inputs]
    monitor.stop()
    with open_run(monitor.output_dir, source="db") as run:
        frame = run.records()
    records = {(r.family, r.name, r.step, None if r.micro_step != r.micro_step else int(r.micro_step), r.call_index):
               (r.min, r.max, r.norm) for r in frame.itertuples()}
    return records, kept


def test_a_forward_that_raises_midway_leaves_the_steps_after_it_as_they_were(output_dir, write_config, monkeypatch):
    """A loop that skips a batch whose forward raised (an out-of-memory error, caught) goes on monitored: the modules
    that ran before the error are one more micro-step of that step, the forward run again is the next, and every
    other step's records (keys, call indices, values) are those of the loop without the error. Nothing of the failed
    forward is kept: its tensors are the memory the loop needs back."""
    clean, _ = _records_of_a_loop_that_skips_a_failed_forward(write_config, monkeypatch, fail=False)
    failed, kept = _records_of_a_loop_that_skips_a_failed_forward(write_config, monkeypatch, fail=True)
    assert kept == [False]
    assert {k: v for k, v in failed.items() if k[2] != 1} == {k: v for k, v in clean.items() if k[2] != 1}
    actv = {run: {(k[1], k[3]): v for k, v in records.items() if k[0] == "actv" and k[2] == 1}
            for run, records in (("clean", clean), ("failed", failed))}
    before_error = {name for name, micro in actv["failed"] if micro == 0}
    assert "layers.0.mlp.output" in before_error and "layers.1.mlp.0.input" not in before_error
    assert "head.output" not in before_error
    assert {(name, micro - 1): v for (name, micro), v in actv["failed"].items() if micro > 0} == actv["clean"]


def test_append_output_continues_an_existing_run(output_dir, write_config):
    first, *_ = train(write_config, steps=2, wg_distribution=True, ops=OPS)
    first.stop()
    run = first.output_dir.parent.name
    second, *_ = train(write_config, steps=2, start_iteration=2, wg_distribution=True, ops=OPS,
                       append_output=[run, run + "~"])
    second.stop()
    assert second.output_dir == first.output_dir
    assert sorted(set(read_family(first.output_dir, "grad_reduced").step)) == [0, 1, 2, 3]


class InPlaceRelu(torch.nn.Module):
    """Its ReLU changes the output of `lin` in place, from step `in_place_from` on."""

    def __init__(self, in_place_from: int = 0):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.relu = torch.nn.ReLU()
        self.out = torch.nn.Linear(8, 1)
        self.in_place_from = in_place_from
        self.step = 0

    def forward(self, x):
        self.relu.inplace = self.step >= self.in_place_from
        return self.out(self.relu(self.lin(x)))


def _train_in_place(write_config, caplog, model, steps):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = TrainerMon(write_config(all_xy=True, xy_distribution=True, forward_only=True, ops=OPS))
    monitor.set_monitor(model, optimizer=optimizer)
    x = torch.randn(16, 8)
    expected = []
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        for step in range(steps):
            model.step = step
            with torch.no_grad():  # not through the module: its hooks would record this call too
                expected.append(torch.nn.functional.linear(x, model.lin.weight, model.lin.bias))
            model(x).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    monitor.stop()
    return monitor, read_family(monitor.output_dir, "actv"), expected


def test_an_activation_modified_in_place_is_recorded_with_the_values_it_was_computed_with(output_dir, write_config,
                                                                                      caplog):
    torch.manual_seed(0)
    monitor, actv, expected = _train_in_place(write_config, caplog, InPlaceRelu(), steps=3)
    # A name is reduced in its hook the first time, and from then on when its tensor changed in place
    # before the next batch: no step loses it, nothing is said.
    for step in range(3):
        row = actv[(actv.step == step) & (actv.name == "lin.output")].iloc[0]
        assert row["min"] == pytest.approx(float(expected[step].min()), rel=1e-5) and row["min"] < 0
        assert actv[(actv.step == step) & (actv.name == "relu.output")].iloc[0]["min"] >= 0
    assert not [r for r in caplog.records if "lin.output" in r.getMessage()]
    assert json.loads((monitor.output_dir / "run.json").read_text())["records_dropped_in_place"] == {}


def test_a_late_in_place_change_drops_that_record_once_and_says_so(output_dir, write_config, caplog):
    torch.manual_seed(0)
    monitor, actv, expected = _train_in_place(write_config, caplog, InPlaceRelu(in_place_from=1), steps=3)
    # step 0 taught that lin.output can wait; at step 1 the held tensor changed before its batch: dropped
    assert "lin.output" in set(actv[actv.step == 0].name)
    assert "lin.output" not in set(actv[actv.step == 1].name)
    assert sum("lin.output" in r.getMessage() for r in caplog.records) == 1
    assert json.loads((monitor.output_dir / "run.json").read_text())["records_dropped_in_place"] == {"lin.output": 1}
    # step 2: it is reduced in its hook, before the ReLU, and shows the negative values the ReLU removes
    row = actv[(actv.step == 2) & (actv.name == "lin.output")].iloc[0]
    assert row["min"] == pytest.approx(float(expected[2].min()), rel=1e-5) and row["min"] < 0


@pytest.mark.parametrize("batch_mb", [0, 1])
def test_batched_and_per_hook_reduction_agree(output_dir, write_config, batch_mb):
    default, *_ = train(write_config, steps=2, grad_acc_steps=2, **FULL)
    default.stop()
    other, *_ = train(write_config, steps=2, grad_acc_steps=2, **FULL, stats_batch_mb=batch_mb)
    other.stop()
    for family in ["actv", "actv_grad"]:
        a = read_family(default.output_dir, family).sort_values(["name", "step", "micro_step"]).reset_index(drop=True)
        b = read_family(other.output_dir, family).sort_values(["name", "step", "micro_step"]).reset_index(drop=True)
        pd.testing.assert_frame_equal(a, b)


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
def test_activation_grads_equal_those_of_torch_module_backward_hooks(output_dir, write_config):
    """The input taps and output tensor hooks see what torch's full backward hooks call grad_input and
    grad_output, for every module call (a run of the same model with those hooks is the reference)."""
    config = dict(all_xy=True, xy_distribution=True, backward_only=True, ops=OPS, ndigits=17)
    monitor, *_ = train(write_config, steps=2, grad_acc_steps=2, **config)
    monitor.stop()
    written = read_family(monitor.output_dir, "actv_grad").set_index(["step", "micro_step", "name"]).norm

    model = make_model()
    forwards = []
    model.register_forward_pre_hook(lambda module, args: forwards.append(None))
    reference = {}

    def backward_hook(name):
        def hook(module, grad_input, grad_output):
            step, micro = divmod(len(forwards) - 1, 2)
            for io, grads in (("input", grad_input), ("output", grad_output)):
                for i, grad in enumerate(grads):
                    if grad is not None:
                        leaf = io if len(grads) == 1 else f"{io}_{i}"
                        reference[(step, micro, f"{name}.{leaf}")] = float(grad.double().norm())
        return hook

    for name, module in model.named_modules():
        module.register_full_backward_hook(backward_hook(name))
    run_steps(model, torch.optim.AdamW(model.parameters(), lr=1e-2), 2, grad_acc_steps=2)
    assert len(reference) > 80 and any(k[2].endswith(".input") for k in reference)
    for key, norm in reference.items():
        assert written[key] == pytest.approx(norm, rel=1e-6), key
    assert len(written) == len(reference), sorted(set(written.index) ^ set(reference))

class _Gate(torch.nn.Module):
    """Takes a tensor positionally, a number, an activation and a constant mask by keyword."""

    def forward(self, x, scale, *, gate, mask):
        return x * scale * torch.sigmoid(gate) + mask


class _GatedModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.gate = _Gate()

    def forward(self, x):
        h = self.proj(x)
        return self.gate(h, 3.0, gate=h * 2, mask=torch.zeros(8).masked_fill(torch.arange(8) > 5, float("-inf")))


def test_keyword_inputs_are_recorded_with_their_grads(output_dir, write_config):
    torch.manual_seed(0)
    model = _GatedModel()
    proj = copy.deepcopy(model.proj)  # the weights of the recorded step (the optimizer moves them)
    monitor = TrainerMon(write_config(all_xy=True, xy_distribution=True, ops=OPS, ndigits=17))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor.set_monitor(model, optimizer=optimizer)
    x = torch.randn(4, 8)
    model(x)[:, :6].pow(2).sum().backward()
    optimizer.step()
    monitor.stop()
    actv = read_family(monitor.output_dir, "actv").set_index("name").norm
    grads = read_family(monitor.output_dir, "actv_grad").set_index("name").norm

    h = proj(x).detach()
    positional, keyword = h.clone().requires_grad_(), (2 * h).requires_grad_()
    _Gate()(positional, 3.0, gate=keyword, mask=torch.zeros(8))[:, :6].pow(2).sum().backward()
    # the positional tensor is input_0, the number is not an input, the keyword activation is input_1, and
    # the constant mask (its -inf entries are no anomaly) is not an input
    assert not any(name.startswith("gate.input_2") for name in actv.index)
    assert actv["gate.input_0"] == pytest.approx(float(h.norm()), rel=1e-6)
    assert actv["gate.input_1"] == pytest.approx(float(2 * h.norm()), rel=1e-6)
    assert grads["gate.input_0"] == pytest.approx(float(positional.grad.norm()), rel=1e-6)
    assert grads["gate.input_1"] == pytest.approx(float(keyword.grad.norm()), rel=1e-6)


class _PassFirst(torch.nn.Module):
    """Returns its first input as it came, and the second scaled."""

    def forward(self, x, y):
        return x, y * 2


class _PassingModel(torch.nn.Module):
    """Modules that return their input as it came: an Identity, a dropout with p = 0, and one of two outputs."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj, self.out = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
        self.keep, self.drop, self.pair = torch.nn.Identity(), torch.nn.Dropout(0.0), _PassFirst()

    def forward(self, x):
        h = self.drop(self.keep(self.proj(x)))
        a, b = self.pair(h, h * 3)
        return self.out(a) + b + h


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
def test_modules_returning_their_input_have_the_records_and_grads_of_torch(output_dir, write_config):
    """A module returning its input as it came (Megatron's IdentityOp, dropout with p = 0) has an output record
    equal to its input's, and the output and input grads torch's full backward hooks see, in that order."""
    model = _PassingModel()
    reference_model = copy.deepcopy(model)
    monitor = TrainerMon(write_config(all_xy=True, xy_distribution=True, ops=OPS, ndigits=17, format=["csv", "db"]))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor.set_monitor(model, optimizer=optimizer)
    x = torch.randn(4, 8)
    model(x).pow(2).sum().backward()
    optimizer.step()
    monitor.stop()
    actv = read_family(monitor.output_dir, "actv").set_index("name")
    grads = read_family(monitor.output_dir, "actv_grad").set_index("name")

    reference, outputs = {}, {}
    for name, module in reference_model.named_modules():
        def backward_hook(module, grad_input, grad_output, name=name):
            for io, leaves in (("input", grad_input), ("output", grad_output)):
                for i, grad in enumerate(leaves):
                    if grad is not None:
                        reference[f"{name}.{io}" + ("" if len(leaves) == 1 else f"_{i}")] = grad.clone()
        module.register_full_backward_hook(backward_hook)
        module.register_forward_hook(lambda module, args, output, name=name: outputs.setdefault(name, output))
    reference_model(x).pow(2).sum().backward()

    h = outputs["proj"].detach()
    for name in ["keep.output", "drop.output", "pair.output_0"]:
        assert actv.norm[name] == actv.norm["proj.output"] == pytest.approx(float(h.double().norm()), rel=1e-6)
        assert actv["min"][name] == float(h.min()) and actv["max"][name] == float(h.max())
    assert actv.norm["pair.output_1"] == pytest.approx(float(6 * h.norm()), rel=1e-6)
    assert set(grads.index) == set(reference)
    for name, grad in reference.items():
        assert grads.norm[name] == pytest.approx(float(grad.double().norm()), rel=1e-6), name
    with sqlite3.connect(monitor.output_dir / "monitor.db") as conn:
        call_index = dict(conn.execute("SELECT name, call_index FROM records JOIN tags ON tags.id = tag_id "
                                       "WHERE family = 'actv_grad'"))
    for output, input_ in [("keep.output", "keep.input"), ("drop.output", "drop.input"),
                           ("pair.output_0", "pair.input_0")]:  # backward reaches a module's output before its input
        assert call_index[output] < call_index[input_]


class _Checkpointed(torch.nn.Module):
    """Two MLP blocks, run through torch.utils.checkpoint when `reentrant` is not None."""

    def __init__(self, reentrant):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(),
                                                              torch.nn.Linear(32, 16)) for _ in range(2))
        self.reentrant = reentrant

    def forward(self, x):
        for block in self.blocks:
            if self.reentrant is None:
                x = x + block(x)
            else:
                x = x + torch.utils.checkpoint.checkpoint(block, x, use_reentrant=self.reentrant)
        return x


@pytest.mark.parametrize("reentrant", [True, False])
def test_activation_checkpointing_records_each_call_once_with_its_grads(output_dir, write_config, reentrant):
    """The forward run again inside backward records nothing twice, and the grads keep the first run's names."""
    frames = {}
    for mode in (None, reentrant):
        model = _Checkpointed(mode)
        monitor = TrainerMon(write_config(all_xy=True, xy_distribution=True, ops=OPS, ndigits=17))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        monitor.set_monitor(model, optimizer=optimizer, grad_acc_steps=2)
        gen = torch.Generator().manual_seed(1)
        for _ in range(2):
            for _ in range(2):
                model(torch.randn(4, 16, generator=gen, requires_grad=True)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        monitor.stop()
        frames[mode] = {family: read_family(monitor.output_dir, family)
                        .set_index(["step", "micro_step", "name"]).sort_index()[["norm", "min", "max"]]
                        for family in ("actv", "actv_grad")}
    for family in ("actv", "actv_grad"):
        plain, checkpointed = frames[None][family], frames[reentrant][family]
        assert list(checkpointed.index) == list(plain.index), family
        assert not any("#" in name for name in checkpointed.index.get_level_values("name"))
        pd.testing.assert_frame_equal(checkpointed, plain, rtol=1e-6)
    assert "blocks.1.0.input" in set(frames[reentrant]["actv_grad"].index.get_level_values("name"))


class BiasReturningLinear(torch.nn.Module):
    """Returns its bias Parameter beside the output, as Megatron's parallel linear layers do."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(8, 8) * 0.1)
        self.bias = torch.nn.Parameter(torch.zeros(8))

    def forward(self, x):
        return x @ self.weight.t(), self.bias


class BiasReturningModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = BiasReturningLinear()

    def forward(self, x):
        out, bias = self.fc(x)
        return (out + bias).square().mean()


def _live_tensor_hooks(model) -> int:
    return sum(len(p._backward_hooks or {}) for p in model.parameters())


def test_no_hook_is_left_on_parameters_a_module_returns(output_dir, write_config):
    torch.manual_seed(0)
    model = BiasReturningModel()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    monitor = TrainerMon(write_config(all_xy=True, xy_distribution=True, sentinel=True, ops=OPS))
    monitor.set_monitor(model, optimizer=optimizer)
    x = torch.randn(4, 8)
    for _ in range(30):
        model(x).backward()
        optimizer.step()
        optimizer.zero_grad()
        assert _live_tensor_hooks(model) == 0
    monitor.stop()
    per_step = read_family(monitor.output_dir, "actv_grad").groupby("step").size()
    assert per_step.nunique() == 1 and len(per_step) == 30, per_step.value_counts()
    assert _live_tensor_hooks(model) == 0
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_input_grad_of_a_module_that_modifies_its_input_in_place(output_dir, write_config):
    """The ReLU (inplace) overwrites the tensor it is given: its input grad is still the grad its backward
    computed for that input."""
    torch.manual_seed(0)
    model = InPlaceRelu()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = TrainerMon(write_config(all_xy=True, xy_distribution=True, ops=OPS))
    monitor.set_monitor(model, optimizer=optimizer)
    expected = []
    for _ in range(3):
        x = torch.randn(16, 8)
        # the same computation, not through the modules (their hooks would record it)
        h = torch.nn.functional.linear(x, model.lin.weight, model.lin.bias)
        y = torch.nn.functional.linear(torch.relu(h), model.out.weight, model.out.bias).sum()
        expected.append(torch.autograd.grad(y, h)[0])
        model(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    monitor.stop()
    grads = read_family(monitor.output_dir, "actv_grad")
    for step in range(3):
        row = grads[(grads.step == step) & (grads.name == "relu.input")].iloc[0]
        assert row["norm"] == pytest.approx(float(expected[step].norm()), rel=1e-5) and row["norm"] > 0


def _tensors_alive_after_a_step(model, optimizer, grad_acc_steps: int) -> tuple[int, int]:
    """(made, alive): the module outputs and their grads one step makes, and how many of them are still alive
    once the step is over (its optimizer step taken, its grads zeroed, its losses dropped)."""
    from torch.utils._pytree import tree_flatten

    refs = []

    def watch(module, args, output):
        for leaf in tree_flatten(output)[0]:
            if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
                refs.append(weakref.ref(leaf))
                if leaf.requires_grad:
                    leaf.register_hook(lambda grad: refs.append(weakref.ref(grad)))

    handles = [m.register_forward_hook(watch) for m in model.modules()]
    run_steps(model, optimizer, 1, grad_acc_steps)
    for handle in handles:
        handle.remove()
    return len(refs), sum(ref() is not None for ref in refs)


@pytest.mark.parametrize("batch_mb", [32, 1, 0])
def test_held_activations_do_not_outlive_their_step(output_dir, write_config, batch_mb):
    """Activations and their grads held for a batched reduction are let go when it runs, by the step's end at
    the latest: once a step is over, none of its module outputs or their grads is alive, as without the monitor."""
    plain = make_model()
    made, alive = _tensors_alive_after_a_step(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2), 2)
    assert made > 0 and alive == 0
    monitor, model, optimizer, _ = train(write_config, steps=2, grad_acc_steps=2, **FULL, stats_batch_mb=batch_mb)
    made, alive = _tensors_alive_after_a_step(model, optimizer, 2)
    monitor.stop()
    assert made > 0 and alive == 0, (made, alive)


def _survivors_of_a_forward(model, optimizer, writer=None) -> int:
    """Objects made by one forward pass that outlive a garbage collection run right after it: those the
    collector moves towards its oldest generation, whose full collections pause the whole process. The
    writer thread is drained first: the files it opens while writing earlier steps are not the forward's."""
    from trainmon.demo import lm_loss
    from training import batches

    tokens, labels = next(batches())
    if writer is not None:
        writer.drain()
    gc.collect()
    gc.disable()
    try:
        loss = lm_loss(model, tokens, labels)
        gc.collect(0)
        survivors = len(gc.get_objects(1))
        loss.backward()
    finally:
        gc.enable()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return survivors


@pytest.mark.parametrize("config, per_call", [(FULL, 10), ({"sentinel": True}, 8)], ids=["full", "sentinel"])
def test_a_monitored_forward_leaves_the_garbage_collector_few_objects(output_dir, write_config, config, per_call):
    """Past the steps that make a run's record keys and grad hooks, a forward pass's hooks keep few objects
    per module call for the collector. Every activation and grad recorded: the input taps' autograd nodes and
    aliases, their grad hooks' dicts, a weak reference per tensor; the sentinel: a grad consumer and its hook
    per module input, a weak reference per tensor. The step's own bookkeeping holds numbers."""
    plain = make_model(layers=4)
    plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    run_steps(plain, plain_optimizer, 2)
    monitor, model, optimizer, _ = train(write_config, steps=3, model=make_model(layers=4), **config)
    calls = []
    handles = [m.register_forward_hook(lambda *_: calls.append(1)) for m in model.modules()]
    # the monitor's writer is drained before each: its work on the monitored step must not land in the plain count
    extra = (_survivors_of_a_forward(model, optimizer, monitor._writer)
             - _survivors_of_a_forward(plain, plain_optimizer, monitor._writer))
    for handle in handles:
        handle.remove()
    monitor.stop()
    assert 0 < extra < per_call * len(calls), (extra, len(calls))
