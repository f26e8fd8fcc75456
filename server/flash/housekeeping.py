"""Housekeeping: the flash store's bounded background work — expiry, eviction, compaction, dead-log trimming.

Expired entries leave the index (a sealed segment whose entries all expired goes whole); while free space is
below two segments the oldest sealed segment is evicted (its hot blocks re-appended first, up to a budget); one
mostly-dead segment is compacted (its live records appended again, then it empties and goes); the dead log is
rewritten without the entries of segments that are gone once it outgrows its share of the reserve. Everything
the store removes on its own is reported to ``on_remove``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from . import reader as rd
from .appends import Appends, Call
from .buckets import BucketTable
from .catalog import Catalog
from .health import Health
from .index import HOT
from .listing import Listing
from .options import FlashOptions
from .reads import Reads, RemoveListener
from .segment_table import Seg, SegmentTable
from .state import load_dead
from .types import EVICTED, EXPIRED, FlashRecord, Removal, WriteResult
from .writer import Pending

log = logging.getLogger("ctxstore.flash")

DEAD_ENTRY_BYTES = 16  # one dead-log entry on disk


@dataclass
class HousekeepReport:
    """What one housekeep() call did."""

    expired_segments: int = 0
    expired_blocks: int = 0
    evicted_segments: int = 0
    evicted_blocks: int = 0
    compacted_segments: int = 0
    compacted_blocks: int = 0


class Housekeeper:
    """Expiry, eviction, compaction and dead-log trimming over the store's parts."""

    def __init__(self, options: FlashOptions, clock: Callable[[], float], health: Health, buckets: BucketTable,
                 segments: SegmentTable, catalog: Catalog, appends: Appends, reads: Reads, listing: Listing,
                 report: RemoveListener, reporting: Callable[[], bool]) -> None:
        self._options = options
        self._clock = clock
        self._health = health
        self._stats = health.stats
        self._buckets = buckets
        self._segments = segments
        self._catalog = catalog
        self._appends = appends
        self._reads = reads
        self._listing = listing
        self._report = report
        self._reporting = reporting  # whether anyone listens (else the keys of removed blocks are not read)
        self._making_room = False

    async def housekeep(self) -> HousekeepReport:
        """FlashStore.housekeep on an open store."""
        rep = HousekeepReport()
        o = self._options
        self._health.check_directory()
        now = self._clock()
        self._listing.forget_idle(now)
        space = self._segments.space
        # 1. expired entries, and with them whole segments
        expired = self._catalog.expired_rows(now, o.expiry_sweep)
        if expired.size:
            idx = self._catalog.index
            for sid in np.unique(idx.seg[expired]).tolist():
                seg = self._segments.get(sid)
                if seg is None or not seg.sealed:
                    continue
                srows = expired[idx.seg[expired] == sid]
                whole = srows.size == seg.live
                n = await self._remove_reported(seg, srows, EXPIRED)
                rep.expired_blocks += n
                rep.expired_segments += int(whole)
        # 2. room for the writer
        while space.free < 2 * o.segment_bytes:
            oldest = self._segments.oldest_sealed()
            if oldest is None:
                break
            rep.evicted_blocks += await self._evict(oldest)
            rep.evicted_segments += 1
        # 3. compaction
        if self._health.degraded is None:
            c = await self._compact_one()
            rep.compacted_segments += int(c > 0)
            rep.compacted_blocks += c
        # 4. the dead log: keep it within the reserve
        if self._appends.dead_entries * DEAD_ENTRY_BYTES > o.meta_reserve // 2 and self._appends.writer is not None:
            self._trim_dead_log()
        return rep

    async def make_room(self, need: int) -> None:
        """Evict the oldest segments until ``need`` bytes are free (the writer is waiting for them)."""
        if self._making_room:
            return
        self._making_room = True
        try:
            while self._segments.space.free < need:
                seg = self._segments.oldest_sealed()
                if seg is None:
                    return
                await self._evict(seg)
        finally:
            self._making_room = False

    async def _evict(self, seg: Seg) -> int:
        """Remove the oldest segment; re-append up to ``rewrite_hot_bytes`` of its hot blocks first (only
        while there is room to write them, never when the writer is waiting for space)."""
        seg.compacting = True  # not picked again while this runs
        idx = self._catalog.index
        rows = idx.rows_of_segment(seg.id)
        budget = self._options.rewrite_hot_bytes
        if budget and rows.size and self._segments.space.free >= self._options.segment_bytes:
            hot = rows[(idx.flags[rows] & HOT) != 0]
            if hot.size:
                await self._relocate(seg, hot, budget)
                rows = self._catalog.index.rows_of_segment(seg.id)
        n = await self._remove_reported(seg, rows, EVICTED)
        if not seg.removed:
            self._segments.drop(seg)
        return n

    async def _remove_reported(self, seg: Seg, rows: np.ndarray, reason: str) -> int:
        """Remove rows of one segment from the index and tell on_remove which keys they were."""
        if rows.size == 0:
            return 0
        idx = self._catalog.index
        offs = idx.off[rows].copy()
        fps = idx.fp[rows].copy()
        names: dict[int, tuple[str, str]] = {}
        if self._reporting():
            try:
                names = await self._reads.keys_at(seg, rows)
            except (OSError, ValueError) as e:
                log.warning("flash: keys of segment %d unreadable (%s); removing without reporting", seg.id, e)
        # the index may have moved on while the keys were read
        still = (idx.seg[rows] == seg.id) & (idx.off[rows] == offs) & (idx.fp[rows] == fps)
        rows, offs = rows[still], offs[still]
        if rows.size == 0:
            return 0
        bkts = idx.bkt[rows].copy()
        self._catalog.remove_rows(rows, log_dead=False)
        for b in np.unique(bkts).tolist():
            self._buckets.changed(b)
            n = int((bkts == b).sum())
            st = self._buckets.stat(b)
            if reason == EXPIRED:
                st.expired += n
            else:
                st.evicted += n
        if reason == EXPIRED:
            self._stats.expired += int(rows.size)
        else:
            self._stats.evicted += int(rows.size)
        self._report([Removal(*names[o], reason) for o in offs.tolist() if o in names])
        return int(rows.size)

    async def _compact_one(self) -> int:
        seg = self._segments.most_dead(self._options.compact_below)
        if seg is None or self._segments.space.free < 2 * self._options.segment_bytes:
            return 0
        seg.compacting = True
        try:
            moved = await self._relocate(seg, self._catalog.index.rows_of_segment(seg.id),
                                         self._options.compact_budget)
        finally:
            seg.compacting = False
        if moved:
            self._stats.compactions += 1
        return moved

    async def _relocate(self, seg: Seg, rows: np.ndarray, budget: int) -> int:
        """Read up to ``budget`` bytes of live records of ``seg``, append them again and wait for the writes.
        The index moves to a new copy only if it still points at the old one. Returns the blocks moved."""
        idx = self._catalog.index
        rlen = idx.hlen[rows].astype(np.int64) + idx.plen[rows]
        rows = rows[np.cumsum(rlen) <= budget]
        if rows.size == 0 or self._appends.writer is None:
            return 0
        items = [rd.ReadItem(i, int(idx.off[r]), int(idx.hlen[r]), int(idx.plen[r]), b"", b"")
                 for i, r in enumerate(rows.tolist())]
        recs: list[Pending] = []
        fut: asyncio.Future[list[WriteResult]] = asyncio.get_running_loop().create_future()

        def moved(results: list[WriteResult]) -> None:
            if not fut.done():
                fut.set_result(results)

        call = Call(moved, 0)
        now = self._clock()
        for run in rd.plan_runs(items, True, self._options.read_gap, self._options.max_read_bytes):
            outcomes, n = await self._reads.read_run(seg, run, True)
            self._stats.device_bytes_read += n
            for o in outcomes:
                if o.status != rd.OK or o.header is None or o.payload is None:
                    continue  # a damaged record is found and dropped by the next read of it
                h, r = o.header, int(rows[o.pos])
                if idx.seg[r] != seg.id or idx.off[r] != items[o.pos].offset:
                    continue
                rec = FlashRecord(h.bucket.decode(), h.key.decode(), bytes(o.payload), float(idx.exp[r]),
                                  h.created, h.meta, h.payload_xxh3)
                _reason, item = self._appends.pending_item(rec, now, call, (seg.id, items[o.pos].offset))
                if item is not None:
                    recs.append(item)
        if not recs:
            return 0
        taken = self._appends.submit_moves(recs, call)
        if not call.remaining:
            return 0
        self._stats.compacted_bytes += sum(r.nbytes for r, t in zip(recs, taken) if t)
        results = await fut
        return sum(1 for r in results if r.stored)

    def _trim_dead_log(self) -> None:
        """Rewrite the dead log without the entries of segments that are gone (on the writer thread)."""
        writer = self._appends.writer
        assert writer is not None
        ids = np.array(self._segments.ids(), np.uint32)
        directory = self._health.path

        def trim() -> int:
            keys = load_dead(directory)
            keep = keys[np.isin((keys >> np.uint64(32)).astype(np.uint32), ids)]
            writer.rewrite_dead(keep)
            return int(keep.size)

        def done(result: object, exc: BaseException | None) -> None:
            if exc is None and isinstance(result, int):
                self._appends.dead_entries = result
            elif isinstance(exc, OSError):
                self._health.io_error("dead log", exc)

        self._appends.dead_entries = 0  # not again until it has grown back
        writer.control(trim, done)
