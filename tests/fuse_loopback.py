"""A FUSE mount of a directory onto another (a loopback): a filesystem whose statfs says FUSE, as a cluster's
FUSE mounts of object stores or sshfs do. Runs in the foreground until unmounted.

    python tests/fuse_loopback.py ROOT MOUNTPOINT

Needs fusepy, libfuse 2 and permission to mount (/dev/fuse; root or fusermount).
"""
import errno
import os
import sys

from fuse import FUSE, FuseOSError, Operations


class Loopback(Operations):
    def __init__(self, root: str):
        self.root = os.path.realpath(root)

    def _path(self, path: str) -> str:
        return os.path.join(self.root, path.lstrip("/"))

    def __call__(self, op, path, *args):
        try:
            return super().__call__(op, self._path(path), *args)
        except OSError as err:
            raise FuseOSError(err.errno or errno.EIO) from None

    def access(self, path, mode):
        if not os.access(path, mode):
            raise FuseOSError(errno.EACCES)

    def getattr(self, path, fh=None):
        st = os.lstat(path)
        return {key: getattr(st, key) for key in ("st_atime", "st_ctime", "st_gid", "st_mode", "st_mtime",
                                                  "st_nlink", "st_size", "st_uid")}

    def readdir(self, path, fh):
        return [".", ".."] + os.listdir(path)

    def statfs(self, path):
        st = os.statvfs(path)
        return {key: getattr(st, key) for key in ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail",
                                                  "f_ffree", "f_files", "f_flag", "f_frsize", "f_namemax")}

    chmod = os.chmod
    mkdir = os.mkdir
    rmdir = os.rmdir
    unlink = os.unlink
    open = os.open

    def chown(self, path, uid, gid):
        os.chown(path, uid, gid)

    def create(self, path, mode, fi=None):
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)

    def rename(self, old, new):
        os.rename(old, self._path(new))

    def read(self, path, size, offset, fh):
        return os.pread(fh, size, offset)

    def write(self, path, data, offset, fh):
        return os.pwrite(fh, data, offset)

    def truncate(self, path, length, fh=None):
        with open(path, "r+") as f:
            f.truncate(length)

    def flush(self, path, fh):
        return 0

    def fsync(self, path, datasync, fh):
        os.fsync(fh)
        return 0

    def release(self, path, fh):
        os.close(fh)
        return 0

    def utimens(self, path, times=None):
        os.utime(path, times)


if __name__ == "__main__":
    FUSE(Loopback(sys.argv[1]), sys.argv[2], foreground=True, nothreads=True)
