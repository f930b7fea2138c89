"""Input grads read at the one autograd node that takes a module's input, instead of through an input tap."""
import json
import logging

import pytest
import torch

from test_csv_output import OPS, read_family
from trainmon import TrainerMon
from trainmon.read import open_run

pd = pytest.importorskip("pandas")


class _Leaves(torch.nn.Module):
    """Leaf modules of the shapes models are made of: one node takes the input (norm, activation, a linear layer on
    2-D input), several nodes do (a linear layer on 3-D input: a view, then addmm), and a module that is not one of
    those (its input is used twice)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.act = torch.nn.GELU()
        self.lin3d = torch.nn.Linear(8, 8)
        self.square = _Square()

    def forward(self, x):
        h = self.act(self.norm(self.lin(x)))
        return self.square(self.lin3d(h.view(2, -1, 8)) + h.view(2, -1, 8))


class _Square(torch.nn.Module):
    def forward(self, x):
        return x * x


def _tap_nodes(loss: torch.Tensor) -> int:
    """How many nodes of trainmon's input tap the graph of `loss` holds."""
    seen, stack, taps = set(), [loss.grad_fn], 0
    while stack:
        node = stack.pop()
        taps += type(node).__name__ == "_InputTapBackward"
        for behind, _ in node.next_functions:
            if behind is not None and behind not in seen:
                seen.add(behind)
                stack.append(behind)
    return taps


def _reference_grads(model: torch.nn.Module, inputs: list) -> dict:
    """(step, name) -> the norm of each grad torch's full backward hooks see, one backward per input."""
    reference, step = {}, [0]
    for name, module in model.named_modules():
        def hook(module, grad_input, grad_output, name=name):
            for io, grads in (("input", grad_input), ("output", grad_output)):
                for i, grad in enumerate(grads):
                    if grad is not None:
                        leaf = io if len(grads) == 1 else f"{io}_{i}"
                        reference[(step[0], f"{name}.{leaf}")] = float(grad.double().norm())
        module.register_full_backward_hook(hook)
    for step[0], x in enumerate(inputs):  # an input with grad (torch's hooks warn otherwise)...
        model(x.detach().requires_grad_()).sum().backward()
    # ...where the monitored runs' has none: the grads of the model's input are left out
    return {key: norm for key, norm in reference.items() if key[1] not in ("lin.input", ".input")}


def _monitored(model: torch.nn.Module, write_config) -> tuple:
    """(monitor, optimizer) of `model` with activations and their grads; the optimizer keeps the weights as they are
    (lr 0), so that every step computes what a reference model, never updated, does."""
    monitor = TrainerMon(write_config(all_xy=True, xy_distribution=True, ops=OPS, ndigits=17))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    monitor.set_monitor(model, optimizer=optimizer)
    return monitor, optimizer


def _not_recorded(monitor: TrainerMon) -> dict:
    """`run.json`'s count of the input grads the monitor could not record, per name."""
    return json.loads((monitor.output_dir / "run.json").read_text())["input_grads_not_recorded"]


def test_input_grads_read_at_their_node_equal_torch_and_leave_no_tap_in_the_graph(output_dir, write_config):
    model = _Leaves()
    reference = _reference_grads(_Leaves(), [torch.randn(4, 8, generator=torch.Generator().manual_seed(s))
                                             for s in range(3)])
    monitor, optimizer = _monitored(model, write_config)
    taps = []
    for step in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        loss = model(x).sum()
        taps.append(_tap_nodes(loss))
        loss.backward()
        optimizer.step()
    monitor.stop()
    written = read_family(monitor.output_dir, "actv_grad").set_index(["step", "name"]).norm
    assert {name for _, name in reference} >= {"norm.input", "act.input", "lin3d.input", "square.input"}
    assert len(written) == len(reference), sorted(set(written.index) ^ set(reference))
    for key, norm in reference.items():
        assert written[key] == pytest.approx(norm, rel=1e-6), key
    # The first step taps every module whose input requires grad; then only the one whose input two nodes take.
    assert taps == [4, 1, 1]
    assert _not_recorded(monitor) == {}


def test_a_call_read_at_its_node_keeps_its_output_grad_before_an_enclosing_modules_of_the_same_tensor(
        output_dir, write_config):
    """`block` returns what its last module `block.1` (a linear layer on 2-D input, read at its node from its second
    call on) returns: that grad is recorded for `block.1` first, then for `block`, at every step, as at the first,
    tapped call (and as under torch.compile)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Sequential(torch.nn.Tanh(), torch.nn.Linear(8, 8)))
    monitor = TrainerMon(write_config(all_xy=True, xy_distribution=True, ops=OPS, format=["db"]))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor.set_monitor(model, optimizer=optimizer)
    for step in range(3):
        model(torch.randn(4, 8, generator=torch.Generator().manual_seed(step)).requires_grad_()).sum().backward()
        optimizer.step()
    monitor.stop()
    with open_run(monitor.output_dir, source="db") as run:
        grads = run.records(family="actv_grad")
    orders = [list(grads[grads.step == step].sort_values("call_index").name) for step in range(3)]
    assert orders[0].index("1.1.output") + 1 == orders[0].index("1.output")
    assert orders[1] == orders[2] == orders[0]


class _Changing(torch.nn.Module):
    """One node takes its input in its first call (a product with a weight); two take it in the later ones."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.full((8,), 2.0))
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x * self.weight if self.calls == 1 else x * self.weight + x.exp()


class _Host(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 8)
        self.changing = _Changing()

    def forward(self, x):
        return self.changing(self.lin(x))


def test_a_call_whose_graph_changed_says_its_input_grad_is_not_recorded_and_later_calls_are(output_dir, write_config,
                                                                                            caplog):
    inputs = [torch.randn(4, 8, generator=torch.Generator().manual_seed(s)) for s in range(3)]
    reference = _reference_grads(_Host(), inputs)
    model = _Host()
    monitor, optimizer = _monitored(model, write_config)
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        for x in inputs:
            model(x).sum().backward()
            optimizer.step()
    monitor.stop()
    written = read_family(monitor.output_dir, "actv_grad").set_index(["step", "name"]).norm
    assert set(reference) - set(written.index) == {(1, "changing.input")}
    for key in written.index:
        assert written[key] == pytest.approx(reference[key], rel=1e-6), key
    said = [r.getMessage() for r in caplog.records if "changing.input" in r.getMessage()]
    assert len(said) == 1 and "step 1" in said[0] and "not recorded" in said[0]
    assert _not_recorded(monitor) == {"changing.input": 1}


class _MaskedSoftmax(torch.nn.Module):
    """Masks its input in place, as Megatron's softmax masks its attention scores (a view of a matmul's output)."""

    masking = True

    def forward(self, scores):
        if self.masking:
            scores.masked_fill_(torch.eye(4, dtype=torch.bool), -1e4)
        return torch.softmax(scores, dim=-1)


class _Scores(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 16)
        self.softmax = _MaskedSoftmax()

    def forward(self, x):
        return self.softmax(self.lin(x).view(-1, 4, 4))


def test_a_module_that_masks_its_input_view_in_place_has_its_input_grad_at_every_call(output_dir, write_config):
    model = _Scores()
    monitor, optimizer = _monitored(model, write_config)
    expected = []
    for step in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        # the same computation out of place, not through the modules
        scores = torch.nn.functional.linear(x, model.lin.weight, model.lin.bias).view(-1, 4, 4)
        out = torch.softmax(scores.masked_fill(torch.eye(4, dtype=torch.bool), -1e4), dim=-1)
        expected.append(float(torch.autograd.grad((out * out).sum(), scores)[0].double().norm()))
        out = model(x)
        (out * out).sum().backward()
        optimizer.step()
    monitor.stop()
    grads = read_family(monitor.output_dir, "actv_grad").set_index(["step", "name"]).norm
    assert [grads[(step, "softmax.input")] for step in range(3)] == pytest.approx(expected, rel=1e-6)
    assert _not_recorded(monitor) == {}


def test_a_call_that_starts_masking_its_input_in_place_says_its_input_grad_is_not_recorded(output_dir, write_config,
                                                                                           caplog):
    """A module whose first call left its input as it was, and whose later call masks it in place: that call's
    input grad cannot be read without the tap, and is said to be missing instead of silently absent."""
    model = _Scores()
    model.softmax.masking = False
    monitor, optimizer = _monitored(model, write_config)
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        for step in range(3):
            model(torch.randn(4, 8, generator=torch.Generator().manual_seed(step))).pow(2).sum().backward()
            optimizer.step()
            model.softmax.masking = True
    monitor.stop()
    grads = read_family(monitor.output_dir, "actv_grad")
    assert sorted(grads[grads.name == "softmax.input"].step) == [0, 2]
    assert _not_recorded(monitor) == {"softmax.input": 1}
    assert any("softmax.input at step 1 is not recorded" in r.getMessage() for r in caplog.records)
