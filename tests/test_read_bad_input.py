"""Crash-shaped and bad input: read what can be read and warn, or fail naming the file (and line), exit 2."""
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from test_anomaly_online import STATS, faulty_run, nan_analyze_json
from test_writers_convert import msprobe_output
from trainmon import open_run
from trainmon.cli import main as cli_main

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def run_dir(output_dir, write_config):
    monitor, _ = faulty_run(write_config, "forward_output_inf", {**STATS, "format": ["csv", "db"]})
    return monitor.output_dir


def _fails_naming(capsys, argv, *names):
    assert cli_main(argv) == 2
    captured = capsys.readouterr()
    for name in names:
        assert name in captured.err, captured.err
    assert "Traceback" not in captured.err and "clean" not in captured.out
    return captured.err


def test_an_uncommitted_last_transaction_is_not_read_and_the_report_warns(run_dir, capsys):
    """A job killed inside a step's transaction leaves it in the WAL, uncommitted."""
    db = run_dir / "monitor.db"
    killed = ("import os, sqlite3, sys\n"
              "c = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
              "c.execute('BEGIN')\n"
              "c.execute('INSERT INTO batches (step, wall_time, records, scalars) VALUES (7, 0, 0, 0)')\n"
              "c.execute('INSERT INTO records SELECT tag_id, 7, micro_step, call_index, pp_stage, count, 1, infs, "
              "zeros, sum, sumsq, min, max, nan_fields FROM records')\n"
              "os._exit(9)\n")
    subprocess.run([sys.executable, "-c", killed, str(db)], check=False)
    report = nan_analyze_json(run_dir.parent, capsys)
    assert report["first"]["step"] == 2 and 7 not in {c["step"] for c in report["chain"]}
    if (run_dir / "monitor.db-wal").exists():
        assert any(str(db) in w for w in report["warnings"])


@pytest.mark.parametrize("content", [b"", None], ids=["empty", "schema_less"])
def test_an_empty_or_schema_less_database_is_an_error_not_clean(run_dir, capsys, tmp_path, content):
    db = run_dir / "monitor.db"
    db.unlink()
    if content is None:
        sqlite3.connect(db).execute("CREATE TABLE other (x)").connection.close()
    else:
        db.write_bytes(content)
    _fails_naming(capsys, ["nan-analyze", str(run_dir.parent)], str(db), "not a trainmon monitor database")
    _fails_naming(capsys, ["show", str(run_dir.parent)], str(db))
    _fails_naming(capsys, ["db2tb", str(run_dir.parent), str(tmp_path / "tb"), "--quiet"], str(db))


def test_a_csv_with_non_numeric_figures_is_an_error_naming_the_line(run_dir, capsys):
    (run_dir / "monitor.db").unlink()
    path = sorted(run_dir.glob("actv_*.csv"))[0]
    lines = path.read_text().splitlines()
    header = lines[0].split(",")
    cells = lines[2].split(",")
    cells[header.index("nans")] = "many"
    path.write_text("\n".join(lines[:2] + [",".join(cells)] + lines[3:]) + "\n")
    _fails_naming(capsys, ["nan-analyze", str(run_dir.parent)], f"{path}, line 3", "not a number")
    _fails_naming(capsys, ["show", str(run_dir.parent)], f"{path}, line 3")


def test_conversions_refuse_a_non_empty_output_and_never_duplicate(tmp_path, capsys):
    src = msprobe_output(tmp_path / "msprobe")
    out = tmp_path / "db"
    assert cli_main(["csv2db", str(src), str(out), "--quiet"]) == 0
    once = len(open_run(out).records())
    _fails_naming(capsys, ["csv2db", str(src), str(out), "--quiet"], str(out), "--overwrite")
    assert cli_main(["csv2db", str(src), str(out), "--quiet", "--overwrite"]) == 0
    assert len(open_run(out).records()) == once
    for command in ("csv2tb", "db2tb"):
        source = src if command == "csv2tb" else out
        _fails_naming(capsys, [command, str(source), str(out), "--quiet"], str(out))
    _fails_naming(capsys, ["db2tb", str(out), str(out / "rank_0"), "--quiet", "--overwrite"], "overlaps")


@pytest.mark.parametrize("argv", [["anomalies", "X", "--top", "-3"], ["anomalies", "X", "--top", "0"],
                                  ["anomalies", "X", "--steps", "-2-3"], ["show", "X", "--max-rows", "-1"],
                                  ["show", "X", "--rank", "-1"], ["demo", "--steps", "0"]])
def test_numeric_arguments_are_range_checked(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli_main(argv)
    assert exit_.value.code == 2 and "Traceback" not in capsys.readouterr().err


def test_a_closed_pipe_ends_the_output_quietly(run_dir):
    """`trainmon nan-analyze RUN | head`: the reader is gone before the command writes (it closes at once)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for command in (["nan-analyze"], ["anomalies"], ["show", "--max-rows", "0"]):
        child = subprocess.Popen([sys.executable, "-m", "trainmon.cli", command[0], str(run_dir.parent),
                                  *command[1:]], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        child.stdout.close()
        err = child.stderr.read().decode()
        assert child.wait(timeout=120) == 141 and err == "", err
