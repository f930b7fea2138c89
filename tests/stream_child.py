"""Processes on both sides of a record stream, for the stream tests.

    python tests/stream_child.py writer STREAM N [--handshake]   frames written in pieces, cut at every offset
    python tests/stream_child.py reader STREAM N [--handshake]   tails STREAM until it has N batches
    python tests/stream_child.py killed STREAM N                 N batches, half of one more, then SIGKILL
    python tests/stream_child.py mirror STREAM N                 brings the read layer's mirror up to date

The writer cuts frame i at its bytes i, i + N, i + 2N, ... (so every offset of a frame is cut once), and every
third frame shows zeros first (what a network filesystem shows of a page whose data has not arrived). With
--handshake the writer writes one piece per line on stdin and answers with the number of whole batches, and the
reader reads once per line on stdin and answers with the number it got: every cut is read.
The reader checks every batch it gets against what the writer wrote and prints the steps it got, as JSON.
"""
import json
import os
import signal
import sys
import time
import zlib
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))

import numpy as np  # noqa: E402

from trainmon.core.records import RecordKey  # noqa: E402
from trainmon.read.database import DbRankReader  # noqa: E402
from trainmon.read import stream_mirror  # noqa: E402
from trainmon.writers import db_schema, stream_format  # noqa: E402
from trainmon.writers.record_stream import RecordStream  # noqa: E402

KEYS = [RecordKey("actv", "layers.0.output", 0, 0, 0, (4, 8), "torch.float32"),
        RecordKey("grad_reduced", "layers.0.weight", 0, None, 1, (8, 8), "torch.bfloat16")]
META = {"rank": 0, "ops": ["norm", "min", "max", "nans", "infs"], "fields": list(db_schema.FIELDS),
        "schema_version": db_schema.SCHEMA_VERSION}


def values(step: int) -> np.ndarray:
    """The records of `step`: distinct per step and key, with a NaN field and an Inf on odd steps."""
    out = np.arange(len(KEYS) * len(db_schema.FIELDS), dtype=np.float64).reshape(len(KEYS), -1) + 1000.0 * step
    if step % 2:
        out[0, 3] = np.nan
        out[1, 5] = np.inf
    return out


def scalars(step: int) -> dict:
    return {"loss": 1.0 / (step + 1), "grad_norm": float("nan") if step % 3 == 0 else float(step)}


def frame_of(step: int, first: bool) -> bytes:
    tags = [[i + 1, k.family, k.name, k.vpp_stage, list(k.shape), k.dtype] for i, k in enumerate(KEYS)] if first else []
    block = db_schema.encode_block([1, 2], [k.micro_step for k in KEYS], [k.call_index for k in KEYS], values(step),
                                   db_schema.nan_masks(values(step)))
    return stream_format.batch_frame(step, 0, 1e9 + step, tags, [[n, v] for n, v in scalars(step).items()], block)


def writer(path: str, n: int, handshake: bool) -> None:
    """Frame i is written in pieces cut at its offsets i, i + n, i + 2n, ...: over n frames, every offset."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    meta = stream_format.meta_frame(META)
    os.pwrite(fd, meta, 0)
    size = len(meta)

    def piece(data: bytes, at: int, whole: int) -> None:
        if handshake:
            sys.stdin.readline()
        os.pwrite(fd, data, at)
        if handshake:
            print(whole, flush=True)  # the batches whole in the file now

    for step in range(n):
        data = frame_of(step, step == 0)
        if step % 3 == 0:
            piece(b"\0" * len(data), size, step)
        cuts = [0] + [c for c in range(step, len(data), n) if c] + [len(data)]
        for start, end in zip(cuts, cuts[1:]):
            piece(data[start:end], size + start, step + (end == len(data)))
        size += len(data)
    os.close(fd)
    if handshake:
        sys.stdin.readline()
        print("done", flush=True)


def check(step: int, rows: list) -> None:
    """`rows` (DbRankReader.rows of one step) are the records the writer wrote for `step`."""
    got = np.array([[row["raw_" + f] for f in db_schema.FIELDS] for row in rows])
    want = values(step)
    assert np.array_equal(np.isnan(got), np.isnan(want)) and np.array_equal(got[~np.isnan(got)],
                                                                            want[~np.isnan(want)]), (step, got)
    assert [(r["family"], r["name"], r["micro_step"], tuple(r["shape"])) for r in rows] == \
        [(k.family, k.name, k.micro_step, k.shape) for k in KEYS]


def written(path: Path, steps: int) -> bytes:
    """Writes a stream of `steps` batches (a metadata frame first, an end frame last); returns its bytes."""
    stream = RecordStream(path)
    stream.set_meta(META)
    for step in range(steps):
        stream.add_step(step, 0, KEYS, values(step), scalars(step))
    stream.close()
    return path.read_bytes()


def mirrored_steps(path: Path, in_order: bool = True) -> list[int]:
    """The steps the read layer gets from the stream at `path`, each checked against what was written;
    `in_order`: the mirror also added them in step order."""
    db = DbRankReader(stream_mirror.sync(path))
    try:
        steps = []
        for step, rows in db.rows(None, None, None):
            check(step, rows)
            steps.append(step)
        if in_order:
            assert [s for (s,) in db.conn.execute("SELECT step FROM batches ORDER BY rowid")] == steps
        return steps
    finally:
        db.close()


def reader(path: str, n: int, handshake: bool) -> None:
    """Tails the stream two ways, by its frames and through the read layer's mirror; checks both."""
    raw_steps, offset, mirrored = [], 0, []
    deadline = time.monotonic() + 120
    while handshake or (min(len(raw_steps), len(mirrored)) < n and time.monotonic() < deadline):
        if handshake and not sys.stdin.readline():
            break
        if not os.path.exists(path):
            continue
        frames = stream_format.read_frames(Path(path), offset)
        for payload in frames.payloads:
            kind, content = stream_format.decode(payload)
            if kind == stream_format.BATCH:
                block = np.frombuffer(zlib.decompress(content.block), dtype=db_schema.BLOCK_DTYPE)
                want = values(content.step)
                assert np.array_equal(block["fields"], want, equal_nan=True), content.step
                assert dict(content.scalars).keys() == scalars(content.step).keys()
                raw_steps.append(content.step)
        offset = frames.end
        mirror = stream_mirror.sync(Path(path))
        db = DbRankReader(mirror)
        try:
            for step, rows in db.rows(None, len(mirrored), None):
                check(step, rows)
                mirrored.append(step)
            batches = db.conn.execute("SELECT step FROM batches ORDER BY rowid").fetchall()
            assert [s for (s,) in batches] == mirrored, "each batch once, in order"
            loss = db.scalars("loss", None, None)
            assert [r["value"] for r in loss] == [scalars(s)["loss"] for s in mirrored]
        finally:
            db.close()
        if handshake:
            print(json.dumps(len(mirrored)), flush=True)
    print(json.dumps({"raw": raw_steps, "mirrored": mirrored}), flush=True)


def killed(path: str, n: int) -> None:
    stream = RecordStream(Path(path))
    stream.set_meta(META)
    for step in range(n):
        stream.add_step(step, 0, KEYS, values(step), scalars(step))
    data = frame_of(n, False)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    os.write(fd, data[:len(data) // 2])
    print(len(data) // 2, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    mode, stream_path, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
    handshake = "--handshake" in sys.argv
    if mode == "writer":
        writer(stream_path, count, handshake)
    elif mode == "reader":
        reader(stream_path, count, handshake)
    elif mode == "mirror":
        print("start", flush=True)
        stream_mirror.sync(Path(stream_path))
    else:
        killed(stream_path, count)
