"""The segment table: the event loop's view of every segment file — its read descriptor, how much of it is
live, whether it is sealed — and the space the files are charged against the capacity.

A segment enters when the writer opens it (or recovery finds it), is sealed by the writer, and leaves when
nothing in it is live any more or housekeeping evicts it; its file is deleted then, and its descriptor closed
once the last read holding it finishes.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .format import BLOCK
from .health import Health
from .osutil import close_quietly
from .recovery import RecoveredSegment
from .segments import open_reader
from .writer import OpenedSegment, SpaceAccount


@dataclass
class Seg:
    """The loop's view of one segment file."""

    id: int
    path: Path
    salt: int
    window_hi: float
    charged: int  # bytes counted against the capacity (segment_bytes while open, the file size once sealed)
    rfd: int
    sealed: bool = False
    live: int = 0  # index entries pointing here
    live_bytes: int = 0  # their record bytes
    data_bytes: int = 0  # record bytes ever written here (live + dead)
    max_exp: float = 0.0  # no live entry expires later (touch included)
    readers: int = 0  # reads in flight holding rfd
    removed: bool = False
    compacting: bool = False


class SegmentTable:
    """Segments by id, and the space they take (shared with the writer thread through ``space``)."""

    def __init__(self, capacity_bytes: int, health: Health, direct_io: bool) -> None:
        self.space = SpaceAccount(capacity_bytes)
        self._segs: dict[int, Seg] = {}
        self._health = health
        self._direct_io = direct_io

    def get(self, sid: int) -> Seg | None:
        return self._segs.get(sid)

    def __getitem__(self, sid: int) -> Seg:
        return self._segs[sid]

    def __iter__(self) -> Iterator[Seg]:
        return iter(self._segs.values())

    def __len__(self) -> int:
        return len(self._segs)

    def ids(self) -> list[int]:
        return sorted(self._segs)

    def open_count(self) -> int:
        return sum(1 for s in self._segs.values() if not s.sealed)

    # ------------------------------------------------------------------------------------------ lifecycle

    def install(self, segments: list[RecoveredSegment], meta_reserve: int) -> None:
        """The sealed segments recovery kept (their live figures are set by :meth:`set_live`)."""
        self.space.charge(meta_reserve)
        for s in segments:
            seg = Seg(s.segment_id, s.path, s.header.salt, s.header.window_hi, s.size, s.fd, sealed=True,
                      data_bytes=max(0, s.size - BLOCK))
            self._segs[seg.id] = seg
            self.space.charge(s.size)

    def set_live(self, sid: int, count: int, nbytes: int, max_exp: float) -> None:
        seg = self._segs[sid]
        seg.live, seg.live_bytes, seg.max_exp = count, nbytes, max_exp

    def opened(self, o: OpenedSegment) -> None:
        """The writer opened a segment: open it for reading too."""
        try:
            rfd = open_reader(o.path, self._direct_io)
        except OSError as e:
            self._health.set_degraded(f"open for reading: {e}")
            rfd = -1
        self._segs[o.segment_id] = Seg(o.segment_id, o.path, o.salt, o.window_hi, o.reserved, rfd)

    def sealed(self, sid: int, size: int) -> None:
        """The writer sealed (``size`` > 0) or gave up a segment; one with nothing live goes at once."""
        seg = self._segs.get(sid)
        if seg is None:
            return
        if size:
            seg.sealed = True
            seg.charged = size
        if seg.sealed and seg.live == 0:
            self.drop(seg)

    def add_live(self, sid: int, nbytes: int, expires_at: float) -> None:
        seg = self._segs[sid]
        seg.live += 1
        seg.live_bytes += nbytes
        seg.max_exp = max(seg.max_exp, expires_at)

    def unlive(self, sid: int, nbytes: int, count: int = 1) -> None:
        """``count`` records of ``nbytes`` in all left the index; a sealed segment left empty goes."""
        seg = self._segs.get(sid)
        if seg is None:
            return
        seg.live -= count
        seg.live_bytes -= nbytes
        if seg.live <= 0 and seg.sealed and not seg.removed:
            self.drop(seg)

    def extend_expiry(self, sids: list[int], expires_at: float) -> None:
        for sid in sids:
            seg = self._segs.get(sid)
            if seg is not None:
                seg.max_exp = max(seg.max_exp, expires_at)

    def drop(self, seg: Seg) -> None:
        """Forget a segment and delete its file (its live rows must be gone already)."""
        if seg.removed:
            return
        seg.removed = True
        self._segs.pop(seg.id, None)
        self._health.stats.dropped_segments += 1
        if seg.readers == 0:
            close_quietly(seg.rfd)
            seg.rfd = -1
        try:
            os.unlink(seg.path)
        except FileNotFoundError:
            pass
        except OSError as e:
            self._health.io_error("unlink", e)
            return  # still on disk: keep charging it
        self.space.release(seg.charged)

    def close_all(self) -> None:
        for seg in self._segs.values():
            close_quietly(seg.rfd)
        self._segs.clear()

    # ------------------------------------------------------------------------------------------ reads

    def hold(self, seg: Seg) -> None:
        """A read starts using ``seg.rfd`` (it stays open until :meth:`release`, even if the segment goes)."""
        seg.readers += 1

    def release(self, seg: Seg, _fut: object = None) -> None:
        seg.readers -= 1
        if seg.removed and seg.readers == 0:
            close_quietly(seg.rfd)
            seg.rfd = -1

    # ------------------------------------------------------------------------------------------ choices

    def oldest_sealed(self) -> Seg | None:
        """The next segment to evict: the oldest sealed one not being worked on."""
        cands = [s for s in self._segs.values() if s.sealed and not s.removed and not s.compacting]
        return min(cands, key=lambda s: s.id) if cands else None

    def most_dead(self, compact_below: float) -> Seg | None:
        """The sealed segment with the smallest live fraction, if it is below ``compact_below``."""
        cands = [s for s in self._segs.values() if s.sealed and not s.removed and not s.compacting and s.data_bytes
                 and s.live_bytes < compact_below * s.data_bytes]
        return min(cands, key=lambda s: s.live_bytes / s.data_bytes) if cands else None
