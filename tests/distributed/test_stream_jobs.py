"""A two-rank DDP job with an Inf injected on rank 1, run once writing monitor.db (output_filesystem "local") and
once writing the record stream ("network"): every command that reads a run answers the same from both."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launch import torchrun
from verify import the_run

pd = pytest.importorskip("pandas")  # the reader the CSV files are checked with (the `db` extra)

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from writer_helpers import tensorboard_scalars  # noqa: E402


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{"local": run directory, "network": run directory} of the same job."""
    base = tmp_path_factory.mktemp("stream_jobs")
    os.environ["TRAINMON_CACHE_DIR"] = str(base / "cache")
    found = {}
    for fs in ("local", "network"):
        out = base / fs
        out.mkdir()
        torchrun("job_torch.py", 2, ["--mode", "ddp", "--out", str(out), "--inject", "1:1", "--steps", "4",
                                     "--output-filesystem", fs], out / "monitor_output")
        found[fs] = the_run(out / "monitor_output")
    yield found
    os.environ.pop("TRAINMON_CACHE_DIR")


def cli(*args) -> str:
    done = subprocess.run([sys.executable, "-m", "trainmon.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode in (0, 1), done.stderr  # 1: nan-analyze found non-finite values
    return done.stdout.replace(str(args[1]), "<run>")


def test_each_run_wrote_its_path(runs):
    for rank in (0, 1):
        local, network = Path(runs["local"], f"rank_{rank}"), Path(runs["network"], f"rank_{rank}")
        assert (local / "monitor.db").is_file() and not (local / "records.stream").exists()
        assert (network / "records.stream").is_file() and not (network / "monitor.db").exists()
        assert not list(network.glob("*-wal")) and not list(network.glob("*-shm"))


@pytest.mark.parametrize("command", [
    ["nan-analyze", "--json"], ["nan-analyze"], ["anomalies", "--json", "--top", "1000"], ["anomalies", "--top", "20"],
    ["show", "--step", "1"], ["show", "--family", "actv", "--rank", "1"],
], ids=lambda c: " ".join(c))
def test_the_commands_answer_the_same_from_stream_and_database(runs, command):
    name, *flags = command
    from_db, from_stream = cli(name, runs["local"], *flags), cli(name, runs["network"], *flags)
    if name == "nan-analyze":  # the report names the files it read: the same but for which file held the records
        assert "records.stream" in from_stream and "records.stream" not in from_db
        from_stream = from_stream.replace("records.stream", "monitor.db")
    assert from_db == from_stream
    assert "rank" in from_db and len(from_db) > 200, from_db


def test_nan_analyze_names_the_injected_inf_from_the_stream(runs):
    import json

    report = json.loads(cli("nan-analyze", runs["network"], "--json"))
    first = report["first"]
    assert (first["rank"], first["step"], first["module"], first["phase"]) == (1, 1, "blocks.0", "forward")


def test_compare_finds_the_two_runs_the_same(runs):
    import json

    across = json.loads(cli("compare", runs["local"], runs["network"], "--json"))
    itself = json.loads(cli("compare", runs["local"], runs["local"], "--json"))
    del across["run_b"], itself["run_b"]
    assert across == itself
    assert across["records"] > 100 and across["first_divergent"] is None
    assert across["verdicts"]["equal"] == across["records"], across["verdicts"]


def test_export_writes_the_same_dataset(runs, tmp_path):
    frames = []
    for fs in ("local", "network"):
        cli("export", runs[fs], tmp_path / fs, "--quiet")
        frame = pd.read_parquet(tmp_path / fs)
        frames.append(frame.sort_values(list(frame.columns[:8])).reset_index(drop=True))
    assert len(frames[0]) > 100
    pd.testing.assert_frame_equal(frames[0], frames[1])


def test_the_daemon_exports_the_same_view(runs, tmp_path):
    views = []
    for fs in ("local", "network"):
        cli("watch", runs[fs], "--once", "--logdir", tmp_path / fs)
        views.append(tensorboard_scalars(tmp_path / fs))
    assert len(views[0]) > 50
    assert views[0].keys() == views[1].keys()
    for key, value in views[0].items():
        assert value == views[1][key] or (value != value and views[1][key] != views[1][key]), key
