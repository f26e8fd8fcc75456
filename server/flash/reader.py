"""Reads, run on a small pool of threads: one ``preadv`` per coalesced run, then verification.

Segment files are read with O_DIRECT where the file system allows it, into page-aligned buffers that are
kept for the next read (:class:`ReadBuffers`). Measured through a node pinned to one core (docs/benchmarks.md,
"Flash tier through a node"): a restore of 128 MiB from the page cache cost the node ~135 ms of CPU, ~30 of
them copying out of the page cache and ~30 faulting in and zeroing fresh buffers; with the page cache dropped
~185 ms (the cache's own pages too), so the node's core, not the device, was the bound. O_DIRECT into reused
buffers costs neither: the device writes straight into memory that is already mapped.

A record is returned only if its header checksum (salted per segment), lengths, bucket and key match what
the index expected and its payload hashes to the XXH3-64 in its header. Anything else is a ``CORRUPT`` (the
store drops it from the index) or a ``MISMATCH`` (a fingerprint collision: a miss, the other key's block
stays).
"""

from __future__ import annotations

import mmap
import os
import threading
import weakref
from dataclasses import dataclass

import numpy as np
import xxhash

from .format import BLOCK, FormatError, RecordHeader, parse_record_header

OK, CORRUPT, MISMATCH, IO_FAILED = 0, 1, 2, 3


@dataclass(slots=True)
class ReadItem:
    pos: int  # position in the caller's request
    offset: int
    header_len: int
    payload_len: int
    bucket: bytes
    key: bytes


@dataclass(slots=True)
class ReadOutcome:
    pos: int
    status: int
    header: RecordHeader | None = None
    payload: memoryview | None = None
    detail: str = ""


HUGE_PAGE = 2 << 20
MIN_POOLED = 256 << 10  # smaller reads take memory the allocator reuses anyway; no pool needed


def aligned_span(offset: int, stop: int) -> tuple[int, int]:
    """(start, length) of the whole :data:`BLOCK` s covering bytes ``offset`` to ``stop`` of a file."""
    start = offset // BLOCK * BLOCK
    return start, -(-stop // BLOCK) * BLOCK - start


def pread_into(fd: int, view: memoryview, offset: int) -> int:
    """Fill ``view`` from ``offset``; returns the bytes read, fewer only at the end of the file (a read that
    ends inside a block ends there: the next would fail under O_DIRECT, not return 0)."""
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n == 0:
            break
        got += n
        if (offset + got) % BLOCK:
            break
    return got


def aligned_array(n: int) -> np.ndarray:
    """``n`` bytes starting on a :data:`BLOCK` boundary (what O_DIRECT needs), from the allocator."""
    raw = np.empty(n + BLOCK, np.uint8)
    start = -raw.ctypes.data % BLOCK
    return raw[start:start + n]


class ReadBuffers:
    """Page-aligned read buffers in power-of-two sizes, handed back for reuse when the last view of one is
    gone (the payloads a reply is still sending keep theirs), and kept up to ``retain_bytes`` in all.

    A fresh buffer costs a page fault and a zeroed page per 4 KiB on first touch; a kept one costs nothing.
    Reads under :data:`MIN_POOLED` use :func:`aligned_array`. Thread-safe: reader threads take buffers, and a
    buffer comes back on whichever thread drops its last view."""

    def __init__(self, retain_bytes: int) -> None:
        self.retain_bytes = retain_bytes
        self.retained = 0  # bytes of the kept buffers
        self.fresh = 0  # buffers made because none was kept (a measure of the pool's size)
        self._free: dict[int, list[mmap.mmap]] = {}
        self._lock = threading.Lock()

    def take(self, n: int) -> np.ndarray:
        """A writable, page-aligned array of at least ``n`` bytes."""
        if n < MIN_POOLED:
            return aligned_array(n)
        size = 1 << (n - 1).bit_length()
        chunk = None
        with self._lock:
            free = self._free.get(size)
            if free:
                chunk = free.pop()
                self.retained -= size
            else:
                self.fresh += 1
        if chunk is None:
            # Private: a shared anonymous map is shmem, whose page lookups cost O_DIRECT ~10 % of the node's CPU.
            chunk = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            if size >= HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE"):
                chunk.madvise(mmap.MADV_HUGEPAGE)  # fewer faults and page-table walks per read
        arr = np.frombuffer(chunk, np.uint8)
        # The array is this use's handle: every payload view refers to it, so it dies with the last of them.
        weakref.finalize(arr, self._give_back, chunk)
        return arr

    def _give_back(self, chunk: mmap.mmap) -> None:
        size = len(chunk)
        with self._lock:
            if self.retained + size <= self.retain_bytes:
                self._free.setdefault(size, []).append(chunk)
                self.retained += size
        # otherwise the chunk is unmapped once the dying array has released it

    def trim(self, keep: int) -> int:
        """Unmap kept buffers, the largest first, until at most ``keep`` bytes are kept; returns what is."""
        with self._lock:
            for size in sorted(self._free, reverse=True):
                free = self._free[size]
                while free and self.retained > keep:
                    free.pop()
                    self.retained -= size
            return self.retained

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self.retained = 0


def plan_runs(items: list[ReadItem], with_payload: bool, max_gap: int, max_run: int) -> list[list[ReadItem]]:
    """Group items of one segment (sorted by offset) into runs read with one call each."""
    runs: list[list[ReadItem]] = []
    end = -1
    start = 0
    for it in sorted(items, key=lambda x: x.offset):
        length = it.header_len + (it.payload_len if with_payload else 0)
        if runs and it.offset - end <= max_gap and it.offset + length - start <= max_run:
            runs[-1].append(it)
            end = max(end, it.offset + length)
        else:
            runs.append([it])
            start, end = it.offset, it.offset + length
    return runs


def read_run(fd: int, salt: int, run: list[ReadItem], with_payload: bool,
             check_key: bool = True, buffers: ReadBuffers | None = None) -> tuple[list[ReadOutcome], int]:
    """Read one run and verify each record in it. Returns the outcomes and the bytes read from the file.

    The read covers whole :data:`BLOCK` s (``fd`` may be opened with O_DIRECT); the buffer comes from
    ``buffers`` when given. ``check_key=False`` (compaction, listing) accepts whatever key the verified
    header holds."""
    stop = max(it.offset + it.header_len + (it.payload_len if with_payload else 0) for it in run)
    start, length = aligned_span(run[0].offset, stop)
    buf = buffers.take(length) if buffers is not None else aligned_array(length)
    view = buf.data[:length]  # a writable memoryview of the array
    try:
        got = pread_into(fd, view, start)
    except OSError as e:
        return [ReadOutcome(it.pos, IO_FAILED, detail=str(e)) for it in run], 0
    out = []
    for it in run:
        rel = it.offset - start
        try:
            h = parse_record_header(view, rel, salt, got)
        except FormatError as e:
            out.append(ReadOutcome(it.pos, CORRUPT, detail=str(e)))
            continue
        if h.header_len != it.header_len or h.payload_len != it.payload_len:
            # a valid header of another shape: not the record the index points at
            out.append(ReadOutcome(it.pos, CORRUPT, detail="lengths differ from the index"))
            continue
        if check_key and (h.bucket != it.bucket or h.key != it.key):
            out.append(ReadOutcome(it.pos, MISMATCH, h, detail="another key (fingerprint collision)"))
            continue
        if not with_payload:
            out.append(ReadOutcome(it.pos, OK, h))
            continue
        body = rel + h.header_len
        if body + h.payload_len > got:
            out.append(ReadOutcome(it.pos, CORRUPT, detail="truncated payload"))
            continue
        payload = view[body:body + h.payload_len]
        if xxhash.xxh3_64_intdigest(payload) != h.payload_xxh3:
            out.append(ReadOutcome(it.pos, CORRUPT, detail="payload checksum mismatch"))
            continue
        out.append(ReadOutcome(it.pos, OK, h, payload))
    return out, got
