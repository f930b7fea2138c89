"""AnomalyPrecursor, the early warning: it fires on a precursor's sustained, accelerating growth (or an entropy's
collapse) and says which signal, which module, since which step and how fast; it stays silent on the growth of
healthy training (fast early, ever slower), on noise, and on what it cannot judge. On the precursor suite
(benchmarks/precursor_suite.py) it warns before the loss spike of a learning-rate ramp and never on healthy runs."""
import math
import random
import sys
from pathlib import Path

import numpy as np
import pytest

from trainmon.anomaly.processor import AnomalyProcessor
from trainmon.anomaly.rules import AnomalyPrecursor, build_rules
from trainmon.core.derive import derive_rows
from trainmon.core.records import ATTENTION_HOOK, MOE_LOAD, PARAM_UPDATED, RecordKey, StepBatch
from trainmon.engine import stats
from trainmon.config.settings import ConfigError, load_config
from trainmon.writers.base import SinkContext

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

WEIGHT = "0:layers.1.attn.qkv.weight/rank0/param_updated"


def key_of(tag: str, family: str) -> RecordKey:
    """The RecordKey of a tag of `writers.tags.tag_of` (weights are matrices)."""
    head = tag.split("/", 1)[0].split(":")
    micro = int(head[2]) if len(head) > 2 else None
    return RecordKey(family, head[1], int(head[0]), micro, 0, (4, 4) if head[1].endswith("weight") else (), "float32")


def feed(rule, series: dict, steps, lr=None) -> list:
    """Steps of {tag: (family, op, value of step)}: the rule's findings as (step, tag, op, value)."""
    found = []
    keys = [key_of(tag, family) for tag, (family, _, _) in series.items()]
    for step in steps:
        rule.begin_step([(tag, family, {op: value(step)}) for tag, (family, op, value) in series.items()], step, keys)
        if lr is not None:
            rule.check_scalar("lr", lr(step))
        found += [(step, *finding) for finding in rule.end_step()]
    return found


def healthy_weight(step: int) -> float:
    """Fast growth early, ever slower (a weight under a warm-up and decaying learning rate), with a little noise."""
    return 5.0 * (1 + 0.3 * (1 - math.exp(-step / 60))) * (1 + 0.001 * math.sin(step))


def diverging_weight(step: int) -> float:
    """healthy_weight until step 150, then growth that accelerates (x1.0005 a step, rising by 0.0002 a step)."""
    if step <= 150:
        return healthy_weight(step)
    return healthy_weight(150) * math.exp(0.0005 * (step - 150) + 0.0001 * (step - 150) ** 2)


def test_it_warns_on_accelerating_growth_saying_what_where_since_when_and_how_fast():
    found = feed(AnomalyPrecursor(), {WEIGHT: (PARAM_UPDATED, "norm", diverging_weight)}, range(300))
    (step, tag, op, rate), = found  # once per episode
    assert tag == WEIGHT and op.startswith("weight_norm rising since step ")
    since = int(op.rsplit(" ", 1)[1])
    assert 150 <= since < step < 200
    slope_then = 0.0005 + 0.0002 * (step - 150)  # d/dstep of the log at the warning
    assert math.log(rate) == pytest.approx(slope_then, rel=0.3)


def test_healthy_growth_noise_and_a_warm_up_do_not_warn():
    rng = random.Random(0)
    noisy = {}  # a largest attention logit: noisy, slowly rising as attention sharpens
    series = {WEIGHT: (PARAM_UPDATED, "norm", healthy_weight),
              "0:layers.0.core.max_logit:0/rank0/attention_hook":
                  (ATTENTION_HOOK, "max", lambda s: noisy.setdefault(s, (2 + s / 300) * math.exp(rng.gauss(0, 0.1)))),
              "0:layers.0.mlp.router.router_entropy/rank0/moe_load":
                  (MOE_LOAD, "min", lambda s: 1.3 - 0.2 * (1 - math.exp(-s / 100)))}
    assert feed(AnomalyPrecursor(), series, range(2000)) == []
    # a linear learning-rate warm-up over 200 steps, then flat: the update-to-weight ratio grows ever slower
    ratio = {"0:layers.1.attn.qkv.weight/rank0/adam_update": ("adam_update", "norm", lambda s: 3.0)}
    weights = {WEIGHT: (PARAM_UPDATED, "norm", lambda s: 6.0)}
    assert feed(AnomalyPrecursor(), {**ratio, **weights}, range(600), lr=lambda s: 1e-3 * min(1, (s + 1) / 200)) == []


def test_a_learning_rate_ramp_shows_in_the_update_ratio_and_only_with_the_logged_lr():
    ratio = {"0:layers.1.attn.qkv.weight/rank0/adam_update": ("adam_update", "norm", lambda s: 3.0),
             WEIGHT: (PARAM_UPDATED, "norm", lambda s: 6.0)}

    def ramp(step):
        return 1e-3 * 50 ** (min(max(step - 150, 0), 100) / 100)

    found = feed(AnomalyPrecursor(), ratio, range(300), lr=ramp)
    (step, tag, op, rate), = found
    assert tag.endswith("/adam_update") and op.startswith("update_ratio rising since step ")
    assert 140 <= int(op.rsplit(" ", 1)[1]) <= 150 < step < 175 and rate == pytest.approx(50 ** 0.01, rel=0.05)
    assert feed(AnomalyPrecursor(), ratio, range(300)) == []  # no logged lr: not judged


def test_a_collapsing_router_entropy_warns_as_a_fall():
    tag = "0:decoder.layers.3.mlp.router.router_entropy/rank0/moe_load"
    collapse = {tag: (MOE_LOAD, "min", lambda s: 1.3 if s < 120 else 1.3 * math.exp(-0.0002 * (s - 120) ** 2))}
    (step, found_tag, op, rate), = feed(AnomalyPrecursor(), collapse, range(250))
    assert found_tag == tag and op.startswith("router_entropy falling since step 1") and rate < 1
    assert step < 160


def test_a_nan_restarts_a_series():
    values = {s: diverging_weight(s) for s in range(400)}
    assert feed(AnomalyPrecursor(), {WEIGHT: (PARAM_UPDATED, "norm", values.get)}, range(400))[0][0] < 200
    values[155] = math.nan  # no log: the series warms up and takes a baseline again
    found = feed(AnomalyPrecursor(), {WEIGHT: (PARAM_UPDATED, "norm", values.get)}, range(400))
    assert all(step >= 155 + 100 + 4 * 10 for step, *_ in found)


def test_the_processor_writes_and_says_the_warning(tmp_path, caplog):
    processor = AnomalyProcessor(build_rules(load_config(
        {"alert": {"rules": [{"rule_name": "AnomalyPrecursor", "args": {"signals": ["weight_norm"]}}]}}).alert.rules))
    processor.start(SinkContext(rank_dir=tmp_path, rank=0, ops=("norm",), ndigits=6, step_count_per_record=1,
                                per_micro_families=frozenset(), metadata={}))
    key = RecordKey(PARAM_UPDATED, "layers.1.attn.qkv.weight", 0, None, 7, (96, 32), "torch.float32")
    fields = stats.FIELDS
    with caplog.at_level("WARNING", logger="trainmon"):
        for step in range(300):
            row = [0.0] * len(fields)
            row[fields.index("count")], row[fields.index("sumsq")] = 1.0, diverging_weight(step) ** 2
            batch = StepBatch(step=step, rank=0, pp_stage=0, keys=[key], values=np.array([row]))
            batch.wait()
            batch.deriver = lambda values: derive_rows(values, ops=("norm",))
            processor.write(batch)
    processor.close()
    lines = (tmp_path / "anomalies.jsonl").read_text().splitlines()
    assert len(lines) == 1 and '"rule": "AnomalyPrecursor"' in lines[0] and '"tensor": "updated_param"' in lines[0]
    said = [r.getMessage() for r in caplog.records if "AnomalyPrecursor" in r.getMessage()]
    assert len(said) == 1 and "layers.1.attn.qkv.weight" in said[0] and "weight_norm rising since step" in said[0]
    assert "a step (doubles in" in said[0]


def test_its_arguments_are_checked():
    with pytest.raises(ConfigError, match=r"signals\[0\].*did you mean \"max_logit\""):
        load_config({"alert": {"rules": [{"rule_name": "AnomalyPrecursor", "args": {"signals": ["max_logits"]}}]}})
    with pytest.raises(ConfigError, match="args.window.*at least 4"):
        load_config({"alert": {"rules": [{"rule_name": "AnomalyPrecursor", "args": {"window": 2}}]}})
    with pytest.raises(ConfigError, match="is not an argument of AnomalyPrecursor"):
        load_config({"alert": {"rules": [{"rule_name": "AnomalyPrecursor", "args": {"threshold": 2}}]}})


@pytest.mark.slow
def test_the_suite_warns_before_the_loss_spike_of_a_learning_rate_ramp_and_never_on_a_healthy_run(output_dir):
    import precursor_suite

    healthy = precursor_suite.run(seed=0)
    assert precursor_suite.warnings_of(healthy["anomalies"]) == []
    ramp = precursor_suite.lead(precursor_suite.run(seed=0, ramp_start=150))
    assert ramp["loss_spike"] is not None and ramp["warning"] is not None, ramp
    assert 150 <= ramp["warning"] < ramp["loss_spike"], ramp


@pytest.mark.slow
def test_the_demo_warns_of_its_injected_instability_and_not_without_it(tmp_path, output_dir, write_config):
    """`trainmon demo --inject instability`: the warning is said before the loss spike; the same demo without the
    ramp (its embedded config, watch off) has no warning in 300 steps."""
    import json
    import os
    import subprocess

    from trainmon.demo import DEMO_CONFIG, train

    _, monitor = train(300, write_config(**{**DEMO_CONFIG, "watch": {"enable": False}}), log_every=0)
    anomalies = monitor.output_dir / "anomalies.jsonl"
    assert not anomalies.exists() or "AnomalyPrecursor" not in anomalies.read_text()

    env = {**os.environ, "MONITOR_OUTPUT_DIR": str(tmp_path / "demo"), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "trainmon.cli", "demo", "--inject", "instability"], env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    said = done.stdout.split("early warning (AnomalyPrecursor", 1)[1]
    warning = int(said.split("step ", 1)[1].split(":", 1)[0])
    spike = int(said.split("the loss first spiked at step ", 1)[1].split(",", 1)[0])
    assert "weight_norm rising since step" in said and 150 < warning < spike, said
    written = [json.loads(line) for line in open(next((tmp_path / "demo").glob("run-*/rank_0/anomalies.jsonl")))]
    assert min(a["step"] for a in written if a["rule"] == "AnomalyPrecursor") == warning
