"""A rank's record stream read as a monitor database: the stream's whole frames copied, as they come, into
a private database on this host's disk, which the read layer then reads as it reads monitor.db.

So every reader (show, nan-analyze, anomalies, export, compare, open_run, the daemon) gives the same answers
from the stream as from a database, and no reader ever opens a database that another host writes. The copy
(the "mirror") lives in `$TRAINMON_CACHE_DIR` (default: `<tmp>/trainmon-<uid>/`, a local disk), one per
stream, and is brought up to date at each read by the frames added since (a poll of the daemon costs the
new batches only). It is a cache: deleting it costs one full read of the stream.

The mirror is written in rollback-journal mode, never WAL: readers in other processes of this host open it
read-only while it grows, and it never has a `-wal` file that would say "a job is writing this".

What a reader finds besides whole frames is kept with the mirror and said by `findings`: gaps (bytes between
whole frames that are no frame: a corrupt frame, or one a network filesystem has not shown yet, read again at
each update until it is whole), frames whose content cannot be read, and the tail.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import sqlite3
import struct
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

from trainmon.writers.anomaly_table import INSERT_ANOMALY, anomaly_row
from trainmon.core.events import AnomalyEvent
from trainmon.core.records import RecordKey
from trainmon.read.errors import InputError
from trainmon.writers import db_schema, stream_format
from trainmon.writers.monitor_db import MonitorDb

CACHE_ENV = "TRAINMON_CACHE_DIR"
MIRROR_SUFFIX = ".stream-mirror.db"
_STATE = "stream_mirror"  # meta key: how far the mirror has read its stream and anomalies.jsonl
_FORMAT = 2  # of that state: a mirror with another is made again
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
        state = _state(path) if path.exists() else {}
        if state.get("format") != _FORMAT:
            path.unlink(missing_ok=True)  # made by another version of this module: read the stream again
        elif state.get("seen") == seen:
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
        if not frames.payloads and not state and _not_a_stream(stream):
            raise InputError.at(stream, "not a trainmon record stream (it does not start with a frame, and no "
                                        "whole frame follows)")
        if jsonl is not None:
            db.conn.executescript(db_schema.ANOMALY_SCHEMA)  # before BEGIN: a script commits what is open
        db.conn.execute("BEGIN")
        unread = state.get("unread", [])
        gaps = []
        for gap_offset, gap_length in state.get("gaps", []):  # whole by now, if a filesystem showed it late
            found = stream_format.read_frames(stream, gap_offset, gap_length)
            unread += _apply(db, found)
            gaps += found.gaps + ([[found.end, found.tail]] if found.tail else [])
        unread += _apply(db, frames)
        gaps += frames.gaps
        ended = bytes(frames.payloads[-1][:1]) == stream_format.END if frames.payloads else state.get("ended", False)
        state = {"format": _FORMAT, "first_crc": frames.first_crc, "offset": frames.end, "tail": frames.tail,
                 "ended": ended, "gaps": [list(gap) for gap in gaps], "unread": unread, "seen": seen,
                 "jsonl_offset": _add_anomalies(db.conn, jsonl, state.get("jsonl_offset", 0))}
        db_schema.write_meta(db.conn, {_STATE: state})
        db.conn.execute("COMMIT")
    finally:
        db.close()


@dataclass(frozen=True)
class Findings:
    """What the last update of a stream's mirror found besides whole frames, each as one line that names the
    stream and the byte offset."""

    lost: list[str]  # data not read: corrupt bytes between whole frames, frames whose content cannot be read
    tail: Optional[str]  # bytes after the last whole frame: a batch being written or torn by a kill, or junk
    ended: bool  # the last whole frame is the end frame: the writer closed the stream

    @property
    def warnings(self) -> list[str]:
        return self.lost + ([self.tail] if self.tail else [])


_LISTED = 3  # gaps, and frames not read whole, named one by one; more are counted


def findings(stream: Path) -> Findings:
    """What reading `stream` into its mirror found besides whole frames (after `sync`)."""
    state = _state(mirror_path(stream))
    gaps, lost = state.get("gaps", []), []
    if gaps:
        listed = ", ".join(f"{length} bytes at offset {offset}" for offset, length in gaps[:_LISTED])
        more = f" and {len(gaps) - _LISTED} more stretches" if len(gaps) > _LISTED else ""
        lost.append(f"{stream}: {listed}{more} are not a whole frame (corrupt, or not yet arrived on a network "
                    "filesystem); the frames after them are read")
    unread = state.get("unread", [])
    lost += [f"{stream}: the frame at offset {offset}: {what}" for offset, what in unread[:_LISTED]]
    if len(unread) > _LISTED:
        lost.append(f"{stream}: {len(unread) - _LISTED} more frames not read whole, the last at offset {unread[-1][0]}")
    tail, ended, end = state.get("tail", 0), state.get("ended", False), state.get("offset", 0)
    if not tail:
        said = None
    elif ended:
        said = f"{stream}: {tail} bytes after its end frame, at offset {end}, are not a frame; ignored"
    else:
        said = (f"{stream}: its last {tail} bytes, from offset {end}, are not a whole step batch (its job is still "
                "writing it or was killed); read up to its last whole batch")
    return Findings(lost, said, ended)


def _not_a_stream(stream: Path) -> bool:
    """Whether the file starts with something other than a frame or zeros (what a network filesystem shows
    of a first frame whose data has not arrived)."""
    with open(stream, "rb") as f:
        head = f.read(len(stream_format.MAGIC))
    return len(head) == len(stream_format.MAGIC) and head not in (stream_format.MAGIC, bytes(len(head)))


def _apply(db: MonitorDb, frames: stream_format.Frames) -> list:
    """Adds the frames' content to the mirror; returns [offset, what] of each frame whose content could not be
    read whole (a frame with a matching CRC from a writer of another version, or records whose tags only
    unreadable frames named)."""
    tags = db.known_tags()
    unread = []
    for start, payload in zip(frames.starts, frames.payloads):
        try:
            kind, content = stream_format.decode(payload)
            if kind == stream_format.BATCH:
                new = {tag_id: (family, name, vpp, tuple(shape), dtype) for tag_id, family, name, vpp, shape, dtype
                       in content.tags + content.tags_again if tag_id not in tags}
                keys, values, recorded, unnamed = _records(content.block, {**tags, **new})
        except (ValueError, KeyError, TypeError, struct.error, zlib.error) as err:
            unread.append([start, f"not readable ({err})"])
            continue
        if kind == stream_format.META:
            db.set_meta(content)
        elif kind == stream_format.BATCH:
            for tag_id, ident in new.items():  # a tag is named in two frames (stream_format): added once
                db.add_tag(tag_id, ident)
            tags.update(new)
            if unnamed:
                unread.append([start, f"step {content.step}: {unnamed} of its {unnamed + len(keys)} records name "
                                      "tags that only unreadable frames define; not read"])
            db.add_step(content.step, content.pp_stage, keys, values, dict(content.scalars), recorded,
                        content.wall_time)
    return unread


def _records(block: bytes, tags: dict) -> tuple[list, np.ndarray, np.ndarray, int]:
    """(keys, values, recorded, unnamed) of a block, as the writer gave them to MonitorDb.add_step: a NaN field
    without its `nan_fields` bit was not recorded. `unnamed`: records left out, their tag not in `tags`."""
    rows = np.frombuffer(zlib.decompress(block), dtype=db_schema.BLOCK_DTYPE)
    named = np.isin(rows["tag_id"], list(tags))
    unnamed = len(rows) - int(named.sum())
    if unnamed:
        rows = rows[named]
    keys = []
    for tag_id, micro, call in zip(rows["tag_id"].tolist(), rows["micro_step"].tolist(), rows["call_index"].tolist()):
        family, name, vpp, shape, dtype = tags[tag_id]
        keys.append(RecordKey(family, name, vpp, None if micro == db_schema.NO_MICRO_STEP else micro, call, shape,
                              dtype))
    values = rows["fields"].astype(np.float64)
    nan_bit = (rows["nan_fields"][:, None].astype(np.int64) >> _BITS) & 1
    return keys, values, ~np.isnan(values) | nan_bit.astype(bool), unnamed


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
