"""FlashStore: the facade the engine uses. Owned by one asyncio event loop; see the package docstring."""

from __future__ import annotations

import asyncio
import bisect
import ctypes
import errno
import fcntl
import functools
import itertools
import logging
import math
import os
import resource
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from . import reader as rd
from .format import BLOCK, FOOTER_ENTRY, MAX_BUCKET, MAX_KEY, TRAILER, bucket_seed, fingerprint, record_size
from .index import HOT, FlashIndex
from .recovery import Recovered, recover, wipe
from .segments import open_reader, read_footer_index, read_footer_keys, read_trailer
from .state import dead_keys, encode_state
from .types import (
    ALREADY_EXPIRED,
    CLOSED,
    CORRUPT,
    DEGRADED,
    EVICTED,
    EXPIRED,
    QUEUE_FULL,
    SUPERSEDED,
    TOO_LARGE,
    BucketStats,
    Entry,
    FlashBlock,
    FlashMeta,
    FlashRecord,
    FlashStats,
    Location,
    RecoveryReport,
    Removal,
    WriteResult,
)
from .writer import OpenedSegment, Pending, SpaceAccount, Writer, Written

log = logging.getLogger("ctxstore.flash")

MiB = 1 << 20
LIST_CACHE_IDLE = 30.0  # seconds without a listing call after which the sorted key list is let go
RemoveListener = Callable[[list[Removal]], None]
DoneCallback = Callable[[list[WriteResult]], None]


@dataclass
class _Seg:
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


@dataclass
class _Call:
    done: DoneCallback | None
    remaining: int
    results: list[WriteResult] = field(default_factory=list)


@dataclass
class HousekeepReport:
    """What one housekeep() call did."""

    expired_segments: int = 0
    expired_blocks: int = 0
    evicted_segments: int = 0
    evicted_blocks: int = 0
    compacted_segments: int = 0
    compacted_blocks: int = 0


class FlashStore:
    """A node's flash tier: blocks in segment files under ``path``, their index in RAM.

    Create it, ``await open()``, then use it from the same event loop. See the package docstring for the
    API and its guarantees."""

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
        if segment_bytes % BLOCK or segment_bytes < 16 * BLOCK:
            raise ValueError("segment_bytes must be a multiple of 4 KiB and at least 64 KiB")
        self.path = Path(path)
        self.capacity_bytes = int(capacity_bytes)
        self.segment_bytes = segment_bytes
        self.meta_reserve = max(MiB, self.capacity_bytes // 1024)
        slots = (self.capacity_bytes - self.meta_reserve) // segment_bytes
        if slots < 3:
            raise ValueError("capacity_bytes must hold at least 3 segments plus 1 MiB for the manifest")
        self.max_open_segments = max(1, min(max_open_segments, slots - 2))
        self.batch_bytes = batch_bytes
        self.queue_bytes = queue_bytes
        self.seal_idle = seal_idle
        self.readers = readers
        self.max_read_bytes = max_read_bytes
        self.read_gap = read_gap
        self._buffers = rd.ReadBuffers(read_buffer_bytes)  # kept between reads (RAM: see stats().buffer_bytes)
        self.window_divisor = window_divisor
        self.min_window = min_window
        self.compact_below = compact_below
        self.compact_bytes = segment_bytes if compact_bytes is None else compact_bytes
        self.rewrite_hot_bytes = rewrite_hot_bytes
        self.expiry_sweep = expiry_sweep
        self.direct_io = direct_io
        self.clock = clock
        self.on_remove = on_remove
        self.max_record_bytes = segment_bytes - 4 * BLOCK - TRAILER

        self.index = FlashIndex()
        self.manifest: dict[str, object] | None = None
        self.recovery: RecoveryReport | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._writer: Writer | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._space = SpaceAccount(self.capacity_bytes)
        self._segs: dict[int, _Seg] = {}
        self._buckets: dict[str, int] = {}
        self._bucket_names: list[str] = []
        self._seeds: dict[str, int] = {}
        self._floors: dict[str, int] = {}
        self._pending: dict[int, tuple[int, int]] = {}  # fp -> (ticket, bucket id) of the latest queued append
        self._tickets = 0
        self._bstats: dict[int, BucketStats] = {}
        self._stats = FlashStats(capacity_bytes=self.capacity_bytes)
        self._degraded: str | None = None
        self._lock_fd = -1
        self._open = False
        self._closing = False
        self._making_room = False
        self._dead_entries = 0
        self._tasks: set[asyncio.Future[Any]] = set()
        self._idle = asyncio.Event()
        self._inflight = 0  # records queued or being written
        # The sorted keys of the last bucket listed, and when they were last used: paging through a quiet bucket
        # costs one scan, and housekeep() lets go of them (a key is ~80 bytes of RAM) once nobody pages.
        self._list_cache: tuple[str, int, list[str]] | None = None
        self._list_cache_used = 0.0
        self._bucket_version: dict[int, int] = {}

    # ================================================================================ lifecycle

    async def open(self, *, reset: bool = False) -> RecoveryReport:
        """Take the directory (created if needed; one process at a time), rebuild the index, start the writer.

        ``reset`` deletes whatever the directory held first. Returns the recovery report; also in ``stats()``."""
        loop = self._loop = asyncio.get_running_loop()
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock_fd = _lock_file(self.path / "LOCK")
        _raise_fd_limit(self.capacity_bytes // self.segment_bytes + 256)  # one read descriptor per segment
        if reset:
            await loop.run_in_executor(None, wipe, self.path)
        rec = await loop.run_in_executor(None, recover, self.path, self.clock(), self.direct_io)
        self._install(rec)
        rec.release_arrays()
        _trim_heap()  # recovery's temporaries were several times the index: give them back to the OS
        rec.report.reset = reset
        self.recovery = self._stats.recovery = rec.report
        self.manifest = rec.report.manifest
        self._pool = ThreadPoolExecutor(max_workers=self.readers, thread_name_prefix="ctxstore-flash-read")
        self._writer = Writer(
            self.path, segment_bytes=self.segment_bytes, batch_bytes=self.batch_bytes, queue_bytes=self.queue_bytes,
            max_open=self.max_open_segments, seal_idle=self.seal_idle, space=self._space, post=self._post,
            first_segment=rec.next_segment, first_seq=rec.next_seq, direct=self.direct_io)
        self._writer.start()
        self._open = True
        self._idle.set()
        self._check_directory()  # a read-only directory serves what it holds, degraded from the start
        r = rec.report
        log.info("flash: %s: recovered %d blocks (%.1f MiB) from %d segments in %.2f s "
                 "(%d sealed, %d tails scanned, %d torn/corrupt records discarded, %d expired)",
                 self.path, r.blocks, r.bytes / MiB, r.segments, r.seconds, r.sealed_segments, r.tail_segments,
                 r.discarded_records, r.expired)
        return r

    def _install(self, rec: Recovered) -> None:
        for name in rec.buckets:
            self._bucket_id(name)
        self._floors = dict(rec.floors)
        self._dead_entries = rec.dead_log_entries
        self.index = FlashIndex(int(rec.fp.size * 1.25) + 1024)
        self.index.bulk_load(rec.fp, rec.seg, rec.off, rec.plen, rec.hlen, rec.exp, rec.bkt)
        self._space.charge(self.meta_reserve)
        for s in rec.segments:
            seg = _Seg(s.segment_id, s.path, s.header.salt, s.header.window_hi, s.size, s.fd, sealed=True,
                       data_bytes=max(0, s.size - BLOCK))
            self._segs[seg.id] = seg
            self._space.charge(s.size)
        if rec.fp.size:
            rlen = rec.hlen.astype(np.int64) + rec.plen
            ids, inv = np.unique(rec.seg, return_inverse=True)
            counts = np.bincount(inv)
            sums = np.bincount(inv, weights=rlen)
            maxe = np.full(ids.size, -np.inf)
            np.maximum.at(maxe, inv, rec.exp)
            for sid, c, b, m in zip(ids.tolist(), counts.tolist(), sums.tolist(), maxe.tolist()):
                seg = self._segs[sid]
                seg.live, seg.live_bytes, seg.max_exp = c, int(b), m

    async def close(self) -> None:
        """Write what is queued, seal the open segments, stop the threads, release the directory."""
        if not self._open:
            return
        self._closing = True
        writer = self._writer
        assert writer is not None and self._loop is not None
        writer.stop()
        await self._loop.run_in_executor(None, writer.join)
        await asyncio.sleep(0)  # let the writer's last posts run
        for task in list(self._tasks):
            task.cancel()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        for seg in self._segs.values():
            _close_quietly(seg.rfd)
        self._segs.clear()
        self._buffers.clear()
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1
        self._open = False

    async def flush(self) -> None:
        """Wait until every record appended so far has been written (or failed)."""
        while self._inflight:
            self._idle.clear()
            try:
                await asyncio.wait_for(self._idle.wait(), 1.0)
            except TimeoutError:
                if self._writer is None or not self._writer.is_alive():
                    return

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
        if self._degraded is not None:
            self._stats.refused += len(records)
            return [DEGRADED] * len(records)
        now = self.clock()
        out: list[str | None] = []
        items: list[Pending] = []
        call = _Call(done, 0)
        for rec in records:
            reason, item = self._pending_item(rec, now, call)
            out.append(reason)
            if item is not None:
                items.append(item)
        if items:
            assert self._writer is not None
            taken = self._writer.submit(items, force=force)
            j = 0
            for i, reason in enumerate(out):
                if reason is None:
                    if taken[j]:
                        item = items[j]
                        self._pending[item.fp] = (item.ticket, self._buckets[item.record.bucket])
                        call.remaining += 1
                        self._inflight += 1
                    else:
                        out[i] = QUEUE_FULL if self._degraded is None else DEGRADED
                    j += 1
        self._stats.refused += sum(r is not None for r in out)
        return out

    def _pending_item(self, rec: FlashRecord, now: float, call: _Call | None,
                      move_from: tuple[int, int] | None = None) -> tuple[str | None, Pending | None]:
        b, k = rec.bucket.encode(), rec.key.encode()
        if len(b) > MAX_BUCKET or len(k) > MAX_KEY:
            return TOO_LARGE, None
        if rec.expires_at <= now:
            return ALREADY_EXPIRED, None
        _, rlen = record_size(b, k, rec.metadata, len(rec.payload))
        if rlen + FOOTER_ENTRY.itemsize + len(k) + len(b) > self.max_record_bytes:
            return TOO_LARGE, None
        self._bucket_id(rec.bucket)
        self._tickets += 1
        fp = fingerprint(self._seed(rec.bucket), k)
        return None, Pending(rec, self._tickets, b, k, fp, self._window(rec.expires_at, now), rlen, call, move_from)

    def _window(self, expires_at: float, now: float) -> tuple[int, int]:
        """Records expiring in the same window share segments, so most segments expire whole."""
        ttl = max(expires_at - now, 1.0)
        width = max(self.min_window, 1 << max(0, math.ceil(math.log2(ttl / self.window_divisor))))
        return width, int(expires_at // width)

    # -------------------------------------------------------------------- messages from the writer

    def _post(self, kind: str, *args: Any) -> None:
        """Called on the writer thread: hand a message to the event loop."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self._on_message, kind, args)
        except RuntimeError:  # the loop closed under us: nothing left to tell
            pass

    def _on_message(self, kind: str, args: tuple[Any, ...]) -> None:
        try:
            if kind == "written":
                self._on_written(args[0])
            elif kind == "opened":
                self._on_opened(args[0])
            elif kind == "sealed":
                self._on_sealed(args[0], args[1])
            elif kind == "wrote":
                self._stats.bytes_written += args[0]
            elif kind == "need_space":
                self._spawn(self._make_room(args[0]))
            elif kind == "failed":
                self._stats.write_errors += 1
                self._set_degraded(args[0])
            elif kind == "control":
                done, result, exc = args
                done(result, exc)
        except Exception:  # a bug here must not kill the loop's callback machinery silently
            log.exception("flash: handling %s failed", kind)

    def _on_opened(self, o: OpenedSegment) -> None:
        try:
            rfd = open_reader(o.path, self.direct_io)
        except OSError as e:
            self._set_degraded(f"open for reading: {e}")
            rfd = -1
        self._segs[o.segment_id] = _Seg(o.segment_id, o.path, o.salt, o.window_hi, o.reserved, rfd)

    def _on_sealed(self, sid: int, size: int) -> None:
        seg = self._segs.get(sid)
        if seg is None:
            return
        if size:
            seg.sealed = True
            seg.charged = size
        if seg.sealed and seg.live == 0:
            self._drop_segment(seg)

    def _on_written(self, results: list[Written]) -> None:
        ok: list[Written] = []
        dead: list[tuple[int, int]] = []
        for w in results:
            item = w.item
            if item.move_from is None:
                self._inflight -= 1
            if w.error is not None:
                if item.move_from is None and self._pending.get(item.fp, (0, 0))[0] == item.ticket:
                    del self._pending[item.fp]
                self._finish(item, WriteResult(item.record, False, w.error))
                continue
            self._stats.writes += 1
            seg = self._segs.get(w.segment)
            if seg is not None:
                seg.data_bytes += item.nbytes
            valid = seg is not None
            if item.move_from is None:
                valid = valid and self._pending.get(item.fp, (0, 0))[0] == item.ticket
                if valid:
                    del self._pending[item.fp]
            else:
                rows, _ = self.index.find(np.array([item.fp], np.uint64))
                r = int(rows[0])
                valid = valid and r >= 0 and (int(self.index.seg[r]), int(self.index.off[r])) == item.move_from
            if valid:
                ok.append(w)
            else:
                dead.append((w.segment, w.offset))
                self._finish(item, WriteResult(item.record, False, SUPERSEDED))
        if ok:
            # the same key twice in one batch: the later one wins, the earlier one is dead on disk
            last: dict[int, Written] = {}
            for w in ok:
                prev = last.get(w.item.fp)
                if prev is not None:
                    dead.append((prev.segment, prev.offset))
                    self._finish(prev.item, WriteResult(prev.item.record, False, SUPERSEDED))
                last[w.item.fp] = w
            batch = list(last.values())
            fps = np.array([w.item.fp for w in batch], np.uint64)
            segs = np.array([w.segment for w in batch], np.uint32)
            offs = np.array([w.offset for w in batch], np.uint32)
            plen = np.array([len(w.item.record.payload) for w in batch], np.uint32)
            hlen = np.array([w.header_len for w in batch], np.uint32)
            exp = np.array([w.item.record.expires_at for w in batch], np.float64)
            bkt = np.array([self._buckets[w.item.record.bucket] for w in batch], np.uint32)
            _where, oseg, ooff, obytes = self.index.put(fps, segs, offs, plen, hlen, exp, bkt)
            for s, o, n in zip(oseg.tolist(), ooff.tolist(), obytes.tolist()):
                dead.append((s, o))
                self._unlive(s, n)
            for w in batch:
                seg = self._segs[w.segment]
                rec = w.item.record
                seg.live += 1
                seg.live_bytes += w.item.nbytes
                seg.max_exp = max(seg.max_exp, rec.expires_at)
                bid = self._buckets[rec.bucket]
                self._bucket_changed(bid)
                if w.item.move_from is None:
                    self._bstat(bid).bytes_written += len(rec.payload)
                self._finish(w.item, WriteResult(rec, True, None,
                                                 Location(w.segment, w.offset, w.header_len, len(rec.payload))))
        self._log_dead(dead)
        if self._inflight == 0:
            self._idle.set()

    def _finish(self, item: Pending, result: WriteResult) -> None:
        call = item.call
        if not isinstance(call, _Call):
            return
        call.results.append(result)
        call.remaining -= 1
        if call.remaining == 0 and call.done is not None:
            try:
                call.done(call.results)
            except Exception:
                log.exception("flash: append callback failed")

    # ================================================================================ the index

    def lookup(self, bucket: str, key: str) -> Entry | None:
        """The index entry of a live block, or None. No I/O."""
        r = self._row(bucket, key)
        if r < 0:
            return None
        idx = self.index
        return _new_entry((int(idx.plen[r]), float(idx.exp[r]), int(idx.seg[r]), int(idx.off[r]), int(idx.hlen[r])))

    def _row(self, bucket: str, key: str) -> int:
        """:meth:`_rows` for one key, without arrays (the engine asks about one key on every write)."""
        bid = self._buckets.get(bucket)
        if bid is None:
            return -1
        r = self.index.find_one(xxhash.xxh3_64_intdigest(key.encode(), self._seed(bucket)))
        if r < 0 or int(self.index.bkt[r]) != bid or not float(self.index.exp[r]) > self.clock():
            return -1
        return r

    def lookup_many(self, bucket: str, keys: Sequence[str]) -> list[Entry | None]:
        """Vectorized lookup (no I/O): per key its Entry, or None if absent or expired."""
        rows = self._rows(bucket, keys)
        out: list[Entry | None] = [None] * len(keys)
        idx = self.index
        hit = np.flatnonzero(rows >= 0)
        r = rows[hit]
        # tuple.__new__ straight from the columns: a third of the cost of calling Entry(...) per key
        made = map(_new_entry, zip(idx.plen[r].tolist(), idx.exp[r].tolist(), idx.seg[r].tolist(),
                                   idx.off[r].tolist(), idx.hlen[r].tolist()))
        for i, e in zip(hit.tolist(), made):
            out[i] = e
        return out

    def present_many(self, bucket: str, keys: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """(present, sizes) as numpy arrays: the cheapest form of lookup_many for bulk lookups."""
        rows = self._rows(bucket, keys)
        present = rows >= 0
        sizes = np.zeros(len(keys), np.int64)
        sizes[present] = self.index.plen[rows[present]]
        return present, sizes

    def contains(self, bucket: str, key: str) -> bool:
        """In the index or queued for writing (what ``delete`` must be told about)."""
        fp = self._fp(bucket, key)
        if fp is None:
            return False
        return fp in self._pending or self._row(bucket, key) >= 0

    def _rows(self, bucket: str, keys: Sequence[str]) -> np.ndarray:
        bid = self._buckets.get(bucket)
        if bid is None or not keys:
            return np.full(len(keys), -1, np.int64)
        seed = self._seed(bucket)
        # == format.fingerprint, inlined and mapped in C: hashing the keys is most of a lookup's cost
        fps = np.array(list(map(xxhash.xxh3_64_intdigest, map(str.encode, keys), itertools.repeat(seed))),
                       np.uint64)
        rows, _ = self.index.find(fps)
        hit = rows >= 0
        r = rows[hit]
        good = (self.index.bkt[r] == bid) & (self.index.exp[r] > self.clock())
        rows[np.flatnonzero(hit)[~good]] = -1
        return rows

    def _fp(self, bucket: str, key: str) -> int | None:
        if bucket not in self._buckets:
            return None
        return fingerprint(self._seed(bucket), key.encode())

    def touch(self, bucket: str, key: str, expires_at: float) -> bool:
        """Set a block's expiry in the index (not persisted: after a restart the written expiry applies)."""
        return self.touch_many(bucket, [key], expires_at) == 1

    def touch_many(self, bucket: str, keys: Sequence[str], expires_at: float) -> int:
        rows = self._rows(bucket, keys)
        rows = rows[rows >= 0]
        self.index.exp[rows] = expires_at
        for sid in np.unique(self.index.seg[rows]).tolist():
            seg = self._segs.get(sid)
            if seg is not None:
                seg.max_exp = max(seg.max_exp, expires_at)
        return int(rows.size)

    def delete(self, bucket: str, key: str) -> bool:
        """Forget a block (and cancel its queued write). Logged in the dead log so a restart does not revive it."""
        return self.delete_many(bucket, [key]) > 0

    def delete_many(self, bucket: str, keys: Sequence[str]) -> int:
        bid = self._buckets.get(bucket)
        if bid is None:
            return 0
        seed = self._seed(bucket)
        cancelled = np.array([self._pending.pop(fingerprint(seed, k.encode()), None) is not None for k in keys],
                             bool)
        rows = self._rows(bucket, keys)
        hit = rows >= 0
        found = np.unique(rows[hit])
        if found.size:
            self._remove_rows(found, log_dead=True)
            self._bucket_changed(bid)
        return int((hit | cancelled).sum())

    def drop_bucket(self, bucket: str) -> int:
        """Forget every block of a bucket at once: one floor in the state file, no per-block work on disk."""
        bid = self._buckets.get(bucket)
        if bid is None:
            return 0
        rows = self.index.rows_of_bucket(bid)
        for fp in [fp for fp, (_t, b) in self._pending.items() if b == bid]:
            del self._pending[fp]
        self._remove_rows(rows, log_dead=False)
        self._bucket_changed(bid)
        assert self._writer is not None
        self._floors[bucket] = self._writer.next_seq
        self._save_state_soon()
        return int(rows.size)

    def buckets(self) -> list[str]:
        """Buckets that have blocks on flash (compare with the engine's manifest after a restart)."""
        used = np.unique(self.index.bkt[self.index.used_rows()]).tolist()
        return [self._bucket_names[b] for b in used]

    def _remove_rows(self, rows: np.ndarray, *, log_dead: bool) -> None:
        if rows.size == 0:
            return
        idx = self.index
        segs = idx.seg[rows].copy()
        rlen = idx.hlen[rows].astype(np.int64) + idx.plen[rows]
        if log_dead:
            self._log_dead_keys(dead_keys(segs, idx.off[rows]))
        idx.remove(rows)
        ids, inv = np.unique(segs, return_inverse=True)
        counts = np.bincount(inv)
        sums = np.bincount(inv, weights=rlen)
        for sid, c, b in zip(ids.tolist(), counts.tolist(), sums.tolist()):
            self._unlive(sid, int(b), c)

    def _unlive(self, sid: int, nbytes: int, count: int = 1) -> None:
        seg = self._segs.get(sid)
        if seg is None:
            return
        seg.live -= count
        seg.live_bytes -= nbytes
        if seg.live <= 0 and seg.sealed and not seg.removed:
            self._drop_segment(seg)

    # ================================================================================ reading

    async def read(self, bucket: str, key: str) -> FlashBlock | None:
        """A verified block, or None (absent, expired, or failed verification: then dropped and counted)."""
        return (await self.read_many(bucket, [key]))[0]

    async def read_many(self, bucket: str, keys: Sequence[str]) -> list[FlashBlock | None]:
        """Verified blocks in the order of ``keys`` (None = miss). Adjacent records are read together."""
        return await self._read(bucket, keys, True)

    async def read_meta(self, bucket: str, key: str) -> FlashMeta | None:
        """A block's verified header (HEAD): reads only the header, not the payload."""
        return (await self.read_meta_many(bucket, [key]))[0]

    async def read_meta_many(self, bucket: str, keys: Sequence[str]) -> list[FlashMeta | None]:
        return await self._read(bucket, keys, False)

    async def _read(self, bucket: str, keys: Sequence[str], with_payload: bool) -> list[Any]:
        out: list[Any] = [None] * len(keys)
        if not self._open:
            return out
        rows = self._rows(bucket, keys)
        idx = self.index
        by_seg: dict[int, list[rd.ReadItem]] = {}
        bucket_b = bucket.encode()
        for i in np.flatnonzero(rows >= 0).tolist():
            r = int(rows[i])
            by_seg.setdefault(int(idx.seg[r]), []).append(
                rd.ReadItem(i, int(idx.off[r]), int(idx.hlen[r]), int(idx.plen[r]), bucket_b, keys[i].encode()))
        self._stats.misses += int((rows < 0).sum())
        if not by_seg:
            return out
        loop = self._loop
        assert loop is not None and self._pool is not None
        futures = []
        gap = self.read_gap if with_payload else 0
        for sid, items in by_seg.items():
            seg = self._segs[sid]  # rows never outlive their segment
            for run in rd.plan_runs(items, with_payload, gap, self.max_read_bytes):
                seg.readers += 1
                fut = loop.run_in_executor(self._pool, rd.read_run, seg.rfd, seg.salt, run, with_payload, True,
                                           self._buffers)
                fut.add_done_callback(functools.partial(self._release_after, seg))
                futures.append((seg, run, fut))
        done = await asyncio.gather(*(f for _s, _r, f in futures), return_exceptions=True)
        bid = self._buckets[bucket]
        bs = self._bstat(bid)
        failed: list[tuple[int, int]] = []  # (position, segment)
        hot: list[int] = []
        for (seg, run, _f), res in zip(futures, done):
            if isinstance(res, BaseException):
                self._io_error("read", res)
                failed.extend((it.pos, seg.id) for it in run)
                continue
            outcomes, nread = res
            self._stats.device_bytes_read += nread
            for o in outcomes:
                if o.status == rd.OK:
                    assert o.header is not None
                    r = int(rows[o.pos])
                    h = o.header
                    value: FlashMeta
                    if with_payload:
                        assert o.payload is not None
                        value = FlashBlock(bucket, keys[o.pos], h.payload_len, h.payload_xxh3, h.created,
                                           float(idx.exp[r]), h.meta, o.payload)
                        bs.reads += 1
                        bs.bytes_read += o.header.payload_len
                        self._stats.reads += 1
                        self._stats.bytes_read += o.header.payload_len
                    else:
                        value = FlashMeta(bucket, keys[o.pos], h.payload_len, h.payload_xxh3, h.created,
                                          float(idx.exp[r]), h.meta)
                    out[o.pos] = value
                    hot.append(r)
                elif o.status == rd.MISMATCH:
                    self._stats.collisions += 1
                    self._stats.misses += 1
                else:
                    if o.status == rd.IO_FAILED:
                        self._io_error("read", OSError(errno.EIO, o.detail))
                    else:
                        log.warning("flash: %s/%s in segment %d failed verification: %s", bucket, keys[o.pos],
                                    seg.id, o.detail)
                    failed.append((o.pos, seg.id))
        if hot:
            self.index.flags[np.array(hot)] |= HOT
        if failed:
            self._drop_failed(bucket, keys, rows, failed)
        return out

    def trim_buffers(self, keep_bytes: int) -> int:
        """Give back kept read buffers until at most ``keep_bytes`` are kept (the caller's memory is short);
        returns the bytes still kept (``stats().buffer_bytes``)."""
        return self._buffers.trim(keep_bytes)

    def _drop_failed(self, bucket: str, keys: Sequence[str], rows: np.ndarray, failed: list[tuple[int, int]]) -> None:
        """Records that failed a read leave the index (if it still points at them) and are reported."""
        idx = self.index
        drop, removals = [], []
        for pos, sid in failed:
            r = int(rows[pos])
            fresh = self._rows(bucket, [keys[pos]])[0]
            if fresh == r and int(idx.seg[r]) == sid:
                drop.append(r)
                removals.append(Removal(bucket, keys[pos], CORRUPT))
        self._stats.misses += len(failed)
        if drop:
            self._stats.corrupt += len(drop)
            self._bstat(self._buckets[bucket]).corrupt += len(drop)
            self._remove_rows(np.array(drop, np.int64), log_dead=True)
            self._bucket_changed(self._buckets[bucket])
            self._report(removals)

    def _release_after(self, seg: _Seg, _fut: object) -> None:
        self._release(seg)

    def _release(self, seg: _Seg) -> None:
        seg.readers -= 1
        if seg.removed and seg.readers == 0:
            _close_quietly(seg.rfd)
            seg.rfd = -1

    # ================================================================================ listing

    async def list_keys(self, bucket: str, start_after: str = "", limit: int = 1000) -> list[str]:
        """Live keys of ``bucket`` greater than ``start_after``, in code-point order, at most ``limit``.

        Keys are not in RAM: this reads the keys section of the footer of every segment that holds the
        bucket (44 bytes + the key per record, from the page cache when warm) and sorts them. The sorted
        list of the last bucket listed is kept until that bucket changes, so paging through a quiet bucket
        costs one scan."""
        bid = self._buckets.get(bucket)
        if bid is None:
            return []
        version = self._bucket_version.get(bid, 0)
        cached = self._list_cache
        self._list_cache_used = self.clock()
        if cached is not None and cached[0] == bucket and cached[1] == version:
            keys = cached[2]
        else:
            keys = await self._scan_keys(bid)
            if self._bucket_version.get(bid, 0) == version:
                self._list_cache = (bucket, version, keys)
        i = bisect.bisect_right(keys, start_after)
        return keys[i:i + limit]

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
        bid = self._buckets.get(bucket)
        if bid is not None:
            async for keys in self._segment_keys(bid):
                yield keys

    async def _segment_keys(self, bid: int) -> AsyncIterator[list[str]]:
        idx = self.index
        rows = np.flatnonzero((idx.bkt[:idx._high] == bid) & (idx.seg[:idx._high] != 0xFFFFFFFF)
                              & (idx.exp[:idx._high] > self.clock()))
        for sid in np.unique(idx.seg[rows]).tolist():
            seg = self._segs.get(sid)
            if seg is None:
                continue
            srows = rows[idx.seg[rows] == sid]
            names = await self._keys_at(seg, srows)
            yield [bk[1] for bk in names.values() if bk[0] == self._bucket_names[bid]]

    async def _scan_keys(self, bid: int) -> list[str]:
        found: list[str] = []
        async for keys in self._segment_keys(bid):
            found.extend(keys)
        found.sort()
        return found

    async def _keys_at(self, seg: _Seg, rows: np.ndarray) -> dict[int, tuple[str, str]]:
        """(bucket, key) of the records at ``offsets``: from the footer of a sealed segment, from the record
        headers of an open one."""
        assert self._loop is not None
        idx = self.index
        offsets = idx.off[rows]
        seg.readers += 1
        try:
            if seg.sealed:
                try:
                    return await self._loop.run_in_executor(self._pool, _footer_keys, seg.rfd, seg.charged,
                                                            set(offsets.tolist()))
                except ValueError:  # no valid footer (a tail that could not be sealed): read the headers
                    pass
            items = [rd.ReadItem(i, int(o), int(h), int(n), b"", b"") for i, (o, h, n) in
                     enumerate(zip(offsets.tolist(), idx.hlen[rows].tolist(), idx.plen[rows].tolist()))]
            out: dict[int, tuple[str, str]] = {}
            for run in rd.plan_runs(items, False, 0, self.max_read_bytes):
                outcomes, _ = await self._loop.run_in_executor(self._pool, rd.read_run, seg.rfd, seg.salt, run,
                                                               False, False)
                for o in outcomes:
                    if o.header is not None:
                        out[items[o.pos].offset] = (o.header.bucket.decode(), o.header.key.decode())
            return out
        finally:
            self._release(seg)

    # ================================================================================ space, housekeeping

    async def housekeep(self) -> HousekeepReport:
        """Bounded background work; call it every second or so. Drops expired segments whole, sweeps expired
        entries (at most ``expiry_sweep``), evicts the oldest segments while free space is below two
        segments, compacts one mostly-dead segment (at most ``compact_bytes``), trims the dead log."""
        rep = HousekeepReport()
        if not self._open or self._closing:
            return rep
        self._check_directory()
        now = self.clock()
        if self._list_cache is not None and now - self._list_cache_used > LIST_CACHE_IDLE:
            self._list_cache = None
        idx = self.index
        # 1. expired entries, and with them whole segments
        hi = idx._high
        expired = np.flatnonzero((idx.exp[:hi] <= now) & (idx.seg[:hi] != 0xFFFFFFFF))[:self.expiry_sweep]
        if expired.size:
            for sid in np.unique(idx.seg[expired]).tolist():
                seg = self._segs.get(sid)
                if seg is None or not seg.sealed:
                    continue
                srows = expired[idx.seg[expired] == sid]
                whole = srows.size == seg.live
                n = await self._remove_reported(seg, srows, EXPIRED)
                rep.expired_blocks += n
                rep.expired_segments += int(whole)
        # 2. room for the writer
        while self._space.free < 2 * self.segment_bytes:
            seg = self._oldest_sealed()
            if seg is None:
                break
            rep.evicted_blocks += await self._evict(seg)
            rep.evicted_segments += 1
        # 3. compaction
        if self._degraded is None:
            c = await self._compact_one()
            rep.compacted_segments += int(c > 0)
            rep.compacted_blocks += c
        # 4. the dead log: keep it within the reserve
        if self._dead_entries * 16 > self.meta_reserve // 2 and self._writer is not None:
            self._trim_dead_log()
        return rep

    def _oldest_sealed(self) -> _Seg | None:
        cands = [s for s in self._segs.values() if s.sealed and not s.removed and not s.compacting]
        return min(cands, key=lambda s: s.id) if cands else None

    async def _make_room(self, need: int) -> None:
        if self._making_room:
            return
        self._making_room = True
        try:
            while self._space.free < need:
                seg = self._oldest_sealed()
                if seg is None:
                    return
                await self._evict(seg)
        finally:
            self._making_room = False

    async def _evict(self, seg: _Seg) -> int:
        """Remove the oldest segment; re-append up to ``rewrite_hot_bytes`` of its hot blocks first (only
        while there is room to write them, never when the writer is waiting for space)."""
        seg.compacting = True  # not picked again while this runs
        rows = self.index.rows_of_segment(seg.id)
        if self.rewrite_hot_bytes and rows.size and self._space.free >= self.segment_bytes:
            hot = rows[(self.index.flags[rows] & HOT) != 0]
            if hot.size:
                await self._relocate(seg, hot, self.rewrite_hot_bytes)
                rows = self.index.rows_of_segment(seg.id)
        n = await self._remove_reported(seg, rows, EVICTED)
        if not seg.removed:
            self._drop_segment(seg)
        return n

    async def _remove_reported(self, seg: _Seg, rows: np.ndarray, reason: str) -> int:
        """Remove rows of one segment from the index and tell on_remove which keys they were."""
        if rows.size == 0:
            return 0
        idx = self.index
        offs = idx.off[rows].copy()
        fps = idx.fp[rows].copy()
        names: dict[int, tuple[str, str]] = {}
        if self.on_remove is not None:
            try:
                names = await self._keys_at(seg, rows)
            except (OSError, ValueError) as e:
                log.warning("flash: keys of segment %d unreadable (%s); removing without reporting", seg.id, e)
        # the index may have moved on while the keys were read
        still = (idx.seg[rows] == seg.id) & (idx.off[rows] == offs) & (idx.fp[rows] == fps)
        rows, offs = rows[still], offs[still]
        if rows.size == 0:
            return 0
        bkts = idx.bkt[rows].copy()
        self._remove_rows(rows, log_dead=False)
        for b in np.unique(bkts).tolist():
            self._bucket_changed(b)
            n = int((bkts == b).sum())
            st = self._bstat(b)
            if reason == EXPIRED:
                st.expired += n
            else:
                st.evicted += n
        if reason == EXPIRED:
            self._stats.expired += int(rows.size)
        else:
            self._stats.evicted += int(rows.size)
        removals = [Removal(*names[o], reason) for o in offs.tolist() if o in names]
        self._report(removals)
        return int(rows.size)

    async def _compact_one(self) -> int:
        cands = [s for s in self._segs.values() if s.sealed and not s.removed and not s.compacting and s.data_bytes
                 and s.live_bytes < self.compact_below * s.data_bytes]
        if not cands or self._space.free < 2 * self.segment_bytes:
            return 0
        seg = min(cands, key=lambda s: s.live_bytes / s.data_bytes)
        seg.compacting = True
        try:
            moved = await self._relocate(seg, self.index.rows_of_segment(seg.id), self.compact_bytes)
        finally:
            seg.compacting = False
        if moved:
            self._stats.compactions += 1
        return moved

    async def _relocate(self, seg: _Seg, rows: np.ndarray, budget: int) -> int:
        """Read up to ``budget`` bytes of live records of ``seg``, append them again and wait for the writes.
        The index moves to a new copy only if it still points at the old one. Returns the blocks moved."""
        idx = self.index
        rlen = idx.hlen[rows].astype(np.int64) + idx.plen[rows]
        rows = rows[np.cumsum(rlen) <= budget]
        if rows.size == 0 or self._writer is None:
            return 0
        assert self._loop is not None
        items = [rd.ReadItem(i, int(idx.off[r]), int(idx.hlen[r]), int(idx.plen[r]), b"", b"")
                 for i, r in enumerate(rows.tolist())]
        recs: list[Pending] = []
        fut: asyncio.Future[list[WriteResult]] = self._loop.create_future()

        def moved(results: list[WriteResult]) -> None:
            if not fut.done():
                fut.set_result(results)

        call = _Call(moved, 0)
        now = self.clock()
        for run in rd.plan_runs(items, True, self.read_gap, self.max_read_bytes):
            seg.readers += 1
            try:
                outcomes, n = await self._loop.run_in_executor(self._pool, rd.read_run, seg.rfd, seg.salt, run,
                                                               True, False, self._buffers)
            finally:
                self._release(seg)
            self._stats.device_bytes_read += n
            for o in outcomes:
                if o.status != rd.OK or o.header is None or o.payload is None:
                    continue  # a damaged record is found and dropped by the next read of it
                h, r = o.header, int(rows[o.pos])
                if idx.seg[r] != seg.id or idx.off[r] != items[o.pos].offset:
                    continue
                rec = FlashRecord(h.bucket.decode(), h.key.decode(), bytes(o.payload), float(idx.exp[r]),
                                  h.created, h.meta, h.payload_xxh3)
                _reason, item = self._pending_item(rec, now, call, (seg.id, items[o.pos].offset))
                if item is not None:
                    recs.append(item)
        if not recs:
            return 0
        taken = self._writer.submit(recs, force=True)
        call.remaining = sum(taken)
        if not call.remaining:
            return 0
        self._stats.compacted_bytes += sum(r.nbytes for r, t in zip(recs, taken) if t)
        results = await fut
        return sum(1 for r in results if r.stored)

    def _drop_segment(self, seg: _Seg) -> None:
        """Forget a segment and delete its file (its live rows must be gone already)."""
        if seg.removed:
            return
        seg.removed = True
        self._segs.pop(seg.id, None)
        self._stats.dropped_segments += 1
        if seg.readers == 0:
            _close_quietly(seg.rfd)
            seg.rfd = -1
        try:
            os.unlink(seg.path)
        except FileNotFoundError:
            pass
        except OSError as e:
            self._io_error("unlink", e)
            return  # still on disk: keep charging it
        self._space.release(seg.charged)

    def _check_directory(self) -> None:
        try:
            st = os.stat(self.path)
            if not os.access(self.path, os.W_OK) or os.statvfs(self.path).f_flag & os.ST_RDONLY:
                raise OSError(errno.EROFS, "directory is read-only")
            del st
        except OSError as e:
            self._io_error("directory", e)

    # ================================================================================ manifest, dead log

    async def save_manifest(self, manifest: dict[str, object]) -> bool:
        """Replace the manifest atomically (with the bucket floors). False if the device refused."""
        self.manifest = manifest
        return await self._save_state()

    async def _save_state(self) -> bool:
        data = encode_state(self.manifest, self._floors)
        writer = self._writer
        loop = self._loop
        if writer is None or loop is None or not writer.is_alive():
            return False
        fut: asyncio.Future[bool] = loop.create_future()

        def done(_result: object, exc: BaseException | None) -> None:
            if exc is not None:
                if isinstance(exc, OSError):
                    self._io_error("manifest", exc)
                else:
                    log.error("flash: saving the manifest failed: %r", exc)
            if not fut.done():
                fut.set_result(exc is None)

        writer.control(lambda: writer.save_state(data), done)
        return await fut

    def _save_state_soon(self) -> None:
        self._spawn(self._save_state())

    def _log_dead(self, locs: list[tuple[int, int]]) -> None:
        if locs:
            arr = np.array(locs, np.uint64)
            self._log_dead_keys(dead_keys(arr[:, 0], arr[:, 1]))

    def _log_dead_keys(self, keys: np.ndarray) -> None:
        if keys.size and self._writer is not None:
            self._dead_entries += int(keys.size)
            self._writer.dead(keys)

    def _trim_dead_log(self) -> None:
        writer = self._writer
        assert writer is not None
        from .state import load_dead
        ids = np.array(sorted(self._segs), np.uint32)
        directory = self.path

        def trim() -> int:
            keys = load_dead(directory)
            keep = keys[np.isin((keys >> np.uint64(32)).astype(np.uint32), ids)]
            writer.rewrite_dead(keep)
            return int(keep.size)

        def done(result: object, exc: BaseException | None) -> None:
            if exc is None and isinstance(result, int):
                self._dead_entries = result
            elif isinstance(exc, OSError):
                self._io_error("dead log", exc)

        self._dead_entries = 0  # not again until it has grown back
        writer.control(trim, done)

    # ================================================================================ stats, errors

    @property
    def degraded(self) -> str | None:
        """Why the store stopped writing (None while healthy)."""
        return self._degraded

    def stats(self) -> FlashStats:
        """Totals and per-bucket figures; blocks and bytes count live (unexpired) blocks."""
        s = self._stats
        idx = self.index
        hi = idx._high
        live = (idx.seg[:hi] != 0xFFFFFFFF) & (idx.exp[:hi] > self.clock())
        b = idx.bkt[:hi][live]
        n = len(self._bucket_names)
        counts = np.bincount(b, minlength=n)
        sizes = np.bincount(b, weights=idx.plen[:hi][live], minlength=n)
        s.blocks = int(live.sum())
        s.bytes = int(sizes.sum())
        s.segments = len(self._segs)
        s.open_segments = sum(1 for x in self._segs.values() if not x.sealed)
        s.disk_bytes = self._space.used
        s.index_bytes = idx.nbytes()
        s.buffer_bytes = self._buffers.retained
        s.queued_bytes = self._writer.queued_bytes if self._writer is not None else 0
        s.degraded = self._degraded
        s.buckets = {}
        for bid, name in enumerate(self._bucket_names):
            st = self._bstats.get(bid)
            if not counts[bid] and st is None:
                continue
            st = st or BucketStats()
            st.blocks, st.bytes = int(counts[bid]), int(sizes[bid])
            s.buckets[name] = st
        return s

    def _set_degraded(self, reason: str) -> None:
        if self._degraded is None:
            self._degraded = reason
            log.error("flash: %s: %s; the flash tier is degraded: no more writes, reads continue", self.path, reason)

    def _io_error(self, what: str, exc: BaseException) -> None:
        if what == "read":
            self._stats.read_errors += 1
        else:
            self._stats.write_errors += 1
        msg = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        code = errno.errorcode.get(exc.errno or 0, "") if isinstance(exc, OSError) else ""
        self._set_degraded(f"{what}: {msg}" + (f" ({code})" if code else ""))
        if self._writer is not None and self._writer.failed is None:
            self._writer.failed = self._degraded

    def _report(self, removals: list[Removal]) -> None:
        if removals and self.on_remove is not None:
            try:
                self.on_remove(removals)
            except Exception:
                log.exception("flash: on_remove listener failed")

    # ================================================================================ small helpers

    def _bucket_id(self, name: str) -> int:
        bid = self._buckets.get(name)
        if bid is None:
            bid = self._buckets[name] = len(self._bucket_names)
            self._bucket_names.append(name)
        return bid

    def _seed(self, bucket: str) -> int:
        seed = self._seeds.get(bucket)
        if seed is None:
            seed = self._seeds[bucket] = bucket_seed(bucket)
        return seed

    def _bstat(self, bid: int) -> BucketStats:
        st = self._bstats.get(bid)
        if st is None:
            st = self._bstats[bid] = BucketStats()
        return st

    def _bucket_changed(self, bid: int) -> None:
        self._bucket_version[bid] = self._bucket_version.get(bid, 0) + 1

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


_new_entry: Callable[[tuple[int, float, int, int, int]], Entry] = functools.partial(tuple.__new__, Entry)


def _raise_fd_limit(need: int) -> None:
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


def _trim_heap() -> None:
    """glibc keeps freed memory for reuse; malloc_trim returns it, so RSS reflects what the index holds."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def _lock_file(path: Path) -> int:
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


def _close_quietly(fd: int) -> None:
    if fd >= 0:
        try:
            os.close(fd)
        except OSError:
            pass


def _footer_keys(fd: int, size: int, offsets: set[int]) -> dict[int, tuple[str, str]]:
    trailer = read_trailer(fd, size)
    buckets, entries = read_footer_index(fd, trailer)
    keys = read_footer_keys(fd, trailer, entries)
    out = {}
    for off, b, k in zip(entries["offset"].tolist(), entries["bucket"].tolist(), keys):
        if off in offsets:
            out[off] = (buckets[b], k.decode())
    return out
