"""The read layer: each record read once from the best source, the union where sources disagree, read-only."""
import json
import sqlite3

import pytest

from test_anomaly_online import STATS, faulty_run, nan_analyze_json
from trainmon.cli import main as cli_main
from trainmon.read import InputError, find_run, open_run
from trainmon.read import csv_rows, database, evidence

SOURCES = {**STATS, "format": ["csv", "db"]}


@pytest.fixture
def run_dir(output_dir, write_config):
    """A finished one-rank run with all three sources; an inf enters at step 2 of 4."""
    monitor, _ = faulty_run(write_config, "forward_output_inf", SOURCES)
    return monitor.output_dir


def _essentials(report: dict) -> dict:
    return {k: report[k] for k in ("first", "first_record", "ties", "chain", "nonfinite_records")}


def _drop_steps_from_db(db, first_step):
    conn = sqlite3.connect(db, isolation_level=None)
    for table in ("records", "batches", "anomalies"):
        conn.execute(f"DELETE FROM {table} WHERE step >= ?", (first_step,))
    conn.close()


def test_each_source_is_read_once_and_csv_files_the_db_holds_are_not_opened(run_dir, capsys, monkeypatch):
    opened = {"db": 0, "csv": 0}
    open_db, read_csv = database.open_db, csv_rows.read_csv_rows

    def count_db(path):
        opened["db"] += 1
        return open_db(path)

    def count_csv(path):
        opened["csv"] += 1
        return read_csv(path)

    monkeypatch.setattr(database, "open_db", count_db)
    monkeypatch.setattr(evidence, "read_csv_rows", count_csv)
    nan_analyze_json(run_dir.parent, capsys)
    assert opened == {"db": 1, "csv": 0}


def test_sources_that_disagree_are_answered_from_their_union(run_dir, capsys):
    whole = _essentials(nan_analyze_json(run_dir.parent, capsys))
    assert whole["first"]["step"] == 2
    # the jsonl lacks the steps the database has: the database answers
    jsonl = run_dir / "anomalies.jsonl"
    lines = jsonl.read_text().splitlines(keepends=True)
    jsonl.write_text("".join(line for line in lines if json.loads(line)["step"] < 2))
    assert _essentials(nan_analyze_json(run_dir.parent, capsys)) == whole
    # the database lacks steps 2 and 3 (cut short); the jsonl as well: the CSV files answer for them
    _drop_steps_from_db(run_dir / "monitor.db", 2)
    partial = _essentials(nan_analyze_json(run_dir.parent, capsys))
    assert partial["first"] == {**whole["first"], "call_index": None}
    assert partial["nonfinite_records"] == whole["nonfinite_records"]  # no record counted twice
    # the jsonl has them back: its call indices win over the CSV rows
    jsonl.write_text("".join(lines))
    assert _essentials(nan_analyze_json(run_dir.parent, capsys)) == whole


def test_reading_creates_no_wal_or_shm_files(run_dir, capsys):
    before = sorted(p.name for p in run_dir.iterdir())
    nan_analyze_json(run_dir.parent, capsys)
    assert cli_main(["anomalies", str(run_dir.parent), "--json"]) == 0
    assert cli_main(["show", str(run_dir.parent), "--max-rows", "1"]) == 0
    with open_run(run_dir.parent) as run:
        run.records()
    assert sorted(p.name for p in run_dir.iterdir()) == before
    assert not list(run_dir.glob("monitor.db-*"))


def test_a_running_jobs_database_is_read_up_to_its_last_commit(run_dir, capsys):
    """A job that is writing holds the WAL: what it committed is read, its open transaction is not."""
    steps = len(open_run(run_dir, source="db").records().step.unique())
    writer = sqlite3.connect(run_dir / "monitor.db", isolation_level=None)
    writer.execute("PRAGMA journal_mode=WAL")
    writer.execute("INSERT INTO batches (step, wall_time, records, scalars) VALUES (99, 0, 0, 0)")
    writer.execute("INSERT INTO records SELECT tag_id, 99, micro_step, call_index, pp_stage, count, nans, infs, "
                   "zeros, sum, sumsq, min, max, sat, pinfs, nan_fields FROM records WHERE step = 0")
    writer.execute("BEGIN")
    writer.execute("INSERT INTO records SELECT tag_id, 100, micro_step, call_index, pp_stage, count, nans, infs, "
                   "zeros, sum, sumsq, min, max, sat, pinfs, nan_fields FROM records WHERE step = 0")
    try:
        assert (run_dir / "monitor.db-wal").exists()
        with open_run(run_dir, source="db") as run:
            read = set(run.records().step)
        assert 99 in read and 100 not in read and len(read) == steps + 1
    finally:
        writer.close()


def test_one_rank_directory_regex_serves_both_layouts(tmp_path):
    for name in ("rank_3", "Nov22_07-00-00-rank5-1a2b3c4d"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "actv_0-0.csv").write_text("vpp_stage,name,step,norm\n0,a.output,0,1.0\n")
    assert [d.rank for d in find_run(tmp_path).ranks] == [3, 5]


def test_errors_name_the_file_and_line(tmp_path):
    path = tmp_path / "actv_0-1.csv"
    path.write_text("vpp_stage,name,step,norm\n0,a.output,0,1.0\n0,a.output,1,lots\n")
    _, rows = csv_rows.read_csv_rows(path)
    with pytest.raises(InputError) as err:
        list(rows)
    assert str(err.value).startswith(f"{path}, line 3: ") and err.value.line == 3
