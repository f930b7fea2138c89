"""One rank's progress as the daemon sees it: the steps it has committed, read through the read layer.

A database is opened for each poll and closed again, so the daemon never holds a lock on a running
job's database and sees every transaction committed since. A step is complete when a later step has
been committed (a step's scalars are committed before its records, in their own transaction), or when
the rank has finished (its run.json carries the writer's report, written at `stop()`).

A stall is measured from the commit of the rank's newest step (the database's `batches.wall_time`, a CSV
file's modification time), not from when the daemon saw it: a daemon started late reports it on time.
"""
from __future__ import annotations

import sqlite3
import time
from typing import Optional

from trainmon.core.layout import WRITER_REPORT
from trainmon.read.errors import InputError
from trainmon.read.layout import RankDir
from trainmon.read.rank_records import open_rank


class RankFollower:
    """Tracks one rank: its newest committed step, whether it finished, stalled or cannot be read.

    Args:
        rank_dir: the rank's directory.
        source: the read layer's source choice ("auto": the database when there is one, else CSV).
    """

    def __init__(self, rank_dir: RankDir, source: str = "auto"):
        self.rank_dir = rank_dir
        self.source = source
        self.latest: Optional[int] = None  # newest committed step
        self.finished = False
        self.error: Optional[str] = None  # the message of a rank that cannot be read, said once
        self.lost: list[str] = []  # the parts of the rank's record stream that could not be read, said once
        self.stalled = False
        self._progress_at = time.time()  # the commit of the newest step (until one is seen: the daemon's start)

    @property
    def rank(self) -> int:
        return self.rank_dir.rank

    def open(self):
        """The read layer's reader of this rank (close it after use).

        Raises:
            InputError: the rank's sources cannot be read (named in the message).
        """
        return open_rank(self.rank_dir, self.source)

    def poll(self, final: bool) -> Optional[str]:
        """Reads the newest committed step; returns a message when the rank became unreadable or readable
        again, or a part of its record stream cannot be read, None otherwise. `final`: every step present is
        complete (a finished run, `--once`)."""
        try:
            reader = self.open()
            try:
                latest, committed_at = _progress(reader)
            finally:
                reader.close()
            self.finished = final or bool(self.rank_dir.metadata().get(WRITER_REPORT))
            stream = self.rank_dir.stream_findings()
        except (InputError, sqlite3.Error, OSError) as err:
            if self.error is None:
                self.error = str(err)
                return f"rank {self.rank}: cannot be read ({err}); the other ranks go on"
            return None
        message = None
        if self.error is not None:
            message = f"rank {self.rank}: readable again"
            self.error = None
        if latest is not None and latest != self.latest:
            self.latest = latest
            self._progress_at = time.time() if committed_at is None else committed_at
            if self.stalled:
                self.stalled = False
                message = f"rank {self.rank}: writing again (step {latest})"
        lost = stream.lost if stream is not None else []
        if lost != self.lost:
            self.lost = lost
            message = "; ".join(filter(None, [message] + [f"rank {self.rank}: {line}" for line in lost])) or None
        return message

    def stall_due(self, stall_after: float) -> bool:
        """Whether the rank, not reported as stalled yet, has committed nothing for `stall_after` seconds (as of
        its last poll)."""
        return not (self.finished or self.error is not None or self.stalled) and \
            time.time() - self._progress_at >= stall_after

    def check_stall(self, stall_after: float) -> Optional[str]:
        """A message the first time the rank has committed nothing for `stall_after` seconds."""
        if not self.stall_due(stall_after):
            return None
        idle = time.time() - self._progress_at
        self.stalled = True
        at = "nothing yet" if self.latest is None else f"step {self.latest}"
        return (f"rank {self.rank}: stalled, no step committed for {idle:.0f} s (last: {at}); the other ranks "
                "go on (a hang, a crash, or a slow step)")

    @property
    def complete_through(self) -> Optional[int]:
        """The last step whose records are all committed (None: none yet)."""
        if self.latest is None:
            return None
        return self.latest if self.finished else self.latest - 1

    def nonfinite_after(self, step: int) -> Optional[int]:
        """The first step after `step` with a non-finite record or anomaly (database sources only)."""
        reader = self.open()
        try:
            return reader.first_anomalous_step(step) if hasattr(reader, "first_anomalous_step") else None
        finally:
            reader.close()


def _progress(reader) -> tuple[Optional[int], Optional[float]]:
    """(the newest committed step, when it was committed as a wall-clock time; None: not known)."""
    if hasattr(reader, "last_commit"):  # a database: its committed batches
        return reader.last_commit()
    files = reader.rank_dir.family_files()  # CSV: the rows of the newest file say how far it got
    if not files:
        return None, None
    newest = max(files, key=lambda f: f.first)
    last = None
    for step, _ in reader.rows(newest.family, newest.first, None):
        last = step
    return last, max(f.path.stat().st_mtime for f in files)
