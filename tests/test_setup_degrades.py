"""set_monitor never takes training down: objects of kinds nobody foresaw are monitored as far as they allow,
with one message saying what is not collected."""
from __future__ import annotations

import logging

import pytest
import torch

from test_csv_output import read_family
from training import batches, make_model, run_steps
from trainmon import TrainerMon
from trainmon.demo import lm_loss

CONFIG = dict(strict=False, wg_distribution=True, mv_distribution=True, param_distribution=True,
              xy_distribution=True, ops=["norm", "nans"])


class OptimizerLike:
    """No hooks dict, no `state`, no `param_groups`: a step() that updates the parameters it was given."""

    def __init__(self, params, lr=0.05):
        self.params = list(params)
        self.lr = lr

    def step(self):
        with torch.no_grad():
            for p in self.params:
                p -= self.lr * p.grad

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None


class HalfBuiltOptimizer(torch.optim.Optimizer, OptimizerLike):
    """A torch optimizer subclass whose Optimizer.__init__ never ran (as accelerate's wrapper)."""

    def __init__(self, params, lr=0.05):
        OptimizerLike.__init__(self, params, lr)

    step = OptimizerLike.step
    zero_grad = OptimizerLike.zero_grad


@pytest.mark.parametrize("kind", [OptimizerLike, HalfBuiltOptimizer])
def test_an_optimizer_that_breaks_every_assumption_is_monitored_as_far_as_it_allows(output_dir, write_config,
                                                                                   caplog, kind):
    model = make_model()
    optimizer = kind(model.parameters())
    seen = {}
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        monitor = TrainerMon(write_config(**CONFIG)).set_monitor(model, optimizer=optimizer)
        losses = run_steps(model, optimizer, 4, on_step=lambda step: seen.update(
            {step: float(model.head.weight.grad.norm())}))
        monitor.stop()
    assert len(losses) == 4 and monitor.output_dir is not None
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and "Adam moments" in messages[0], messages
    reduced = read_family(monitor.output_dir, "grad_reduced")
    assert sorted(set(reduced.step)) == [0, 1, 2, 3]
    for step, norm in seen.items():
        assert reduced[(reduced.step == step) & (reduced.name == "head.weight")].norm.iloc[0] == \
            pytest.approx(norm, rel=1e-6)
    assert sorted(set(read_family(monitor.output_dir, "actv").step)) == [0, 1, 2, 3]


def test_an_object_without_step_turns_monitoring_off_and_training_goes_on(output_dir, write_config, caplog):
    class Stepless:
        def __init__(self, params):
            self.inner = OptimizerLike(params)

        def apply(self):
            self.inner.step()

    model = make_model()
    optimizer = Stepless(model.parameters())
    data = batches()
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        monitor = TrainerMon(write_config(**CONFIG)).set_monitor(model, optimizer=optimizer)
        for _ in range(3):
            lm_loss(model, *next(data)).backward()
            optimizer.apply()
            optimizer.inner.zero_grad()
        monitor.stop()
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and "monitoring is off, training continues" in messages[0], messages
    assert "no step() method" in messages[0]
    assert not monitor.active
    assert all(not hooks for hooks in (model._forward_hooks, model._forward_pre_hooks))


def test_a_missing_optimizer_is_the_callers_error(write_config):
    with pytest.raises(ValueError, match="needs the optimizer"):
        TrainerMon(write_config(**CONFIG)).set_monitor(make_model(), optimizer=None)
