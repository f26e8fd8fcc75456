"""What ends with time in the RAM store: objects' TTLs and pins.

Two heaps of (time, seq, bucket, key): expiry times and pin ends. They name objects rather than hold them, so a
removed object's payload is freed at once instead of lingering until its old expiry; an entry whose object was
removed, replaced or given a later time is stale and skipped when it comes up (compaction drops them once they
are most of the heap). Reaping takes expired objects in expiry order, O(log n) each, so making room costs what it
frees and not a scan of the store.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

from .budget import Budget
from .objects import Bucket, StoredObject

Remove = Callable[[StoredObject, str], None]


class Expiry:
    """The expiry heap and the pin-end heap of a store's ``buckets``; expired objects leave through ``remove``."""

    def __init__(self, buckets: dict[str, Bucket], budget: Budget, remove: Remove) -> None:
        self.buckets = buckets  # the store's own table (shared, never copied)
        self.budget = budget
        self._remove = remove
        self._expiry: list[tuple[float, int, str, str]] = []
        self._pins: list[tuple[float, int, str, str]] = []  # pin ends
        self._seq = itertools.count()

    def watch(self, obj: StoredObject) -> None:
        """Reap ``obj`` at its ``expires_at`` (a new object)."""
        heapq.heappush(self._expiry, (obj.expires_at, next(self._seq), obj.bucket, obj.key))

    def extend(self, obj: StoredObject, expires_at: float) -> None:
        """Move ``obj``'s expiry to ``expires_at`` (its entry at the old time goes stale)."""
        obj.expires_at = expires_at
        heapq.heappush(self._expiry, (expires_at, next(self._seq), obj.bucket, obj.key))

    def pin_ends(self, obj: StoredObject, until: float) -> None:
        """Stop counting ``obj``'s pinned bytes once its pin ends at ``until`` (see :meth:`drain_pins`)."""
        heapq.heappush(self._pins, (until, next(self._seq), obj.bucket, obj.key))

    def reap(self, now: float, limit: int | None, stop_when_fits: int | None = None) -> int:
        """Drop up to ``limit`` objects expired at ``now`` (all of them for None), or only until ``stop_when_fits``
        more bytes fit in the budget; returns how many."""
        removed = 0
        heap = self._expiry
        while heap and heap[0][0] <= now:
            if limit is not None and removed >= limit:
                break
            if stop_when_fits is not None and self.budget.fits(stop_when_fits):
                break
            expires_at, _, bucket, key = heapq.heappop(heap)
            obj = self._find(bucket, key)
            if obj is not None and obj.expires_at == expires_at:
                self._remove(obj, "expired")
                removed += 1
        return removed

    def compact(self) -> None:
        """Drop stale entries once they are most of the heap (TTL changes and removals leave them behind)."""
        live = sum(len(b.objects) for b in self.buckets.values())
        if len(self._expiry) > 2 * live + 1024:
            self._expiry = [e for e in self._expiry if (o := self._find(e[2], e[3])) and o.expires_at == e[0]]
            heapq.heapify(self._expiry)

    def drain_pins(self, now: float) -> None:
        """Stop counting pins that have ended as pinned bytes."""
        heap = self._pins
        while heap and heap[0][0] <= now:
            until, _, bucket, key = heapq.heappop(heap)
            obj = self._find(bucket, key)
            if obj is not None and obj.pinned_until == until:
                self.budget.pinned -= obj.charge
                self.buckets[bucket].stats.pinned_bytes -= obj.charge
                obj.pinned_until = 0.0  # drained: no longer counted in pinned bytes

    def _find(self, bucket: str, key: str) -> StoredObject | None:
        """The live object at (bucket, key) whatever its expiry, or None."""
        b = self.buckets.get(bucket)
        return None if b is None else b.objects.get(key)
