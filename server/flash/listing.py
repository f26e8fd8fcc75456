"""Listing a bucket's keys. Keys are not in RAM: they are read from the footers of the segments that hold the
bucket (from the record headers of an open segment) and sorted. The sorted keys of the last bucket listed are
kept until that bucket changes, so paging through a quiet bucket costs one scan, and let go once nobody pages
(a key is ~80 bytes of RAM)."""

from __future__ import annotations

import bisect
from collections.abc import AsyncIterator, Callable

import numpy as np

from .buckets import BucketTable
from .catalog import Catalog
from .reads import Reads
from .segment_table import SegmentTable

LIST_CACHE_IDLE = 30.0  # seconds without a listing call after which the sorted key list is let go


class Listing:
    """Key listings, and the one sorted listing kept for paging."""

    def __init__(self, clock: Callable[[], float], buckets: BucketTable, segments: SegmentTable, catalog: Catalog,
                 reads: Reads) -> None:
        self._clock = clock
        self._buckets = buckets
        self._segments = segments
        self._catalog = catalog
        self._reads = reads
        self.cache: tuple[str, int, list[str]] | None = None  # (bucket, its version, its sorted keys)
        self._cache_used = 0.0

    async def list_keys(self, bucket: str, start_after: str, limit: int) -> list[str]:
        bid = self._buckets.get(bucket)
        if bid is None:
            return []
        version = self._buckets.version(bid)
        cached = self.cache
        self._cache_used = self._clock()
        if cached is not None and cached[0] == bucket and cached[1] == version:
            keys = cached[2]
        else:
            keys = await self._scan_keys(bid)
            if self._buckets.version(bid) == version:
                self.cache = (bucket, version, keys)
        i = bisect.bisect_right(keys, start_after)
        return keys[i:i + limit]

    async def keys_by_segment(self, bucket: str) -> AsyncIterator[list[str]]:
        bid = self._buckets.get(bucket)
        if bid is not None:
            async for keys in self._segment_keys(bid):
                yield keys

    def forget_idle(self, now: float) -> None:
        """Let go of the kept listing if nobody paged through it lately."""
        if self.cache is not None and now - self._cache_used > LIST_CACHE_IDLE:
            self.cache = None

    async def _segment_keys(self, bid: int) -> AsyncIterator[list[str]]:
        idx = self._catalog.index
        rows = self._catalog.live_rows(self._clock(), bid)
        for sid in np.unique(idx.seg[rows]).tolist():
            seg = self._segments.get(sid)
            if seg is None:
                continue
            srows = rows[idx.seg[rows] == sid]
            names = await self._reads.keys_at(seg, srows)
            yield [bk[1] for bk in names.values() if bk[0] == self._buckets.names[bid]]

    async def _scan_keys(self, bid: int) -> list[str]:
        found: list[str] = []
        async for keys in self._segment_keys(bid):
            found.extend(keys)
        found.sort()
        return found
