"""The tensorboard format: event files read back by TensorBoard's own EventAccumulator."""
import math
import sys

import pytest
import torch

from writer_helpers import OPS, monitored, tensorboard_scalars
from trainmon import open_run
from trainmon.writers.base import SinkContext
from trainmon.writers.tensorboard_sink import TensorBoardSink


def test_every_tag_step_and_value_reads_back(output_dir, write_config):
    losses = {}

    def log_loss(monitor, step):
        losses[step] = 10.0 + step
        monitor.log_scalar("loss", torch.tensor(losses[step]))

    monitor, _ = monitored(write_config, steps=3, on_step=log_loss, format=["tensorboard", "db"])
    events = tensorboard_scalars(monitor.output_dir)

    expected = {}
    run = open_run(monitor.output_dir.parent)
    frame = run.records()
    for row in frame.to_dict("records"):
        for op in OPS:
            if not math.isnan(row[op]):
                expected[(f"{row['tag']}_{op}", row["step"])] = row[op]
    expected.update({("loss", step): value for step, value in losses.items()})
    assert set(events) == set(expected)
    for key, value in expected.items():
        assert events[key] == pytest.approx(value, rel=1e-6, abs=1e-30), key  # float32 in TensorBoard
    # msprobe's tag scheme
    assert ("0:layers.0.mlp.output:1/rank0/actv_norm", 2) in events
    assert ("0:head.weight/rank0/pre_grad_max", 0) in events
    assert ("0:head.weight/rank0/post_grad_min", 1) in events
    assert ("0:head.weight/rank0/exp_avg_sq_mean", 2) in events
    assert len(expected) > 1000


def test_a_missing_tensorboard_package_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    monkeypatch.setitem(sys.modules, "tensorboard.compat.proto.event_pb2", None)
    context = SinkContext(rank_dir=tmp_path, rank=0, ops=("norm",), ndigits=6, step_count_per_record=1,
                          per_micro_families=frozenset())
    with pytest.raises(ImportError, match="pip install tensorboard"):
        TensorBoardSink().start(context)


def test_tensorboard_logdir_shows_one_run_per_rank(output_dir, write_config):
    from tensorboard.backend.event_processing.plugin_event_multiplexer import EventMultiplexer

    monitor, _ = monitored(write_config, steps=1, grad_acc_steps=1, format=["tensorboard"], xy_distribution=False)
    logdir = EventMultiplexer()
    logdir.AddRunsFromDirectory(str(output_dir))  # what `tensorboard --logdir monitor_output` does
    logdir.Reload()
    assert list(logdir.Runs()) == [f"{monitor.output_dir.parent.name}/rank_0"]


@pytest.mark.parametrize("step", [0, 7, 300, 2 ** 40, -3])
def test_directly_encoded_scalars_parse_as_protobuf_builds_them(step):
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.proto.summary_pb2 import Summary
    from trainmon.writers.event_encoding import scalar_event
    tags = [f"actv/layers.{i}/layers.{i}.out/norm_max" for i in range(200)] + ["x" * 300, "ünïcode/tag"]
    values = [float(i) / 7 for i in range(len(tags))]
    values[:6] = [math.nan, math.inf, -math.inf, 1e39, -1e39, 1e-50]  # beyond float32: ±Inf, or 0
    ours = Event.FromString(scalar_event(step, 1234.5, tags, values))
    theirs = Event(step=step, wall_time=1234.5,
                   summary=Summary(value=[Summary.Value(tag=t, simple_value=v) for t, v in zip(tags, values)]))
    assert (ours.step, ours.wall_time) == (theirs.step, theirs.wall_time)
    got = [(v.tag, v.simple_value) for v in ours.summary.value]
    want = [(v.tag, v.simple_value) for v in theirs.summary.value]
    assert [t for t, _ in got] == [t for t, _ in want] == tags
    assert all(a == b or (math.isnan(a) and math.isnan(b)) for (_, a), (_, b) in zip(got, want))
    assert math.isinf(got[3][1]) and got[3][1] > 0
