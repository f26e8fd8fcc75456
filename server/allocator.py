"""Keep the C allocator from holding freed payload memory (glibc only).

A node allocates and frees payload-sized buffers all day (a PUT's body, a GET's answer). glibc serves a
large request with its own ``mmap`` and returns it to the kernel on ``free`` -- but after the first such
free it *raises* its mmap threshold to that size (up to 32 MiB), so the next payloads come from the heap,
where a freed block below a live one cannot be given back: RSS then stays far above the budget after the
load has gone (measured: +89 MiB, 7x the object size, after six stalled 12 MiB answers were closed).
Fixing the threshold disables that adaptation; a lower trim threshold hands freed heap tops back sooner,
and fewer arenas bound what helper threads (hashing, file I/O) keep in arenas of their own.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys
from typing import Any

log = logging.getLogger(__name__)

# mallopt parameters, from glibc's <malloc.h>.
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8

MMAP_THRESHOLD = 256 << 10  # payload-sized buffers above this get their own mapping, returned on free
TRIM_THRESHOLD = 1 << 20
ARENA_MAX = 2


def tune() -> bool:
    """Apply the settings above to this process's glibc malloc; False (and no change) elsewhere."""
    if not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and other C libraries have no mallopt
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    done = all(mallopt(param, value) == 1 for param, value in (
        (M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_ARENA_MAX, ARENA_MAX)))
    if not done:
        log.debug("mallopt refused a setting; the allocator keeps its defaults for it")
    return done


# A buffer the size of a large payload is a fresh mapping: every 4 KiB page of it faults on first touch, and
# in these VMs a fault costs ~2.7 µs (0.7 s per GB: more than the socket copy). bytearray(n) touches each page
# to zero it; a payload buffer that the body will overwrite anyway is made uninitialized instead and its pages
# populated by one madvise call (MADV_POPULATE_WRITE, Linux 5.14): 128 × 1 MiB in 53 ms instead of 81 ms
# (docs/benchmarks.md). Below the mmap threshold the heap serves it and this gains nothing.
MADV_POPULATE_WRITE = 23
_PAGE = 4096
_populate: Any = None


def payload_buffer(size: int) -> bytearray:
    """A writable buffer of ``size`` bytes whose contents the caller overwrites in full before anyone reads
    them (a body read into it, or the buffer dropped): uninitialized and pre-faulted when that is cheaper."""
    global _populate
    if size < MMAP_THRESHOLD or _populate is False:
        return bytearray(size)
    if _populate is None:
        _populate = _populate_functions()
        if _populate is False:
            return bytearray(size)
    new, madvise = _populate
    buf: bytearray = new(None, size)
    address = ctypes.addressof((ctypes.c_char * size).from_buffer(buf))
    start = (address + _PAGE - 1) & ~(_PAGE - 1)
    end = (address + size) & ~(_PAGE - 1)
    if end > start and madvise(start, end - start, MADV_POPULATE_WRITE) != 0:
        _populate = False  # an older kernel: the pages fault as they are written, as bytearray's would
    return buf


def _populate_functions() -> Any:
    if not sys.platform.startswith("linux"):
        return False
    try:
        new = ctypes.pythonapi.PyByteArray_FromStringAndSize
        new.restype = ctypes.py_object
        new.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t]
        madvise = ctypes.CDLL(None, use_errno=True).madvise
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        madvise.restype = ctypes.c_int
    except (AttributeError, OSError):
        return False
    return new, madvise
