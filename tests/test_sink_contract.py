"""The contract every sink keeps, run over every format of the sink table (and the sinks TrainerMon adds):
a constructor touches no file; `start` opens; `write` of real step batches and `flush` make the figures
readable by the format's own reader (pandas, TensorBoard's event reader, sqlite3); `close` is safe twice;
and a sink that fails is disabled alone, the others writing on."""
from __future__ import annotations

import math
import sqlite3

import numpy as np
import pytest
import torch

from trainmon.core import sinks as table
from trainmon.core.derive import derive_rows
from trainmon.core.layout import DB_NAME, STREAM_NAME
from trainmon.core.records import ACTV, GRAD_REDUCED, RecordKey, StepBatch
from trainmon.engine import stats
from trainmon.writers.base import Sink, SinkContainer, SinkContext
from trainmon.writers.registry import build_sinks
from trainmon.writers.tags import tag_of

OPS = ("min", "max", "norm", "mean", "nans", "infs")
TENSORS = {ACTV: torch.linspace(-2.0, 3.0, 12).reshape(3, 4), GRAD_REDUCED: torch.tensor([1.0, -4.0, math.inf])}
KEYS = {ACTV: RecordKey(ACTV, "layers.0.output", 0, 0, 1, (3, 4), "torch.float32"),
        GRAD_REDUCED: RecordKey(GRAD_REDUCED, "layers.0.weight", 0, None, 2, (3,), "torch.float32")}
STEPS = (0, 1)


def batch(step: int) -> StepBatch:
    """A step batch as the collector ships it: records of real tensors (scaled by the step), derived lazily."""
    tensors = [t * (step + 1) for t in TENSORS.values()]
    values = stats.tensor_records(tensors, 0.0, stats.fields_for_ops(OPS)).numpy()
    out = StepBatch(step=step, rank=0, pp_stage=0, keys=list(KEYS.values()), values=values,
                    scalars={"loss": 2.5 - step})
    out.deriver = lambda v: derive_rows(v, OPS)
    return out.wait()


def expected(step: int) -> dict:
    """{family: norm} as torch computes it."""
    return {family: float(torch.linalg.vector_norm(t * (step + 1))) for family, t in TENSORS.items()}


def context(rank_dir, stream=False) -> SinkContext:
    return SinkContext(rank_dir=rank_dir, rank=0, ops=OPS, ndigits=12, step_count_per_record=1,
                       per_micro_families=frozenset({ACTV}), metadata={"run": "contract"}, stream=stream)


# ---- each format's own reader: {(family, step): norm} -------------------------------------------------------
def read_csv(rank_dir, sink) -> dict:
    pd = pytest.importorskip("pandas")
    out = {}
    for family in KEYS:
        for path in rank_dir.glob(f"{family}_*.csv"):
            for _, row in pd.read_csv(path).iterrows():
                out[(family, int(row["step"]))] = float(row["norm"])
    return out


def read_tensorboard(rank_dir, sink) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(rank_dir), size_guidance={"scalars": 0})
    events.Reload()
    out = {}
    for family, key in KEYS.items():
        tag = f"{tag_of(key, 0)}_norm"
        out.update({(family, e.step): e.value for e in events.Scalars(tag)} if tag in events.Tags()["scalars"] else {})
    return out


def _sql_norms(path) -> dict:
    with sqlite3.connect(path) as conn:
        rows = conn.execute("SELECT t.family, r.step, r.sumsq, r.infs FROM records r JOIN tags t ON t.id = r.tag_id")
        return {(family, step): math.inf if infs else math.sqrt(sumsq) for family, step, sumsq, infs in rows}


def read_db(rank_dir, sink) -> dict:
    return _sql_norms(rank_dir / DB_NAME)


def read_stream(rank_dir, sink) -> dict:
    from trainmon.read import stream_mirror

    return _sql_norms(stream_mirror.sync(rank_dir / STREAM_NAME))


def read_api(rank_dir, sink) -> dict:
    latest = sink.latest(list(KEYS))   # the in-memory sink keeps the last step of each family
    return {(family, STEPS[-1]): latest[tag_of(key, 0)]["norm"] for family, key in KEYS.items()}


READERS = {"csv": read_csv, "tensorboard": read_tensorboard, "db": read_db, "api": read_api}
CASES = [(name, False) for name in table.formats()] + [("db", True)]  # db on a network filesystem: the stream


def make(name: str) -> Sink:
    if name == table.API:
        from trainmon.writers.api_sink import ApiSink
        return ApiSink()
    (sink,) = build_sinks([name])
    return sink


def test_every_format_of_the_table_is_covered():
    assert set(table.formats()) == set(READERS)


@pytest.mark.parametrize("name, stream", CASES, ids=[f"{n}{'-stream' if s else ''}" for n, s in CASES])
def test_a_sink_writes_what_its_reader_reads_back(tmp_path, name, stream):
    rank_dir = tmp_path / "run" / "rank_0"
    sink = make(name)
    assert not tmp_path.joinpath("run").exists(), "a constructor opens no file: start() does"
    sink.start(context(rank_dir, stream))
    for step in STEPS:
        sink.write(batch(step))
        sink.flush()
    read = read_stream if stream else READERS[name]
    got = read(rank_dir, sink)
    want = {(family, step): norm for step in STEPS for family, norm in expected(step).items()}
    if name == table.API:
        want = {k: v for k, v in want.items() if k[1] == STEPS[-1]}
    assert got.keys() == want.keys()
    for k, norm in want.items():
        assert got[k] == pytest.approx(norm, rel=1e-6) or (math.isinf(norm) and math.isinf(got[k])), k
    sink.close()
    sink.close()  # twice: safe


@pytest.mark.parametrize("name", [n for n in table.formats() if n != table.API])
def test_a_failing_sink_is_disabled_alone(tmp_path, name):
    """The failing sink loses its steps, counted; the real sink beside it writes every step."""

    class Broken(Sink):
        name = "broken"

        def write(self, batch):
            raise OSError("disk full")

    rank_dir = tmp_path / "rank_0"
    real = make(name)
    container = SinkContainer([Broken(), real])
    container.start(context(rank_dir))
    for step in STEPS:
        container.write(batch(step))
    container.close()
    assert container.failures == {"broken": "write: OSError: disk full"}
    assert container.lost_steps == {"broken": len(STEPS)}
    got = READERS[name](rank_dir, real)
    assert {step for _, step in got} == set(STEPS)


def test_a_registered_sink_is_built_and_written(tmp_path):
    written = []

    class Recording(Sink):
        name = "recording"

        def write(self, batch):
            written.append((batch.step, [row["norm"] for row in batch.derived]))

    table.register_sink("recording", Recording)
    try:
        (sink,) = build_sinks(["recording"])
    finally:
        table.unregister_sink("recording")
    sink.start(context(tmp_path))
    sink.write(batch(0))
    norms = expected(0)
    assert written[0][0] == 0
    np.testing.assert_allclose(written[0][1], [norms[ACTV], norms[GRAD_REDUCED]], rtol=1e-6)


def test_an_unknown_format_says_which_are_known():
    with pytest.raises(ValueError, match="format 'parquet' has no sink; known: csv, api, tensorboard, db"):
        build_sinks(["parquet"])


def test_the_api_sink_keeps_each_familys_last_step_that_recorded_it():
    from trainmon.writers.api_sink import ApiSink

    sink = ApiSink()
    sink.start(context(None))
    sink.write(batch(0))
    only_actv = batch(1)
    keep = [i for i, key in enumerate(only_actv.keys) if key.family == ACTV]
    only_actv.keys, only_actv.values = [only_actv.keys[i] for i in keep], only_actv.values[keep]
    only_actv._derived = None
    sink.write(only_actv)
    latest = sink.latest([ACTV, GRAD_REDUCED])
    assert latest[tag_of(KEYS[ACTV], 0)]["norm"] == pytest.approx(expected(1)[ACTV])
    assert latest[tag_of(KEYS[GRAD_REDUCED], 0)]["norm"] == pytest.approx(expected(0)[GRAD_REDUCED])


def test_every_built_in_format_has_its_sink():
    from trainmon.core import sinks
    from trainmon.writers import registry

    made = registry.build_sinks([name for name in sinks.BUILT_IN])
    assert len(made) == len(sinks.BUILT_IN) - 1  # api: the monitor's own
