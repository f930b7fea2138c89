"""A rank's record stream read as a monitor database: the stream's whole frames copied, as they come, into
a private database on this host's disk, which the read layer then reads as it reads monitor.db.

So every reader (show, nan-analyze, anomalies, export, compare, open_run, the daemon) gives the same answers
from the stream as from a database, and no reader ever opens a database that another host writes. The copy
(the "mirror") lives in `$TRAINMON_CACHE_DIR` (default: `<tmp>/trainmon-<uid>/`, a local disk), one per
stream, and is brought up to date at each read by the frames added since (a poll of the daemon costs the
new batches only). It is a cache: deleting it costs one full read of the stream.

The mirror is written in rollback-journal mode, never WAL: readers in other processes of this host open it
read-only while it grows, and it never has a `-wal` file that would say "a job is writing this".
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import sqlite3
import tempfile
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Optional

import numpy as np

from trainmon.writers.anomaly_table import INSERT_ANOMALY, anomaly_row
from trainmon.core.events import AnomalyEvent
from trainmon.core.records import RecordKey
from trainmon.read.errors import InputError
from trainmon.writers import db_schema, stream_format

if TYPE_CHECKING:
    from trainmon.writers.db_sink import MonitorDb

CACHE_ENV = "TRAINMON_CACHE_DIR"
MIRROR_SUFFIX = ".stream-mirror.db"
_STATE = "stream_mirror"  # meta key: how far the mirror has read its stream and anomalies.jsonl
_BITS = np.arange(len(db_schema.FIELDS))


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path(tempfile.gettempdir()) / f"trainmon-{os.getuid()}")


def mirror_path(stream: Path) -> Path:
    key = hashlib.sha1(os.path.realpath(stream).encode()).hexdigest()[:24]
    return cache_dir() / f"{key}{MIRROR_SUFFIX}"


def is_mirror(path: Path) -> bool:
    return path.name.endswith(MIRROR_SUFFIX)


def sync(stream: Path, jsonl: Optional[Path] = None) -> Path:
    """The mirror of `stream` (and of its rank's anomalies.jsonl), brought up to date; returns its path.

    Raises:
        InputError: the file is not a trainmon record stream, or anomalies.jsonl has a bad line.
        OSError: the stream cannot be read, or the cache directory cannot be written.
    """
    path = mirror_path(stream)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    with _locked(path.with_name(path.name + ".lock")):
        seen = [_identity(stream), _identity(jsonl)]
        if path.exists() and _state(path).get("seen") == seen:
            return path  # nothing new (the poll of a rank that wrote nothing since)
        try:
            _update(path, stream, jsonl, seen)
        except sqlite3.DatabaseError as err:
            if isinstance(err, sqlite3.OperationalError):
                raise  # e.g. locked: the cache is fine, try again later
            path.unlink(missing_ok=True)  # a damaged cache: read the stream again
            _update(path, stream, jsonl, seen)
    return path


@contextlib.contextmanager
def _locked(lock: Path) -> Iterator[None]:
    """One updater of a mirror at a time (the daemon's workers and a command may read one rank at once)."""
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _identity(file: Optional[Path]) -> Optional[list]:
    """(size, mtime, inode) of a file, from an open(): on NFS, opening is what revalidates cached attributes."""
    if file is None:
        return None
    fd = os.open(file, os.O_RDONLY)
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def _state(mirror: Path) -> dict:
    """How far the mirror has read ({} for a mirror without that record, which is then read again)."""
    conn = sqlite3.connect(f"file:{mirror}?mode=ro", uri=True)
    try:
        row = conn.execute("SELECT value FROM meta WHERE key = ?", (_STATE,)).fetchone()
    except sqlite3.DatabaseError:
        return {}
    finally:
        conn.close()
    return json.loads(row[0]) if row else {}


def _update(path: Path, stream: Path, jsonl: Optional[Path], seen: list) -> None:
    from trainmon.writers.db_sink import MonitorDb  # the writers import torch: only a stream-only rank needs them

    db = MonitorDb(path, journal_mode="DELETE")
    try:
        db.conn.execute("PRAGMA synchronous=OFF")  # a cache: a damaged one is read again from the stream
        db.conn.execute("PRAGMA busy_timeout=60000")  # readers hold it only for a query
        state = db_schema.read_meta(db.conn).get(_STATE, {})
        offset = state.get("offset", 0)
        frames = stream_format.read_frames(stream, offset)
        if state and (frames.first_crc != state["first_crc"] or stream.stat().st_size < offset):
            db.close()  # another stream at this path (a new run in its place): start again
            path.unlink()
            return _update(path, stream, jsonl, seen)
        if frames.first_crc is None and _not_a_stream(stream):
            raise InputError.at(stream, "not a trainmon record stream (it does not start with a frame)")
        if jsonl is not None:
            db.conn.executescript(db_schema.ANOMALY_SCHEMA)  # before BEGIN: a script commits what is open
        db.conn.execute("BEGIN")
        _apply(db, frames.payloads)
        state = {"first_crc": frames.first_crc, "offset": frames.end, "tail": frames.tail, "seen": seen,
                 "jsonl_offset": _add_anomalies(db.conn, jsonl, state.get("jsonl_offset", 0))}
        db_schema.write_meta(db.conn, {_STATE: state})
        db.conn.execute("COMMIT")
    finally:
        db.close()


def tail_bytes(mirror: Path) -> int:
    """Bytes at the end of the mirrored stream that were not a whole frame at its last update."""
    return _state(mirror).get("tail", 0)


def _not_a_stream(stream: Path) -> bool:
    with open(stream, "rb") as f:
        head = f.read(len(stream_format.MAGIC))
    return len(head) == len(stream_format.MAGIC) and head != stream_format.MAGIC


def _apply(db: MonitorDb, payloads: list) -> None:
    tags = db.known_tags()
    for payload in payloads:
        kind, content = stream_format.decode(payload)
        if kind == stream_format.META:
            db.set_meta(content)
        elif kind == stream_format.BATCH:
            for tag_id, family, name, vpp, shape, dtype in content.tags:
                tags[tag_id] = (family, name, vpp, tuple(shape), dtype)
                db.add_tag(tag_id, tags[tag_id])
            keys, values, recorded = _records(content.block, tags)
            db.add_step(content.step, content.pp_stage, keys, values, dict(content.scalars), recorded,
                        content.wall_time)


def _records(block: bytes, tags: dict) -> tuple[list, np.ndarray, np.ndarray]:
    """(keys, values, recorded) of a block, as the writer gave them to MonitorDb.add_step: a NaN field without
    its `nan_fields` bit was not recorded."""
    rows = np.frombuffer(zlib.decompress(block), dtype=db_schema.BLOCK_DTYPE)
    keys = []
    for tag_id, micro, call in zip(rows["tag_id"].tolist(), rows["micro_step"].tolist(), rows["call_index"].tolist()):
        family, name, vpp, shape, dtype = tags[tag_id]
        keys.append(RecordKey(family, name, vpp, None if micro == db_schema.NO_MICRO_STEP else micro, call, shape,
                              dtype))
    values = rows["fields"].astype(np.float64)
    nan_bit = (rows["nan_fields"][:, None].astype(np.int64) >> _BITS) & 1
    return keys, values, ~np.isnan(values) | nan_bit.astype(bool)


def _add_anomalies(conn: sqlite3.Connection, jsonl: Optional[Path], offset: int) -> int:
    """Adds the whole lines of anomalies.jsonl after `offset` to the anomalies table (as the anomaly processor
    adds them to monitor.db's); returns the offset after them."""
    if jsonl is None:
        return offset
    with open(jsonl, "rb") as f:
        f.seek(offset)
        data = f.read()
    rows = []
    for line in data.splitlines(keepends=True):
        if not line.endswith(b"\n"):
            break  # still being written
        if line.strip():
            try:
                rows.append(anomaly_row(AnomalyEvent.from_json(json.loads(line))))
            except (ValueError, TypeError) as err:
                raise InputError.at(jsonl, f"not an anomaly record at byte {offset}: {err}") from None
        offset += len(line)
    conn.executemany(INSERT_ANOMALY, rows)
    return offset
