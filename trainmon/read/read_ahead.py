"""Reading a file ahead of the scattered reads that follow.

SQLite reads a query's pages one at a time, wherever they lie in the file, and a database's tables and
indexes are interleaved step by step. When those pages are not in the page cache (a run on a network
filesystem, one written long ago, more ranks than memory holds), each is a round trip to the disk, and
a reader that visits a few megabytes of a database spread over its whole length pays more for the round
trips than one sequential read of the file would cost. Past READ_AHEAD_BELOW bytes the sequential read
costs more than the pages a reader needs.
"""
from __future__ import annotations

import os
from pathlib import Path

READ_AHEAD_BELOW = 64 << 20


def read_ahead(path: Path) -> None:
    """Asks the kernel to bring `path` into the page cache in one sequential read, without waiting for it,
    when it is smaller than READ_AHEAD_BELOW (nothing where the platform has no such request)."""
    if not hasattr(os, "posix_fadvise"):
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # the reader that follows names the file
    try:
        if os.fstat(fd).st_size < READ_AHEAD_BELOW:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
    finally:
        os.close(fd)
