"""Keep the C allocator from holding freed payload memory (glibc only).

A node allocates and frees payload-sized buffers all day (a PUT's body, a GET's answer), in random order. glibc
serves a large request with its own ``mmap`` and returns it to the kernel on ``free`` -- but after the first
such free it *raises* its mmap threshold to that size (up to 32 MiB), so the next payloads come from the heap,
where a freed block below a live one is never given back: RSS then stays far above the budget after the load
has gone (measured: +89 MiB, 7x the object size, after six stalled 12 MiB answers were closed), and under mixed
load it settles at 1.25x the budget above the process's base. Three things keep it close:

- a fixed mmap threshold (1 MiB: an allocation that large gets its own mapping, returned when freed; fixing it
  stops the adaptive rise). Payloads of 64 KiB or more do not come from malloc at all: they live in the
  node's own reused mappings (``engine/buffers.py``), so what the heap holds between 64 KiB and 1 MiB is
  short-lived (a socket read, the parser's body chunks, an answer's head);
- a low trim threshold and :func:`trim` once a second (``malloc_trim``: the free pages *inside* the heap go
  back too, so what lives on the heap costs what it holds);
- two arenas, so the helper threads (hashing, file I/O) do not each keep an arena of their own.

Measured with ``benchmarks/rss_mixed_load.py`` (docs/hardening.md): 1.10 above the base with the threshold at
256 KiB, 1.04 at 64 KiB with the trim; without the fixed threshold 1.10. The threshold was 64 KiB until S3 PUT
bodies of 64 KiB and more moved into reused mappings: at 64 KiB, each transient buffer of a 64 KiB PUT (the
socket read, the parser's chunk, the body) was a fresh mapping faulted in page by page and unmapped again,
~200 µs of a PUT's ~600 (docs/benchmarks.md, "S3"). At 1 MiB the same load stays at 1.10 (60 s, one round;
1.15 with the threshold raised but PUT bodies under 1 MiB still on the heap).
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

MMAP_THRESHOLD = 1 << 20  # allocations this large get their own mapping, returned on free
TRIM_THRESHOLD = 1 << 20
ARENA_MAX = 2


_libc: ctypes.CDLL | None = None


def trim() -> None:
    """Hand the free pages inside the heap back to the kernel (``malloc_trim``): payloads freed in random order
    leave holes below live ones that the trim threshold alone never returns. Cheap when little is free."""
    if _libc is not None:
        _libc.malloc_trim(0)


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
    global _libc
    if hasattr(libc, "malloc_trim"):
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        libc.malloc_trim.restype = ctypes.c_int
        _libc = libc
    done = all(mallopt(param, value) == 1 for param, value in (
        (M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_ARENA_MAX, ARENA_MAX)))
    if not done:
        log.debug("mallopt refused a setting; the allocator keeps its defaults for it")
    return done
