"""The sentinel and the activation hooks run as one wrapper around each module's forward (in_graph.around_forward):
what reads or replaces a module's forward, or copies the module, meets the module as it would unmonitored."""
import copy
import inspect

import pytest
import torch

from test_csv_output import FULL, read_family
from training import make_model, run_steps
from trainmon import TrainerMon

pd = pytest.importorskip("pandas")
CONFIG = {**FULL, "sentinel": True}


def monitored(write_config, model):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    monitor = TrainerMon(write_config(**CONFIG))
    monitor.set_monitor(model, optimizer=optimizer)
    return monitor, optimizer


def test_the_wrapper_keeps_the_forward_signature_and_goes_with_the_monitor(output_dir, write_config):
    model = make_model()
    signatures = {name: inspect.signature(m.forward) for name, m in model.named_modules()}
    monitor, _ = monitored(write_config, model)
    for name, module in model.named_modules():
        assert module.forward.__self__ is module
        assert inspect.signature(module.forward) == signatures[name], name  # what transformers' Trainer reads
    monitor.stop()
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_a_deep_copy_of_a_monitored_model_computes_with_its_own_weights(output_dir, write_config):
    model = make_model()
    monitor, _ = monitored(write_config, model)
    twin = copy.deepcopy(model)                        # an EMA copy, made while monitored
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(0.5)
    reference = make_model()                           # unmonitored, with the copy's weights
    reference.load_state_dict(twin.state_dict())
    tokens = torch.randint(0, 64, (2, 16))
    for m in twin.modules():                           # the copy's wrappers are bound to the copy
        assert m.forward.__self__ is m
    torch.testing.assert_close(twin(tokens), reference(tokens), rtol=0, atol=0)
    assert not torch.allclose(twin(tokens), model(tokens))
    monitor.stop()


class _Counting:
    """An instance-level forward in the way accelerate's hooks set one: calls the forward it replaced."""

    def __init__(self, module):
        self.inner, self.calls = module.forward, 0
        module.forward = self

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.inner(*args, **kwargs)


def test_forwards_replaced_before_and_after_the_monitor_keep_working(output_dir, write_config):
    model = make_model()
    head = model.head
    before = _Counting(head)                           # replaced before trainmon: trainmon's wrapper calls it
    monitor, optimizer = monitored(write_config, model)
    after = _Counting(head)                            # replaced after: it calls trainmon's wrapper
    run_steps(model, optimizer, 1)
    monitor.stop()
    assert before.calls == after.calls == 1
    assert head.forward is after                       # not undone by the monitor's stop
    actv = read_family(monitor.output_dir, "actv")
    assert {"head.input", "head.output"} <= set(actv.name)
    model(torch.randint(0, 64, (2, 16)))               # the stopped wrapper between the two passes the call on
    assert before.calls == after.calls == 2
    assert len(read_family(monitor.output_dir, "actv")) == len(actv)


def test_a_forward_hook_registered_before_the_monitor_is_seen_by_it(output_dir, write_config):
    """Output replaced by a forward hook: the module's hooks stay hooks, after the one that replaces it."""
    model = make_model()
    model.head.register_forward_hook(lambda module, args, output: output * 2)
    monitor, optimizer = monitored(write_config, model)
    assert "forward" not in model.head.__dict__ and "forward" in model.layers[0].__dict__
    outputs = []
    model.head.register_forward_hook(lambda module, args, output: outputs.append(output.detach()))
    run_steps(model, optimizer, 1)
    monitor.stop()
    actv = read_family(monitor.output_dir, "actv").set_index("name")
    assert actv.norm["head.output"] == pytest.approx(float(outputs[0].double().norm()), rel=1e-6)


def test_a_group_with_nothing_to_do_in_a_call_is_skipped_before_and_after_it():
    """A call where a group's `active()` is False (a step that is not collected) runs neither its before nor its
    after; the groups that are active, or have no `active`, run as always. The answer is taken once a call."""
    from trainmon.hooks import in_graph

    module, ran, recording = torch.nn.Linear(4, 4), [], [False]

    def answer():
        ran.append("asked")
        return recording[0]

    handles = [in_graph.around_forward(module, kind, lambda m, args, kwargs, kind=kind: ran.append(f"{kind} before"),
                                       lambda m, args, kwargs, out, kind=kind: ran.append(f"{kind} after"),
                                       active=active)
               for kind, active in (("gated", answer), ("always", None))]
    x = torch.randn(2, 4)
    module(x)
    assert ran == ["asked", "always before", "always after"]
    ran.clear()
    recording[0] = True
    torch.testing.assert_close(module(x), torch.nn.functional.linear(x, module.weight, module.bias))
    assert ran == ["asked", "gated before", "always before", "gated after", "always after"]
    for handle in handles:
        handle.remove()
    ran.clear()
    module(x)
    assert ran == [] and "forward" not in module.__dict__


def test_an_evaluation_forward_runs_neither_the_sentinel_nor_the_activation_hooks(output_dir, write_config,
                                                                                 monkeypatch):
    """The sentinel probes training forwards and the activation hooks record them (without
    `eval_xy_distribution`): in a validation loop or a `generate` their wrappers skip them, and nothing is recorded."""
    from trainmon.hooks.module_hooks import ActivationHooks
    from trainmon.hooks.sentinel import NanSentinel

    ran = []
    for group in (ActivationHooks, NanSentinel):
        make = group._make_pre_forward

        def counted(hooks, *args, make=make, group=group):
            hook = make(hooks, *args)

            def pre_hook(module, call_args, kwargs):
                ran.append(group.__name__)
                return hook(module, call_args, kwargs)

            return pre_hook

        monkeypatch.setattr(group, "_make_pre_forward", counted)
    model = make_model()
    monitor, optimizer = monitored(write_config, model)
    try:
        run_steps(model, optimizer, 1)
        trained, ran[:] = list(ran), []
        model.eval()
        with torch.no_grad():
            model(torch.randint(0, 64, (2, 16)))
    finally:
        monitor.stop()
    assert trained.count("ActivationHooks") == trained.count("NanSentinel") > 10  # every module's call
    assert ran == []
    assert set(read_family(monitor.output_dir, "actv").step) == {0}
