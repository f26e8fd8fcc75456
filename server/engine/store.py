"""The object store of the engine: buckets, objects, TTLs, pins and eviction.

Every method runs to completion without yielding, so a call is atomic with respect to every other call made
from the same event loop: a conditional write is checked and applied in one step, and a reader never sees
half an object.

Making room evicts expired objects first (an expiry heap, O(log n) per object), then the least recently used
unpinned ones. Each bucket keeps its own LRU list; choosing a victim compares the heads of the lists that
apply (all buckets for the node budget, one for a bucket quota, the tenant's for a tenant quota), so it costs
O(buckets) per victim, and a write evicts only what it needs.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable, Iterator
from types import MappingProxyType

import xxhash

from . import errors
from .budget import Budget, Reservation
from .config import EngineConfig
from .objects import OBJECT_OVERHEAD, Bucket, Payload, StoredObject, etag_matches

# Shared by every object without metadata of a kind: three empty dicts per object would cost ~200 bytes.
_EMPTY: dict[str, str] = MappingProxyType({})  # type: ignore[assignment]

# Why an object left the store; also the `reason` of a removal event.
REMOVAL_REASONS = ("evicted", "expired", "deleted", "flushed", "replaced")

StoreListener = Callable[[StoredObject], None]
RemovalListener = Callable[[StoredObject, str], None]
Clock = Callable[[], float]


class ObjectStore:
    """Buckets and their objects, charged against a :class:`Budget`."""

    def __init__(self, config: EngineConfig, budget: Budget, clock: Clock) -> None:
        self.config = config
        self.budget = budget
        self.clock = clock
        self.buckets: dict[str, Bucket] = {}
        self._ticks = itertools.count(1)  # recency: every write and recorded read takes the next tick
        # Heaps of (time, seq, bucket, key). They name objects rather than hold them, so a removed object's
        # payload is freed at once instead of lingering until its old expiry; stale entries are skipped.
        self._expiry: list[tuple[float, int, str, str]] = []
        self._pins: list[tuple[float, int, str, str]] = []  # pin ends
        self._seq = itertools.count()
        self.on_store: list[StoreListener] = []
        self.on_remove: list[RemovalListener] = []

    # ------------------------------------------------------------------ buckets

    def create_bucket(self, tenant: str, name: str) -> bool:
        """Create ``name`` for ``tenant``. Returns False if the tenant already owns it (not an error in S3)."""
        bucket = self.buckets.get(name)
        if bucket is not None:
            if bucket.owner != tenant:
                raise errors.BucketAlreadyExists(bucket=name)
            return False
        self.buckets[name] = Bucket(name=name, owner=tenant, created=self.clock())
        return True

    def bucket(self, tenant: str, name: str) -> Bucket:
        """The bucket ``name`` if ``tenant`` owns it."""
        bucket = self.buckets.get(name)
        if bucket is None:
            raise errors.NoSuchBucket(bucket=name)
        if bucket.owner != tenant:
            raise errors.AccessDenied(bucket=name)
        return bucket

    def bucket_named(self, name: str) -> Bucket:
        """A bucket whoever owns it (operators act across tenants)."""
        bucket = self.buckets.get(name)
        if bucket is None:
            raise errors.NoSuchBucket(bucket=name)
        return bucket

    def list_buckets(self, tenant: str) -> list[Bucket]:
        return sorted((b for b in self.buckets.values() if b.owner == tenant), key=lambda b: b.name)

    def remove_bucket(self, tenant: str, name: str) -> Bucket:
        """Delete an empty bucket (expired objects are dropped with it); returns it for its counters."""
        bucket = self.bucket(tenant, name)
        now = self.clock()
        if any(not obj.expired(now) for obj in bucket.objects.values()):
            raise errors.BucketNotEmpty(bucket=name)
        for obj in list(bucket.objects.values()):
            self._remove(obj, "expired")
        del self.buckets[name]
        return bucket

    # ------------------------------------------------------------------ capacity

    def reserve(self, nbytes: int) -> Reservation:
        """Set aside room for an object of ``nbytes`` payload before its body is read.

        Raises InsufficientCapacity when eviction cannot make room (everything left pinned or in flight)
        and EntityTooLarge when the object could never fit."""
        if nbytes > self.config.max_object_size:
            raise errors.EntityTooLarge(f"object of {nbytes} bytes exceeds the maximum {self.config.max_object_size}")
        charge = nbytes + OBJECT_OVERHEAD
        self.make_room(charge)
        return self.budget.hold(charge)

    def make_room(self, need: int, replacing: StoredObject | None = None) -> None:
        """Evict until ``need`` more bytes fit in the budget.

        ``replacing``: the live object the new one replaces; its bytes count as free and it is not evicted."""
        budget = self.budget
        if need > budget.limit:
            raise errors.EntityTooLarge(f"{need} bytes cannot fit in a budget of {budget.limit}")
        credit = replacing.charge if replacing is not None else 0
        if budget.fits(need, credit):
            return
        now = self.clock()
        self._reap_expired(now, limit=None, stop_when_fits=need - credit)
        if budget.fits(need, credit):
            return
        self.drain_pins(now)
        evictable = budget.evictable()
        if replacing is not None and not replacing.pinned(now):
            evictable -= credit
        if budget.used - credit - evictable + need > budget.limit:
            raise errors.InsufficientCapacity("everything left in the budget is pinned or being written")
        self.evict_lru(lambda: budget.fits(need, credit), self.buckets.values(), now, replacing)

    def evict_lru(self, fits: Callable[[], bool], buckets: Iterable[Bucket], now: float,
                  spare: StoredObject | None = None) -> None:
        """Evict least recently used objects of ``buckets`` until ``fits()``, never a pinned one (nor ``spare``).

        Each bucket keeps its own LRU list; the victim is the oldest head across them (objects carry an
        engine-wide access tick), so quotas can evict within a bucket or a tenant with the same mechanism."""
        candidates = list(buckets)
        stepped_over = 0
        limit = min(self.config.max_pinned_scan, sum(len(b.lru) for b in candidates))
        while not fits():
            victim: StoredObject | None = None
            home: Bucket | None = None
            for bucket in candidates:
                if bucket.lru:
                    head = next(iter(bucket.lru))
                    if victim is None or head.tick < victim.tick:
                        victim, home = head, bucket
            if victim is None or home is None:
                raise errors.InsufficientCapacity("nothing left to evict")
            if victim.pinned(now) or victim is spare:
                # Step over it: it goes to its list's recent end and is revisited only after everything else.
                home.lru.move_to_end(victim)
                victim.tick = next(self._ticks)
                stepped_over += 1
                if stepped_over > limit:
                    raise errors.InsufficientCapacity("everything left to evict is pinned")
                continue
            self._remove(victim, "evicted")

    def reap_expired(self, limit: int | None) -> int:
        """Drop up to ``limit`` expired objects (all of them for None); returns how many."""
        return self._reap_expired(self.clock(), limit)

    def _reap_expired(self, now: float, limit: int | None, stop_when_fits: int | None = None) -> int:
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

    def compact_expiry_heap(self) -> None:
        """Drop stale entries once they are most of the heap (TTL changes and removals leave them behind)."""
        live = sum(len(b.objects) for b in self.buckets.values())
        if len(self._expiry) > 2 * live + 1024:
            self._expiry = [e for e in self._expiry if (o := self._find(e[2], e[3])) and o.expires_at == e[0]]
            heapq.heapify(self._expiry)

    def _find(self, bucket: str, key: str) -> StoredObject | None:
        """The live object at (bucket, key) whatever its expiry, or None."""
        b = self.buckets.get(bucket)
        return None if b is None else b.objects.get(key)

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

    # ------------------------------------------------------------------ objects

    def resolve_ttl(self, bucket: Bucket, requested: float | None) -> float:
        """The TTL an object gets: requested, else the bucket default, else the server default; capped."""
        if requested is not None and not requested > 0:
            raise errors.InvalidArgument(f"TTL must be positive, got {requested}")
        ttl = requested or bucket.default_ttl or self.config.default_ttl
        return min(ttl, self.config.max_ttl)

    def put(
        self,
        tenant: str,
        bucket_name: str,
        key: str,
        data: Payload,
        *,
        etag: str,
        ttl: float | None = None,
        content_type: str = "binary/octet-stream",
        headers: dict[str, str] | None = None,
        user_meta: dict[str, str] | None = None,
        checksums: dict[str, str] | None = None,
        parts_count: int = 0,
        if_none_match: bool = False,
        if_match: str | None = None,
        reservation: Reservation | None = None,
        xxh3: int | None = None,
    ) -> StoredObject:
        """Commit a whole object atomically. ``data`` must not be mutated afterwards.

        ``if_none_match``: fail if a live object exists. ``if_match``: replace only that ETag (missing → NoSuchKey).
        ``xxh3``: the payload's XXH3-64 if the caller already computed it."""
        if reservation is not None:
            reservation.release()  # first: a put that fails must not keep the budget
        bucket = self.bucket(tenant, bucket_name)
        now = self.clock()
        self.check_conditions(bucket, key, now, if_none_match, if_match)
        ttl_s = self.resolve_ttl(bucket, ttl)
        obj = StoredObject(
            bucket=bucket_name, key=key, data=data, etag=etag,
            xxh3=xxhash.xxh3_64_intdigest(data) if xxh3 is None else xxh3,
            created=now, ttl=ttl_s, content_type=content_type, headers=headers or _EMPTY,
            user_meta=user_meta or _EMPTY, checksums=checksums or _EMPTY, parts_count=parts_count,
            tenant=bucket.owner,
        )
        old = bucket.objects.get(key)
        live_old = old if old is not None and not old.expired(now) else None
        self._within_quotas(bucket, obj.charge, live_old, now)
        self.make_room(obj.charge, replacing=live_old)
        old = bucket.objects.get(key)  # an expired one may have been reaped to make room
        if old is not None:
            self._remove(old, "replaced" if old is live_old else "expired")
        self._insert(bucket, obj)
        bucket.stats.puts += 1
        bucket.stats.bytes_in += obj.size
        for listener in self.on_store:
            listener(obj)
        return obj

    def _within_quotas(self, bucket: Bucket, need: int, replacing: StoredObject | None, now: float) -> None:
        """Make room under the bucket's and the tenant's byte quotas by evicting their own LRU objects."""
        credit = replacing.charge if replacing is not None else 0
        quota, _ = self.budget.tenant_usage(bucket.owner)
        # Both size checks come before any eviction: a write refused by one quota must not evict for the other.
        if bucket.quota and need > bucket.quota:
            raise errors.EntityTooLarge(f"{need} bytes exceed the bucket quota of {bucket.quota}")
        if quota and need > quota:
            raise errors.EntityTooLarge(f"{need} bytes exceed the tenant quota of {quota}")
        if bucket.quota:
            self.evict_lru(lambda: bucket.stats.charged - credit + need <= bucket.quota, [bucket], now, replacing)
        if quota:
            self.evict_within_tenant(bucket.owner, quota, now, need - credit, replacing)

    def evict_within_tenant(self, tenant: str, quota: int, now: float, need: int = 0,
                            spare: StoredObject | None = None) -> None:
        """Evict the tenant's own LRU objects until its charge plus ``need`` fits its quota."""
        owned = [b for b in self.buckets.values() if b.owner == tenant]
        self.evict_lru(lambda: self.budget.tenant_usage(tenant)[1] + need <= quota, owned, now, spare)

    def check_conditions(
        self, bucket: Bucket, key: str, now: float, if_none_match: bool, if_match: str | None
    ) -> None:
        current = bucket.objects.get(key)
        if current is not None and current.expired(now):
            current = None
        if if_none_match and current is not None:
            raise errors.PreconditionFailed("the key already exists", bucket=bucket.name, key=key)
        if if_match is not None:
            if current is None:
                raise errors.NoSuchKey(bucket=bucket.name, key=key)
            if not etag_matches(if_match, current.etag):
                raise errors.PreconditionFailed("ETag does not match", bucket=bucket.name, key=key)

    def _insert(self, bucket: Bucket, obj: StoredObject) -> None:
        bucket.objects[obj.key] = obj
        obj.tick = next(self._ticks)
        bucket.lru[obj] = None
        heapq.heappush(self._expiry, (obj.expires_at, next(self._seq), obj.bucket, obj.key))
        self.budget.charge_object(bucket.owner, obj.charge)
        bucket.stats.objects += 1
        bucket.stats.bytes += obj.size
        bucket.stats.charged += obj.charge

    def remove(self, obj: StoredObject, reason: str) -> None:
        """Take ``obj`` out of the store (a no-op if it is gone already) and tell the listeners why."""
        self._remove(obj, reason)

    def _remove(self, obj: StoredObject, reason: str) -> None:
        if not obj.live:
            return
        obj.live = False
        bucket = self.buckets.get(obj.bucket)
        if bucket is not None:
            if bucket.objects.get(obj.key) is obj:
                del bucket.objects[obj.key]
            stats = bucket.stats
            stats.objects -= 1
            stats.bytes -= obj.size
            stats.charged -= obj.charge
            bucket.lru.pop(obj, None)
            if obj.pinned_until:
                stats.pinned_bytes -= obj.charge
            if reason == "evicted":
                stats.evictions += 1
            elif reason == "expired":
                stats.expirations += 1
            elif reason == "deleted":
                stats.deletes += 1
        self.budget.uncharge_object(obj.tenant, obj.charge)
        if obj.pinned_until:  # counted until drained, even once ended
            self.budget.pinned -= obj.charge
        obj.pinned_until = 0.0
        for listener in self.on_remove:
            listener(obj, reason)

    def get(self, tenant: str, bucket_name: str, key: str, *, record: bool = True) -> StoredObject:
        """The live object at ``key``. ``record``: count a hit or miss, mark it recently used, slide its TTL."""
        bucket = self.bucket(tenant, bucket_name)
        return self._get_live(bucket, key, self.clock(), record)

    def _get_live(self, bucket: Bucket, key: str, now: float, record: bool) -> StoredObject:
        obj = bucket.objects.get(key)
        if obj is not None and obj.expired(now):
            self._remove(obj, "expired")
            obj = None
        if obj is None:
            if record:
                bucket.stats.misses += 1
            raise errors.NoSuchKey(bucket=bucket.name, key=key)
        if record:
            bucket.stats.hits += 1
            bucket.lru.move_to_end(obj)
            obj.tick = next(self._ticks)
            if bucket.sliding_ttl and now + obj.ttl > obj.expires_at:  # slide forward, never back
                self._set_expiry(obj, now + obj.ttl)
        return obj

    def lookup(self, tenant: str, bucket_name: str, keys: Iterable[str]) -> list[StoredObject | None]:
        """Live objects for many keys (None where absent); counts hits and misses, touches LRU."""
        bucket = self.bucket(tenant, bucket_name)
        now = self.clock()
        out: list[StoredObject | None] = []
        for key in keys:
            try:
                out.append(self._get_live(bucket, key, now, True))
            except errors.NoSuchKey:
                out.append(None)
        return out

    def record_read(self, obj: StoredObject, nbytes: int) -> None:
        """Count payload bytes sent to a reader."""
        bucket = self.buckets.get(obj.bucket)
        if bucket is not None:
            bucket.stats.bytes_out += nbytes

    def delete(self, tenant: str, bucket_name: str, key: str) -> bool:
        """Remove ``key``. Returns whether a live object was removed (S3 answers 204 either way)."""
        bucket = self.bucket(tenant, bucket_name)
        obj = bucket.objects.get(key)
        if obj is None:
            return False
        was_live = not obj.expired(self.clock())
        self._remove(obj, "deleted" if was_live else "expired")
        return was_live

    def iter_objects(self, tenant: str, bucket_name: str, start: str = "", inclusive: bool = True
                     ) -> Iterator[StoredObject]:
        """Live objects in key order from ``start``. Do not mutate the bucket while iterating."""
        bucket = self.bucket(tenant, bucket_name)
        now = self.clock()
        objects = bucket.objects
        for key in objects.irange(minimum=start or None, inclusive=(inclusive, True)):
            obj = objects[key]
            if not obj.expired(now):
                yield obj

    def under(self, name: str, prefix: str) -> list[StoredObject]:
        """Every object of bucket ``name`` (expired or not) whose key starts with ``prefix``."""
        bucket = self.bucket_named(name)
        if not prefix:
            return list(bucket.objects.values())
        out = []
        for key in bucket.objects.irange(minimum=prefix):
            if not key.startswith(prefix):
                break
            out.append(bucket.objects[key])
        return out

    def pin(self, tenant: str, bucket_name: str, keys: Iterable[str], seconds: float) -> int:
        """Protect live objects from eviction for ``seconds`` (capped by max_pin). Returns how many."""
        if not seconds > 0:
            raise errors.InvalidArgument("pin duration must be positive")
        bucket = self.bucket(tenant, bucket_name)
        now = self.clock()
        until = now + min(seconds, self.config.max_pin)
        count = 0
        for key in keys:
            obj = bucket.objects.get(key)
            if obj is None or obj.expired(now):
                continue
            count += 1
            if obj.pinned_until >= until:
                continue
            if not obj.pinned_until:  # not counted yet (an ended pin stays counted until drained)
                self.budget.pinned += obj.charge
                bucket.stats.pinned_bytes += obj.charge
            obj.pinned_until = until
            heapq.heappush(self._pins, (until, next(self._seq), obj.bucket, obj.key))
        return count

    def unpin(self, tenant: str, bucket_name: str, keys: Iterable[str]) -> int:
        bucket = self.bucket(tenant, bucket_name)
        now = self.clock()
        count = 0
        for key in keys:
            obj = bucket.objects.get(key)
            if obj is not None and obj.pinned(now):
                self.budget.pinned -= obj.charge
                bucket.stats.pinned_bytes -= obj.charge
                obj.pinned_until = 0.0
                count += 1
        return count

    def touch(self, tenant: str, bucket_name: str, keys: Iterable[str], ttl: float | None = None) -> int:
        """Extend the life of live objects to now + ttl (never shortens). Returns how many were live."""
        bucket = self.bucket(tenant, bucket_name)
        now = self.clock()
        count = 0
        for key in keys:
            obj = bucket.objects.get(key)
            if obj is None or obj.expired(now):
                continue
            count += 1
            life = self.resolve_ttl(bucket, ttl if ttl is not None else obj.ttl)
            if now + life > obj.expires_at:
                self._set_expiry(obj, now + life)
        return count

    def _set_expiry(self, obj: StoredObject, expires_at: float) -> None:
        obj.expires_at = expires_at
        heapq.heappush(self._expiry, (expires_at, next(self._seq), obj.bucket, obj.key))
