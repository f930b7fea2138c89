"""Which filesystem holds the output, and so how the `db` format writes there.

SQLite's WAL needs every user of a database to share its wal-index, an mmapped `-shm` file, and byte-range
locks: both hold on one host's local disk, neither across the hosts of a network or parallel filesystem
(NFS, Lustre, GPFS, CIFS/SMB, CephFS, FUSE mounts of object stores). There the `db` format writes an
append-only, CRC-framed record stream instead (`stream_sink`), which any host can tail.

The filesystem is found by `statfs(2)`'s magic number (through libc: Python has no `os.statfs`), or,
where that call is not available, by the longest mount point of /proc/self/mountinfo holding the path.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

logger = logging.getLogger("trainmon")

LOCAL, NETWORK = "local", "network"
CHOICES = ("auto", LOCAL, NETWORK)  # the config key `output_filesystem`
DB_PATH, STREAM_PATH = "db", "stream"  # how the `db` format writes: SQLite in WAL mode, or the record stream

# statfs f_type magic numbers (linux/magic.h and the filesystems' own sources) -> a name.
MAGIC_NAMES = {
    0x6969: "nfs", 0x0BD00BD0: "lustre", 0x47504653: "gpfs", 0xFF534D42: "cifs", 0xFE534D42: "smb2",
    0x517B: "smb", 0x65735546: "fuse", 0x00C36400: "ceph", 0x19830326: "beegfs", 0x5346414F: "afs",
    0x01021997: "9p", 0x794C7630: "overlay", 0xEF53: "ext4", 0x58465342: "xfs", 0x9123683E: "btrfs",
    0x01021994: "tmpfs", 0x2FC12FC1: "zfs", 0x858458F6: "ramfs",
}
# Names of /proc/self/mountinfo's fstype field that mean a shared filesystem (a FUSE mount is "fuse.<name>").
NETWORK_NAMES = frozenset({"nfs", "nfs4", "lustre", "gpfs", "cifs", "smb", "smb2", "smb3", "fuse", "ceph",
                           "beegfs", "afs", "9p", "glusterfs", "panfs", "wekafs", "orangefs", "pvfs2"})


@dataclass(frozen=True)
class OutputFilesystem:
    """Where a rank writes and how the `db` format writes there (recorded in run.json)."""

    fstype: str  # e.g. "nfs", "lustre", "ext4", "fuse.sshfs"; "unknown" when it could not be found
    kind: str  # LOCAL or NETWORK
    write_path: str  # DB_PATH or STREAM_PATH
    reason: str  # one sentence: why this path

    def as_dict(self) -> dict:
        return asdict(self)


def statfs_magic(path: str) -> Optional[int]:
    """`statfs(path).f_type` through libc, None where libc or the call is not available (not Linux)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name, use_errno=True)
        call = libc.statfs
    except (OSError, AttributeError):
        return None
    buf = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on 64-bit Linux; f_type comes first
    if call(os.fsencode(path), buf) != 0:
        return None
    return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF


def mountinfo_fstype(path: str, mountinfo: Optional[str] = None) -> Optional[str]:
    """The fstype of the mount holding `path`: the longest mount point of /proc/self/mountinfo that contains it."""
    if mountinfo is None:
        try:
            mountinfo = Path("/proc/self/mountinfo").read_text()
        except OSError:
            return None
    best, fstype = -1, None
    for line in mountinfo.splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        point = fields[4].replace("\\040", " ")
        after = line.split(" - ", 1)[1].split()
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) > best and after:
            best, fstype = len(point), after[0]
    return fstype


def filesystem_name(path: Path, statfs: Callable[[str], Optional[int]] = statfs_magic,
                    mountinfo: Optional[str] = None) -> str:
    """The name of the filesystem holding `path` (its nearest existing ancestor): from statfs's magic, with
    mountinfo's name for a FUSE mount (which says what is behind it) or where statfs cannot tell."""
    real = os.path.realpath(path)  # the mount points of mountinfo are real paths
    existing = Path(real)
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    name = MAGIC_NAMES.get(statfs(str(existing)))
    if name in (None, "fuse"):
        name = mountinfo_fstype(real, mountinfo) or name
    return name or "unknown"


def is_network(fstype: str) -> bool:
    return fstype in NETWORK_NAMES or fstype.split(".")[0] in NETWORK_NAMES


def choose(path: Path, setting: str = "auto", statfs: Callable[[str], Optional[int]] = statfs_magic,
           mountinfo: Optional[str] = None) -> OutputFilesystem:
    """The write path of the `db` format for output under `path`.

    Args:
        setting: the config key `output_filesystem`: "auto" (from the filesystem), "local" or "network".
        statfs, mountinfo: stand-ins for the system's (tests).
    """
    fstype = filesystem_name(path, statfs, mountinfo)
    if setting == LOCAL:
        return OutputFilesystem(fstype, LOCAL, DB_PATH, "output_filesystem is \"local\" in the config")
    if setting == NETWORK:
        return OutputFilesystem(fstype, NETWORK, STREAM_PATH, "output_filesystem is \"network\" in the config")
    if is_network(fstype):
        return OutputFilesystem(fstype, NETWORK, STREAM_PATH,
                                f"{fstype} is a shared filesystem, where SQLite's WAL (shared memory and locks) "
                                "does not work across hosts")
    return OutputFilesystem(fstype, LOCAL, DB_PATH, f"{fstype} is a local filesystem")


def log_choice(choice: OutputFilesystem, directory: Path) -> None:
    """The one line that says how the `db` format writes, and why."""
    what = ("monitor.db (SQLite, WAL)" if choice.write_path == DB_PATH else
            "records.stream (append-only, CRC-framed; `trainmon stream2db` makes monitor.db after the job)")
    logger.info("trainmon: output in %s is on %s (%s): the db format writes %s, because %s", directory,
                choice.fstype, choice.kind, what, choice.reason)
