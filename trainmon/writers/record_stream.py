"""Writing `rank_<R>/records.stream` (see stream_format): what the `db` format writes on a network or
parallel filesystem, where no other host could read a SQLite database in WAL mode."""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from trainmon.core.records import RecordKey
from trainmon.writers import db_schema, stream_format

# Each batch is written (one write(2)) as it comes; fsync makes it reach the file server, from where other
# hosts read it: every FSYNC_BATCHES batches, or sooner once FSYNC_SECONDS have passed since the last one.
FSYNC_BATCHES = 16
FSYNC_SECONDS = 2.0


class RecordStream:
    """Appends step batches to one record stream, with the interface of `db_sink.MonitorDb`.

    An existing stream is appended to (`append_output`): a tail that is not a whole frame (the writer was
    killed mid-batch) is cut first, so that the new frames follow the last whole one.

    Args:
        path: the stream file; created if missing.
    """

    def __init__(self, path: Path, fsync_batches: int = FSYNC_BATCHES, fsync_seconds: float = FSYNC_SECONDS):
        self.path = path
        self.fsync_batches = fsync_batches
        self.fsync_seconds = fsync_seconds
        self._tag_ids: dict[tuple, int] = {}
        self._named_last: list = []  # the tags the last batch was the first to use: the next one names them again
        end = self._known_frames() if path.exists() else 0
        self._fd: Optional[int] = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.ftruncate(self._fd, end)
        self._size = end
        self._unsynced = 0
        self._synced_at = time.monotonic()

    def _known_frames(self) -> int:
        """Reads the tags of an existing stream; returns where its whole frames end."""
        frames = stream_format.read_frames(self.path)
        for payload in frames.payloads:
            kind, content = stream_format.decode(payload)
            if kind == stream_format.BATCH:
                for tag_id, family, name, vpp, shape, dtype in content.tags + content.tags_again:
                    self._tag_ids[(family, name, vpp, tuple(shape), dtype)] = tag_id
        return frames.end

    def set_meta(self, items: dict) -> None:
        self._append(stream_format.meta_frame(items), sync=True)

    def add_step(self, step: int, pp_stage: int, keys: Sequence[RecordKey], values: np.ndarray, scalars: dict,
                 recorded: Optional[np.ndarray] = None, wall_time: Optional[float] = None) -> None:
        """Appends one step batch: the same content as a `record_blocks` row, its new tags and its scalars."""
        new_tags, tag_ids = [], []
        for key in keys:
            ident = (key.family, key.name, key.vpp_stage, tuple(key.shape), key.dtype)
            tag_id = self._tag_ids.get(ident)
            if tag_id is None:
                tag_id = self._tag_ids[ident] = len(self._tag_ids) + 1
                new_tags.append([tag_id, key.family, key.name, key.vpp_stage, list(key.shape), key.dtype])
            tag_ids.append(tag_id)
        block = db_schema.encode_block(tag_ids, [k.micro_step for k in keys], [k.call_index for k in keys], values,
                                       db_schema.nan_masks(values, recorded), recorded)
        data = stream_format.batch_frame(step, pp_stage, wall_time or time.time(), new_tags,
                                         [[name, float(value)] for name, value in scalars.items()], block,
                                         self._named_last)
        try:
            self._append(data)
        except BaseException:
            for tag in new_tags:  # not written: the next batch that uses them names them
                del self._tag_ids[(tag[1], tag[2], tag[3], tuple(tag[4]), tag[5])]
            raise
        self._named_last = new_tags

    def _append(self, data: bytes, sync: bool = False) -> None:
        """Writes one frame; a frame that fails part way (a full disk) is cut off again, so that the next one
        follows a whole frame."""
        try:
            written = 0
            while written < len(data):
                written += os.write(self._fd, data[written:])
        except BaseException:
            os.ftruncate(self._fd, self._size)
            raise
        self._size += len(data)
        self._unsynced += 1
        if sync or self._unsynced >= self.fsync_batches or time.monotonic() - self._synced_at >= self.fsync_seconds:
            self._sync()

    def _sync(self) -> None:
        os.fsync(self._fd)
        self._unsynced = 0
        self._synced_at = time.monotonic()

    def close(self) -> None:
        if self._fd is None:
            return
        try:
            self._append(stream_format.end_frame(time.time()), sync=True)
        finally:
            os.close(self._fd)
            self._fd = None
