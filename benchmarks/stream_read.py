"""What reading a record stream costs a reader (the daemon, a command): per rank-step, CPU time of this process.

    python benchmarks/stream_read.py --records-from /tmp/trainmon_bench_*/run-*/rank_0/records.stream --steps 200

The batches of `--records-from` (a stream that overhead.py wrote with `"output_filesystem": "network"`) are
repeated under new step numbers until there are `--steps`. Then:
- following: the frames are appended to a growing stream `--per-poll` steps at a time, and after each append
  the read layer brings its mirror up to date (what the daemon's poll of one rank costs) and reads the new
  steps' columns (what its export reads);
- first read: the whole stream mirrored at once (a command on a finished run, the first time);
- again: the same read when nothing is new (every later command, every idle poll).
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from trainmon.core.layout import STREAM_NAME
from trainmon.read import stream_mirror
from trainmon.read.database import DbRankReader
from trainmon.writers import stream_format


def frames_of(source: Path, steps: int) -> list[bytes]:
    """The meta frame, then `steps` batch frames: the source's batches, repeated under new step numbers."""
    meta, batches = None, []
    for payload in stream_format.read_frames(source).payloads:
        kind, content = stream_format.decode(payload)
        if kind == stream_format.META and meta is None:
            meta = content
        elif kind == stream_format.BATCH:
            batches.append(content)
    out = [stream_format.meta_frame(meta)]
    for step in range(steps):
        b = batches[step % len(batches)]
        out.append(stream_format.batch_frame(step, b.pp_stage, b.wall_time, b.tags if step == 0 else [], b.scalars,
                                             b.block))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records-from", required=True, type=Path)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--per-poll", type=int, default=1, help="steps appended between two reads")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="trainmon_stream_read_"))
    os.environ[stream_mirror.CACHE_ENV] = str(work / "cache")
    frames = frames_of(args.records_from, args.steps)
    records = None

    growing = work / "follow" / STREAM_NAME
    growing.parent.mkdir()
    growing.write_bytes(frames[0])
    sync_cpu, read_cpu = [], []
    for start in range(1, len(frames), args.per_poll):
        with open(growing, "ab") as f:
            f.write(b"".join(frames[start:start + args.per_poll]))
        c0 = time.process_time()
        mirror = stream_mirror.sync(growing)
        c1 = time.process_time()
        reader = DbRankReader(mirror)
        columns = reader.columns(None, start - 1, start - 2 + args.per_poll).data
        reader.close()
        c2 = time.process_time()
        records = len(columns["step"]) // len(frames[start:start + args.per_poll])
        sync_cpu.append((c1 - c0) / args.per_poll)
        read_cpu.append((c2 - c1) / args.per_poll)

    whole = work / "whole" / STREAM_NAME
    whole.parent.mkdir()
    whole.write_bytes(b"".join(frames))
    c0 = time.process_time()
    stream_mirror.sync(whole)
    first = (time.process_time() - c0) / args.steps
    c0 = time.process_time()
    stream_mirror.sync(whole)
    again = time.process_time() - c0

    size = whole.stat().st_size
    print(f"{args.steps} steps of {records} records, {size / args.steps / 1024:.1f} KB per step in the stream, "
          f"{stream_mirror.mirror_path(whole).stat().st_size / args.steps / 1024:.1f} KB in its mirror")
    print(f"following, {args.per_poll} step(s) a poll: mirror update {statistics.median(sync_cpu) * 1e3:.2f} ms "
          f"per rank-step (median), reading the new steps' columns {statistics.median(read_cpu) * 1e3:.2f} ms")
    print(f"first read of the whole stream: {first * 1e3:.2f} ms per rank-step; again, nothing new: "
          f"{again * 1e3:.2f} ms per read")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
