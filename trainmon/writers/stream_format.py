"""The record stream `rank_<R>/records.stream`: append-only, CRC-framed step batches (docs/guides/cluster.md says
when it is written). The writer (`stream_sink`) and every reader (`read.stream_mirror`) use the functions here.

A frame is `MAGIC | length (u32) | crc32 (u32) | payload`, little-endian; the CRC covers the length and the
payload. The payload's first byte is its kind:
- `M` metadata: JSON, the `meta` table of monitor.db (written at every start of a writer);
- `B` a step batch: a u32 length, a JSON header {step, pp_stage, wall_time, tags, scalars, tags_again}, then
  the batch's records as one `record_blocks` blob (db_schema.BLOCK_DTYPE, zlib). `tags` holds the tags this
  batch is the first to use, as [id, family, name, vpp_stage, shape, dtype], `tags_again` those the batch
  before it was the first to use: keys twice, then ids, so that a corrupt frame takes no name that a later
  frame needs (a reader of an earlier version reads `tags` only: the format did not change for it);
- `E` the writer closed the stream (JSON {wall_time}).
A frame is one write(2). A reader takes a frame only when all of it is there and its CRC matches; anything
else at the end of the file (a frame being written, a torn one after a crash, zeros that a network
filesystem shows before the data) is a tail it waits for, never data. Bytes that are not a whole frame but
are followed by one (a corrupt frame) are a gap: the reader resynchronises on the next whole frame (its MAGIC,
a length that fits and a matching CRC), so a corrupt frame costs its own records only.
"""
from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Optional

MAGIC = b"\xa7TMs"
_HEAD = struct.Struct("<4sII")
_U32 = struct.Struct("<I")
MAX_FRAME = 1 << 30  # a larger length is not a frame of ours
META, BATCH, END = b"M", b"B", b"E"
_READ_CHUNK = 1 << 24


def frame(kind: bytes, body: bytes) -> bytes:
    payload = kind + body
    length = _U32.pack(len(payload))
    return MAGIC + length + _U32.pack(zlib.crc32(payload, zlib.crc32(length))) + payload


def meta_frame(meta: dict) -> bytes:
    return frame(META, json.dumps(meta, default=str).encode())


def batch_frame(step: int, pp_stage: int, wall_time: float, new_tags: list, scalars: list, block: bytes,
                tags_again: list = ()) -> bytes:
    """`scalars`: [name, value] pairs (NaN and Inf as JSON's NaN and Infinity, which Python reads back)."""
    header = json.dumps({"step": step, "pp_stage": pp_stage, "wall_time": wall_time, "tags": new_tags,
                         "scalars": scalars, "tags_again": list(tags_again)}).encode()
    return frame(BATCH, _U32.pack(len(header)) + header + block)


def end_frame(wall_time: float) -> bytes:
    return frame(END, json.dumps({"wall_time": wall_time}).encode())


@dataclass(frozen=True)
class Batch:
    """One decoded `B` frame."""

    step: int
    pp_stage: int
    wall_time: float
    tags: list
    scalars: list
    block: bytes  # db_schema.encode_block's blob
    tags_again: list  # the tags the batch before was the first to use


def decode(payload: bytes):
    """(kind, content): a dict for `M` and `E`, a Batch for `B`."""
    payload = bytes(payload)
    kind, body = payload[:1], payload[1:]
    if kind != BATCH:
        return kind, json.loads(body)
    (size,) = _U32.unpack_from(body)
    header = json.loads(body[4:4 + size])
    return kind, Batch(header["step"], header["pp_stage"], header["wall_time"], header["tags"], header["scalars"],
                       body[4 + size:], header.get("tags_again", []))


@dataclass
class Frames:
    """The whole frames of a stream from an offset on, the gaps between them, and what follows them."""

    payloads: list = field(default_factory=list)  # each frame's payload, in order
    starts: list = field(default_factory=list)  # the offset of each frame
    ends: list = field(default_factory=list)  # the offset just after each frame
    gaps: list = field(default_factory=list)  # (offset, length) of the bytes before a whole frame that are no frame
    end: int = 0  # the offset after the last whole frame: where the next read starts
    tail: int = 0  # bytes after `end` that are not (yet) a whole frame with a matching CRC
    first_crc: Optional[int] = None  # the CRC of the stream's first frame (names the stream), when read


def read_frames(path: Path, offset: int = 0, length: Optional[int] = None) -> Frames:
    """The whole frames from `offset` to the end of the file (or in the `length` bytes from `offset`).

    The file is opened for this read and closed again: on NFS that is what makes another host's writes
    visible (close-to-open consistency).
    """
    out = Frames(end=offset)
    with open(path, "rb") as f:
        out.first_crc = _first_crc(f)
        f.seek(offset)
        stop = None if length is None else offset + length
        buf, at_end = b"", False
        while more := f.read(want := _READ_CHUNK if stop is None else min(_READ_CHUNK, stop - f.tell())):
            if at_end and buf:
                # the file grew during this read: the tail read at its end then (a frame being written) may be
                # whole now, and taken as a gap if read beside the frames written after it: read it again
                f.seek(out.end)
                buf, at_end = b"", False
                continue
            at_end = len(more) < want
            buf += more
            buf = buf[_split(buf, out):]
        out.tail = len(buf)
    return out


def _split(buf: bytes, out: Frames) -> int:
    """Moves the whole frames of `buf` (and the gaps before them) into `out`; returns the bytes they took."""
    pos = 0
    view = memoryview(buf)
    while pos < len(buf):
        size = whole_frame(view, pos)
        if size is None:
            after = _next_whole_frame(buf, view, pos + 1)
            if after is None:
                break  # a tail: nothing whole follows (yet)
            out.gaps.append((out.end, after - pos))
            out.end += after - pos
            pos = after
            continue
        out.starts.append(out.end)
        out.payloads.append(view[pos + _HEAD.size:pos + size])
        pos += size
        out.end += size
        out.ends.append(out.end)
    return pos


def _next_whole_frame(buf: bytes, view: memoryview, pos: int) -> Optional[int]:
    """Where the next whole frame of `buf` from `pos` on starts (None: none is whole)."""
    pos = buf.find(MAGIC, pos)
    while pos >= 0 and whole_frame(view, pos) is None:
        pos = buf.find(MAGIC, pos + 1)
    return pos if pos >= 0 else None


def whole_frame(buf, pos: int) -> Optional[int]:
    """The size of the frame at `buf[pos:]` when all of it is there and its CRC matches, else None."""
    if len(buf) - pos < _HEAD.size:
        return None
    magic, length, crc = _HEAD.unpack_from(buf, pos)
    if magic != MAGIC or length > MAX_FRAME or len(buf) - pos - _HEAD.size < length:
        return None
    start = pos + _HEAD.size
    if zlib.crc32(buf[start:start + length], zlib.crc32(_U32.pack(length))) != crc:
        return None
    return _HEAD.size + length


def _first_crc(f: BinaryIO) -> Optional[int]:
    head = f.read(_HEAD.size)
    return _HEAD.unpack(head)[2] if len(head) == _HEAD.size and head[:4] == MAGIC else None
