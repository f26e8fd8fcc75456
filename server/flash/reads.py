"""The reading side of the flash store on the event loop: turns keys into runs of records per segment, hands
the runs to the reader threads (:mod:`.reader` does the reading and verifying), and takes the outcomes back —
blocks returned, collisions counted, records that failed verification dropped from the index and reported."""

from __future__ import annotations

import asyncio
import errno
import functools
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from . import reader as rd
from .buckets import BucketTable
from .catalog import Catalog
from .health import Health
from .index import HOT
from .options import FlashOptions
from .segment_table import Seg, SegmentTable
from .segments import footer_keys
from .types import CORRUPT, FlashBlock, FlashMeta, Removal

log = logging.getLogger("ctxstore.flash")

RemoveListener = Callable[[list[Removal]], None]


class Reads:
    """The reader threads, the read buffers they fill, and the reads in flight."""

    def __init__(self, options: FlashOptions, health: Health, buckets: BucketTable, segments: SegmentTable,
                 catalog: Catalog, report: RemoveListener) -> None:
        self._options = options
        self._health = health
        self._stats = health.stats
        self._buckets = buckets
        self._segments = segments
        self._catalog = catalog
        self._report = report
        self.buffers = rd.ReadBuffers(options.read_buffer_bytes)  # kept between reads (stats().buffer_bytes)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pool: ThreadPoolExecutor | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._pool = ThreadPoolExecutor(max_workers=self._options.readers, thread_name_prefix="ctxstore-flash-read")

    def stop(self) -> None:
        """Wait for the reads in flight; give back the buffers."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self.buffers.clear()

    async def read(self, bucket: str, keys: Sequence[str], with_payload: bool) -> list[Any]:
        """FlashBlocks (``with_payload``) or FlashMetas of ``keys`` in their order; None for a miss."""
        out: list[Any] = [None] * len(keys)
        rows = self._catalog.rows(bucket, keys)
        idx = self._catalog.index
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
        gap = self._options.read_gap if with_payload else 0
        for sid, items in by_seg.items():
            seg = self._segments[sid]  # rows never outlive their segment
            for run in rd.plan_runs(items, with_payload, gap, self._options.max_read_bytes):
                self._segments.hold(seg)
                fut = loop.run_in_executor(self._pool, rd.read_run, seg.rfd, seg.salt, run, with_payload, True,
                                           self.buffers)
                fut.add_done_callback(functools.partial(self._segments.release, seg))
                futures.append((seg, run, fut))
        done = await asyncio.gather(*(f for _s, _r, f in futures), return_exceptions=True)
        bid = self._buckets.id(bucket)
        bs = self._buckets.stat(bid)
        failed: list[tuple[int, int]] = []  # (position, segment)
        hot: list[int] = []
        for (seg, run, _f), res in zip(futures, done):
            if isinstance(res, BaseException):
                self._health.io_error("read", res)
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
                        self._health.io_error("read", OSError(errno.EIO, o.detail))
                    else:
                        log.warning("flash: %s/%s in segment %d failed verification: %s", bucket, keys[o.pos],
                                    seg.id, o.detail)
                    failed.append((o.pos, seg.id))
        if hot:
            self._catalog.index.flags[np.array(hot)] |= HOT
        if failed:
            self._drop_failed(bucket, keys, rows, failed)
        return out

    def _drop_failed(self, bucket: str, keys: Sequence[str], rows: np.ndarray, failed: list[tuple[int, int]]) -> None:
        """Records that failed a read leave the index (if it still points at them) and are reported."""
        idx = self._catalog.index
        drop, removals = [], []
        for pos, sid in failed:
            r = int(rows[pos])
            fresh = self._catalog.rows(bucket, [keys[pos]])[0]
            if fresh == r and int(idx.seg[r]) == sid:
                drop.append(r)
                removals.append(Removal(bucket, keys[pos], CORRUPT))
        self._stats.misses += len(failed)
        if drop:
            bid = self._buckets.id(bucket)
            self._stats.corrupt += len(drop)
            self._buckets.stat(bid).corrupt += len(drop)
            self._catalog.remove_rows(np.array(drop, np.int64), log_dead=True)
            self._buckets.changed(bid)
            self._report(removals)

    async def read_run(self, seg: Seg, run: list[rd.ReadItem], with_payload: bool) -> tuple[list[rd.ReadOutcome], int]:
        """One run of ``seg``'s records, whatever their keys (compaction): :func:`.reader.read_run` on a reader
        thread, into the kept buffers."""
        assert self._loop is not None
        self._segments.hold(seg)
        try:
            return await self._loop.run_in_executor(self._pool, rd.read_run, seg.rfd, seg.salt, run, with_payload,
                                                    False, self.buffers)
        finally:
            self._segments.release(seg)

    async def keys_at(self, seg: Seg, rows: np.ndarray) -> dict[int, tuple[str, str]]:
        """offset -> (bucket, key) of the records at ``rows`` of ``seg``: from the footer of a sealed segment,
        from the record headers of an open one."""
        assert self._loop is not None
        idx = self._catalog.index
        offsets = idx.off[rows]
        self._segments.hold(seg)
        try:
            if seg.sealed:
                try:
                    return await self._loop.run_in_executor(self._pool, footer_keys, seg.rfd, seg.charged,
                                                            set(offsets.tolist()))
                except ValueError:  # no valid footer (a tail that could not be sealed): read the headers
                    pass
            items = [rd.ReadItem(i, int(o), int(h), int(n), b"", b"") for i, (o, h, n) in
                     enumerate(zip(offsets.tolist(), idx.hlen[rows].tolist(), idx.plen[rows].tolist()))]
            out: dict[int, tuple[str, str]] = {}
            for run in rd.plan_runs(items, False, 0, self._options.max_read_bytes):
                outcomes, _ = await self._loop.run_in_executor(self._pool, rd.read_run, seg.rfd, seg.salt, run,
                                                               False, False)
                for o in outcomes:
                    if o.header is not None:
                        out[items[o.pos].offset] = (o.header.bucket.decode(), o.header.key.decode())
            return out
        finally:
            self._segments.release(seg)
