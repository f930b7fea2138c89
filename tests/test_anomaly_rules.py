"""Rules: no false alerts on a healthy run or on integer-fed modules; spikes and turbulence fire where
they should, and a NaN never poisons a rule's history."""
import json
import math

import pytest
import torch

from training import BATCH, SEQ, VOCAB, batches, make_model
from trainmon import TrainerMon
from trainmon.anomaly.processor import AlertRateLimit
from trainmon.anomaly.rules import AnomalyNan, AnomalySpike, AnomalyTurbulence
from trainmon.demo import lm_loss
from trainmon.engine import stats
from trainmon.config.settings import ConfigError, load_config

HEALTHY = dict(targets={}, all_xy=True, xy_distribution=True, wg_distribution=True, param_distribution=True,
               mv_distribution=True, ops=["min", "max", "norm", "mean", "zeros", "nans", "infs"], format="csv",
               sentinel=True, alert={"rules": [{"rule_name": "AnomalyNan"}, {"rule_name": "AnomalySpike"}]})


def anomalies(rank_dir):
    path = rank_dir / "anomalies.jsonl"
    return [json.loads(line) for line in open(path)] if path.exists() else []


@pytest.mark.slow
def test_healthy_200_step_run_has_no_anomaly_records(output_dir, write_config):
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    monitor = TrainerMon(write_config(**HEALTHY))
    monitor.set_monitor(model, optimizer=optimizer)
    data = batches()
    losses = []
    for _ in range(200):
        tokens, labels = next(data)
        loss = lm_loss(model, tokens, labels)
        loss.backward()
        monitor.log_scalar("loss", loss.detach())  # judged by the rules too
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    monitor.stop()
    assert (monitor.output_dir / "anomalies.jsonl").exists()
    assert anomalies(monitor.output_dir) == []
    assert sum(losses[-10:]) < sum(losses[:10])  # it did train


class IntegerFed(torch.nn.Module):
    """Token ids pass through integer-only modules (a huge int64 offset and a bool mask) before the model."""

    def __init__(self, model):
        super().__init__()
        self.shift = _Shift()
        self.mask = _Mask()
        self.model = model

    def forward(self, tokens):
        shifted = self.shift(tokens)
        keep = self.mask(shifted)
        return self.model(torch.where(keep, shifted - 10 ** 15, shifted))


class _Shift(torch.nn.Module):
    def forward(self, tokens):
        return tokens + 10 ** 15  # far above any AnomalyNan threshold if it were read as a float


class _Mask(torch.nn.Module):
    def forward(self, ids):
        return ids >= 0


def test_integer_fed_modules_never_alert(output_dir, write_config):
    model = IntegerFed(make_model())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = {**HEALTHY, "alert": {"rules": [{"rule_name": "AnomalyNan", "args": {"threshold": 1e9}}]}}
    monitor = TrainerMon(write_config(**config))
    monitor.set_monitor(model, optimizer=optimizer)
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        lm_loss(model, tokens, tokens).backward()
        optimizer.step()
        optimizer.zero_grad()
    monitor.stop()
    assert anomalies(monitor.output_dir) == []


def _row(nans=0, infs=0):
    row = [0.0] * len(stats.FIELDS)
    row[stats.FIELDS.index("nans")], row[stats.FIELDS.index("infs")] = nans, infs
    return row


def test_nan_rule_reads_counts_not_figures():
    rule = AnomalyNan()
    assert rule.check_record("t", _row(), {"norm": 3.0}) == []
    assert rule.check_record("t", _row(nans=2), {"norm": 3.0}) == [("nans", 2)]  # norm is over finite values
    assert rule.check_record("t", _row(infs=1), {"norm": 3.0}) == [("infs", 1)]
    assert AnomalyNan(threshold=10).check_record("t", _row(), {"max": -11.0, "norm": 9.0}) == [("max", -11.0)]
    (op, value), = rule.check_scalar("loss", math.nan)
    assert op == "value" and math.isnan(value)


def test_spike_warms_up_fires_on_a_spike_and_ignores_nan():
    rule = AnomalySpike(threshold=6, window=20, warmup=5, min_relative=0.01)
    noise = [1.0, 1.02, 0.98, 1.01, 0.99, 1.03, 0.97, 1.0]
    assert not any(rule.check_scalar("loss", v) for v in noise[:4] + [50.0])  # still warming up
    rule = AnomalySpike(threshold=6, window=20, warmup=5, min_relative=0.01)
    assert not any(rule.check_scalar("loss", v) for v in noise)
    assert not rule.check_scalar("loss", math.nan)  # AnomalyNan's business; kept out of the history
    assert not rule.check_scalar("loss", math.inf)
    assert rule.check_scalar("loss", 1.5) == [("value", 1.5)]
    assert not rule.check_scalar("loss", 1.01)  # the history was not poisoned by the NaN, Inf or spike
    assert not rule.check_scalar("loss", 0.5)  # only upward spikes


def test_spike_default_needs_seven_times_the_median():
    rule = AnomalySpike()
    for v in [1.0, 1.02, 0.98, 1.01, 0.99, 1.03, 0.97, 1.0, 1.01, 0.99]:
        assert not rule.check_scalar("grad_norm", v)
    assert not rule.check_scalar("grad_norm", 6.5)
    assert rule.check_scalar("grad_norm", 7.5) == [("value", 7.5)]


def test_spike_judges_only_its_ops_per_tag():
    rule = AnomalySpike(threshold=6, window=10, warmup=3)
    for v in (1.0, 1.01, 0.99, 1.0):
        assert rule.check_record("a", _row(), {"norm": v, "max": v}) == []
    assert rule.check_record("b", _row(), {"norm": 100.0}) == []  # another tag: its own history
    assert rule.check_record("a", _row(), {"norm": 100.0, "max": 100.0}) == [("norm", 100.0)]


def test_turbulence_uses_finite_running_mean():
    rule = AnomalyTurbulence(threshold=0.5)
    assert not rule.check_scalar("g", 1.0)
    assert not rule.check_scalar("g", math.nan)
    assert not rule.check_scalar("g", 1.4)
    # the NaN stayed out of the mean: (1.0 + 1.4) / 2 = 1.2, so the bound is 1.2 x 1.5 = 1.8
    assert rule.check_scalar("g", 1.85) == [("value", 1.85)]
    calm = AnomalyTurbulence(threshold=0.5)
    assert not any(calm.check_scalar("g", v) for v in (1.0, 1.4, 1.75))
    negative = AnomalyTurbulence(threshold=0.5)
    negative.check_scalar("m", -2.0)
    assert negative.check_scalar("m", -3.5) == [("value", -3.5)]


@pytest.mark.parametrize("args, key", [({"windw": 3}, "args.windw"), ({"warmup": 80}, "args.warmup"),
                                       ({"threshold": -1}, "args.threshold"), ({"ops": ["norn"]}, "args.ops[0]"),
                                       ({"noise": 1}, "args.noise"), ({"noise": "1e-6"}, "args.noise")])
def test_bad_rule_args_are_config_errors(args, key):
    with pytest.raises(ConfigError, match=key.replace("[", r"\[").replace("]", r"\]")):
        load_config({"alert": {"rules": [{"rule_name": "AnomalySpike", "args": args}]}})


def test_alert_lines_are_rate_limited():
    now = [0.0]
    limit = AlertRateLimit(burst=2, interval=60.0, clock=lambda: now[0])
    assert [limit.allow() for _ in range(4)] == [True, True, False, False]
    now[0] = 30.0
    assert not limit.allow()
    now[0] = 61.0
    assert limit.allow() and limit.suppressed == 3


def _firing(rule, series) -> list[int]:
    return [i for i, v in enumerate(series) if rule.check_scalar("x", v)]


@pytest.mark.parametrize("series", [
    [6e-7 * 1.6 ** i for i in range(40)],  # Adam's second moment filling up
    [1e-4 * (i + 1) / 40 for i in range(40)],  # linear learning-rate warm-up
    [3.0 * 0.85 ** i for i in range(40)],  # grads shrinking as the loss falls
    [5.0 - 0.1 * i for i in range(40)],  # a linear decay
    [(1 + 0.3 * (-1) ** i) * 1.1 ** i for i in range(40)],  # growth with alternating noise
], ids=["geometric_x1.6", "linear_warmup", "geometric_decay", "linear_decay", "noisy_growth"])
def test_spike_stays_quiet_on_smooth_trends(series):
    assert _firing(AnomalySpike(), series) == []


@pytest.mark.parametrize("series", [
    [6e-7 * 1.6 ** i for i in range(40)],
    [1e-4 * (i + 1) / 40 for i in range(40)],
    [1.0 + 0.01 * (-1) ** i for i in range(40)],
], ids=["geometric_x1.6", "linear_warmup", "flat"])
def test_spike_fires_at_the_step_of_a_tenfold_jump_over_the_trend(series):
    jumped = list(series)
    jumped[25] *= 10
    assert _firing(AnomalySpike(), jumped) == [25]
