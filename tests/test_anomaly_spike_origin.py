"""A spike is named where it starts: a fivefold spike of a module's forward output, which first crosses
AnomalySpike's bound downstream in the backward, is named at that forward output; a healthy run of the same
suite gives no alert; the values traced back count only in a step that fired, also through the processor."""
import json
import sys
from pathlib import Path

import pytest
import torch

from trainmon.anomaly.processor import AnomalyProcessor
from trainmon.anomaly.rules import AnomalySpike
from trainmon.core.derive import derive_rows
from trainmon.core.records import ACTV, ACTV_GRAD, RecordKey, StepBatch
from trainmon.engine import stats
from trainmon.read.csv_rows import read_csv_rows
from trainmon.writers.base import SinkContext

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import spike_suite  # noqa: E402

STEPS, SPIKE_STEP = 300, 250


def norm_of(rank_dir: Path, step: int, name: str) -> float:
    """`name`'s forward norm at `step`, as its CSV holds it."""
    _, rows = read_csv_rows(rank_dir / f"{ACTV}_{step}-{step}.csv")
    return next(row["norm"] for row in rows if row["name"] == name)


@pytest.mark.slow
def test_a_fivefold_forward_spike_is_named_at_its_forward_output(output_dir, write_config):
    anomalies = spike_suite.train(write_config(**spike_suite.CONFIG), STEPS, spike_step=SPIKE_STEP, factor=5)
    assert {a["step"] for a in anomalies} == {SPIKE_STEP}
    first, = [a for a in anomalies if a["first"]]
    assert (first["module"], first["phase"], first["tensor"], first["micro_step"]) == \
        (spike_suite.SPIKE_MODULE, "forward", "output", 0)
    assert "backward" in {a["phase"] for a in anomalies}  # where the bound was crossed
    rank_dir, = output_dir.glob("*/rank_0")
    named = f"{spike_suite.SPIKE_MODULE}.output"
    assert first["value"] == pytest.approx(norm_of(rank_dir, SPIKE_STEP, named), rel=1e-5)  # CSV: 6 digits
    # below the 7 x trend that fires: it is named because its step fired downstream
    assert 4 < first["value"] / norm_of(rank_dir, SPIKE_STEP - 1, named) < 6


@pytest.mark.slow
def test_a_healthy_run_of_the_suite_has_no_alert(output_dir, write_config):
    assert spike_suite.train(write_config(**spike_suite.CONFIG), STEPS) == []


def wobble(i: int) -> float:
    return 1.0 + 0.02 * (-1) ** i


def judge_step(rule, step_values: dict) -> tuple[list, list]:
    """Feeds one step's norms {tag: value} to `rule`: (tags that fire, (tag, op, value) that end_step traces)."""
    records = [(tag, ACTV, {"norm": value}) for tag, value in step_values.items()]
    rule.begin_step(records)
    fired = [tag for tag, _, ops in records if rule.check_record(tag, (), ops)]
    return fired, rule.end_step()


def warmed_up(rule, tags, steps=20):
    for i in range(steps):
        assert judge_step(rule, {tag: wobble(i) for tag in tags}) == ([], [])
    return rule


def test_a_step_that_fires_traces_the_values_that_departed_with_it():
    rule = warmed_up(AnomalySpike(), ("origin", "downstream", "calm", "wobbly"))
    fired, traced = judge_step(rule, {"origin": 5.0, "downstream": 10.0, "calm": 1.0, "wobbly": 1.8})
    assert fired == ["downstream"]
    assert traced == [("origin", "norm", 5.0)]  # 1.8 x the trend is not traced: below 2 x
    assert judge_step(rule, {"origin": 1.0, "downstream": 1.0, "calm": 1.0, "wobbly": 1.0}) == ([], [])


def test_a_departure_in_a_step_that_does_not_fire_is_no_alarm():
    rule = warmed_up(AnomalySpike(), ("origin", "downstream"))
    assert judge_step(rule, {"origin": 5.0, "downstream": 1.0}) == ([], [])
    # nor does it linger: the next step's firing does not bring it back
    assert judge_step(rule, {"origin": 1.0, "downstream": 10.0}) == (["downstream"], [])


def test_a_scalar_that_fires_traces_records_and_a_record_traces_scalars():
    rule = warmed_up(AnomalySpike(), ("origin",))
    for i in range(20):
        assert not rule.check_scalar("loss", wobble(i))
    records = [("origin", ACTV, {"norm": 3.0})]
    rule.begin_step(records)
    assert rule.check_record("origin", (), {"norm": 3.0}) == []
    assert rule.check_scalar("loss", 10.0) == [("value", 10.0)]
    assert rule.end_step() == [("origin", "norm", 3.0)]
    rule.begin_step([("origin", ACTV, {"norm": 10.0})])
    assert rule.check_record("origin", (), {"norm": 10.0}) == [("norm", 10.0)]
    assert rule.check_scalar("loss", 3.0) == []
    assert rule.end_step() == [("loss", "value", 3.0)]


# ---- through the processor: the traced forward record is the step's first anomaly -------------------------------
FORWARD = RecordKey(ACTV, "layers.2.mlp.output", 0, 0, 43, (8,), "torch.float32")
BACKWARD = RecordKey(ACTV_GRAD, "layers.2.mlp.fc2.output", 0, 0, 88, (8,), "torch.float32")


def batch(step: int, forward: float, backward: float, loss: float) -> StepBatch:
    """A step batch of real records: constant tensors of the given norms."""
    tensors = [torch.full((8,), norm / 8 ** 0.5) for norm in (forward, backward)]
    values = stats.tensor_records(tensors, 0.0, stats.fields_for_ops(("norm",))).numpy()
    out = StepBatch(step=step, rank=0, pp_stage=0, keys=[FORWARD, BACKWARD], values=values,
                    scalars={"loss": loss})
    out.deriver = lambda v: derive_rows(v, ("norm",))
    return out.wait()


def processed(tmp_path, steps: list[tuple]) -> list[dict]:
    processor = AnomalyProcessor([AnomalySpike()])
    processor.start(SinkContext(rank_dir=tmp_path, rank=0, ops=("norm",), ndigits=12, step_count_per_record=1,
                                per_micro_families=frozenset({ACTV, ACTV_GRAD})))
    for step, values in enumerate(steps):
        processor.write(batch(step, *values))
    processor.close()
    return [json.loads(line) for line in open(tmp_path / "anomalies.jsonl")]


def test_the_processor_names_the_traced_forward_output_first(tmp_path):
    healthy = [(20 * wobble(i), 0.03 * wobble(i), 2.0 * wobble(i)) for i in range(20)]
    # x5 forward, x10 its grad; then x3 forward with a x10 loss; then x5 forward alone
    events = processed(tmp_path, healthy + [(100.0, 0.3, 2.0), (60.0, 0.03, 20.0), (100.0, 0.03, 2.0)])
    assert [(e["step"], e["module"], e["tensor"], e["first"]) for e in events] == [
        (20, "layers.2.mlp", "output", True), (20, "layers.2.mlp.fc2", "grad_output", False),
        (21, "layers.2.mlp", "output", True), (21, "loss", "scalar", False)]
    assert events[0]["value"] == 100.0 and events[0]["phase"] == "forward" and events[0]["call_index"] == 43
