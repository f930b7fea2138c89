"""The step collector's reuse of records: a tensor recorded again in the same step, unchanged, is not read
again; a changed or different tensor is."""
from __future__ import annotations

import weakref

import pytest
import torch

from trainmon.core.records import RecordKey
from trainmon.engine import paths, stats, stats_cpu, stats_native
from trainmon.engine.paths import SNAPSHOT_MAX_BYTES
from trainmon.hooks.collector import StepCollector

FIELDS = stats.fields_for_ops(["norm", "min", "max"])
NORM = stats.FIELDS.index("sumsq")


def key(name: str, t: torch.Tensor) -> RecordKey:
    return RecordKey("actv", name, 0, 0, 0, tuple(t.shape), str(t.dtype))


def collector_reading(monkeypatch, on_arrival: bool = False, fields=FIELDS):
    """A collector whose batches never fill, and the tensors each call of the engine read (by identity). Without
    `on_arrival` every tensor takes the held path, none is read on arrival (`stats_cpu.RecordsOnArrival`)."""
    reads = []
    if on_arrival:
        assert stats_native.prepare()
    else:
        monkeypatch.setattr(paths, "ON_ARRIVAL_MIN_ELEMENTS", 1 << 62)

    def tensor_records(tensors, eps, fields, engine=stats.tensor_records, **options):
        reads.append([id(t) for t in tensors])
        return engine(tensors, eps, fields, **options)
    monkeypatch.setattr(stats, "tensor_records", tensor_records)
    return StepCollector(1e-8, fields, rank=0, batch_bytes=1 << 30), reads


def sumsq(batch, name):
    return {k.name: row[NORM] for k, row in zip(batch.keys, batch.values)}[name]


def deferrable(collector, *names):
    """Makes `names` deferred: a name's first record is read at once, and watched until the next batch."""
    for name in names:
        t = torch.ones(3)
        collector.record([key(name, t)], [t], defer=True)
    collector.flush_pending()


def test_an_unchanged_tensor_recorded_after_its_batch_reuses_its_record(monkeypatch):
    collector, reads = collector_reading(monkeypatch)
    deferrable(collector, "block.0.output", "block.1.input", "block.1.input_2")
    reads.clear()
    x = torch.randn(1000)
    collector.record([key("block.0.output", x)], [x], defer=True)
    collector.flush_pending()                         # as when the pending batch filled
    collector.record([key("block.1.input", x)], [x], defer=True)
    x.mul_(2)                                         # changed in place: read again
    collector.record([key("block.1.input_2", x)], [x], defer=True)
    batch = collector.finish_step().wait()
    assert [id(x) in r for r in reads] == [True, True]
    assert sumsq(batch, "block.0.output") == sumsq(batch, "block.1.input")
    assert sumsq(batch, "block.1.input") == pytest.approx(float((x / 2).double().square().sum()), rel=1e-6)
    assert sumsq(batch, "block.1.input_2") == pytest.approx(float(x.double().square().sum()), rel=1e-6)


def test_a_new_tensor_at_a_dead_ones_id_is_read(monkeypatch):
    collector, reads = collector_reading(monkeypatch)
    deferrable(collector, "a", "b")
    old = torch.ones(1000)
    collector.record([key("a", old)], [old], defer=True)
    collector.flush_pending()
    dead_id, kept = id(old), []
    del old
    for _ in range(10_000):                           # CPython hands a freed object's address to the next one
        new = torch.full((1000,), 2.0)
        if id(new) == dead_id:
            break
        kept.append(new)
    assert id(new) == dead_id
    collector.record([key("b", new)], [new], defer=True)
    batch = collector.finish_step().wait()
    assert sumsq(batch, "a") == 1000.0 and sumsq(batch, "b") == 4000.0


def test_records_are_not_shared_across_steps(monkeypatch):
    collector, reads = collector_reading(monkeypatch)
    deferrable(collector, "a")
    x = torch.randn(100)
    collector.record([key("a", x)], [x], defer=True)
    collector.finish_step()
    reads.clear()
    collector.record([key("a", x)], [x], defer=True)
    collector.finish_step()
    assert any(id(x) in r for r in reads)


def test_a_name_that_changes_in_place_is_copied_in_its_hook_and_read_with_the_batch(monkeypatch):
    """A CPU tensor of a name that changes in place is recorded with its values in the hook: a copy taken there is
    read with the next batch, beside the held tensors, not by a statistics call of its own. One larger than
    SNAPSHOT_MAX_BYTES is read in its hook."""
    collector, reads = collector_reading(monkeypatch)
    deferrable(collector, "held")
    first = torch.randn(1000)
    collector.record([key("logits", first)], [first], defer=True)
    first.mul_(2)                                     # changed in place before the batch: read at once from now on
    collector.finish_step().wait()
    reads.clear()
    logits, held, wide = torch.randn(1000), torch.randn(1000), torch.randn(SNAPSHOT_MAX_BYTES // 4 + 1)
    expected = float(logits.double().square().sum())
    collector.record([key("logits", logits)], [logits], defer=True)
    logits.mul_(3)
    collector.record([key("held", held)], [held], defer=True)
    collector.record([key("wide", wide)], [wide], defer=True)
    batch = collector.finish_step().wait()
    assert sumsq(batch, "logits") == pytest.approx(expected, rel=1e-6)
    assert sumsq(batch, "held") == pytest.approx(float(held.double().square().sum()), rel=1e-6)
    assert sumsq(batch, "wide") == pytest.approx(float(wide.double().square().sum()), rel=1e-6)
    assert reads[0] == [id(wide)]
    assert len(reads) == 2 and len(reads[1]) == 2 and id(held) in reads[1] and id(logits) not in reads[1]


def test_records_of_earlier_batches_serve_after_later_ones(monkeypatch):
    collector, reads = collector_reading(monkeypatch)
    deferrable(collector, "a", "b", "a_again", "b_again")
    collector.finish_step()
    reads.clear()
    x, y = torch.randn(100), torch.randn(200)
    collector.record([key("a", x)], [x], defer=True)
    collector.flush_pending()
    collector.record([key("b", y)], [y], defer=True)
    collector.flush_pending()
    collector.record([key("a_again", x), key("b_again", y)], [x, y], defer=True)
    batch = collector.finish_step().wait()
    assert reads == [[id(x)], [id(y)]]                # each read once, in its own batch
    assert sumsq(batch, "a") == sumsq(batch, "a_again") == pytest.approx(float(x.double().square().sum()), rel=1e-6)
    assert sumsq(batch, "b") == sumsq(batch, "b_again") == pytest.approx(float(y.double().square().sum()), rel=1e-6)


def test_a_held_tensor_changed_before_its_batch_is_dropped_and_read_again_in_its_new_values(monkeypatch):
    collector, reads = collector_reading(monkeypatch)
    deferrable(collector, "a", "a_again")
    collector.finish_step()
    x = torch.randn(100)
    collector.record([key("a", x)], [x], defer=True)
    x.mul_(2)                                         # after it was held: its record would show the new values
    collector.flush_pending()
    collector.record([key("a_again", x)], [x], defer=True)
    batch = collector.finish_step().wait()
    assert "a" not in [k.name for k in batch.keys] and collector.dropped_in_place == {"a": 1}
    assert sumsq(batch, "a_again") == pytest.approx(float(x.double().square().sum()), rel=1e-6)


def test_a_held_tensor_whose_data_is_replaced_is_not_read_and_its_name_is_read_in_its_hook_after(monkeypatch):
    """Megatron's deallocated pipeline outputs: `out.data = torch.empty(1)` after the send leaves `_version` as it was.
    The held tensor's record would describe that one uninitialised element."""
    collector, reads = collector_reading(monkeypatch)
    deferrable(collector, "stage.output", "next.input")
    collector.finish_step()
    reads.clear()
    out = torch.randn(1000)
    collector.record([key("stage.output", out)], [out], defer=True)
    out.data = torch.full((1,), 3.0)
    collector.flush_pending()
    collector.record([key("next.input", out)], [out], defer=True)   # the entry of the batch serves it no more
    batch = collector.finish_step().wait()
    assert "stage.output" not in [k.name for k in batch.keys] and collector.dropped_in_place == {"stage.output": 1}
    assert all(id(out) not in r for r in reads[:1]) and any(id(out) in r for r in reads[1:])
    assert sumsq(batch, "next.input") == 9.0          # its values now, read
    again = torch.randn(1000)
    expected = float(again.double().square().sum())
    collector.record([key("stage.output", again)], [again], defer=True)   # copied in its hook from now on
    again.data = torch.empty(1)
    batch = collector.finish_step().wait()
    assert sumsq(batch, "stage.output") == pytest.approx(expected, rel=1e-6) and collector.dropped_in_place == {
        "stage.output": 1}


def test_a_held_tensor_whose_storage_is_freed_is_not_read(monkeypatch):
    """FSDP2 frees a parameter's unsharded storage with `untyped_storage().resize_(0)`: the tensor keeps its shape and
    version, and its data pointer points at nothing; reading it there would read memory given back."""
    collector, reads = collector_reading(monkeypatch)
    deferrable(collector, "freed", "kept")
    collector.finish_step()
    reads.clear()
    freed, kept = torch.randn(1 << 16), torch.randn(1000)
    collector.record([key("freed", freed), key("kept", kept)], [freed, kept], defer=True)
    freed.untyped_storage().resize_(0)
    batch = collector.finish_step().wait()
    assert [k.name for k in batch.keys] == ["kept"] and collector.dropped_in_place == {"freed": 1}
    assert sumsq(batch, "kept") == pytest.approx(float(kept.double().square().sum()), rel=1e-6)
    assert len(reads) == 1 and id(freed) not in reads[0]


def test_a_name_whose_data_is_replaced_on_first_sight_is_read_in_its_hook(monkeypatch):
    collector, _ = collector_reading(monkeypatch)
    out = torch.randn(100)
    collector.record([key("stage.output", out)], [out], defer=True)   # first sight: read at once, watched
    out.data = torch.empty(1)
    collector.finish_step()
    out = torch.randn(100)
    expected = float(out.double().square().sum())
    collector.record([key("stage.output", out)], [out], defer=True)   # copied in its hook, read with the batch
    out.data = torch.empty(1)
    batch = collector.finish_step().wait()
    assert sumsq(batch, "stage.output") == pytest.approx(expected, rel=1e-6) and collector.dropped_in_place == {}


def assert_records_equal_the_engines(batch, expected: dict) -> None:
    """Each named record of `batch` equals the engine's record of the values given for it (read in one batch)."""
    names = list(expected)
    want = stats.tensor_records([expected[n] for n in names], 1e-8, FIELDS)
    got = {k.name: row for k, row in zip(batch.keys, batch.values)}
    for name, row in zip(names, want):
        assert list(got[name]) == pytest.approx(row.tolist(), rel=1e-6), name


def test_a_large_cpu_tensor_is_read_on_arrival_not_held(monkeypatch):
    """A CPU activation of paths.ON_ARRIVAL_MIN_ELEMENTS or more is read in its hook, while its data is in the
    caches: no engine call reads it, the collector keeps no reference to it, and a change in place after its hook
    neither drops nor alters its record. Recorded again after that change, it is read again."""
    collector, reads = collector_reading(monkeypatch, on_arrival=True)
    deferrable(collector, "small")
    collector.finish_step()
    reads.clear()
    g = torch.Generator().manual_seed(5)
    big, small = torch.randn(3, paths.ON_ARRIVAL_MIN_ELEMENTS, generator=g), torch.randn(100, generator=g)
    before = big.clone()
    collector.record([key("big.output", big), key("small", small)], [big, small], defer=True)
    alive = weakref.ref(big)
    big.mul_(2)
    collector.record([key("next.input", big)], [big], defer=True)
    after = big.clone()
    del big
    assert alive() is None                            # not held until the batch: its memory goes when the model's does
    batch = collector.finish_step().wait()
    assert reads == [[id(small)]] and collector.dropped_in_place == {}
    assert_records_equal_the_engines(batch, {"big.output": before, "next.input": after, "small": small})


def test_a_record_read_on_arrival_serves_the_same_tensor_after_its_batch(monkeypatch):
    """A batch's rows are its held tensors' and then those read on arrival: a tensor recorded again, unchanged,
    after its batch was reduced reuses the right row, whichever way it was read; so does one recorded again before
    the batch."""
    collector, reads = collector_reading(monkeypatch, on_arrival=True)
    deferrable(collector, "held", "held_again")
    collector.finish_step()
    reads.clear()
    g = torch.Generator().manual_seed(6)
    n = paths.ON_ARRIVAL_MIN_ELEMENTS
    first, held, second = torch.randn(n, generator=g), torch.randn(50, generator=g), torch.randn(2 * n, generator=g)
    collector.record([key("first", first), key("held", held)], [first, held], defer=True)
    collector.record([key("second", second), key("first_again", first)], [second, first], defer=True)
    collector.flush_pending()
    collector.record([key("second_again", second), key("held_again", held)], [second, held], defer=True)
    batch = collector.finish_step().wait()
    assert reads == [[id(held)]]
    assert_records_equal_the_engines(batch, {"first": first, "first_again": first, "second": second,
                                             "second_again": second, "held": held, "held_again": held})


def test_a_tensor_whose_figures_are_not_its_record_takes_the_engine(monkeypatch):
    """A tensor holding a NaN or an Inf, or reaching the saturation limit, needs the exact kernels or a count of its
    own: its read on arrival is not kept, and it is held for the engine's batch as before."""
    collector, reads = collector_reading(monkeypatch, on_arrival=True, fields=stats.fields_for_ops(
        ["norm", "min", "max", "sat"], sat_threshold=100.0))
    deferrable(collector, "nan", "loud", "quiet")
    collector.finish_step()
    reads.clear()
    n = paths.ON_ARRIVAL_MIN_ELEMENTS
    nan, loud, quiet = torch.randn(n), torch.randn(n), torch.randn(n)
    nan[n // 2], loud[3] = float("nan"), 150.0
    collector.record([key("nan", nan), key("loud", loud), key("quiet", quiet)], [nan, loud, quiet], defer=True)
    batch = collector.finish_step().wait()
    assert reads == [[id(nan), id(loud)]]             # held, and read with the batch; `quiet` read on arrival
    got = {k.name: dict(zip(stats.FIELDS, row)) for k, row in zip(batch.keys, batch.values)}
    assert got["nan"]["nans"] == 1 and got["nan"]["count"] == n - 1
    assert got["loud"]["sat"] == 1 and got["quiet"]["sat"] == 0 and got["quiet"]["count"] == n


def test_a_graph_buffer_is_recorded_with_its_values_at_the_hook_and_never_found_again_by_identity(monkeypatch):
    """A compiled graph lends its hooks buffers whose memory its later kernels overwrite without a version bump: a
    small one is copied in the hook (held is the copy), and the same object recorded again is read again."""
    from trainmon.hooks import in_graph

    collector, reads = collector_reading(monkeypatch)
    monkeypatch.setattr(in_graph, "graph_buffers", lambda: True)
    buffer = torch.full((100,), 2.0)
    collector.record([key("a.output", buffer)], [buffer], defer=True)
    buffer.data.fill_(3.0)                          # the graph reuses the memory: no version bump
    collector.record([key("b.output", buffer)], [buffer], defer=True)
    buffer.data.fill_(5.0)
    batch = collector.finish_step().wait()
    assert sumsq(batch, "a.output") == 100 * 4.0 and sumsq(batch, "b.output") == 100 * 9.0
    assert all(id(buffer) not in read for read in reads)  # the copies were read, one batch for both
    assert len(reads) == 1
