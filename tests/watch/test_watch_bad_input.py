"""`watch --once` on what is not a readable run says so and exits 2 (the file named, no traceback); a live
daemon on an empty root waits for runs."""
import shutil
import sys
from pathlib import Path
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


@pytest.mark.slow
@pytest.mark.parametrize("corrupt", [_corrupt_db, _corrupt_csv], ids=["database", "csv"])
def test_once_on_a_corrupt_rank_exits_2_naming_the_file(finished_run, tmp_path, corrupt):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    path = corrupt(run)
    done = watch_once(run, "--heatmap-every", 1000)
    assert done.returncode == 2, done.stderr
    assert str(path) in done.stderr and "Traceback" not in done.stderr, done.stderr


@pytest.mark.slow
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


def _csv_run(write_config) -> Path:
    """One rank's CSV files of 8 steps, 4 steps a file: `actv_0-3.csv`, `actv_4-7.csv`, ..."""
    import torch
    from training import make_model, run_steps
    from trainmon import TrainerMon
    monitor = TrainerMon(write_config(format=["csv"], all_xy=True, xy_distribution=True, wg_distribution=True,
                                      ops=["min", "max", "norm", "nans", "infs"], step_count_per_record=4))
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters())
    monitor.set_monitor(model, optimizer=optimizer)
    run_steps(model, optimizer, 8)
    monitor.stop()
    return monitor.output_dir.parent


def _figure(path):  # a figure that is not a number
    lines = path.read_text().splitlines(keepends=True)
    lines[2] = lines[2].replace(",0,", ",zero,", 1)
    path.write_text("".join(lines))
    return 3


def _cut(path):  # a line cut short (a writer killed), then more lines
    lines = path.read_text().splitlines(keepends=True)
    lines[4] = lines[4][:len(lines[4]) // 2] + "\n"
    path.write_text("".join(lines))
    return 5


def _junk(path):
    path.write_bytes(bytes(range(256)) * 4)
    return 1


def _empty(path):
    path.write_bytes(b"")
    return 1


@pytest.mark.parametrize("corrupt", [_figure, _cut, _junk, _empty], ids=["figure", "cut", "junk", "empty"])
def test_a_corrupt_csv_is_named_and_the_rest_exported(output_dir, write_config, tmp_path, watch_log, corrupt):
    """An older CSV of a rank (not the one whose rows tell its progress) is corrupt: its file and line are said, its
    rows from there are left out, the rest is exported, and `--once` does not end as if the run were read whole."""
    from trainmon.watch.run_watcher import RunWatcher, WatchOptions
    run = _csv_run(write_config)
    path = run / "rank_0" / "actv_0-3.csv"
    line = corrupt(path)
    watcher = RunWatcher(run, tmp_path / "view", WatchOptions(once=True))
    watcher.poll(final=True)
    watcher.finish(draw=False)
    where = f"{path}, line {line}"
    assert where in watcher.unreadable()[0]
    assert [r.getMessage() for r in watch_log.records if where in r.getMessage()], watch_log.text
    events = read_events(tmp_path / "view")[0]
    kept = [0] if line > 2 else []  # the rows before the bad line (of step 0) are read
    assert [step for step, _ in events["Worst tensor/actv norm"]] == kept + [4, 5, 6, 7]
    assert [step for step, _ in events["Worst tensor/grad_reduced norm"]] == list(range(8))


def test_once_on_a_corrupt_csv_exits_2_naming_the_file_and_line(output_dir, write_config, tmp_path):
    run = _csv_run(write_config)
    path = run / "rank_0" / "actv_0-3.csv"
    _figure(path)
    done = watch_once(run, "--heatmap-every", 1000)
    assert done.returncode == 2, done.stderr
    assert f"{path}, line 3" in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert (run / "watch").is_dir()  # the rest was exported


@pytest.mark.parametrize("once", [True, False], ids=["once", "live"])
@pytest.mark.parametrize("place", ["under_a_file", "a_file"])
def test_a_logdir_that_cannot_be_made_is_one_line_and_status_2(finished_run, tmp_path, capsys, watch_log, once,
                                                               place):
    from trainmon.cli import main
    (tmp_path / "file").write_text("a file where a directory should be")
    logdir = tmp_path / "file" / "view" if place == "under_a_file" else tmp_path / "file"
    assert main(["watch", str(finished_run), "--logdir", str(logdir), "--interval", "0.1"] + ["--once"] * once) == 2
    err = capsys.readouterr().err
    assert f"trainmon watch: {logdir}: cannot create the output directory" in err and "Traceback" not in err, err


def test_once_with_a_rank_the_run_lacks_exits_2(finished_run, tmp_path, capsys, watch_log):
    from trainmon.cli import main
    assert main(["watch", str(finished_run), "--once", "--rank", "7", "--logdir", str(tmp_path / "view")]) == 2
    err = capsys.readouterr().err
    assert f"trainmon watch: {finished_run}: has no rank 7" in err and "Traceback" not in err, err


def test_messages_go_to_the_stderr_of_each_call(finished_run, tmp_path, monkeypatch):
    """A program that runs `main(["watch", ...])` twice, its stderr replaced and the old one closed in between (as
    a test runner does), gets the second call's messages on the new stderr, with no logging error."""
    import io
    from trainmon.cli import main
    first = io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    assert main(["watch", str(finished_run), "--once", "--logdir", str(tmp_path / "a")]) == 0
    first.close()
    second = io.StringIO()
    monkeypatch.setattr(sys, "stderr", second)
    assert main(["watch", str(finished_run), "--once", "--rank", "7", "--logdir", str(tmp_path / "b")]) == 2
    assert f"trainmon watch: {finished_run}: has no rank 7" in second.getvalue()
    assert "Logging error" not in second.getvalue() and "Traceback" not in second.getvalue(), second.getvalue()
