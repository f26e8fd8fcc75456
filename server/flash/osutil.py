"""Operating-system helpers of the flash store: descriptor limits, the directory lock, quiet closes, heap trim.

Plain functions over the OS, no store state; used by the facade (open/close), the segment table and the
writer threads.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import os
import resource
from pathlib import Path

log = logging.getLogger("ctxstore.flash")


def raise_fd_limit(need: int) -> None:
    """Raise the soft RLIMIT_NOFILE towards ``need`` (within the hard limit); warn if it cannot get there."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        new = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        except (ValueError, OSError):
            new = soft
        if new < need:
            log.warning("flash: %d open files allowed, %d may be needed (one per segment): raise the limit or "
                        "use larger segments", new, need)


def trim_heap() -> None:
    """glibc keeps freed memory for reuse; malloc_trim returns it, so RSS reflects what the index holds."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def lock_file(path: Path) -> int:
    """Hold an exclusive lock on ``path`` for as long as the store is open (one process per directory)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        if e.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise
        try:
            fd = os.open(path, os.O_RDONLY)  # a read-only directory: lock the file that is there
        except FileNotFoundError:
            return -1
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        # An OSError, as the directory's other start-up failures (permissions, a full or read-only disk) are.
        raise OSError(errno.EBUSY, f"{path.parent} is in use by another flash store") from None
    return fd


def close_quietly(fd: int) -> None:
    """Close ``fd`` if it is one (>= 0), ignoring errors: for descriptors nothing more is read from."""
    if fd >= 0:
        try:
            os.close(fd)
        except OSError:
            pass


def unlink_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def directory_unwritable(path: Path) -> OSError | None:
    """Why ``path`` cannot take writes (missing, not writable, a read-only mount), or None."""
    try:
        os.stat(path)
        if not os.access(path, os.W_OK) or os.statvfs(path).f_flag & os.ST_RDONLY:
            raise OSError(errno.EROFS, "directory is read-only")
    except OSError as e:
        return e
    return None
