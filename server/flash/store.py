"""FlashStore: the facade the engine uses. Owned by one asyncio event loop; see the package docstring.

The store is its parts, each with its own state (one concept per module):

- :class:`.options.FlashOptions`: the settings, validated, and what follows from them;
- :class:`.health.Health`: the counters and whether the store is degraded;
- :class:`.buckets.BucketTable`: bucket names <-> ids, seeds, floors, per-bucket counters;
- :class:`.segment_table.SegmentTable`: the segment files, their live figures, the space they take;
- :class:`.catalog.Catalog`: the index by bucket and key (lookups, touch, delete);
- :class:`.appends.Appends`: appends, the writer thread (:mod:`.writer`) and what it reports back;
- :class:`.reads.Reads`: reads on the reader threads (:mod:`.reader`);
- :class:`.listing.Listing`: key listings;
- :class:`.housekeeping.Housekeeper`: expiry, eviction, compaction, dead-log trimming.

This class wires them together, owns the open/close lifecycle and keeps the API in one place.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .appends import Appends, DoneCallback
from .buckets import BucketTable
from .catalog import Catalog
from .health import Health
from .housekeeping import Housekeeper, HousekeepReport
from .index import FlashIndex
from .listing import LIST_CACHE_IDLE, Listing
from .options import MiB, FlashOptions
from .osutil import lock_file, raise_fd_limit, trim_heap
from .reads import Reads, RemoveListener
from .recovery import recover, wipe
from .segment_table import SegmentTable
from .types import CLOSED, BucketStats, Entry, FlashBlock, FlashMeta, FlashRecord, FlashStats, RecoveryReport, Removal

__all__ = ["LIST_CACHE_IDLE", "DoneCallback", "FlashStore", "HousekeepReport", "RemoveListener"]

log = logging.getLogger("ctxstore.flash")


class FlashStore:
    """A node's flash tier: blocks in segment files under ``path``, their index in RAM.

    Create it, ``await open()``, then use it from the same event loop. See the package docstring for the
    API and its guarantees, :class:`.options.FlashOptions` for the keyword arguments."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        capacity_bytes: int,
        *,
        segment_bytes: int = 64 * MiB,
        batch_bytes: int = 8 * MiB,
        queue_bytes: int = 256 * MiB,
        max_open_segments: int = 4,
        seal_idle: float = 10.0,
        readers: int = 4,
        max_read_bytes: int = 8 * MiB,
        read_gap: int = 256 * 1024,
        read_buffer_bytes: int = 64 * MiB,
        window_divisor: float = 16.0,
        min_window: int = 64,
        compact_below: float = 0.5,
        compact_bytes: int | None = None,
        rewrite_hot_bytes: int = 0,
        expiry_sweep: int = 65536,
        direct_io: bool = True,
        clock: Callable[[], float] = time.time,
        on_remove: RemoveListener | None = None,
    ) -> None:
        self.options = o = FlashOptions(
            capacity_bytes, segment_bytes=segment_bytes, batch_bytes=batch_bytes, queue_bytes=queue_bytes,
            max_open_segments=max_open_segments, seal_idle=seal_idle, readers=readers,
            max_read_bytes=max_read_bytes, read_gap=read_gap, read_buffer_bytes=read_buffer_bytes,
            window_divisor=window_divisor, min_window=min_window, compact_below=compact_below,
            compact_bytes=compact_bytes, rewrite_hot_bytes=rewrite_hot_bytes, expiry_sweep=expiry_sweep,
            direct_io=direct_io)
        self.path = Path(path)
        self.clock = clock
        self.on_remove = on_remove
        self.manifest: dict[str, object] | None = None
        self.recovery: RecoveryReport | None = None
        self._health = Health(self.path, o.capacity_bytes)
        self._stats = self._health.stats
        self._buckets = BucketTable()
        self._segments = SegmentTable(o.capacity_bytes, self._health, o.direct_io)
        self._catalog = Catalog(self._buckets, self._segments, clock, self._log_dead_keys)
        self._appends = Appends(self.path, o, clock, self._health, self._buckets, self._segments, self._catalog,
                                self._need_space)
        self._reads = Reads(o, self._health, self._buckets, self._segments, self._catalog, self._report)
        self._listing = Listing(clock, self._buckets, self._segments, self._catalog, self._reads)
        self._housekeeper = Housekeeper(o, clock, self._health, self._buckets, self._segments, self._catalog,
                                        self._appends, self._reads, self._listing, self._report,
                                        lambda: self.on_remove is not None)
        self._lock_fd = -1
        self._open = False
        self._closing = False
        self._tasks: set[asyncio.Future[Any]] = set()

    @property
    def index(self) -> FlashIndex:
        """The RAM index (see :mod:`.index`)."""
        return self._catalog.index

    # ================================================================================ lifecycle

    async def open(self, *, reset: bool = False) -> RecoveryReport:
        """Take the directory (created if needed; one process at a time), rebuild the index, start the writer.

        ``reset`` deletes whatever the directory held first. Returns the recovery report; also in ``stats()``."""
        o = self.options
        loop = asyncio.get_running_loop()
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock_fd = lock_file(self.path / "LOCK")
        raise_fd_limit(o.capacity_bytes // o.segment_bytes + 256)  # one read descriptor per segment
        if reset:
            await loop.run_in_executor(None, wipe, self.path)
        rec = await loop.run_in_executor(None, recover, self.path, self.clock(), o.direct_io)
        for name in rec.buckets:
            self._buckets.id(name)
        self._buckets.floors = dict(rec.floors)
        self._appends.dead_entries = rec.dead_log_entries
        self._segments.install(rec.segments, o.meta_reserve)
        self._catalog.install(rec)
        rec.release_arrays()
        trim_heap()  # recovery's temporaries were several times the index: give them back to the OS
        rec.report.reset = reset
        self.recovery = self._stats.recovery = rec.report
        self.manifest = rec.report.manifest
        self._reads.start(loop)
        self._appends.start(loop, rec.next_segment, rec.next_seq)
        self._open = True
        self._health.check_directory()  # a read-only directory serves what it holds, degraded from the start
        r = rec.report
        log.info("flash: %s: recovered %d blocks (%.1f MiB) from %d segments in %.2f s "
                 "(%d sealed, %d tails scanned, %d torn/corrupt records discarded, %d expired)",
                 self.path, r.blocks, r.bytes / MiB, r.segments, r.seconds, r.sealed_segments, r.tail_segments,
                 r.discarded_records, r.expired)
        return r

    async def close(self) -> None:
        """Write what is queued, seal the open segments, stop the threads, release the directory."""
        if not self._open:
            return
        self._closing = True
        await self._appends.stop()
        for task in list(self._tasks):
            task.cancel()
        self._reads.stop()
        self._segments.close_all()
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1
        self._open = False

    async def flush(self) -> None:
        """Wait until every record appended so far has been written (or failed)."""
        await self._appends.flush()

    # ================================================================================ writing

    def append(self, records: Sequence[FlashRecord], done: DoneCallback | None = None, *,
               force: bool = False) -> list[str | None]:
        """Queue records for the writer; returns at once, per record ``None`` (accepted) or why it was refused.
        ``force``: whatever the queue's byte bound, for a caller that bounds what it queues itself (the engine's
        tier counts payloads against ``--disk-queue``; this bound counts whole records, headers included, and
        would refuse some of what the tier admitted).

        ``done`` is called on the event loop, once, with a WriteResult for every accepted record, when all
        of them are written: ``stored=True`` means readable from flash from then on, so the caller may drop
        its RAM copy; until then it keeps serving them itself. A later append, delete or drop_bucket of the
        same key before the write finishes makes it ``stored=False, reason="superseded"``."""
        if not self._open or self._closing:
            return [CLOSED] * len(records)
        return self._appends.append(records, done, force)

    # ================================================================================ the index

    def lookup(self, bucket: str, key: str) -> Entry | None:
        """The index entry of a live block, or None. No I/O."""
        return self._catalog.lookup(bucket, key)

    def lookup_many(self, bucket: str, keys: Sequence[str]) -> list[Entry | None]:
        """Vectorized lookup (no I/O): per key its Entry, or None if absent or expired."""
        return self._catalog.lookup_many(bucket, keys)

    def present_many(self, bucket: str, keys: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """(present, sizes) as numpy arrays: the cheapest form of lookup_many for bulk lookups."""
        return self._catalog.present_many(bucket, keys)

    def contains(self, bucket: str, key: str) -> bool:
        """In the index or queued for writing (what ``delete`` must be told about)."""
        if bucket not in self._buckets:
            return False
        return self._appends.contains(self._buckets.fingerprint(bucket, key)) or self._catalog.row(bucket, key) >= 0

    def touch(self, bucket: str, key: str, expires_at: float) -> bool:
        """Set a block's expiry in the index (not persisted: after a restart the written expiry applies)."""
        return self.touch_many(bucket, [key], expires_at) == 1

    def touch_many(self, bucket: str, keys: Sequence[str], expires_at: float) -> int:
        return self._catalog.touch_many(bucket, keys, expires_at)

    def delete(self, bucket: str, key: str) -> bool:
        """Forget a block (and cancel its queued write). Logged in the dead log so a restart does not revive it."""
        return self.delete_many(bucket, [key]) > 0

    def delete_many(self, bucket: str, keys: Sequence[str]) -> int:
        if bucket not in self._buckets:
            return 0
        cancelled = self._appends.cancel(bucket, keys)
        found = self._catalog.delete_many(bucket, keys)
        return int((found | cancelled).sum())

    def drop_bucket(self, bucket: str) -> int:
        """Forget every block of a bucket at once: one floor in the state file, no per-block work on disk."""
        bid = self._buckets.get(bucket)
        if bid is None:
            return 0
        self._appends.cancel_bucket(bid)
        n = self._catalog.drop_bucket(bid)
        self._buckets.floors[bucket] = self._appends.next_seq
        self._spawn(self._save_state())
        return n

    def buckets(self) -> list[str]:
        """Buckets that have blocks on flash (compare with the engine's manifest after a restart)."""
        return [self._buckets.names[b] for b in self._catalog.bucket_ids()]

    # ================================================================================ reading

    async def read(self, bucket: str, key: str) -> FlashBlock | None:
        """A verified block, or None (absent, expired, or failed verification: then dropped and counted)."""
        return (await self.read_many(bucket, [key]))[0]

    async def read_many(self, bucket: str, keys: Sequence[str]) -> list[FlashBlock | None]:
        """Verified blocks in the order of ``keys`` (None = miss). Adjacent records are read together."""
        if not self._open:
            return [None] * len(keys)
        return await self._reads.read(bucket, keys, True)

    async def read_meta(self, bucket: str, key: str) -> FlashMeta | None:
        """A block's verified header (HEAD): reads only the header, not the payload."""
        return (await self.read_meta_many(bucket, [key]))[0]

    async def read_meta_many(self, bucket: str, keys: Sequence[str]) -> list[FlashMeta | None]:
        if not self._open:
            return [None] * len(keys)
        return await self._reads.read(bucket, keys, False)

    def trim_buffers(self, keep_bytes: int) -> int:
        """Give back kept read buffers until at most ``keep_bytes`` are kept (the caller's memory is short);
        returns the bytes still kept (``stats().buffer_bytes``)."""
        return self._reads.buffers.trim(keep_bytes)

    # ================================================================================ listing

    async def list_keys(self, bucket: str, start_after: str = "", limit: int = 1000) -> list[str]:
        """Live keys of ``bucket`` greater than ``start_after``, in code-point order, at most ``limit``.

        Keys are not in RAM: this reads the keys section of the footer of every segment that holds the
        bucket (44 bytes + the key per record, from the page cache when warm) and sorts them. The sorted
        list of the last bucket listed is kept until that bucket changes, so paging through a quiet bucket
        costs one scan."""
        return await self._listing.list_keys(bucket, start_after, limit)

    async def iter_keys(self, bucket: str, start_after: str = "", page: int = 1000) -> AsyncIterator[str]:
        """Async iterator over list_keys pages."""
        while True:
            keys = await self.list_keys(bucket, start_after, page)
            for k in keys:
                yield k
            if len(keys) < page:
                return
            start_after = keys[-1]

    async def keys_by_segment(self, bucket: str) -> AsyncIterator[list[str]]:
        """Live keys of ``bucket``, one segment's at a time, in no order: for a walk over every key (such as
        announcing what a restart recovered) that should hold no more than one segment's keys at once."""
        async for keys in self._listing.keys_by_segment(bucket):
            yield keys

    # ================================================================================ housekeeping

    async def housekeep(self) -> HousekeepReport:
        """Bounded background work; call it every second or so. Drops expired segments whole, sweeps expired
        entries (at most ``expiry_sweep``), evicts the oldest segments while free space is below two
        segments, compacts one mostly-dead segment (at most ``compact_bytes``), trims the dead log."""
        if not self._open or self._closing:
            return HousekeepReport()
        return await self._housekeeper.housekeep()

    def _need_space(self, need: int) -> None:
        self._spawn(self._housekeeper.make_room(need))

    # ================================================================================ manifest

    async def save_manifest(self, manifest: dict[str, object]) -> bool:
        """Replace the manifest atomically (with the bucket floors). False if the device refused."""
        self.manifest = manifest
        return await self._save_state()

    async def _save_state(self) -> bool:
        return await self._appends.save_state(self.manifest, self._buckets.floors)

    # ================================================================================ stats

    @property
    def degraded(self) -> str | None:
        """Why the store stopped writing (None while healthy)."""
        return self._health.degraded

    def stats(self) -> FlashStats:
        """Totals and per-bucket figures; blocks and bytes count live (unexpired) blocks."""
        s = self._stats
        idx = self._catalog.index
        rows = self._catalog.live_rows(self.clock())
        b = idx.bkt[rows]
        n = len(self._buckets.names)
        counts = np.bincount(b, minlength=n)
        sizes = np.bincount(b, weights=idx.plen[rows], minlength=n)
        s.blocks = int(rows.size)
        s.bytes = int(sizes.sum())
        s.segments = len(self._segments)
        s.open_segments = self._segments.open_count()
        s.disk_bytes = self._segments.space.used
        s.index_bytes = idx.nbytes()
        s.buffer_bytes = self._reads.buffers.retained
        s.queued_bytes = self._appends.queued_bytes
        s.degraded = self._health.degraded
        s.buckets = {}
        for bid, name in enumerate(self._buckets.names):
            st = self._buckets.stat_if_any(bid)
            if not counts[bid] and st is None:
                continue
            st = st or BucketStats()
            st.blocks, st.bytes = int(counts[bid]), int(sizes[bid])
            s.buckets[name] = st
        return s

    # ================================================================================ helpers

    def _log_dead_keys(self, keys: np.ndarray) -> None:
        self._appends.log_dead_keys(keys)

    def _report(self, removals: list[Removal]) -> None:
        if removals and self.on_remove is not None:
            try:
                self.on_remove(removals)
            except Exception:
                log.exception("flash: on_remove listener failed")

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
