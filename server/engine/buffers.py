"""Payload buffers kept for reuse: the buffer of a block that died serves the next block of the same size.

Why: a payload buffer of 64 KiB or more is a mapping of its own. A fresh one faults in and zeroes every 4 KiB
page on first touch (~2.7 µs a page in these VMs), and unmapping it costs again: measured in-process, 31 µs to
make and populate a 64 KiB buffer and 10 µs to unmap it, 347 and 45 µs for 1 MiB. That was a third of a
node's CPU during a save of 64 KiB blocks (docs/benchmarks.md). A kept buffer costs neither.

Safety: a buffer goes back only when nothing refers to it any more. Each use gets a fresh handle (a numpy
array over the kept mapping); the object's payload, every reply's view of it and every slice refer to that
handle, so it dies with the last of them and a weak reference's callback then returns the mapping. A reply
still being sent, or a demotion still writing, keeps the buffer. A buffer is handed out with the previous
block's bytes still in it: every caller fills it in full before anyone reads it, or drops it.

Memory: what is kept counts against the node's budget as node state while the budget has room, up to a
sixteenth of it (at most 256 MiB). A small part (a 128th, at most 32 MiB) may be kept uncharged: a full
node evicts a block to make room for the next one, and the victim's buffer is what the next block should get.
Making room drops kept buffers before it evicts a live block, and a node that takes none for
:data:`IDLE_SECONDS` gives them back (size by size: a size no block asks for any more does not hold the
room another size needs).
"""

from __future__ import annotations

import mmap
import sys
import weakref
from collections import deque
from collections.abc import Callable

import numpy as np

from .budget import Budget

MIN_POOLED = 64 << 10  # smaller payloads come from the C heap, which reuses its memory by itself
PAGE = mmap.PAGESIZE
KEEP_SHARE, KEEP_CAP = 16, 256 << 20  # kept and charged: at most budget / 16, and 256 MiB
LOOSE_SHARE, LOOSE_CAP = 128, 32 << 20  # kept but not charged (the budget is full): budget / 128, 32 MiB
IDLE_SECONDS = 5.0  # no buffer of a size taken for this long: the kept ones of that size are unmapped
MADV_POPULATE_WRITE = 23  # Linux 5.14; not in Python 3.11's mmap module

Payload = bytearray | memoryview


class PayloadBuffers:
    """Writable payload buffers, recycled by size (rounded up to a page). Used from the event loop; only the
    return of a buffer may happen on another thread (whichever drops its last reference)."""

    def __init__(self, budget: Budget, charge: Callable[[int], None], clock: Callable[[], float]) -> None:
        self._budget = budget
        self._charge = charge  # charge(delta): count kept bytes against the budget as node state
        self._clock = clock
        self._free: dict[int, list[mmap.mmap]] = {}
        # id of a handle's weak reference -> (the reference, the handle's mapping), while the handle lives
        self._lent: dict[int, tuple[weakref.ref[np.ndarray], mmap.mmap]] = {}
        self._returned: deque[mmap.mmap] = deque()  # back from use, not sorted in yet (any thread appends)
        self._returned_bytes = 0
        self._return_bound = self.keep_limit() + self.loose_limit()  # of what may wait to be sorted in
        self._populate = sys.platform.startswith("linux")
        self._taken_at: dict[int, float] = {}  # size -> when a buffer of it was last asked for
        self.kept = 0  # bytes of the buffers in the free lists
        self.charged = 0  # the part of ``kept`` counted against the budget
        self.fresh = 0  # buffers mapped because none of the size was kept
        self.reused = 0  # buffers handed out again

    def keep_limit(self) -> int:
        return min(self._budget.limit // KEEP_SHARE, KEEP_CAP)

    def loose_limit(self) -> int:
        return min(self._budget.limit // LOOSE_SHARE, LOOSE_CAP)

    def take(self, size: int) -> Payload:
        """A writable buffer of exactly ``size`` bytes, holding whatever its last user left in it: the caller
        overwrites every byte before anyone reads it, or drops it."""
        return self.take_many([size])[0]

    def take_many(self, sizes: list[int]) -> list[Payload]:
        """:meth:`take` for each of ``sizes``: one pass for a run of blocks (the clock read and the budget
        charge once, not per block)."""
        out: list[Payload] = []
        unkept = 0
        now = self._clock()
        for size in sizes:
            if size < MIN_POOLED:
                out.append(bytearray(size))
                continue
            rounded = -(-size // PAGE) * PAGE
            self._taken_at[rounded] = now
            free = self._free.get(rounded)
            if not free and self._returned:
                if unkept:  # settle what was taken so far first: sorting in charges against what is kept
                    self._uncharge_taken()
                    unkept = 0
                self._sort_returned()
                free = self._free.get(rounded)
            if free:
                chunk = self._pop(rounded)
                self.kept -= rounded
                unkept += rounded
                self.reused += 1
            else:
                chunk = self._map(rounded)
                self.fresh += 1
            handle = np.frombuffer(chunk, np.uint8, count=size)
            ref = weakref.ref(handle, self._give_back)
            self._lent[id(ref)] = (ref, chunk)
            out.append(handle.data)  # a memoryview of the handle: it keeps the handle alive
        if unkept:
            self._uncharge_taken()
        return out

    def make_room(self, need: int) -> None:
        """Unmap kept buffers until ``need`` more bytes fit in the budget (or none is left): called before a
        live block is evicted for room."""
        while self.charged and not self._budget.fits(need):
            self._drop_one(charged_first=True)

    def housekeep(self) -> None:
        """Sort in the buffers that came back; give back the sizes not asked for in :data:`IDLE_SECONDS`, and
        what exceeds the limits (the budget may have been changed)."""
        self._sort_returned()
        now = self._clock()
        self._taken_at = {size: at for size, at in self._taken_at.items() if now - at < IDLE_SECONDS}
        for size in [size for size in self._free if size not in self._taken_at]:
            self._unkeep(size * len(self._free.pop(size)), charged_first=True)
        while self.charged > self.keep_limit():
            self._drop_one(charged_first=True)
        while self.kept - self.charged > self.loose_limit():
            self._drop_one(charged_first=False)

    # ------------------------------------------------------------------ internals

    def _map(self, size: int) -> mmap.mmap:
        chunk = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if self._populate:
            # One call faults in every page (the body overwrites them anyway): cheaper than a fault each.
            try:
                chunk.madvise(MADV_POPULATE_WRITE)
            except OSError:  # an older kernel: the pages fault as they are written
                self._populate = False
        return chunk

    def _give_back(self, ref: weakref.ref[np.ndarray]) -> None:
        lent = self._lent.pop(id(ref), None)
        if lent is None:
            return
        chunk = lent[1]
        # Bounded even before it is sorted in: a flush that frees a million blocks keeps only this much. (No
        # lock: deque appends are atomic, and a racing count only makes this bound approximate until the
        # next sort.)
        n = len(chunk)
        if self._returned_bytes + n <= self._return_bound:
            self._returned_bytes += n
            self._returned.append(chunk)
        # otherwise the mapping is unmapped as this frame lets go of it

    def _sort_returned(self) -> None:
        returned = self._returned
        keep, loose = self.keep_limit(), self.loose_limit()
        self._return_bound = keep + loose
        charged = 0
        while returned:
            chunk = returned.popleft()
            n = len(chunk)
            self._returned_bytes -= n
            if self.charged + n <= keep and self._budget.fits(charged + n):
                charged += n
                self.charged += n
            elif self.kept - self.charged + n > loose:
                continue  # no room to keep it: unmapped
            self._free.setdefault(n, []).append(chunk)
            self.kept += n
        if charged:
            self._charge(charged)

    def _unkeep(self, n: int, *, charged_first: bool = False) -> None:
        """``n`` bytes left the free lists. Taken for a block (whose reservation charges it), the uncharged
        part shrinks first; dropped for room, the charged part does."""
        self.kept -= n
        if charged_first:
            self._set_charged(max(0, self.charged - n))
        else:
            self._uncharge_taken()

    def _uncharge_taken(self) -> None:
        """Buffers were taken out of ``kept``: what is still charged is at most what is still kept."""
        self._set_charged(min(self.charged, self.kept))

    def _set_charged(self, charged: int) -> None:
        if charged != self.charged:
            self._charge(charged - self.charged)
            self.charged = charged

    def _pop(self, size: int) -> mmap.mmap:
        """A kept buffer of ``size`` (there is one); no empty list is left behind (making room picks from
        the sizes that are there)."""
        free = self._free[size]
        chunk = free.pop()
        if not free:
            del self._free[size]
        return chunk

    def _drop_one(self, *, charged_first: bool) -> None:
        size = max(self._free)
        self._pop(size)
        self._unkeep(size, charged_first=charged_first)
