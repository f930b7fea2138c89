"""`watch --once` on what is not a readable run says so and exits 2 (the file named, no traceback); a live
daemon on an empty root waits for runs."""
import shutil
import time

import pytest

from runs import read_events, terminate, watch, watch_once


def _corrupt_db(run):
    (run / "rank_2" / "monitor.db").write_bytes(b"this is not a database" * 100)
    return run / "rank_2" / "monitor.db"


def _corrupt_csv(run):
    for db in run.glob("rank_*/monitor.db"):
        db.unlink()
    path = sorted((run / "rank_1").glob("grad_reduced_*.csv"))[0]
    with open(path, "a") as fh:
        fh.write('garbage,"unterminated\n1,2\n')
    return path


@pytest.mark.parametrize("corrupt", [_corrupt_db, _corrupt_csv], ids=["database", "csv"])
def test_once_on_a_corrupt_rank_exits_2_naming_the_file(finished_run, tmp_path, corrupt):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    path = corrupt(run)
    done = watch_once(run, "--heatmap-every", 1000)
    assert done.returncode == 2, done.stderr
    assert str(path) in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_once_on_a_corrupt_database_exports_the_other_ranks(finished_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    _corrupt_db(run)
    assert watch_once(run, "--heatmap-every", 1000, "--ranks", 0, 2).returncode == 2
    events = read_events(run / "watch")[0]
    assert len(events["rank0/scalars/grad_norm"]) == 60 and not any(t.startswith("rank2/") for t in events)


@pytest.mark.parametrize("content", [[], ["notes.txt"], ["logs/"]], ids=["empty", "a file", "a directory"])
def test_once_on_what_is_not_a_run_exits_2(tmp_path, content):
    path = tmp_path / "out"
    path.mkdir()
    for name in content:
        if name.endswith("/"):
            (path / name).mkdir()
        else:
            (path / name).write_text("not monitor output")
    done = watch_once(path)
    assert done.returncode == 2, done.stderr
    assert str(path) in done.stderr and "no run here" in done.stderr and "Traceback" not in done.stderr


def test_a_live_daemon_on_an_empty_root_waits_for_runs(tmp_path):
    daemon = watch(tmp_path, "--interval", 0.2)
    time.sleep(2.0)
    assert daemon.poll() is None, daemon.communicate()[1]
    status, err = terminate(daemon)
    assert status == 0, err
