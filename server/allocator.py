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
