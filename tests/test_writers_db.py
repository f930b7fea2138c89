"""The db format: contents equal the CSV output, non-finite values are faithful, bad conditions are survived."""
import json
import math
import os
import sqlite3
import subprocess
import sys
import zlib

import numpy as np
import pytest
import torch

from writer_helpers import OPS, integrity, monitored, tensorboard_scalars
from trainmon import open_run
from trainmon.core.records import GRAD_REDUCED, RecordKey
from trainmon.writers import db_schema
from trainmon.writers.db_sink import MonitorDb

INDEX = ["family", "name", "vpp_stage", "step", "micro_step"]


def test_db_contents_equal_csv_contents(output_dir, write_config):
    monitor, _ = monitored(write_config, steps=3, grad_acc_steps=2, format=["csv", "db"])
    db_path = monitor.output_dir / "monitor.db"
    assert integrity(db_path) == "ok"
    with sqlite3.connect(db_path) as conn:
        assert conn.execute("SELECT COUNT(*) FROM batches").fetchone()[0] == 3
    assert not (monitor.output_dir / "monitor.db-wal").exists()  # written in WAL mode, closed without it
    from_db = open_run(monitor.output_dir, source="db").records()
    from_csv = open_run(monitor.output_dir, source="csv").records()
    assert len(from_db) == len(from_csv) > 500
    assert set(from_db.family) == set(from_csv.family) == {"actv", "actv_grad", "grad_unreduced", "grad_reduced",
                                                           "param_origin", "param_updated", "exp_avg", "exp_avg_sq"}
    key = lambda frame: frame.assign(micro_step=frame.micro_step.fillna(-1)).set_index(INDEX).sort_index()  # noqa
    db, csv = key(from_db), key(from_csv)
    assert db.index.equals(csv.index) and not db.index.duplicated().any()
    for op in OPS:  # ndigits=17 makes the CSV exact, so the two must agree to the last bit
        np.testing.assert_array_equal(db[op].to_numpy(), csv[op].to_numpy(), err_msg=op)
    assert [list(s) for s in db["shape"]] == [list(s) for s in csv["shape"]]
    assert (db["dtype"] == csv["dtype"]).all()
    # the ordering key is kept: call_index grows within a step, forward before backward
    step0 = from_db[from_db.step == 0].sort_values("call_index")
    assert step0.call_index.is_unique
    assert step0.family.iloc[0] == "actv"


def test_both_common_queries_use_an_index(output_dir, write_config):
    monitor, _ = monitored(write_config, steps=1, grad_acc_steps=1, format=["db"], xy_distribution=False)
    with sqlite3.connect(monitor.output_dir / "monitor.db") as conn:
        by_tag = " ".join(r[-1] for r in conn.execute(
            "EXPLAIN QUERY PLAN SELECT * FROM records WHERE tag_id = 3 ORDER BY step"))
        by_step = " ".join(r[-1] for r in conn.execute(
            "EXPLAIN QUERY PLAN SELECT * FROM records WHERE step = 0"))
    # one tag over steps: a seek per step (skip-scan) in the index led by the step
    assert "records_step_tag (ANY(step) AND tag_id=?)" in by_tag and "records_step_tag (step=?)" in by_step, \
        (by_tag, by_step)


def _wal_frames_of_one_step(db: MonitorDb, step: int, keys: list, values: np.ndarray) -> int:
    db.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    db.add_step(step, 0, keys, values, {})
    return db.conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()[1]


@pytest.mark.parametrize("nonfinite", [False, True], ids=["finite", "every-record-nan"])
def test_a_step_writes_as_many_pages_late_in_a_run_as_early(tmp_path, nonfinite):
    """A step's rows go at the end of every index of `records`, so the pages a step writes do not grow with the
    steps before it, even when every record is non-finite (an index led by the tag would take a page per tag and
    step: the writer would fall further behind the longer the run)."""
    db = MonitorDb(tmp_path / "monitor.db")
    keys = [RecordKey("actv", f"layers.{i}.output", 0, 0, i, (4,), "torch.float32") for i in range(400)]
    values = np.random.default_rng(0).standard_normal((len(keys), len(db_schema.FIELDS)))
    values[:, 1] = 3.0 if nonfinite else 0.0  # nans
    for step in range(10):
        db.add_step(step, 0, keys, values, {})
    early = _wal_frames_of_one_step(db, 10, keys, values)
    for step in range(11, 300):
        db.add_step(step, 0, keys, values, {})
    late = _wal_frames_of_one_step(db, 300, keys, values)
    db.close()
    assert late <= 1.25 * early, (early, late)  # with a (tag_id, step) index: 63 and 658 pages


def _first_nonfinite(path) -> tuple[dict, dict]:
    """The `first_nonfinite` table, and each tag's first non-finite step computed from `records`."""
    with sqlite3.connect(path) as conn:
        noted = dict(conn.execute("SELECT tag_id, step FROM first_nonfinite"))
        direct = dict(conn.execute(f"SELECT tag_id, MIN(step) FROM records WHERE {db_schema.NONFINITE_RECORD} "
                                   "GROUP BY tag_id"))
    return noted, direct


def test_first_nonfinite_holds_each_tags_first_nonfinite_step(tmp_path):
    db = MonitorDb(tmp_path / "monitor.db")
    keys = [RecordKey("actv", name, 0, 0, i, (4,), "torch.float32") for i, name in enumerate("abc")]
    values = np.zeros((3, len(db_schema.FIELDS)))
    nans, infs = db_schema.FIELDS.index("nans"), db_schema.FIELDS.index("infs")
    for step in range(10):
        values[:] = 0
        values[0, nans] = step in (3, 5)   # a: NaN at steps 3 and 5
        values[1, infs] = step >= 7        # b: Inf from step 7; c: never
        db.add_step(step, 0, keys, values, {})
    noted, direct = _first_nonfinite(tmp_path / "monitor.db")
    assert noted == direct == {db._tag_ids[("actv", "a", 0, (4,), "torch.float32")]: 3,
                               db._tag_ids[("actv", "b", 0, (4,), "torch.float32")]: 7}
    values[:] = 0
    values[1, infs] = 1                   # a job resumed from an earlier checkpoint writes step 2 again
    db.add_step(2, 0, keys, values, {})
    db.close()
    noted, direct = _first_nonfinite(tmp_path / "monitor.db")
    assert noted == direct and sorted(noted.values()) == [2, 3]


def test_a_version_4_database_moves_to_first_nonfinite_when_a_job_appends(tmp_path):
    path = tmp_path / "monitor.db"
    db = MonitorDb(path)
    keys = [RecordKey("actv", name, 0, 0, i, (4,), "torch.float32") for i, name in enumerate("ab")]
    values = np.zeros((2, len(db_schema.FIELDS)))
    for step in range(4):
        values[0, db_schema.FIELDS.index("nans")] = step >= 1
        db.add_step(step, 0, keys, values, {})
    # as schema version 4 wrote it: the two indexes led by the tag, no first_nonfinite table
    db.conn.executescript("DROP TABLE first_nonfinite; "
                          "CREATE INDEX records_tag_step ON records (tag_id, step); "
                          "CREATE INDEX records_nonfinite_tag ON records (tag_id, step, micro_step, nans, infs) "
                          "WHERE nans > 0 OR infs > 0;")
    db_schema.write_meta(db.conn, {"schema_version": 4})
    db.close()
    MonitorDb(path).close()
    noted, direct = _first_nonfinite(path)
    assert noted == direct and list(noted.values()) == [1]
    with sqlite3.connect(path) as conn:
        indexes = {name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
        assert db_schema.read_meta(conn)["schema_version"] == db_schema.SCHEMA_VERSION == 5
    assert not indexes & {"records_tag_step", "records_nonfinite_tag"}, indexes


def test_metadata_holds_config_versions_and_world_size(output_dir, write_config):
    monitor, _ = monitored(write_config, steps=1, grad_acc_steps=1, format=["db"], xy_distribution=False)
    meta = open_run(monitor.output_dir).metadata()
    assert meta["world_size"] == 1 and meta["rank"] == 0 and meta["schema_version"] == db_schema.SCHEMA_VERSION
    assert meta["versions"]["torch"] == torch.__version__
    assert meta["config"]["ops"] == OPS and meta["ops"] == OPS
    assert meta["fields"] == list(db_schema.FIELDS)


def test_nan_and_inf_are_stored_faithfully(output_dir, write_config):
    def poison(monitor, step):
        monitor.log_scalar("loss", float("nan") if step == 1 else 1.0)
        if step == 1:
            grad = monitor._optimizer.param_groups[0]["params"][0].grad
            grad.view(-1)[:3] = torch.tensor([float("nan"), float("inf"), -float("inf")])

    monitor, _ = monitored(write_config, steps=2, grad_acc_steps=1, on_step=poison, format=["db"],
                           xy_distribution=False)
    run = open_run(monitor.output_dir)
    name = next(iter(run.family(GRAD_REDUCED, steps=0).name))  # the first parameter
    row = run.tag(f"0:{name}/rank0/post_grad", steps=1).iloc[0]
    assert (row["nans"], row["infs"], row["raw_count"]) == (1, 2, math.prod(row["shape"]) - 3)
    assert math.isfinite(row["raw_sum"]) and math.isfinite(row["raw_sumsq"]) and row["raw_pinfs"] == 1
    assert math.isnan(row["norm"]) and math.isnan(row["max"])  # as torch gives them
    loss = run.scalars("loss")
    assert loss.value.iloc[0] == 1.0 and math.isnan(loss.value.iloc[1])
    with sqlite3.connect(monitor.output_dir / "monitor.db") as conn:
        assert conn.execute("SELECT value, is_nan FROM scalars WHERE step = 1").fetchone() == (None, 1)


def test_nan_fields_are_marked_and_inf_is_real(tmp_path):
    db = MonitorDb(tmp_path / "monitor.db")
    key = RecordKey("exp_avg", "w", 0, None, 0, (2,), "torch.float32")
    # a record whose sum overflowed to NaN, and one without finite elements (min +inf, max -inf)
    values = np.array([[2, 0, 0, 0, np.nan, np.inf, -1.0, 1.0, 0, 0], [0, 2, 0, 0, 0.0, 0.0, np.inf, -np.inf, 0, 0]])
    db.add_step(0, 0, [key, key], values, {})
    db.close()
    with sqlite3.connect(tmp_path / "monitor.db") as conn:
        rows = conn.execute('SELECT "sum", typeof("sum"), sumsq, nan_fields, "min", "max" FROM records').fetchall()
    assert rows[0] == (None, "null", math.inf, 1 << db_schema.FIELDS.index("sum"), -1.0, 1.0)
    assert rows[1] == (0.0, "real", 0.0, 0, math.inf, -math.inf)
    frame = open_run(tmp_path, source="db").records()
    assert math.isnan(frame["raw_sum"].iloc[0]) and frame["raw_sumsq"].iloc[0] == math.inf
    assert frame["nan_fields"].iloc[0] == 1 << db_schema.FIELDS.index("sum")


@pytest.mark.parametrize("rows_per_insert", [7, 2048])
def test_a_step_of_many_records_is_stored_whole_and_in_order(tmp_path, monkeypatch, rows_per_insert):
    """The records of a step go in as multi-row INSERTs: a step of more rows than one statement takes is
    split, and every row arrives once, in the batch's order, equal to its record block."""
    monkeypatch.setattr(db_schema, "_MAX_ROWS_PER_INSERT", rows_per_insert)
    db = MonitorDb(tmp_path / "monitor.db")
    keys = [RecordKey("actv", f"layers.{i % 5}", 0, i % 3, i, (i + 1,), "torch.float32") for i in range(50)]
    values = np.random.default_rng(0).standard_normal((50, len(db_schema.FIELDS)))
    values[3, 4] = np.nan
    db.add_step(4, 0, keys, values, {})
    db.close()
    with sqlite3.connect(tmp_path / "monitor.db") as conn:
        fields = ", ".join(f'"{f}"' for f in db_schema.FIELDS)
        stored = conn.execute(f"SELECT step, micro_step, call_index, nan_fields, {fields} FROM records "
                              "ORDER BY rowid").fetchall()
        (block,) = conn.execute("SELECT records FROM record_blocks").fetchone()
    assert [(r[0], r[1], r[2]) for r in stored] == [(4, i % 3, i) for i in range(50)]
    np.testing.assert_array_equal(np.array([[np.nan if v is None else v for v in r[4:]] for r in stored]), values)
    assert stored[3][3] == 1 << db_schema.FIELDS.index("sum")
    np.testing.assert_array_equal(np.frombuffer(zlib.decompress(block), db_schema.BLOCK_DTYPE)["fields"], values)


def test_corrupt_existing_db_disables_the_sink_and_counts_the_loss(output_dir, write_config, caplog):
    rank_dir = output_dir / "myrun" / "rank_0"
    rank_dir.mkdir(parents=True)
    (rank_dir / "monitor.db").write_bytes(b"this is not a database" * 100)
    monitor, _ = monitored(write_config, steps=3, grad_acc_steps=1, format=["csv", "db"], xy_distribution=False,
                           append_output=["myrun", "myrun~"])
    messages = [r.getMessage() for r in caplog.records if "db sink" in r.getMessage()]
    assert len(messages) == 1 and "monitor.db" in messages[0] and "disabled" in messages[0], messages
    report = json.loads((rank_dir / "run.json").read_text())["writer"]
    assert report["disabled_sinks"]["db"]["lost_steps"] == 3 and report["written_steps"] == 3
    assert (rank_dir / "monitor.db").read_bytes() == b"this is not a database" * 100
    assert sorted(set(open_run(rank_dir, source="csv").family(GRAD_REDUCED).step)) == [0, 1, 2]


@pytest.mark.slow
def test_a_full_disk_loses_output_not_training(output_dir, write_config):
    """RLIMIT_FSIZE stops every file at 300 kB: the db and the event file fill up, the job trains on."""
    config = write_config(targets={}, wg_distribution=True, xy_distribution=True, ops=OPS,
                          format=["csv", "db", "tensorboard"])
    child = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "train_child.py"), config,
                            "--steps", "25", "--fsize", "300000"], capture_output=True, text=True, timeout=240)
    assert child.returncode == 0, child.stderr[-3000:]
    assert "step 24" in child.stdout and "done" in child.stdout
    rank_dir = output_dir / child.stdout.split()[1].split(os.sep)[-2] / "rank_0"
    report = json.loads((rank_dir / "run.json").read_text())["writer"]
    disabled = report["disabled_sinks"]
    assert set(disabled) >= {"db", "tensorboard"}, report
    assert 0 < disabled["db"]["lost_steps"] < 25
    for sink in ("db", "tensorboard"):
        assert child.stderr.count(f"the {sink} sink failed") == 1, child.stderr[-3000:]
    assert report["written_steps"] == 25 and "csv" not in disabled
    assert integrity(rank_dir / "monitor.db") == "ok"
    with sqlite3.connect(rank_dir / "monitor.db") as conn:
        steps = [s for (s,) in conn.execute("SELECT step FROM batches ORDER BY step")]
        per_step = dict(conn.execute("SELECT step, COUNT(*) FROM records GROUP BY step"))
        announced = dict(conn.execute("SELECT step, records FROM batches"))
    assert steps == list(range(25 - disabled["db"]["lost_steps"]))
    assert per_step == announced  # the step that hit the full disk was rolled back whole
    # the event file holds every step before the failure, readable by TensorBoard
    loss_steps = sorted(step for tag, step in tensorboard_scalars(rank_dir) if tag == "loss")
    assert loss_steps == list(range(25 - disabled["tensorboard"]["lost_steps"]))


def test_fields_no_op_needs_are_stored_as_not_recorded(output_dir, write_config):
    monitor, _ = monitored(write_config, steps=1, grad_acc_steps=1, format=["db"], xy_distribution=False,
                           ops=["norm"])
    with sqlite3.connect(monitor.output_dir / "monitor.db") as conn:
        nulls = conn.execute('SELECT COUNT(*), SUM("min" IS NULL), SUM("sum" IS NULL), SUM(sumsq IS NULL), '
                             "SUM(nan_fields) FROM records").fetchone()
    assert nulls[0] > 0 and nulls[1:] == (nulls[0], nulls[0], 0, 0)
    frame = open_run(monitor.output_dir).records()
    assert frame["norm"].notna().all() and frame["raw_min"].isna().all()


def test_show_reads_the_database(output_dir, write_config, capsys):
    from trainmon.cli import main

    monitor, _ = monitored(write_config, steps=2, grad_acc_steps=1, format=["db"], xy_distribution=False,
                           on_step=lambda monitor, step: monitor.log_scalar("loss", 3.25 + step))
    assert main(["show", str(output_dir), "--scalars"]) == 0  # an output root with one run
    out = capsys.readouterr().out
    assert "loss" in out and "3.25" in out and "4.25" in out
    assert main(["show", str(monitor.output_dir.parent), "--family", "exp_avg", "--step", "1", "--ops", "norm"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["rank", "tag", "step", "norm"] and all(" 1 " in line for line in lines[1:])


@pytest.mark.slow
def test_open_run_reads_every_ranks_database(output_dir, write_config):
    """Two ranks of one job (RANK/WORLD_SIZE from the launcher's environment) write one run."""
    config = write_config(targets={}, wg_distribution=True, ops=OPS, format=["db"], append_output=["job", "job~"])
    (output_dir / "job").mkdir(parents=True)  # append_output reuses an existing run between the two bounds
    for rank in (0, 1):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}
        child = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "train_child.py"), config,
                                "--steps", "3"], capture_output=True, text=True, timeout=180, env=env)
        assert child.returncode == 0, child.stderr[-3000:]
    run = open_run(output_dir / "job")
    assert run.ranks == [0, 1] and run.metadata(1)["world_size"] == 2
    grads = run.family(GRAD_REDUCED, steps=range(1, 3))
    assert sorted(set(grads.step)) == [1, 2] and sorted(set(grads["rank"])) == [0, 1]
    assert grads[grads["rank"] == 1].tag.str.contains("/rank1/post_grad").all()
    # same model, same data: both ranks hold the same figures
    by_rank = [grads[grads["rank"] == r].sort_values(["step", "name"]).norm.to_numpy() for r in (0, 1)]
    np.testing.assert_array_equal(*by_rank)
    assert sorted(run.scalars("loss")["rank"]) == [0, 0, 0, 1, 1, 1]


def _step_db(path, reader_holds_s: float):
    """A database of one step, closed while a read-only reader (as the daemon's) is connected for `reader_holds_s`
    seconds; returns the reader's count of batches, read before the close."""
    import threading
    db = MonitorDb(path)
    assert db.conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    values = np.zeros((1, len(db_schema.FIELDS)))
    values[0, db_schema.FIELDS.index("count")] = 4  # four finite zeros
    db.add_step(0, 0, [RecordKey("actv", "a", 0, 0, 0, (4,), "torch.float32")], values, {"loss": 1.0})
    reader = sqlite3.connect(f"file:{path}?mode=ro", uri=True, check_same_thread=False)
    batches = reader.execute("SELECT COUNT(*) FROM batches").fetchone()[0]
    threading.Timer(reader_holds_s, reader.close).start()
    db.close()
    return batches


def test_close_removes_the_wal_once_a_connected_reader_lets_go(tmp_path):
    path = tmp_path / "monitor.db"
    assert _step_db(path, reader_holds_s=0.3) == 1
    assert not os.path.exists(f"{path}-wal")
    with sqlite3.connect(f"file:{path}?mode=ro&immutable=1", uri=True) as conn:
        assert conn.execute("SELECT COUNT(*) FROM records").fetchone()[0] == 1


def test_a_wal_a_reader_kept_past_the_close_is_empty_and_not_taken_for_a_running_job(tmp_path, monkeypatch, capsys):
    from trainmon.cli import main as cli_main
    from trainmon.writers import monitor_db
    monkeypatch.setattr(monitor_db, "CLOSE_WAIT_S", 0.1)
    rank_dir = tmp_path / "run" / "rank_0"
    rank_dir.mkdir(parents=True)
    (rank_dir / "run.json").write_text(json.dumps({"rank": 0}))
    _step_db(rank_dir / "monitor.db", reader_holds_s=0.5)
    wal = rank_dir / "monitor.db-wal"
    assert wal.exists() and wal.stat().st_size == 0  # checkpointed into the database, then kept by the reader
    assert cli_main(["nan-analyze", str(tmp_path / "run")]) == 0
    out, err = capsys.readouterr()
    assert "still writing" not in out + err and "clean" in out, out + err
