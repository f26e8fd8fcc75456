"""Reads that span RAM and the tier below it: locate, fetch (one or many), existence, promotion before a
conditional write, prefetch, listing, and the snapshot of live keys the event stream replays.

RAM answers first; what it lacks is asked of the lower tier (:mod:`.lower`). After any await (a read of the
lower tier) RAM is asked again, so a write that landed meanwhile wins. On a RAM-only node the lower tier holds
nothing and each of these is RAM's answer.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncGenerator, Callable

from .config import EngineConfig
from .lower import DISK, RAM, LowerTier
from .objects import Bucket, StoredObject
from .store import Clock, ObjectStore

LIST_CHUNK = 1000  # keys taken from RAM (or the lower tier) at a time when a listing merges the tiers


class TierReads:
    """The engine's reads across both tiers (the engine resolves the tenant's bucket, these read it)."""

    def __init__(self, config: EngineConfig, store: ObjectStore, tier: LowerTier, clock: Clock) -> None:
        self.config = config
        self.store = store
        self.tier = tier
        self.clock = clock

    def existing(self, bucket: Bucket, keys: list[str]) -> list[bool]:
        """Per key, whether either tier holds a live object there (not counted as a read)."""
        return [where is not None for where in self.tiers(bucket, keys)]

    def tiers(self, bucket: Bucket, keys: list[str]) -> list[str | None]:
        """Per key the tier holding a live object there (``ram``, ``disk``) or None. Not counted as a read: no
        hit or miss, no LRU touch, no TTL slide (a router asking what the node holds is not a restore). No I/O."""
        ram = self.store.lookup_in(bucket, keys, record=False, count_misses=False)
        found: list[str | None] = [None if obj is None else RAM for obj in ram]
        if not self.tier.may_hold(bucket.name):
            return found
        absent = [i for i, obj in enumerate(ram) if obj is None]
        for i, size in zip(absent, self.tier.sizes(bucket.name, [keys[i] for i in absent]), strict=True):
            if size is not None:
                found[i] = DISK
        return found

    def locate(self, bucket: Bucket, keys: list[str]) -> tuple[list[int], list[str | None] | None]:
        """Per key the live block's payload size (-1 where absent) and its tier (``ram``, ``disk`` or None);
        the tiers are None when every present block is in RAM. Counts hits (and lower-tier hits) and misses,
        touches LRU. No I/O: the lower tier answers from its index. Flat lists, not a tuple per key: a lookup
        of 8192 keys is on the hot path."""
        below = self.tier.may_hold(bucket.name)
        ram = self.store.lookup_in(bucket, keys, record=True, count_misses=not below)
        sizes = [-1 if o is None else o.size for o in ram]
        if not below or -1 not in sizes:
            return sizes, None
        stats = bucket.stats
        absent = [i for i, size in enumerate(sizes) if size < 0]
        tiers: list[str | None] | None = None
        hits = 0
        for i, size in zip(absent, self.tier.sizes(bucket.name, [keys[i] for i in absent]), strict=True):
            if size is not None:
                if tiers is None:
                    tiers = [None if o is None else RAM for o in ram]
                sizes[i], tiers[i] = size, DISK
                hits += 1
        stats.hits += hits
        stats.disk_hits += hits
        stats.misses += len(absent) - hits
        return sizes, tiers

    async def fetch(self, bucket: Bucket, keys: list[str], *, record: bool, meta_only: bool
                    ) -> list[StoredObject | None]:
        """Live objects for ``keys`` from either tier (None where absent). ``record``: count hits and misses,
        refresh LRU, slide TTLs, promote lower-tier hits into RAM. ``meta_only``: a lower-tier hit reads only
        the record's header (HEAD, listings); its ``data`` is then empty. The payload reads of one call are
        bounded to half the budget; keys beyond that are answered as misses (a recompute, never an error)."""
        store = self.store
        if not self.tier.may_hold(bucket.name):
            return store.lookup_in(bucket, keys, record=record, count_misses=True)
        out = store.lookup_in(bucket, keys, record=record, count_misses=False)
        absent = [i for i, o in enumerate(out) if o is None]
        if absent:
            names = [keys[i] for i in absent]
            if not meta_only:
                room, chosen = self.config.budget // 2, []
                for i, size in zip(absent, self.tier.sizes(bucket.name, names), strict=True):
                    if size is not None and size <= room:
                        room -= size
                        chosen.append(i)
                absent, names = chosen, [keys[i] for i in chosen]
            if names:
                read = await self.tier.read(bucket, names, with_payload=not meta_only)
                # RAM may have got a newer version during the read: it wins.
                again = store.lookup_in(bucket, names, record=record, count_misses=False)
                now = self.clock()
                for i, ram, obj in zip(absent, again, read, strict=True):
                    if ram is not None:
                        out[i] = ram
                    elif obj is not None:
                        out[i] = obj
                        if record:
                            self._record_lower_hit(bucket, obj, now, promote=not meta_only)
        if record:
            bucket.stats.misses += sum(1 for o in out if o is None)
        return out

    def _record_lower_hit(self, bucket: Bucket, obj: StoredObject, now: float, *, promote: bool) -> None:
        stats = bucket.stats
        stats.hits += 1
        stats.disk_hits += 1
        if bucket.sliding_ttl and now + obj.ttl > obj.expires_at:
            obj.expires_at = now + obj.ttl
            self.tier.touch(bucket.name, [obj.key], obj.expires_at)
        if promote:
            self.tier.promote(bucket, obj)

    async def resident(self, bucket: Bucket, key: str) -> None:
        """Bring an object only the lower tier holds into RAM (before a write conditional on its ETag)."""
        if self.store.lookup_in(bucket, [key], record=False, count_misses=False)[0] is None:
            [obj] = await self.tier.read(bucket, [key])
            if obj is not None and obj.transient:
                self.tier.promote(bucket, obj)

    def prefetch(self, bucket: Bucket, keys: list[str]) -> dict[str, int]:
        """Start promoting the lower tier's ``keys`` into RAM ahead of a restore; returns at once how many keys
        are in RAM, below it, in neither tier, and how many it started reading (0 when the tier's prefetches
        are all busy, or it holds nothing)."""
        now = self.clock()
        in_ram = sum(1 for k in keys if (o := bucket.objects.get(k)) is not None and not o.expired(now))
        below = sum(1 for size in self.tier.sizes(bucket.name, keys) if size is not None)
        started = self.tier.prefetch(bucket, keys)
        return {"ram": in_ram, "disk": below, "missing": max(0, len(keys) - in_ram - below), "started": started}

    async def list_objects(self, tenant: str, bucket: Bucket, start: str = "", inclusive: bool = True
                           ) -> AsyncGenerator[StoredObject, None]:
        """Live objects of both tiers in key order from ``start`` (a key in both is listed once, from RAM).
        The lower tier's come with their metadata (read from their record headers) and no payload."""
        cursor, first = start, inclusive  # keys > cursor (>= on the first round when inclusive)
        while True:
            # A chunk from RAM, taken at once: the bucket may change while the lower tier is read below.
            ram = list(itertools.islice(self.store.iter_objects(tenant, bucket.name, cursor, first), LIST_CHUNK))
            raw = await self.tier.list_page(bucket.name, _before(cursor) if first else cursor, LIST_CHUNK)
            names = [k for k in raw if k >= cursor] if first else raw
            # Emit up to the first point where either source may have more keys it has not shown yet.
            ends = [ram[-1].key] if len(ram) == LIST_CHUNK else []
            if len(raw) == LIST_CHUNK:
                ends.append(raw[-1])
            bound = min(ends) if ends else None
            if names:
                ram_keys = {o.key for o in ram}
                names = [k for k in names if k not in ram_keys and (bound is None or k <= bound)]
            below = [o for o in await self.tier.read(bucket, names, with_payload=False) if o is not None] \
                if names else []
            merged = [o for o in ram if bound is None or o.key <= bound]
            if below:
                merged += below
                merged.sort(key=lambda o: o.key)
            for obj in merged:
                yield obj
            if bound is None:
                return
            cursor, first = bound, False

    async def live_keys(self, chosen: list[Bucket], at: Callable[[], None]
                        ) -> dict[str, tuple[str, list[str], list[str]]]:
        """Bucket → (owner, its live keys, those of them held only by the lower tier), exactly as of
        the moment ``at()`` is called (synchronously, after any listing of the lower tier: the event stream
        takes its sequence number there)."""
        buckets = self.store.buckets
        listed: dict[str, list[str]] = {}
        with self.tier.watch() as fresh:  # blocks demoted while the lower tier is listed are added from here
            for b in chosen:
                listed[b.name] = await self.tier.keys_under(b.name, "")
            at()
            now = self.clock()
            out: dict[str, tuple[str, list[str], list[str]]] = {}
            for b in chosen:
                if buckets.get(b.name) is not b:
                    continue
                ram = [k for k, o in b.objects.items() if not o.expired(now)]
                maybe = listed[b.name] + fresh.get(b.name, [])
                if not maybe:
                    out[b.name] = (b.owner, ram, [])
                    continue
                in_ram = set(ram)
                maybe = [k for k in dict.fromkeys(maybe) if k not in in_ram]
                below = sorted(k for k, size in zip(maybe, self.tier.sizes(b.name, maybe), strict=True)
                               if size is not None)
                out[b.name] = (b.owner, sorted(in_ram.union(below)), below)
            return out


def _before(key: str) -> str:
    """A string just below ``key`` in code-point order, so a listing "after" it includes ``key`` itself."""
    if not key:
        return ""
    last = ord(key[-1])
    return key[:-1] if last == 0 else key[:-1] + chr(last - 1) + "\U0010ffff"
