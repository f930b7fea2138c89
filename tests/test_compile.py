"""Compiled training with trainmon attached: `torch.compile(model)` (default and `fullgraph=True`) and
block-by-block compile train to the end, trainmon adds no graph break and no graph, the records are the
eager ones, and an Inf in one block is named exactly. `aot_eager` traces as inductor does (Dynamo, then
AOTAutograd) without its C++ compile time; one end-to-end test uses inductor."""
import collections
import contextlib
import gc
import json
import logging
import re

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import counters
from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
from torch._functorch import config as functorch_config
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from training import DEVICES, batches, make_model
from trainmon import TrainerMon
from trainmon.cli import main as cli_main
from trainmon.core.events import SENTINEL_RULE
from trainmon.demo import lm_loss
from trainmon.hooks import in_graph
from trainmon.hooks.module_hooks import ActivationHooks
from trainmon.read import open_run

OPS = ["min", "max", "norm", "nans", "infs"]
TIERS = {
    "sentinel": {"sentinel": True},
    "weight_grads": {"wg_distribution": True},
    "activations": {"xy_distribution": True, "all_xy": True, "forward_only": True},
    "activation_grads": {"xy_distribution": True, "all_xy": True, "backward_only": True},
    "adam_state": {"mv_distribution": True},
}
ALL = {k: v for tier in TIERS.values() for k, v in tier.items() if k not in ("forward_only", "backward_only")}
GA, STEPS = 2, 3
MODES = ("default", "fullgraph", "blocks", "in_place")


def slow_but(values, fast) -> list:
    """`values` to parametrize a test, each marked slow but those in `fast`: every case compiles a model, and the fast
    set keeps one or two of them."""
    return [value if value in fast else pytest.param(value, marks=pytest.mark.slow) for value in values]


def compiled(model, mode: str, backend: str = "aot_eager"):
    """`model` compiled as `mode` says: the whole model, with fullgraph, in place, or each block (torchtitan's
    way)."""
    if mode == "blocks":
        for i, block in enumerate(model.layers):
            model.layers[i] = torch.compile(block, backend=backend)
        return model
    if mode == "in_place":  # Module.compile(): the root's own hooks are inside the graph too
        model.compile(backend=backend)
        return model
    return torch.compile(model, backend=backend, fullgraph=mode == "fullgraph")


def train(model, optimizer, fault=None, steps=STEPS):
    """GA micro-batches per step; `fault(step, micro)` runs before each forward. Returns the losses."""
    data, losses = batches(device=next(model.parameters()).device), []
    for step in range(steps):
        for micro in range(GA):
            if fault is not None:
                fault(step, micro)
            tokens, labels = next(data)
            loss = lm_loss(model, tokens, labels) / GA
            loss.backward()
            losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses


def monitored_run(write_config, config: dict | None, mode: str | None, backend="aot_eager", device="cpu",
                  prepare=None):
    """(losses, graph breaks, graphs, monitor) of a 4-block run; mode None is eager. `prepare(model)` runs first."""
    torch._dynamo.reset()
    counters.clear()
    model = make_model(layers=4, device=device)
    if prepare is not None:
        prepare(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    run_model = model if mode is None else compiled(model, mode, backend)
    monitor = None
    if config is not None:
        monitor = TrainerMon(write_config(ops=OPS, format=["db"], targets={}, **config))
        monitor.set_monitor(run_model, optimizer=optimizer, grad_acc_steps=GA)
    try:
        losses = train(run_model, optimizer)
    finally:  # a failed run's hooks would stay on, in the module-wide state of later tests' compiled graphs
        if monitor is not None:
            monitor.stop()
    return losses, sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"], monitor


@pytest.fixture(scope="module")
def unmonitored():
    """Losses, breaks and graphs of the unmonitored compiled runs, per mode."""
    return {mode: monitored_run(None, None, mode)[:3] for mode in MODES}


@pytest.mark.slow
@pytest.mark.parametrize("mode", slow_but(MODES, {"default", "blocks"}))
@pytest.mark.parametrize("tier", slow_but([*TIERS, "all"], {"all"}))
def test_compiled_training_runs_to_the_end_with_no_graph_break_from_trainmon(output_dir, write_config, unmonitored,
                                                                            tier, mode):
    losses, breaks, graphs, monitor = monitored_run(write_config, ALL if tier == "all" else TIERS[tier], mode)
    base_losses, base_breaks, base_graphs = unmonitored[mode]
    assert base_breaks == 0 and breaks == 0
    assert graphs == base_graphs == 1  # and no recompile: one graph for all four blocks too
    assert losses == base_losses  # monitoring does not change the numerics
    with open_run(monitor.output_dir) as run:
        assert run.ranks == [0]
        if tier not in ("sentinel", "activation_grads"):  # the sentinel writes probes only when one fails
            assert len(run.records()), "records were written"


@pytest.mark.parametrize("mode", slow_but(["default", "blocks"], {"blocks"}))
def test_trainmon_attached_after_the_first_compiled_step_records_the_modules_inside(output_dir, write_config, mode):
    """Dynamo does not guard on the hooks of the modules it inlines: a graph compiled before trainmon was attached
    would run on without them. Attaching drops it, and the modules inside are recorded as with an early attach."""
    torch._dynamo.reset()
    model = make_model(layers=4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    run_model = compiled(model, mode)
    train(run_model, optimizer, steps=1)                          # compiled, unmonitored
    monitor = TrainerMon(write_config(ops=OPS, format=["db"], targets={}, **TIERS["activations"]))
    monitor.set_monitor(run_model, optimizer=optimizer, grad_acc_steps=GA)
    train(run_model, optimizer, steps=2)
    monitor.stop()
    names = {key[1] for key in _records(monitor) if key[0] == "actv"}
    assert {"layers.0.mlp.0.output", "layers.3.attn.output"} <= names


def _records(monitor) -> dict:
    with open_run(monitor.output_dir, source="db") as run:
        frame = run.records()
    return {(r.family, r.name, r.step, None if r.micro_step != r.micro_step else int(r.micro_step)): r
            for r in frame.itertuples()}


@pytest.mark.slow
@pytest.mark.parametrize("mode", slow_but(["default", "fullgraph", "blocks"], {"blocks"}))
def test_compiled_records_are_the_eager_ones(output_dir, write_config, caplog, mode):
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        *_, eager = monitored_run(write_config, ALL, None)
        *_, comp = monitored_run(write_config, ALL, mode)
    eager_records, compiled_records = _records(eager), _records(comp)
    assert not any("_orig_mod" in key[1] for key in compiled_records)
    # Every family, the grads of activations made inside the compiled region included, and nothing said
    assert set(compiled_records) == set(eager_records)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    families = {key[0] for key in compiled_records}
    assert {"actv", "actv_grad", "grad_unreduced", "grad_reduced", "exp_avg", "exp_avg_sq"} <= families
    for key, got in compiled_records.items():
        want = eager_records[key]
        for op in OPS:
            assert getattr(got, op) == pytest.approx(getattr(want, op), rel=1e-4, abs=1e-6), (key, op)


OBSERVE = (torch.ops.trainmon.observe, torch.ops.trainmon.observe.default)


def counting_ops(graphs: list):
    """A Dynamo backend that traces as `aot_eager` does, and appends to `graphs` how many `trainmon::observe` ops each
    graph it is given holds."""
    aot_eager = torch._dynamo.lookup_backend("aot_eager")

    def backend(graph_module, example_inputs):
        graphs.append(sum(node.target in OBSERVE for node in graph_module.graph.nodes))
        return aot_eager(graph_module, example_inputs)

    return backend


@pytest.mark.parametrize("mode", slow_but(MODES, {"default"}))
def test_a_step_not_collected_runs_no_activation_hook_inside_a_compiled_region(output_dir, write_config, monkeypatch,
                                                                             mode):
    """`step_interval`: on a step that is not collected the activation hooks do not run. Each module's wrapper skips
    them in eager mode. A compiled module's forward runs a graph of its own there, traced without trainmon's ops and
    compiled once. The collected steps record what eager mode records."""
    ran = collections.Counter()  # activation pre-hooks run, by step
    make_pre_forward = ActivationHooks._make_pre_forward

    def counted(hooks, watched):
        hook = make_pre_forward(hooks, watched)

        def pre_hook(module, args, kwargs):
            ran[hooks.state.collector.step] += 1
            return hook(module, args, kwargs)

        return pre_hook

    monkeypatch.setattr(ActivationHooks, "_make_pre_forward", counted)
    config = {**{k: v for k, v in ALL.items() if k != "sentinel"}, "step_interval": 2}  # the sentinel runs every step
    *_, eager = monitored_run(write_config, config, None)
    in_eager = dict(ran)
    ran.clear()
    graphs = []
    *_, comp = monitored_run(write_config, config, mode, backend=counting_ops(graphs))
    eager_records, compiled_records = _records(eager), _records(comp)
    assert {key[2] for key in compiled_records} == {0, 2}
    assert set(compiled_records) == set(eager_records)
    for key, got in compiled_records.items():
        for op in OPS:
            assert getattr(got, op) == pytest.approx(getattr(eager_records[key], op), rel=1e-4, abs=1e-6), (key, op)
    assert ran[0] == in_eager[0] and ran[2] == in_eager[2]          # collected: every hook ran
    assert 1 not in in_eager and 1 not in ran                       # not collected: none ran
    assert len(graphs) == 2 and graphs[0] > 0 and graphs[1] == 0   # one graph with the ops, one without


def test_compiled_blocks_inside_activation_checkpointing_say_which_grads_they_do_not_collect(output_dir, write_config,
                                                                                           caplog):
    """Each block compiled, then put in torch's checkpoint wrapper (the order torchtitan does not use): the backward
    runs each block's graph again, whose ops carry no request for the grads inside it. One message says so; the
    blocks' own grads and every other record are the eager run's."""
    def compiled_then_checkpointed(model):
        for i, block in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(torch.compile(block, backend="aot_eager"))

    config = TIERS["activation_grads"] | {"backward_only": False}
    *_, eager = monitored_run(write_config, config, None, prepare=checkpointed_blocks)
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        *_, comp = monitored_run(write_config, config, None, prepare=compiled_then_checkpointed)
    assert [r.getMessage() for r in caplog.records].count(f"trainmon: {in_graph.RECOMPUTED_GRADS_REFUSED}") == 1
    eager_records, compiled_records = _records(eager), _records(comp)
    missing = set(eager_records) - set(compiled_records)
    assert missing and all(re.match(r"layers\.\d\._checkpoint_wrapped_module\.\w", key[1]) for key in missing)
    assert {("actv_grad", f"layers.{i}._checkpoint_wrapped_module.{io}", 2, 1) for i in range(4)
            for io in ("input", "output")} <= set(compiled_records)
    assert set(compiled_records) < set(eager_records)


@pytest.mark.parametrize("mode", slow_but(["default", "blocks"], {"blocks"}))
def test_an_evaluation_forward_of_a_compiled_model_runs_a_graph_without_the_ops(output_dir, write_config, mode):
    """Neither the sentinel nor the activations look at an evaluation forward (without `eval_xy_distribution`): its
    graph is traced without trainmon's ops, and a training step after it runs the graph with them again."""
    graphs = []
    model = make_model(layers=4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    run_model = compiled(model, mode, counting_ops(graphs))
    monitor = TrainerMon(write_config(ops=OPS, format=["db"], targets={}, **ALL))
    monitor.set_monitor(run_model, optimizer=optimizer, grad_acc_steps=GA)
    torch._dynamo.reset()
    try:
        train(run_model, optimizer, steps=1)
        run_model.eval()
        with torch.no_grad():
            run_model(next(batches())[0])
        run_model.train()
        train(run_model, optimizer, steps=1)
    finally:
        monitor.stop()
    assert len(graphs) == 2 and graphs[0] > 0 and graphs[1] == 0
    assert {key[2] for key in _records(monitor) if key[0] == "actv"} == {0, 1}


@pytest.mark.parametrize("mode", slow_but(["eager", "default", "blocks"], {"eager", "default"}))
def test_what_a_step_holds_for_its_backward_is_freed_without_the_cycle_collector(output_dir, write_config, mode):
    """What the hooks keep for the backward (the grads each call asks for, and whom for; inside a compiled region,
    what its graph hands back) is freed by reference counting once nothing needs it: in a reference cycle it would
    wait for Python's garbage collector, whose collections then run more often and scan more (a pause of hundreds of
    ms in a large process)."""
    torch._dynamo.reset()
    model = make_model(layers=4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    run_model = model if mode == "eager" else compiled(model, mode)
    monitor = TrainerMon(write_config(ops=OPS, format=["db"], targets={}, **ALL))
    monitor.set_monitor(run_model, optimizer=optimizer, grad_acc_steps=GA)
    train(run_model, optimizer, steps=2)  # compiled, and every hook's first-call work done
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what the collector finds stays in `gc.garbage`, to be named
    try:
        train(run_model, optimizer, steps=2)
        gc.collect()
        # trainmon's own objects only: torch's caches may let go of an earlier test's compiled graphs meanwhile
        garbage = collections.Counter(type(o).__qualname__ for o in gc.garbage
                                      if type(o).__module__.startswith("trainmon."))
    finally:
        gc.garbage.clear()
        gc.set_debug(0)
        gc.enable()
    monitor.stop()
    assert len(_records(monitor)) > 0
    assert not garbage


def _activation_order(monitor) -> list:
    """(step, micro-step, call index, family, name) of the activation and activation-grad records, in call order."""
    with open_run(monitor.output_dir, source="db") as run:
        frame = run.records()
    return sorted((r.step, r.micro_step, r.call_index, r.family, r.name) for r in frame.itertuples()
                  if r.family in ("actv", "actv_grad"))


def hooks_of_their_own(model):
    """A forward pre-hook and a forward hook on every module (as FSDP2 has on the modules it shards): trainmon's then
    go on as hooks too, not around the forward."""
    for module in model.modules():
        module.register_forward_pre_hook(lambda module, args: None)
        module.register_forward_hook(lambda module, args, output: None)


@pytest.mark.slow
@pytest.mark.parametrize("mode,prepare", [
    *(pytest.param(mode, None, marks=() if mode == "default" else pytest.mark.slow) for mode in MODES),
    pytest.param("blocks", hooks_of_their_own, marks=pytest.mark.slow)],
                         ids=[*MODES, "blocks-hooks_of_their_own"])
def test_compiled_activation_grads_take_the_eager_places_in_the_call_order(output_dir, write_config, mode, prepare):
    """Inside a compiled region the grads come to the hooks from the compiled backward: at the place where eager
    grad hooks record them, with the same call indices, down to a module and its last submodule, which return one
    tensor (eager records the submodule's first)."""
    config = TIERS["activation_grads"] | {"backward_only": False}
    *_, eager = monitored_run(write_config, config, None, prepare=prepare)
    *_, comp = monitored_run(write_config, config, mode, prepare=prepare)
    order = _activation_order(comp)
    assert order == _activation_order(eager)
    grads = [name for step, micro, _, family, name in order if (step, micro, family) == (1, 1, "actv_grad")]
    assert grads.index("layers.2.mlp.2.output") + 1 == grads.index("layers.2.mlp.output")
    assert grads.index("head.output") + 1 == grads.index(".output")
    assert grads.index("layers.2.mlp.0.input") < grads.index("layers.2.mlp.input") < grads.index("layers.2.input")


def checkpointed_blocks(model):
    """Each block in torch's checkpoint wrapper, as torchtitan's activation checkpointing puts it."""
    for i, block in enumerate(model.layers):
        model.layers[i] = checkpoint_wrapper(block)


@pytest.mark.slow
@pytest.mark.parametrize("mode", slow_but(["default", "blocks"], {"default"}))
def test_activation_checkpointing_inside_a_compiled_region_trains_and_says_what_it_does_not_collect(
        output_dir, write_config, caplog, mode):
    """torch recomputes in the backward what a checkpointed region of a compiled graph saves: there no grad is tapped,
    and one message says so. The blocks' own grads (their wrappers' calls, outside the checkpointed region) and
    every other record are the eager run's."""
    config = TIERS["activation_grads"] | {"backward_only": False, "squash_name": True}
    *_, eager = monitored_run(write_config, config, None, prepare=checkpointed_blocks)
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        losses, breaks, graphs, comp = monitored_run(write_config, config, mode, prepare=checkpointed_blocks)
    assert (breaks, graphs) == (0, 1) and len(losses) == STEPS * GA
    assert [r.getMessage() for r in caplog.records].count(f"trainmon: {in_graph.SUBGRAPH_GRADS_REFUSED}") == 1
    eager_records, compiled_records = _records(eager), _records(comp)
    missing = set(eager_records) - set(compiled_records)
    assert missing and all(key[0] == "actv_grad" and re.match(r"layers\.\d\.\w", key[1]) for key in missing)
    assert {("actv_grad", f"layers.{i}.{io}", 2, 1) for i in range(4) for io in ("input", "output")} <= \
        set(compiled_records)
    assert set(compiled_records) < set(eager_records)
    for key, got in compiled_records.items():
        assert got.norm == pytest.approx(eager_records[key].norm, rel=1e-5, abs=1e-9), key


@pytest.mark.slow
@pytest.mark.parametrize("mode", slow_but(["default", "blocks"], {"default"}))
def test_compiled_activation_grads_are_those_of_a_full_backward_hook(output_dir, write_config, mode):
    """The grads a compiled graph hands the hooks are the `grad_output` and `grad_input` a full backward hook on the
    module sees: an input's grad as the module's own backward computed it, before the residual branch's is added
    (a block's input feeds its first norm and its residual sum)."""
    torch._dynamo.reset()
    reference, seen = make_model(layers=4), {}
    for name in ("layers.1.ln1", "layers.1.mlp"):
        dict(reference.named_modules())[name].register_full_backward_hook(
            lambda module, grad_input, grad_output, name=name: seen.update(
                {f"{name}.input": grad_input[0], f"{name}.output": grad_output[0]}))
    tokens, labels = next(batches())
    lm_loss(reference, tokens, labels).backward()
    model = make_model(layers=4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    run_model = compiled(model, mode)
    monitor = TrainerMon(write_config(ops=OPS, format=["db"], targets={}, **TIERS["activation_grads"]))
    monitor.set_monitor(run_model, optimizer=optimizer)
    lm_loss(run_model, tokens, labels).backward()
    optimizer.step()
    monitor.stop()
    records = _records(monitor)
    block_input = records[("actv_grad", "layers.0.output", 0, 0)]  # the same tensor's whole grad
    assert block_input.norm != pytest.approx(seen["layers.1.ln1.input"].norm().item(), rel=1e-3)
    for name, grad in seen.items():
        record = records[("actv_grad", name, 0, 0)]
        assert (record.norm, record.min, record.max) == pytest.approx(
            (grad.norm().item(), grad.min().item(), grad.max().item()), rel=1e-5, abs=1e-9), name


class _Leaves(torch.nn.Module):
    """Leaves (all but `mlp`): one taking the graph's input, three inside another hooked module, two taking one
    tensor, one taking a tensor made between two calls."""

    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(8, 16)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
        self.side = torch.nn.Linear(16, 16)
        self.gate = torch.nn.Linear(16, 16)
        self.second = torch.nn.Linear(16, 4)

    def forward(self, x):
        h = self.first(x)
        return self.second(torch.tanh(self.mlp(h)) + self.side(h) * self.gate(h))


def test_a_leaf_call_is_one_op_after_its_forward_and_records_what_eager_records(output_dir, write_config):
    """A module that holds no hooked module runs its befores and its afters in one op after its forward; its
    inputs' taps save an empty tensor made for them before it. Its records, its input's grad included (the grad its
    own backward computed, not the sum over the tensor's consumers: `side` and `gate` take one tensor), are the
    eager ones."""
    ops = []

    def forward_graph(gm, example_inputs):
        ops.append(sum(node.target is torch.ops.higher_order.with_effects
                       and node.args[1] is torch.ops.trainmon.observe.default for node in gm.graph.nodes))
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=forward_graph,  # inductor's partition, which merges common subexpressions
                           bw_compiler=lambda gm, example_inputs: make_boxed_func(gm.forward),
                           partition_fn=min_cut_rematerialization_partition)
    runs = []
    for compile_it in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = _Leaves()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        monitor = TrainerMon(write_config(ops=OPS, format=["db"], targets={}, xy_distribution=True, all_xy=True))
        run_model = torch.compile(model, backend=backend) if compile_it else model
        monitor.set_monitor(run_model, optimizer=optimizer, grad_acc_steps=GA)
        for step in range(2):
            for micro in range(GA):
                x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + micro), requires_grad=True)
                run_model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        monitor.stop()
        runs.append(_records(monitor))
    assert ops == [9]  # two for mlp, one for each leaf (sixteen with two a call)
    eager, comp = runs
    assert set(comp) == set(eager)
    assert {("actv_grad", f"{name}.input", 1, 1) for name in ("mlp.0", "mlp.1", "mlp.2", "side", "gate")} <= set(comp)
    for key, got in comp.items():
        for op in OPS:
            assert getattr(got, op) == pytest.approx(getattr(eager[key], op), rel=1e-5, abs=1e-7), (key, op)


@pytest.mark.slow  # inductor's C++ compile
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["default", "fullgraph", "blocks"])
def test_inductor_records_are_the_eager_ones(output_dir, write_config, mode, device):
    """Inductor reuses the memory of a dead intermediate for later kernels without bumping a version counter:
    the tensors a compiled graph lends trainmon's hooks are read before the hooks return, never later and never
    taken for an earlier call's tensor because they are the same object. Step 0 only: inductor's numerics
    differ from eager's in the last bits, which Adam's first update amplifies."""
    *_, eager = monitored_run(write_config, ALL, None, device=device)
    *_, comp = monitored_run(write_config, ALL, mode, backend="inductor", device=device)
    eager_records, compiled_records = _records(eager), _records(comp)
    assert set(compiled_records) == set(eager_records)
    step_0 = [key for key in compiled_records if key[2] == 0 and key[0] in ("actv", "actv_grad", "grad_unreduced")]
    assert {key[0] for key in step_0} == {"actv", "actv_grad", "grad_unreduced"}
    for key in step_0:
        got, want = compiled_records[key], eager_records[key]
        for op in ("min", "max", "norm"):
            assert getattr(got, op) == pytest.approx(getattr(want, op), rel=1e-5, abs=1e-6), (key, op)


@pytest.mark.parametrize("mode", slow_but(["default", "blocks"], {"default"}))
def test_an_inductor_graph_whose_first_run_collects_nothing_records_the_steps_after(output_dir, write_config, mode):
    """Inductor's runtime checks a graph's first run for custom ops whose result aliases an input (an error where
    `CI` is set, and in these tests; a warning elsewhere). With `start_step` 1 that run collects nothing but the
    sentinel's probes, for which the graph holds the ops: the others return no request, and the ops that take an
    inner call's result take one that carries none."""
    assert functorch_config.error_on_custom_op_aliasing  # set by conftest.py: else an alias would only warn
    config = {**ALL, "start_step": 1}
    *_, eager = monitored_run(write_config, config, None)
    *_, comp = monitored_run(write_config, config, mode, backend="inductor")
    eager_records, compiled_records = _records(eager), _records(comp)
    assert set(compiled_records) == set(eager_records)
    assert {key[2] for key in compiled_records} == set(range(1, STEPS))
    assert {"actv", "actv_grad"} <= {key[0] for key in compiled_records}


@pytest.mark.slow
def test_eager_and_compiled_activation_records_match_torch(output_dir, write_config):
    """A compiled run's activation record is the statistic of the tensor the module returned."""
    torch._dynamo.reset()
    model = make_model(layers=4)
    outputs = {}
    model.layers[1].mlp.register_forward_hook(lambda m, a, out: outputs.setdefault("out", out.detach().clone()))
    run_model = compiled(model, "default")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    monitor = TrainerMon(write_config(ops=OPS, format=["db"], targets={}, **TIERS["activations"]))
    monitor.set_monitor(run_model, optimizer=optimizer, grad_acc_steps=GA)
    train(run_model, optimizer, steps=1)
    monitor.stop()
    record = _records(monitor)[("actv", "layers.1.mlp.output", 0, 0)]
    out = outputs["out"]
    assert record.norm == pytest.approx(out.norm().item(), rel=1e-5)
    assert (record.min, record.max) == pytest.approx((out.min().item(), out.max().item()))


def weight_inf_fault(model, module: str, at: tuple[int, int]):
    """Writes +Inf into row 0 of `module`'s weight before the forward of (step, micro): its output is the
    first non-finite tensor of the run."""
    weight = dict(model.named_modules())[module].weight

    def fault(step, micro):
        if (step, micro) == at:
            with torch.no_grad():
                weight[0, 0] = float("inf")

    return fault


# inductor with the sentinel alone and with every tier: its C++ compile is slow here
@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode,backend,config", [
    pytest.param("default", "inductor", {"sentinel": True}, marks=pytest.mark.slow),
    pytest.param("blocks", "inductor", ALL, marks=pytest.mark.slow),
    ("blocks", "aot_eager", {"sentinel": True}), ("blocks", "aot_eager", ALL),
    pytest.param("fullgraph", "aot_eager", {"sentinel": True}, marks=pytest.mark.slow),
    pytest.param("fullgraph", "aot_eager", ALL, marks=pytest.mark.slow)],
    ids=["inductor-sentinel", "inductor-blocks-all", "blocks-sentinel", "blocks-all", "fullgraph-sentinel", "fullgraph-all"])
def test_an_inf_in_one_blocks_mlp_is_named_exactly_under_compile(output_dir, write_config, capsys, caplog, mode,
                                                                 backend, config, device):
    torch._dynamo.reset()
    model = make_model(layers=4, device=device)
    fault = weight_inf_fault(model, "layers.1.mlp.0", (1, 1))
    run_model = compiled(model, mode, backend)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    monitor = TrainerMon(write_config(format=["db"], targets={}, alert={"rules": [{"rule_name": "AnomalyNan"}]},
                                      ops=OPS, **config))
    monitor.set_monitor(run_model, optimizer=optimizer, grad_acc_steps=GA)
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        train(run_model, optimizer, fault)
    monitor.stop()
    expected = {"rank": 0, "step": 1, "micro_step": 1, "module": "layers.1.mlp.0", "phase": "forward",
                "tensor": "output"}
    online = [json.loads(line) for line in open(monitor.output_dir / "anomalies.jsonl")]
    first = min((r for r in online if r["first"]), key=lambda r: (r["step"], r["call_index"]))
    assert {k: first[k] for k in expected} == expected
    assert cli_main(["nan-analyze", str(monitor.output_dir.parent), "--json"]) == 1  # found
    report = json.loads(capsys.readouterr().out)
    assert {k: report["first"][k] for k in expected} == expected


def test_a_hook_under_cuda_graph_capture_records_nothing_and_says_so(output_dir, write_config, caplog, monkeypatch):
    """A stand-in for stream capture (no GPU here): the captured forwards record nothing, and one message
    says why; the forwards outside capture are recorded, traced hooks and eager hooks alike."""
    torch._dynamo.reset()
    model = make_model(layers=4)
    model.layers[0] = torch.compile(model.layers[0], backend="aot_eager")  # traced hooks and eager ones
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    monitor = TrainerMon(write_config(ops=OPS, format=["db"], targets={}, **TIERS["activations"]))
    monitor.set_monitor(model, optimizer=optimizer, grad_acc_steps=GA)
    capturing = {"on": False}
    monkeypatch.setattr(in_graph, "stream_capturing", lambda: capturing["on"])

    def capture_step_one(step, micro):
        capturing["on"] = step == 1

    with caplog.at_level(logging.WARNING, logger="trainmon"):
        train(model, optimizer, capture_step_one)
    monitor.stop()
    actv = {key for key in _records(monitor) if key[0] == "actv"}
    names = {key[1] for key in actv}
    assert {"layers.0.mlp.0.output", "layers.1.mlp.0.output"} <= names
    assert {key[2] for key in actv} == {0, 2}
    assert [r.getMessage() for r in caplog.records].count(f"trainmon: {in_graph.CAPTURE_REFUSED}") == 1


def test_stop_removes_the_hooks_and_their_tokens_entries(output_dir, write_config):
    torch._dynamo.reset()
    model = make_model(layers=2)
    run_model = compiled(model, "default")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    monitor = TrainerMon(write_config(ops=OPS, format=["db"], targets={}, **ALL))
    monitor.set_monitor(run_model, optimizer=optimizer)
    assert in_graph._hooks and in_graph._gates
    monitor.stop()
    assert not in_graph._hooks and not in_graph._gates
    assert not any(in_graph._GATED in m.__dict__ for m in model.modules())
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_a_module_stops_being_a_leaf_when_a_module_inside_it_is_hooked():
    """A module's traced call is one op while it holds no hooked module (which would otherwise run its hooks before
    the module's befores): whichever is hooked first, and whatever the hook (a forward wrapper or a registered
    hook)."""
    def nothing(*args):
        return None

    outer = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.GELU())
    handles = [in_graph.after_forward(outer, "test", nothing)]
    assert outer.__dict__.get(in_graph._LEAF)
    handles.append(in_graph.after_forward(outer[0], "test", nothing))
    assert not outer.__dict__.get(in_graph._LEAF) and outer[0].__dict__.get(in_graph._LEAF)
    other = torch.nn.Sequential(torch.nn.Linear(2, 2))
    handles.append(in_graph.forward_pre_hook(other[0], "test", nothing))  # the inner module first
    handles.append(in_graph.after_forward(other, "test", nothing))
    assert not other.__dict__.get(in_graph._LEAF)
    for handle in handles:
        handle.remove()
    assert not any(in_graph._LEAF in module.__dict__ for module in [*outer.modules(), *other.modules()])


def _bytes_held_for_backward(write_config, config: dict | None) -> int:
    """The bytes of the distinct storages autograd holds for the backward of a bf16 model's compiled forward
    (min-cut partitioner, no code generation), monitored with `config` or not."""
    torch._dynamo.reset()
    model = make_model(hidden=64).to(torch.bfloat16)
    run_model = torch.compile(model, backend="aot_eager_decomp_partition")
    monitor = None
    if config is not None:
        monitor = TrainerMon(write_config(ops=OPS, format=["db"], targets={}, **config))
        monitor.set_monitor(run_model, optimizer=torch.optim.AdamW(model.parameters()))
    storages = {}

    def pack(tensor):
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    tokens, labels = next(batches())
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = lm_loss(run_model, tokens, labels)
    loss.backward()
    if monitor is not None:
        monitor.stop()
    return sum(storages.values())


@pytest.fixture
def no_autograd_cache():
    """Each compile partitioned anew. Through the config's own patch: pytest's monkeypatch deletes, at undo, a
    config attribute that it read through the module's `__getattr__` (pytest 9.2)."""
    with torch._functorch.config.patch(enable_autograd_cache=False):
        yield


@pytest.mark.slow
@pytest.mark.parametrize("session_flag", slow_but([True, False], {True}), ids=["compile-session-flag",
                                                                               "no-compile-session-flag"])
@pytest.mark.parametrize("tier", slow_but(["sentinel", "activations", "activation_grads"], {"activations"}))
def test_a_compiled_forward_holds_for_the_backward_what_it_holds_unmonitored(output_dir, write_config, monkeypatch,
                                                                             no_autograd_cache, tier, session_flag):
    """trainmon's op in the graph made AOTAutograd's partitioner save fp32 products of LayerNorm and GELU that it
    recomputes from their bf16 inputs unmonitored (see in_graph); the setting it turns off for that is back after.

    Without the flag torch holds for a whole compile (releases before it, such as the GPU runs' 2.11, which held
    2.33 GB more), `torch.compiler.is_compiling()` is False in the op's fake implementation, which Dynamo runs
    untraced.

    With activation grads or the sentinel (its backward probes), the graph holds the taps that hand the grads back:
    its partition may differ (it holds 1.7 KB less, of 500 KB), never to hold more."""
    if not session_flag and hasattr(torch.compiler, "_compile_session_context"):
        monkeypatch.setattr(torch.compiler, "_compile_session_context", contextlib.nullcontext)
    setting = torch._functorch.config.ban_recompute_used_far_apart
    held = _bytes_held_for_backward(write_config, TIERS[tier])
    unmonitored = _bytes_held_for_backward(write_config, None)
    assert held <= unmonitored if tier in ("activation_grads", "sentinel") else held == unmonitored
    assert torch._functorch.config.ban_recompute_used_far_apart == setting


@pytest.mark.slow
def test_the_partition_setting_is_back_after_each_compile_across_a_dynamo_reset(output_dir, write_config,
                                                                              no_autograd_cache):
    """`torch._dynamo.reset()` (which `_bytes_held_for_backward` calls first) drops the callbacks that run at a
    compile's end: the one that puts the partitioner's setting back is registered again by the next compile."""
    setting = torch._functorch.config.ban_recompute_used_far_apart
    held = [_bytes_held_for_backward(write_config, TIERS["sentinel"]) for _ in range(2)]
    assert held[0] == held[1]
    assert torch._functorch.config.ban_recompute_used_far_apart == setting


@pytest.mark.slow
def test_a_fullgraph_compile_runs_the_capture_query_eagerly(output_dir, write_config, monkeypatch):
    """On CUDA, the compiled module's own hooks ask whether a graph is being captured, under Dynamo's frame
    callback: the query must run as it is, not be compiled (a torch.* call returning a bool is unsupported, so
    a `fullgraph=True` compile failed). Here a query that Dynamo cannot trace stands in for CUDA's."""
    asked = []
    # CUDA as the accelerator in use for trainmon's query (and for Dynamo, whose default it is); none for the
    # optimizer's capture check, which would ask for the stream of the device this machine has not
    monkeypatch.setattr(torch.accelerator, "current_accelerator",
                        lambda check_available=False: None if check_available else torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing",
                        torch.compiler.disable(lambda: asked.append(True) and False))
    losses, breaks, _, monitor = monitored_run(write_config, {"sentinel": True}, "fullgraph")
    assert len(losses) == STEPS * GA and all(map(torch.isfinite, map(torch.tensor, losses)))
    assert breaks == 0
    assert len(asked) >= STEPS * GA                   # the root's hooks asked at every forward, eagerly


def test_tracing_without_dynamo_is_not_inside_a_subgraph():
    """AOTAutograd alone, or a non-strict export, traces the hooks with no Dynamo frame: no higher-order op either."""
    assert in_graph._in_subgraph() is False


def test_the_ops_stay_in_program_order_and_out_of_cuda_graphs():
    """What passes and inductor read from the two ops' registration: ordered effects (never reordered among
    themselves, never dropped as unused) and `cudagraph_unsafe` (`mode="reduce-overhead"` runs them outside what it
    captures, where a Python op would run once, at capture)."""
    from torch._higher_order_ops.effects import EffectType, _get_effect

    for op in (torch.ops.trainmon.observe.default, torch.ops.trainmon.observe_grads.default):
        assert _get_effect(op) == EffectType.ORDERED
        assert torch.Tag.cudagraph_unsafe in op.tags


class _NanGrad(torch.autograd.Function):
    """Identity whose backward hands back NaN while `armed` is 1."""

    @staticmethod
    def forward(ctx, x, armed):
        ctx.save_for_backward(armed)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        armed, = ctx.saved_tensors
        return torch.where(armed > 0, torch.full_like(grad, float("nan")), grad), None


class GeluWithNanGrad(torch.nn.Module):
    """GELU whose backward makes NaN while its `armed` buffer is 1: a fault of the backward alone, inside the compiled
    region (a buffer, so arming it compiles nothing again)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("armed", torch.zeros(()))

    def forward(self, x):
        return _NanGrad.apply(torch.nn.functional.gelu(x), self.armed)


def _sentinel_run(write_config, mode: str | None, backward: bool, actv_grad: bool = False):
    """The anomalies written online, and the run's folder, of a sentinel run of two steps (mode None: eager) whose
    `layers.1.mlp.1` makes NaN in its backward at step 1, micro-step 1 (`backward`), or whose `layers.1.mlp.0` makes
    +Inf in its forward there; the anomalies are the sentinel's alone. `actv_grad`: activation grads are collected
    too."""
    torch._dynamo.reset()
    model = make_model(layers=4)
    faulty = model.layers[1].mlp[1] = GeluWithNanGrad()

    def backward_fault(step, micro):
        faulty.armed.fill_(float((step, micro) == (1, 1)))

    fault = backward_fault if backward else weight_inf_fault(model, "layers.1.mlp.0", (1, 1))
    run_model = model if mode is None else compiled(model, mode)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    collect = TIERS["activation_grads"] if actv_grad else {}
    monitor = TrainerMon(write_config(format=["db"], targets={}, sentinel=True, ops=OPS, **collect,
                                      alert={"rules": [{"rule_name": "AnomalyNan"}]}))
    monitor.set_monitor(run_model, optimizer=optimizer, grad_acc_steps=GA)
    train(run_model, optimizer, fault, steps=2)
    monitor.stop()
    online = [r for r in map(json.loads, open(monitor.output_dir / "anomalies.jsonl")) if r["rule"] == SENTINEL_RULE]
    return online, monitor.output_dir.parent


def _places(records) -> collections.Counter:
    """How many anomalies each (step, micro-step, module, phase, tensor) has."""
    return collections.Counter((r["step"], r["micro_step"], r["module"], r["phase"], r["tensor"]) for r in records)


@pytest.mark.parametrize("mode", slow_but(MODES, {"default"}))
def test_a_nan_made_by_a_backward_inside_a_compiled_region_is_named_by_the_sentinel(output_dir, write_config, capsys,
                                                                                   mode):
    """The sentinel alone probes the grads of the modules' inputs inside a compiled region as in eager mode: the NaN
    that `layers.1.mlp.1`'s backward makes is first at that module's input grad, online and in nan-analyze, and the
    places it reaches are the eager run's (a block compiled on its own adds its input's grad, taken outside its
    graph). The weight grads are probed at the end of the backward in every mode, the root compiled in place
    included."""
    eager, _ = _sentinel_run(write_config, None, backward=True)
    online, run_dir = _sentinel_run(write_config, mode, backward=True)
    expected = {"rank": 0, "step": 1, "micro_step": 1, "module": "layers.1.mlp.1", "phase": "backward",
                "tensor": "grad_input"}
    first = min((r for r in online if r["first"]), key=lambda r: (r["step"], r["call_index"]))
    assert {k: first[k] for k in expected} == expected
    assert cli_main(["nan-analyze", str(run_dir), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert {k: report["first"][k] for k in expected} == expected
    assert not _places(eager) - _places(online)
    assert set(_places(online) - _places(eager)) == (
        {(1, 1, f"layers.{i}", "backward", "grad_input") for i in (0, 1)} if mode == "blocks" else set())
    assert (1, 1, "embed.weight", "backward", "grad") in _places(online)


def test_activation_grads_leave_the_sentinels_places_as_they_are(output_dir, write_config):
    """Activation grads tap each module's input, handing every module its own alias of a tensor: the sentinel still
    probes a tensor's grad once, named after the innermost module that took it, so a NaN made by a backward reaches
    the places it reaches without them (not also each container's input)."""
    alone, _ = _sentinel_run(write_config, None, backward=True)
    with_actv_grad, _ = _sentinel_run(write_config, None, backward=True, actv_grad=True)
    assert _places(with_actv_grad) == _places(alone)
    assert (1, 1, "layers.1.mlp.1", "backward", "grad_input") in _places(alone)


@pytest.mark.parametrize("actv_grad", slow_but([False, True], {True}), ids=["sentinel", "sentinel+actv_grad"])
@pytest.mark.parametrize("mode", slow_but(MODES, {"in_place"}))
def test_the_sentinel_probes_each_forward_tensor_of_a_compiled_region_once(output_dir, write_config, mode, actv_grad):
    """A container returning its last child's output (nn.Sequential) is probed once, as in eager mode, inside a
    compiled region too, so an Inf is reported at the places, and as many times, as in eager mode; so is the
    model's output where activation grads are on (the root, outside the region, is handed another tensor than the
    head inside it, known by the head's tap). Without them the sentinel taps no output: the model's output is probed
    once more."""
    eager, compiled_run = ([r for r in run if r["phase"] == "forward"]
                           for run, _ in (_sentinel_run(write_config, m, backward=False, actv_grad=actv_grad)
                                          for m in (None, mode)))
    assert all(_places(eager)[(1, 1, name, "forward", "output")] == 1 for name in ("layers.1.mlp.0", "layers.1.mlp.2"))
    assert not _places(eager) - _places(compiled_run)
    assert set(_places(compiled_run) - _places(eager)) == (
        {(1, 1, "", "forward", "output")} if mode != "blocks" and not actv_grad else set())
