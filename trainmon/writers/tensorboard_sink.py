"""The `tensorboard` format: event files in each rank directory, written by TensorBoard's own writer."""
from __future__ import annotations

import itertools
import os
import socket
import struct
import time
from pathlib import Path
from typing import Iterable, Optional

from trainmon.core.records import StepBatch
from trainmon.writers.base import Sink, SinkContext
from trainmon.writers.event_encoding import scalar_event
from trainmon.writers.tags import tag_of

EVENT_FILE_PREFIX = "events.out.tfevents."  # what `tensorboard --logdir` reads


def _fast_record_writer(record_writer):
    """TensorBoard's RecordWriter with a compiled CRC32C when the `crc32c` package is installed.

    TensorBoard checksums every record with a pure-Python CRC32C (about 50 ms for one step's event
    of a small model); the framing is the same, only the checksum is computed in C.
    """
    try:
        from crc32c import crc32c
    except ImportError:
        return record_writer

    def masked(data: bytes) -> int:
        crc = crc32c(data)
        return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF

    class CompiledCrcRecordWriter(record_writer):
        def write(self, data: bytes) -> None:
            header = struct.pack("<Q", len(data))
            self._writer.write(header + struct.pack("<I", masked(header)) + data + struct.pack("<I", masked(data)))

    return CompiledCrcRecordWriter


def import_tensorboard():
    """(RecordWriter, Event, Summary) from the `tensorboard` package, or an ImportError saying how to get it."""
    try:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.record_writer import RecordWriter
    except ImportError as err:
        raise ImportError("the 'tensorboard' format needs the tensorboard package: pip install tensorboard "
                          f"(or pip install 'trainmon[tensorboard]'); import failed with: {err}") from err
    return _fast_record_writer(RecordWriter), Event, Summary


class EventWriter:
    """One event file, written synchronously with TensorBoard's RecordWriter: each `add` is one Event.

    TensorBoard's EventFileWriter would add a second queue and thread behind the writer thread, and
    report a full disk only at a later call; here a failed write raises at once.
    One Event per step (not per value) keeps the cost per step low; a step's scalars are encoded directly
    (`event_encoding`), other values through TensorBoard's protobuf classes.
    """

    _files = itertools.count()  # tells apart files opened in the same second by one process

    def __init__(self, logdir: Path, resume: Optional[tuple[Path, int]] = None):
        """Args:
            logdir: the directory of the new event file.
            resume: (file, size): append to that file instead, cut back to `size` bytes first (what a
                reader that was killed had confirmed; `trainmon watch` resumes this way).
        """
        record_writer, self._event, self._summary = import_tensorboard()
        if resume is not None:
            self.path, size = resume
            handle = open(self.path, "r+b")
            handle.truncate(size)
            handle.seek(size)
            self._records = record_writer(handle)
            return
        logdir.mkdir(parents=True, exist_ok=True)
        # EventFileWriter's naming: tensorboard --logdir finds the file and orders it by time.
        name = f"{EVENT_FILE_PREFIX}{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.{next(self._files)}"
        self.path = logdir / name
        self._records = record_writer(open(self.path, "wb"))
        self._records.write(self._event(wall_time=time.time(), file_version="brain.Event:2").SerializeToString())
        self._records.flush()

    def add(self, step: int, values: Iterable[tuple[str, float]], wall_time: Optional[float] = None) -> None:
        """Writes (tag, value) pairs of one step; values are stored as float32 (TensorBoard's scalar type)."""
        pairs = list(values)
        if pairs:
            tags, numbers = zip(*pairs)
            self._records.write(scalar_event(step, wall_time or time.time(), tags, numbers))

    def add_values(self, step: int, values: list, wall_time: Optional[float] = None) -> None:
        """Writes `Summary.Value`s of one step (images, text, plugin data) as one Event."""
        summary = self._summary(value=values)
        if summary.value:
            event = self._event(step=step, wall_time=wall_time or time.time(), summary=summary)
            self._records.write(event.SerializeToString())

    def flush(self) -> None:
        self._records.flush()

    def size(self) -> int:
        """Bytes written so far (after a flush)."""
        self.flush()
        return self.path.stat().st_size

    def close(self) -> None:
        if not self._records.closed:
            self._records.close()


def batch_values(batch: StepBatch, rank: int) -> list[tuple[str, float]]:
    """(tag, value) of every figure and scalar of a step: msprobe's tags plus `_{op}`, scalars by name."""
    values = [(f"{tag_of(key, rank)}_{op}", value)
              for key, figures in zip(batch.keys, batch.derived) for op, value in figures.items()
              if value is not None]
    values += [(name, float(value)) for name, value in batch.scalars.items()]
    return values


class TensorBoardSink(Sink):
    """Writes `rank_<R>/events.out.tfevents.*`, so `tensorboard --logdir <output>` shows one run per rank."""

    name = "tensorboard"

    def __init__(self):
        self._writer: Optional[EventWriter] = None
        self._rank = 0

    def start(self, context: SinkContext) -> None:
        self._rank = context.rank
        self._writer = EventWriter(context.rank_dir)

    def write(self, batch: StepBatch) -> None:
        self._writer.add(batch.step, batch_values(batch, self._rank))

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
