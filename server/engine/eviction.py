"""Choosing what the RAM store evicts: the least recently used unpinned object of a scope.

Each bucket keeps its own LRU list, and objects carry an engine-wide access tick (every write and recorded read
takes the next), so the oldest head across several lists is the scope's LRU object. Heaps of the buckets' LRU
heads (one for the node, one per tenant) give the oldest head of the lists that apply (all buckets for the node
budget, the tenant's for a tenant quota, one list for a bucket quota) in O(log buckets), so a write evicts only
what it needs and costs the same with four buckets or thousands.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator

from . import errors
from .config import EngineConfig
from .objects import Bucket, StoredObject

Scope = Bucket | str | None  # what an eviction may take from: one bucket, a tenant's buckets, or every bucket
NODE = ""  # the eviction heap of every bucket, and the count of every object (tenant names are never empty)


class Eviction:
    """LRU victims of a store's ``buckets``, taken out through ``evict``.

    The store owns the recency ``ticks`` and the live ``count`` per scope (NODE or a tenant): it advances and
    updates them on its write and read paths; eviction reads them, and takes a tick for an object it steps over."""

    def __init__(self, config: EngineConfig, buckets: dict[str, Bucket], ticks: Iterator[int],
                 count: dict[str, int], evict: Callable[[StoredObject], None]) -> None:
        self.config = config
        self.buckets = buckets  # the store's own table (shared, never copied)
        self.ticks = ticks
        self.count = count
        self._evict = evict
        # Heaps of (head tick, seq, bucket) per scope (NODE or a tenant): each bucket with objects has one entry
        # in each heap that covers it, whose tick is at most its LRU head's (ticks only grow), fixed up lazily.
        self._heads: dict[str, list[tuple[int, int, Bucket]]] = {NODE: []}
        self._seq = itertools.count()

    def enter_heads(self, bucket: Bucket, tick: int) -> None:
        """A bucket that holds objects again gets an entry in the node's heap and its owner's."""
        for name in (NODE, bucket.owner):
            if name not in bucket.heads:
                heapq.heappush(self._heads.setdefault(name, []), (tick, next(self._seq), bucket))
                bucket.heads.add(name)

    def evict_lru(self, fits: Callable[[], bool], scope: Scope, now: float,
                  spare: StoredObject | None = None) -> None:
        """Evict least recently used objects of ``scope`` until ``fits()``, never a pinned one (nor ``spare``).

        ``scope``: a bucket (its own LRU list), a tenant name (its buckets) or None (every bucket)."""
        stepped_over = 0
        limit = min(self.config.max_pinned_scan, self._count(scope))
        while not fits():
            found = self._oldest(scope)
            if found is None:
                raise errors.InsufficientCapacity("nothing left to evict")
            victim, home = found
            if victim.pinned(now) or victim is spare:
                # Step over it: it goes to its list's recent end and is revisited only after everything else.
                home.lru.move_to_end(victim)
                victim.tick = next(self.ticks)
                stepped_over += 1
                if stepped_over > limit:
                    raise errors.InsufficientCapacity("everything left to evict is pinned")
                continue
            self._evict(victim)

    def _count(self, scope: Scope) -> int:
        if isinstance(scope, Bucket):
            return len(scope.lru)
        return self.count.get(NODE if scope is None else scope, 0)

    def _oldest(self, scope: Scope) -> tuple[StoredObject, Bucket] | None:
        """The least recently used object of ``scope`` and its bucket, or None if the scope holds none."""
        if isinstance(scope, Bucket):
            return (next(iter(scope.lru)), scope) if scope.lru else None
        name = NODE if scope is None else scope
        heap = self._heads.get(name)
        while heap:
            tick, _, bucket = heap[0]
            if not bucket.lru or self.buckets.get(bucket.name) is not bucket:  # emptied, or deleted
                heapq.heappop(heap)
                bucket.heads.discard(name)
                continue
            head = next(iter(bucket.lru))
            if head.tick != tick:  # the head moved on (read, evicted, stepped over): fix the entry, look again
                heapq.heapreplace(heap, (head.tick, next(self._seq), bucket))
                continue
            return head, bucket
        return None
