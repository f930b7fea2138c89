"""The record stream (`records.stream`): what the db format writes on a network filesystem, read live from any
host. A reader takes whole frames only, each once; a killed writer leaves every batch it finished readable."""
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import stream_child
from stream_child import mirrored_steps, written
from writer_helpers import monitored
from trainmon import open_run
from trainmon.read import stream_mirror
from trainmon.read.evidence import rank_evidence
from trainmon.read.layout import RankDir
from trainmon.writers import stream_format
from trainmon.writers.record_stream import RecordStream

pd = pytest.importorskip("pandas")  # the reader the CSV files are checked with (the `db` extra)

CHILD = str(Path(__file__).with_name("stream_child.py"))
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(stream_mirror.CACHE_ENV, str(tmp_path / "cache"))
    ENV[stream_mirror.CACHE_ENV] = str(tmp_path / "cache")


def garbage(data: bytes, size: int) -> bytes:
    """Random bytes in place of `data[size:]`, the first of them different: random bytes that happen to be
    the missing ones (1 in 256 where a frame lacks only its last byte) would complete the frame."""
    rest = bytearray(os.urandom(len(data) - size))
    if rest:
        rest[0] = data[size] ^ 0xFF
    return bytes(rest)


def test_a_file_cut_at_every_byte_offset_gives_its_whole_frames_only(tmp_path):
    data = written(tmp_path / "full.stream", 3)
    ends = stream_format.read_frames(tmp_path / "full.stream").ends
    assert len(ends) == 5 and ends[-1] == len(data)  # meta, three batches, end
    cut = tmp_path / "cut.stream"
    for size in range(len(data) + 1):
        whole = sum(end <= size for end in ends)
        for rest in (b"", bytes(len(data) - size), garbage(data, size)):  # nothing, zeros, garbage
            cut.write_bytes(data[:size] + rest)
            frames = stream_format.read_frames(cut)
            assert len(frames.payloads) == whole and frames.end == (ends[whole - 1] if whole else 0), size
            assert frames.tail == (len(data) if rest else size) - frames.end


def test_a_growing_file_read_after_every_byte_gives_each_batch_once(tmp_path):
    data = written(tmp_path / "full.stream", 3)
    ends = stream_format.read_frames(tmp_path / "full.stream").ends
    growing = tmp_path / "rank_0" / "records.stream"
    growing.parent.mkdir()
    growing.write_bytes(b"")
    for size in range(1, len(data) + 1):
        with open(growing, "ab") as f:
            f.write(data[size - 1:size])
        whole_batches = max(0, min(3, sum(end <= size for end in ends) - 1))
        assert mirrored_steps(growing) == list(range(whole_batches)), size


def test_a_writer_and_a_reader_process_cut_at_every_offset_in_lockstep(tmp_path):
    path, n = tmp_path / "records.stream", 40
    assert len(stream_child.frame_of(1, False)) > n, "the cuts of n frames cover every offset"
    writer = subprocess.Popen([sys.executable, CHILD, "writer", str(path), str(n), "--handshake"], env=ENV,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    reader = subprocess.Popen([sys.executable, CHILD, "reader", str(path), str(n), "--handshake"], env=ENV,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    reads = 0
    try:
        while True:
            writer.stdin.write("\n")
            writer.stdin.flush()
            answer = writer.stdout.readline().strip()
            if answer == "done":
                break
            reader.stdin.write("\n")
            reader.stdin.flush()
            got = reader.stdout.readline().strip()
            assert got == answer, f"read {got} batches while {answer} were whole"
            reads += 1
        reader.stdin.close()
        final = json.loads(reader.stdout.read())
        assert reader.wait(30) == 0 and writer.wait(30) == 0
    finally:
        for process in (writer, reader):
            if process.poll() is None:
                process.kill()
    assert final == {"raw": list(range(n)), "mirrored": list(range(n))}
    assert reads > 5 * n


class _WrittenAtEnd:
    """A file whose writer, once a read has reached its end, completes the zeros it showed there and appends
    the next frame (what a network filesystem shows of a frame whose data arrives during the read)."""

    def __init__(self, f, path: Path, at: int, frame: bytes, after: bytes):
        self.f, self.path, self.at, self.frame, self.after = f, path, at, frame, after

    def read(self, size: int = -1) -> bytes:
        data = self.f.read(size)
        if self.frame is not None and 0 <= len(data) < size and self.f.tell() > self.at:
            with open(self.path, "r+b") as w:
                w.seek(self.at)
                w.write(self.frame + self.after)
            self.frame = None
        return data

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def test_a_frame_completed_while_the_file_is_read_is_read_whole_not_skipped(tmp_path, monkeypatch):
    path = tmp_path / "records.stream"
    meta, first, second = (stream_format.meta_frame(stream_child.META), stream_child.frame_of(0, True),
                           stream_child.frame_of(1, False))
    path.write_bytes(meta + bytes(len(first)))  # the first batch shows as zeros
    monkeypatch.setattr(stream_format, "open", lambda p, mode: _WrittenAtEnd(open(p, mode), path, len(meta), first,
                                                                          second), raising=False)
    frames = stream_format.read_frames(path)
    assert [stream_format.decode(p)[1].step for p in frames.payloads[1:]] == [0, 1] and frames.gaps == []
    assert frames.end == len(meta + first + second) and frames.tail == 0


def test_a_writer_and_a_reader_process_racing_freely(tmp_path):
    path, n = tmp_path / "records.stream", 300
    reader = subprocess.Popen([sys.executable, CHILD, "reader", str(path), str(n)], env=ENV,
                              stdout=subprocess.PIPE, text=True)
    writer = subprocess.run([sys.executable, CHILD, "writer", str(path), str(n)], env=ENV, timeout=120)
    out, _ = reader.communicate(timeout=240)  # past the reader's own deadline: a batch it missed is named below
    assert writer.returncode == 0 and reader.returncode == 0
    assert json.loads(out) == {"raw": list(range(n)), "mirrored": list(range(n))}


def test_kill_9_mid_frame_leaves_every_whole_batch_and_nothing_else(tmp_path):
    path = tmp_path / "rank_0" / "records.stream"
    path.parent.mkdir()
    done = subprocess.run([sys.executable, CHILD, "killed", str(path), "5"], env=ENV, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr
    half = int(done.stdout)
    assert mirrored_steps(path) == [0, 1, 2, 3, 4]
    torn_at = stream_format.read_frames(path).end
    found = stream_mirror.findings(path)
    assert (found.lost, found.ended) == ([], False)
    assert f"last {half} bytes, from offset {torn_at}, are not a whole step batch" in found.tail, found.tail
    assert mirrored_steps(path) == [0, 1, 2, 3, 4], "read again: nothing twice"
    evidence = rank_evidence(RankDir(0, path.parent), {})
    assert evidence.warnings == [found.tail] and not evidence.incomplete, "a torn tail is not data lost"
    # a job that appends (append_output) cuts the torn frame and goes on after the last whole one
    stream = RecordStream(path)
    stream.add_step(5, 0, stream_child.KEYS, stream_child.values(5), stream_child.scalars(5))
    stream.close()
    assert mirrored_steps(path) == [0, 1, 2, 3, 4, 5]
    assert stream_format.read_frames(path).tail == 0


@pytest.mark.slow
def test_a_reader_killed_while_it_updates_its_mirror_loses_and_repeats_nothing(tmp_path, monkeypatch):
    path = tmp_path / "rank_0" / "records.stream"
    path.parent.mkdir()
    steps = 6000  # about 0.6 s of mirroring here
    written(path, steps)
    interrupted = 0
    for attempt, delay in enumerate((0.05, 0.15, 0.3, 0.45)):
        cache = tmp_path / f"cache{attempt}"
        monkeypatch.setenv(stream_mirror.CACHE_ENV, str(cache))
        child = subprocess.Popen([sys.executable, CHILD, "mirror", str(path), "0"], stdout=subprocess.PIPE, text=True,
                                 env={**ENV, stream_mirror.CACHE_ENV: str(cache)})
        assert child.stdout.readline().strip() == "start"
        time.sleep(delay)
        child.send_signal(signal.SIGKILL)
        child.wait(30)
        mirror = stream_mirror.mirror_path(path)
        interrupted += mirror.with_name(mirror.name + "-journal").exists()
        assert mirrored_steps(path) == list(range(steps)), delay
    assert interrupted, "at least one kill came in the middle of an update"


def test_a_killed_training_job_is_read_up_to_its_last_whole_batch(output_dir, write_config, tmp_path):
    config = write_config(format=["db"], output_filesystem="network", targets={}, all_xy=True, xy_distribution=True,
                          wg_distribution=True, ops=["norm", "min", "max", "nans", "infs"])
    env = {**ENV, "MONITOR_OUTPUT_DIR": str(output_dir)}
    child = subprocess.Popen([sys.executable, str(Path(__file__).with_name("train_child.py")), config], env=env,
                             stdout=subprocess.PIPE, text=True)
    try:
        rank_dir = Path(child.stdout.readline().split(" ", 1)[1].strip())
        for line in child.stdout:
            if line.startswith("step 8"):
                break
    finally:
        child.kill()
        child.wait(30)
    run = open_run(rank_dir)
    steps = sorted(set(run.records()["step"]))
    assert steps == list(range(len(steps))) and len(steps) >= 3, steps
    assert list(run.scalars("loss")["step"]) == steps, "each step once, records and scalars together"
    frames = stream_format.read_frames(rank_dir / "records.stream")
    batches = [stream_format.decode(p)[1].step for p in frames.payloads if bytes(p[:1]) == stream_format.BATCH]
    assert batches == steps
    per_step = run.records().groupby("step").size()
    assert (per_step == per_step.iloc[0]).all(), "no step is partial"
    assert np.isfinite(run.records()["norm"]).all()


def test_stream2db_writes_the_same_database_after_the_job(output_dir, write_config):
    from trainmon import open_run
    from trainmon.cli import main

    def poison(monitor, step):
        monitor.log_scalar("loss", float("nan") if step == 1 else 1.0)

    monitor, _ = monitored(write_config, steps=3, on_step=poison, format=["db"], output_filesystem="network",
                           alert={"rules": [{"rule_name": "AnomalyNan"}]})
    with open_run(monitor.output_dir) as run:
        before, scalars = run.records(), run.scalars()
    assert main(["stream2db", str(monitor.output_dir.parent)]) == 0
    assert main(["stream2db", str(monitor.output_dir.parent)]) == 2, "an existing monitor.db is kept"
    db = monitor.output_dir / "monitor.db"
    with sqlite3.connect(db) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
        assert conn.execute("SELECT COUNT(*) FROM anomalies WHERE step = 1").fetchone()[0] >= 1
    (monitor.output_dir / "records.stream").unlink()  # what is read now is the database alone
    with open_run(monitor.output_dir) as run:
        pd.testing.assert_frame_equal(run.records(), before)
        pd.testing.assert_frame_equal(run.scalars(), scalars)
    assert len(before) > 100 and scalars["value"].isna().sum() == 1
