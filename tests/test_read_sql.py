"""The read layer's SQL paths give what reading every record in Python gave: the post-mortem's summary of
a database (`db_nonfinite`), and records as columns (`db_columns`)."""
import json
import math
import shutil
import sqlite3
from dataclasses import replace

import numpy as np
import pytest

from trainmon.core.layout import DB_NAME
from trainmon.writers.anomaly_table import AnomalyTable
from trainmon.core.events import AnomalyEvent
from trainmon.analysis.rank_summary import summarize, summarize_rank_dir
from trainmon.read import find_run, open_run
from trainmon.read import jsonl
from trainmon.read.database import DbRankReader
from trainmon.read.db_nonfinite import record_event
from trainmon.core.records import RecordKey
from trainmon.writers import db_schema
from trainmon.writers.db_sink import MonitorDb

OPS = ["min", "max", "norm", "mean", "zeros", "nans", "infs", "sat"]
# family, name: the tags of the fixture (two share a module: layers.1's input and output)
TAGS = [("actv", "layers.0.output"), ("actv", "layers.1.input"), ("actv", "layers.1.output"),
        ("actv_grad", "layers.1.input"), ("grad_reduced", "layers.1.weight"), ("comm", "all_reduce[0-1]@dp#0.output")]
GOOD = (4.0, 0, 0, 0, 1.0, 2.0, -1.0, 1.0, 0, 0)
INF = (3.0, 0, 1, 0, 1.0, 2.0, -1.0, 1.0, 0, 1)


def _anomaly(step, micro, call, module, phase, tensor, op, value, family, rank=0):
    return AnomalyEvent(rank=rank, step=step, micro_step=micro, pp_stage=0, vpp_stage=0, call_index=call,
                        module=module, phase=phase, tensor=tensor, op=op, value=value, rule="AnomalyNan", family=family)


def _write_rank(rank_dir):
    """A database where: records share call indices (ties), several tags of one module turn non-finite,
    the anomalies table repeats records, holds a NaN loss, an infinite figure of a finite record, and an
    anomaly of a step whose records were not committed; step 3's records were not committed."""
    rank_dir.mkdir(parents=True)
    path = rank_dir / DB_NAME
    conn = db_schema.connect(str(path))
    db_schema.write_meta(conn, {"ops": OPS, "schema_version": db_schema.SCHEMA_VERSION})
    conn.executemany("INSERT INTO tags (id, family, name, vpp_stage, shape, dtype) VALUES (?, ?, ?, 0, '[2]', 'f')",
                     [(i, f, n) for i, (f, n) in enumerate(TAGS, 1)])
    bad = {1: {2, 3}, 2: {1, 3, 4, 5, 6}}  # step -> non-finite tags
    rows = []
    for step in range(3):
        for call, tag in enumerate(range(1, 7)):
            micro = 0 if tag <= 4 else None
            values = INF if tag in bad.get(step, ()) else GOOD
            # the two layers.1 activations of one call share its index
            rows.append((tag, step, micro, min(call, 2), 0, *values, 0))
        conn.execute("INSERT INTO batches VALUES (?, 0, 6, 0)", (step,))
    rows.append((4, 0, 0, 3, 0, 0.0, math.nan, math.nan, math.nan, 0.0, 0.0, math.inf, -math.inf, math.nan, math.nan, 0))
    db_schema.insert_records(conn, [r[:5] + tuple(None if v != v else v for v in r[5:-1]) + r[-1:] for r in rows])
    conn.close()
    table = AnomalyTable(path)
    table.open()
    table.append([_anomaly(1, 0, 1, "layers.1", "forward", "input", "infs", 1.0, "actv"),
                  _anomaly(1, 0, 2, "layers.1", "forward", "output", "infs", 1.0, "actv"),
                  _anomaly(1, None, None, "loss", "scalar", "value", "value", math.nan, "scalar"),
                  _anomaly(0, None, 4, "layers.1.weight", "optimizer", "reduced_grad", "norm", math.inf,
                           "grad_reduced"),
                  _anomaly(1, None, 5, "all_reduce[0-1]@dp#0.output", "communication", "comm", "mean", 2.0, "comm"),
                  _anomaly(3, 0, 0, "layers.0", "forward", "output", "nans", 2.0, "actv")])
    table.close()
    return path


def _every_event(path, rank) -> list[AnomalyEvent]:
    """Every non-finite event of the database, as the reader built them before it summarised in SQL."""
    conn = sqlite3.connect(path)
    columns = db_schema.ANOMALY_COLUMNS
    events = []
    for row in conn.execute(f"SELECT {', '.join(columns)}, is_nan FROM anomalies ORDER BY step, rowid"):
        fields = dict(zip(columns, row))
        fields["value"], fields["first"] = db_schema.decode_real(fields["value"], row[-1]), bool(fields["first"])
        event = AnomalyEvent(**fields)
        events += [event] if event.nonfinite else []
    for family, name, vpp, step, micro, call, pp, nans, infs in conn.execute(
            "SELECT t.family, t.name, t.vpp_stage, r.step, r.micro_step, r.call_index, r.pp_stage, r.nans, r.infs "
            f"FROM records r JOIN tags t ON t.id = r.tag_id WHERE {db_schema.NONFINITE_RECORD} "
            "ORDER BY r.step, r.call_index"):
        op, value = ("nans", nans) if nans else ("infs", infs)
        events.append(record_event(rank, step, micro, pp, vpp, call, family, name, op, value))
    conn.close()
    return events


# What schema version 4 had where version 5 has first_nonfinite, and what databases older still had neither of.
_SCHEMA_4 = ("DROP TABLE first_nonfinite; CREATE INDEX records_nonfinite_tag ON records "
             "(tag_id, step, micro_step, nans, infs) WHERE nans > 0 OR infs > 0;")
_OLDER = "DROP TABLE first_nonfinite; DROP INDEX anomalies_nonfinite;"


@pytest.mark.parametrize("older", [None, _SCHEMA_4, _OLDER], ids=["current", "schema-4", "older-without-either"])
def test_sql_summary_equals_the_summary_of_every_record(tmp_path, older):
    path = _write_rank(tmp_path / "run" / "rank_0")
    if older:
        conn = sqlite3.connect(path)
        conn.executescript(older)
        conn.close()
    expected = summarize(0, _every_event(path, 0))
    got = summarize_rank_dir(find_run(tmp_path / "run").ranks[0])
    assert got.records == expected.records == 7 + 3  # the loss, the infinite norm, the uncommitted step's
    assert got.firsts == expected.firsts and got.comm == expected.comm
    assert [(e.step, e.module, e.tensor, e.rule) for e in got.firsts[:2]] == [
        (0, "layers.1.weight", "reduced_grad", "AnomalyNan"), (1, "layers.1", "input", "AnomalyNan")]
    assert sorted(p.name for p in path.parent.iterdir()) == ["monitor.db"]  # read-only: no -wal, -shm


def test_a_jsonl_beside_the_database_adds_only_the_steps_it_lacks(tmp_path):
    path = _write_rank(tmp_path / "run" / "rank_0")
    jsonl = path.parent / "anomalies.jsonl"
    extra = _anomaly(4, 0, 0, "layers.0", "forward", "output", "infs", 1.0, "actv")
    known = _anomaly(3, 0, 0, "layers.0", "forward", "output", "nans", 2.0, "actv")  # also in the db's table
    jsonl.write_text("".join(json.dumps(e.to_json()) + "\n" for e in (known, extra)) + '{"rank": 0, "st')
    expected = summarize(0, _every_event(path, 0) + [extra])
    got = summarize_rank_dir(find_run(tmp_path / "run").ranks[0])
    assert got.records == expected.records == 11 and got.firsts == expected.firsts
    assert len(got.warnings) == 1 and "cut short" in got.warnings[0]


def test_columns_equal_the_rows(tmp_path):
    path = _write_rank(tmp_path / "run" / "rank_0")
    reader = DbRankReader(path)
    try:
        rows = [row for _, step_rows in reader.rows(None, 1, 2) for row in step_rows]
        columns = reader.columns(None, 1, 2)
        assert list(columns.data) == list(rows[0]) and len(columns) == len(rows)
        for i, row in enumerate(rows):
            for name, value in row.items():
                got = columns.data[name][i]
                if name in columns.missing and columns.missing[name][i]:
                    assert value is None, (name, i)
                else:
                    assert got == value or (got != got and value != value), (name, i, got, value)
        grads = reader.columns("grad_reduced", 0, 0)
        assert grads.data["name"] == ["layers.1.weight"] and grads.data["step"].tolist() == [0]
    finally:
        reader.close()


def test_a_figure_without_a_value_reads_as_none_in_rows_and_missing_in_columns(tmp_path):
    _write_rank(tmp_path / "run" / "rank_0")
    with open_run(tmp_path / "run") as run:
        frame = run.family("actv_grad", steps=0)
    # the record of count 0 with unrecorded NaN/Inf counts: no min, max, mean or zeros; its sum is 0
    empty = frame[frame["call_index"] == 3].iloc[0]
    assert all(math.isnan(empty[op]) for op in ("min", "max", "mean", "zeros", "sat"))
    assert (empty["nans"], empty["infs"], empty["norm"]) == (0.0, 0.0, 0.0)
    assert frame["tag"].tolist() == ["0:layers.1.input:0/rank0/actv_grad"] * 2


def test_the_steps_of_a_jsonl_are_read_at_once_or_by_the_regex(tmp_path):
    events = [_anomaly(step, 0, call, "layers.0", "forward", "output", "infs", 1.0, "actv", rank=12)
              for step in (7, 7, 123456, 9) for call in (0, 1)]
    lines = "".join(json.dumps(e.to_json()) + "\n" for e in events).encode()
    assert jsonl._leading_steps(lines) == {7, 9, 123456}
    for other in (lines + b'{"step": 5, "rank": 12}\n', lines.replace(b'"step": 9,', b'"step": 9 ,')):
        assert jsonl._leading_steps(other) is None  # another key order, another spelling: the regex reads them
    path = tmp_path / "anomalies.jsonl"
    path.write_bytes(lines + lines[:40])  # cut short
    with open(path, "rb") as fh:
        assert jsonl._skipped_head(fh, {7, 9, 123456}.__contains__) == (len(lines), len(events))
    with open(path, "rb") as fh:
        assert jsonl._skipped_head(fh, {7, 9}.__contains__) == (0, 0)
    warnings = []
    assert list(jsonl.read_jsonl(path, warnings.append, {7, 9}.__contains__)) == events[4:6]
    assert len(warnings) == 1


def _columns(path, family=None, first=None, last=None):
    reader = DbRankReader(path)
    try:
        return reader.columns(family, first, last)
    finally:
        reader.close()


def _assert_same_columns(got, want):
    assert list(got.data) == list(want.data) and len(got) == len(want) > 0
    for name, column in want.data.items():
        if isinstance(column, np.ndarray):
            assert got.data[name].dtype == column.dtype, name
            np.testing.assert_array_equal(got.data[name], column, err_msg=name)
        else:
            assert got.data[name] == column, name
    for op, missing in want.missing.items():
        np.testing.assert_array_equal(got.missing[op], missing, err_msg=op)


def _write_blocks_run(path, steps):
    """Batches as a writer commits them: NaN and Inf fields, fields not recorded, micro-steps, records out of
    call order, and two batches of one step."""
    keys = [RecordKey("actv", "layers.1.output", 0, 1, 5, (4,), "torch.float32"),
            RecordKey("actv", "layers.0.output", 0, 0, 2, (4,), "torch.float32"),
            RecordKey("actv", "layers.0.output", 0, 1, 3, (4,), "torch.float32"),
            RecordKey("grad_reduced", "layers.1.weight", 1, None, 9, (4, 4), "torch.bfloat16")]
    db = MonitorDb(path)
    db.set_meta({"schema_version": db_schema.SCHEMA_VERSION, "ops": OPS})
    for step in steps:
        values = np.random.default_rng(step).normal(size=(len(keys), len(db_schema.FIELDS)))
        values[0, db_schema.FIELDS.index("sum")] = math.nan
        values[1, db_schema.FIELDS.index("max")] = math.inf
        values[:, db_schema.FIELDS.index("count")] = [4, 0, 3, 16]
        recorded = np.ones_like(values, dtype=bool)
        recorded[2, db_schema.FIELDS.index("sat")] = False
        db.add_step(step, step % 2, keys, values, {"loss": 1.0}, recorded)
        if step % 3 == 0:  # a second batch of the step
            db.add_step(step, step % 2, keys[:2], values[:2] * 2, {})
    db.close()


def test_blocks_and_records_give_the_same_columns(tmp_path):
    """The `record_blocks` table gives the columns `records` gives; a database without it (schema version 2),
    and one that a version 3 writer appended to, are read from `records` where a step lacks its block."""
    blocks, records = tmp_path / "blocks.db", tmp_path / "records.db"
    _write_blocks_run(blocks, range(8))
    shutil.copy(blocks, records)
    conn = sqlite3.connect(records)
    conn.execute("DROP TABLE record_blocks")
    conn.close()  # checkpoints: the copy below has no -wal beside it
    for family, first, last in [(None, None, None), ("actv", 2, 5), ("grad_reduced", 3, None), (None, 6, 6)]:
        _assert_same_columns(_columns(blocks, family, first, last), _columns(records, family, first, last))
    appended = tmp_path / "appended.db"
    shutil.copy(records, appended)
    _write_blocks_run(appended, range(8, 12))  # reopened: gains the table, later steps get blocks
    conn = sqlite3.connect(appended)
    assert [s for (s,) in conn.execute("SELECT DISTINCT step FROM record_blocks")] == [8, 9, 10, 11]
    conn.close()
    whole = tmp_path / "whole.db"
    _write_blocks_run(whole, range(12))
    for first, last in [(None, None), (5, 9), (8, 11)]:
        _assert_same_columns(_columns(appended, None, first, last), _columns(whole, None, first, last))


def test_a_copy_with_a_call_index_that_sorts_later_takes_its_place_in_order():
    """A record read twice (its CSV row on the stage run.json names, its database row on another): the copy with a
    call index is kept, and the firsts follow its place, not the other copy's."""
    row = _anomaly(2, 0, None, "layers.1", "forward", "output", "infs", 1.0, "actv")
    indexed = replace(row, pp_stage=1, call_index=5)
    earlier = replace(row, pp_stage=1, call_index=0, tensor="input")  # between the two copies in the key order
    summary = summarize(0, [indexed, row, earlier])
    assert summary.records == 2 and summary.firsts == [earlier]
    assert summarize(0, [row, earlier]).firsts == [row]  # without the indexed copy, the CSV row comes first
