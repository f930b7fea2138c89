"""A real FUSE mount (a loopback of a local directory): detected as a shared filesystem, the db format writes the
record stream there, and the run reads back through the mount as from the directory behind it. Skipped where
nothing can be mounted (no fusepy, libfuse 2, /dev/fuse or permission to mount)."""
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from writer_helpers import monitored
from trainmon import open_run
from trainmon.read import stream_mirror
from trainmon.writers import filesystem

pd = pytest.importorskip("pandas")  # the reader the CSV files are checked with (the `db` extra)

try:
    import fuse  # noqa: F401  (fusepy loads libfuse 2 when imported)
except (ImportError, OSError) as exc:  # not installed, or no libfuse 2 (an OSError)
    pytest.skip(f"fusepy cannot be used: {exc}", allow_module_level=True)


@pytest.fixture
def mounted(tmp_path, monkeypatch):
    """A FUSE loopback mount of tmp_path/backing at tmp_path/mnt."""
    backing, point = tmp_path / "backing", tmp_path / "mnt"
    backing.mkdir()
    point.mkdir()
    monkeypatch.setenv(stream_mirror.CACHE_ENV, str(tmp_path / "cache"))
    process = subprocess.Popen([sys.executable, str(Path(__file__).with_name("fuse_loopback.py")), str(backing),
                                str(point)], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 20
    while not os.path.ismount(point) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    if not os.path.ismount(point):
        process.kill()
        pytest.skip(f"no FUSE mount possible here: {process.communicate()[1][-300:]}")
    yield backing, point
    subprocess.run(["umount", str(point)], check=False)
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()


def test_a_fuse_mount_gets_the_record_stream(mounted, write_config, monkeypatch):
    backing, point = mounted
    choice = filesystem.choose(point / "out")
    assert (choice.kind, choice.write_path) == (filesystem.NETWORK, filesystem.STREAM_PATH), choice
    assert choice.fstype.startswith("fuse")
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(point / "out"))
    monitor, _ = monitored(write_config, steps=3, format=["db"], alert={"rules": [{"rule_name": "AnomalyNan"}]})
    rank_dir = Path(monitor.output_dir)
    behind = backing / rank_dir.relative_to(point)
    assert (behind / "records.stream").is_file() and not (behind / "monitor.db").exists()
    assert not list(behind.glob("*-wal")) and not list(behind.glob("*-shm")), "no SQLite file on the mount"
    with open_run(rank_dir.parent) as through_mount, open_run(behind.parent) as direct:
        records = through_mount.records()
        pd.testing.assert_frame_equal(records, direct.records())
    assert sorted(set(records["step"])) == [0, 1, 2] and len(records) > 300
