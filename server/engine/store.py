"""The object store of the engine: buckets and their objects (writes, conditions, reads, leases, pins, TTLs).

Every method runs to completion without yielding, so a call is atomic with respect to every other call made
from the same event loop: a conditional write is checked and applied in one step, and a reader never sees
half an object.

The store composes three parts that act on its tables: :mod:`.capacity` (reservations, quotas and making room
in the budget), :mod:`.expiry` (the expiry and pin-end heaps, reaping) and :mod:`.eviction` (the LRU victim of
a bucket, a tenant or the node). The store keeps what every read and write touches: the objects' recency ticks
and LRU lists and the live counts per scope, written inline on the hot paths; the parts read them.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from types import MappingProxyType
from typing import NamedTuple

import xxhash

from . import errors
from .budget import Budget, Reservation
from .buffers import PayloadBuffers
from .capacity import Capacity
from .config import EngineConfig
from .eviction import NODE, Eviction
from .expiry import Expiry
from .lower import LowerTier, NoLowerTier
from .objects import OBJECT_OVERHEAD, Bucket, Payload, StoredObject, etag_matches

NODE_STATE = ""  # the "tenant" the buckets' own records are charged to: the node's, no one's quota

# Shared by every object without metadata of a kind: three empty dicts per object would cost ~200 bytes.
_EMPTY: dict[str, str] = MappingProxyType({})  # type: ignore[assignment]


class BlockWrite(NamedTuple):
    """One verified block for :meth:`ObjectStore.put_blocks` (a bulk put's commit)."""

    key: str
    data: Payload
    etag: str
    xxh3: int
    reservation: Reservation | None

# Why an object left the store; also the `reason` of a removal event.
# ``demoted``: it moved to the flash tier (a change of medium; the tier announces it once the write lands).
REMOVAL_REASONS = ("evicted", "expired", "deleted", "flushed", "replaced", "demoted")

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
        self.count: dict[str, int] = {NODE: 0}  # live objects per scope (NODE or a tenant)
        self.on_store: list[StoreListener] = []
        self.on_remove: list[RemovalListener] = []
        self.lower: LowerTier = NoLowerTier()  # the tier below RAM (the engine sets the node's)
        self.buffers = PayloadBuffers(budget, lambda delta: budget.charge(NODE_STATE, delta, "state"), clock)
        self.expiry = Expiry(self.buckets, budget, self._remove)
        self.eviction = Eviction(config, self.buckets, self._ticks, self.count, self._evict)
        self.capacity = Capacity(config, budget, clock, self.buffers, self.expiry, self.eviction, self.bucket)

    # ------------------------------------------------------------------ buckets

    def create_bucket(self, tenant: str, name: str) -> bool:
        """Create ``name`` for ``tenant``. Returns False if the tenant already owns it (not an error in S3)."""
        bucket = self.buckets.get(name)
        if bucket is not None:
            if bucket.owner != tenant:
                raise errors.BucketAlreadyExists(bucket=name)
            return False
        owned = sum(1 for b in self.buckets.values() if b.owner == tenant)
        if owned >= self.config.max_buckets_per_tenant:
            raise errors.TooManyBuckets(f"a tenant may own at most {self.config.max_buckets_per_tenant} buckets")
        bucket = Bucket(name=name, owner=tenant, created=self.clock(),
                        charge=self.config.bucket_overhead)
        # A bucket counts against the node's budget, not its owner's quota: buckets are capped per tenant.
        self.capacity.make_room(bucket.charge)
        self.budget.charge(NODE_STATE, bucket.charge, "state")
        self.buckets[name] = bucket
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
        if any(not obj.expired(now) for obj in bucket.objects.values()) or (
                self.lower.live_blocks(name)):
            raise errors.BucketNotEmpty(bucket=name)
        for obj in list(bucket.objects.values()):
            self._remove(obj, "expired")
        self.lower.drop_bucket(name)  # expired blocks may linger there; a re-created bucket must not see them
        del self.buckets[name]
        self.budget.charge(NODE_STATE, -bucket.charge, "state")
        return bucket

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
        if_none_match: bool | str = False,
        if_match: str | None = None,
        reservation: Reservation | None = None,
        xxh3: int | None = None,
    ) -> StoredObject:
        """Commit a whole object atomically. ``data`` must not be mutated afterwards.

        ``if_none_match``: True or ``*``: fail if a live object exists; ETags: fail if the live object has one
        of them. ``if_match``: replace only that ETag (missing → NoSuchKey).
        ``xxh3``: the payload's XXH3-64 if the caller already computed it."""
        if reservation is not None:
            reservation.release()  # first: a put that fails must not keep the budget
        bucket = self.bucket(tenant, bucket_name)
        now = self.clock()
        self.check_conditions(bucket, key, now, if_none_match, if_match)
        ttl_s = self.resolve_ttl(bucket, ttl)
        return self._commit(bucket, now, StoredObject(
            bucket=bucket_name, key=key, data=data, etag=etag,
            xxh3=xxhash.xxh3_64_intdigest(data) if xxh3 is None else xxh3,
            created=now, ttl=ttl_s, content_type=content_type, headers=headers or _EMPTY,
            user_meta=user_meta or _EMPTY, checksums=checksums or _EMPTY, parts_count=parts_count,
            tenant=bucket.owner,
        ))

    def put_blocks(self, tenant: str, bucket_name: str, blocks: list[BlockWrite], *, ttl: float | None,
                   if_absent: bool) -> list[errors.StorageError | StoredObject]:
        """Commit many verified blocks of one bucket, each on its own (a failure, ``PreconditionFailed`` or no
        room, is that block's outcome, returned in its place): what :meth:`put` does for each, with the bucket,
        the clock and the TTL looked up once. Every reservation is released first."""
        for block in blocks:
            if block.reservation is not None:
                block.reservation.release()
        bucket = self.bucket(tenant, bucket_name)
        now = self.clock()
        ttl_s = self.resolve_ttl(bucket, ttl)
        out: list[errors.StorageError | StoredObject] = []
        for block in blocks:
            try:
                self.check_conditions(bucket, block.key, now, if_absent, None)
                out.append(self._commit(bucket, now, StoredObject(
                    bucket=bucket_name, key=block.key, data=block.data, etag=block.etag, xxh3=block.xxh3,
                    created=now, ttl=ttl_s, content_type="binary/octet-stream", headers=_EMPTY, user_meta=_EMPTY,
                    checksums=_EMPTY, tenant=bucket.owner,
                )))
            except (errors.PreconditionFailed, errors.InsufficientCapacity, errors.EntityTooLarge) as exc:
                out.append(exc)
        # Ranked last key first, so the first is the most recent: a call's keys are a chain's blocks in order,
        # and the eviction that comes for them later must take its tail before its head (a hole ends the prefix).
        for obj in reversed(out):
            if isinstance(obj, StoredObject) and bucket.objects.get(obj.key) is obj:
                bucket.lru.move_to_end(obj)
                obj.tick = next(self._ticks)
        return out

    def _commit(self, bucket: Bucket, now: float, obj: StoredObject) -> StoredObject:
        """Make room for ``obj`` (within the quotas, then the budget), replace what holds its key, insert it."""
        key = obj.key
        old = bucket.objects.get(key)
        live_old = old if old is not None and not old.expired(now) else None
        capacity = self.capacity
        capacity.within_quotas(bucket, obj.charge, live_old, now)
        capacity.make_room(obj.charge, replacing=live_old)
        old = bucket.objects.get(key)  # an expired one may have been reaped to make room
        if old is not None:
            self._remove(old, "replaced" if old is live_old else "expired")
        # An older version below RAM is superseded (announced before the new one).
        self.lower.forget(bucket, (key,), "replaced")
        self._insert(bucket, obj)
        bucket.stats.puts += 1
        bucket.stats.bytes_in += obj.size
        for listener in self.on_store:
            listener(obj)
        return obj

    def check_conditions(
        self, bucket: Bucket, key: str, now: float, if_none_match: bool | str, if_match: str | None
    ) -> None:
        current = bucket.objects.get(key)
        if current is not None and current.expired(now):
            current = None
        if current is None and (if_none_match or if_match is not None):
            current = self.lower.queued_object(bucket.name, key)
            if current is None and self.lower.holds(bucket.name, key):
                if if_none_match is True:
                    raise errors.PreconditionFailed("the key already exists", bucket=bucket.name, key=key)
                # Its ETag is on flash: the protocol layer reads it into RAM first (Engine.resident); if RAM
                # had no room for it, the client retries.
                raise errors.InsufficientCapacity("the object's ETag is on flash; retry", bucket=bucket.name,
                                                  key=key)
        if if_none_match and current is not None and (
                if_none_match is True or etag_matches(str(if_none_match), current.etag)):
            raise errors.PreconditionFailed("the key already exists", bucket=bucket.name, key=key)
        if if_match is not None:
            if current is None:
                raise errors.NoSuchKey(bucket=bucket.name, key=key)
            if not etag_matches(if_match, current.etag):
                raise errors.PreconditionFailed("ETag does not match", bucket=bucket.name, key=key)

    def _insert(self, bucket: Bucket, obj: StoredObject) -> None:
        bucket.objects[obj.key] = obj
        obj.tick = next(self._ticks)
        was_empty = not bucket.lru
        bucket.lru[obj] = None
        if was_empty:
            self.eviction.enter_heads(bucket, obj.tick)
        self.expiry.watch(obj)
        self.budget.charge(bucket.owner, obj.charge)
        self.count[NODE] += 1
        self.count[bucket.owner] = self.count.get(bucket.owner, 0) + 1
        bucket.stats.objects += 1
        bucket.stats.bytes += obj.size
        bucket.stats.charged += obj.charge

    def admit(self, bucket: Bucket, obj: StoredObject) -> None:
        """Put a block read back from the flash tier into RAM (a promotion: not a write, no ``puts``), making
        room as a write would: within its tenant's and bucket's quotas, then the budget."""
        now = self.clock()
        old = bucket.objects.get(obj.key)
        if old is not None:
            if not old.expired(now):
                raise errors.PreconditionFailed("a newer version is in RAM", bucket=bucket.name, key=obj.key)
            self._remove(old, "expired")
        capacity = self.capacity
        capacity.within_quotas(bucket, obj.charge, None, now)
        capacity.make_room(obj.charge)
        obj.live = True
        self._insert(bucket, obj)
        for listener in self.on_store:
            listener(obj)

    def demote_now(self, obj: StoredObject) -> bool:
        """Move a live object to the tier below at once (not for room: by policy); False if it stays."""
        if not obj.live or obj.pinned(self.clock()) or not self.lower.demote(obj):
            return False
        self._remove(obj, "demoted")
        return True

    def announce_removed(self, obj: StoredObject, reason: str) -> None:
        """Tell the listeners an object already out of RAM's tables left the node (a demotion that failed)."""
        for listener in self.on_remove:
            listener(obj, reason)

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
            self.count[NODE] -= 1
            self.count[obj.tenant] -= 1
            if obj.pinned_until:
                stats.pinned_bytes -= obj.charge
            if reason == "evicted":
                stats.evictions += 1
            elif reason == "expired":
                stats.expirations += 1
            elif reason == "deleted":
                stats.deletes += 1
        self.budget.charge(obj.tenant, -obj.charge)
        if reason == "demoted":  # still served (from the demotion queue) until its flash write lands
            obj.transient = True
        if obj.readers:  # still being sent: its payload stays in memory, so its bytes stay counted until then
            self.budget.used += obj.charge
            self.budget.sending += obj.charge
        if obj.pinned_until:  # counted until drained, even once ended
            self.budget.pinned -= obj.charge
        obj.pinned_until = 0.0
        for listener in self.on_remove:
            listener(obj, reason)

    def _evict(self, victim: StoredObject) -> None:
        """Take an eviction's victim out of RAM: down to the tier below if it takes it, else gone."""
        self._remove(victim, "demoted" if self.lower.demote(victim) else "evicted")

    def lease(self, obj: StoredObject) -> Callable[[], None]:
        """Count a response sending ``obj``'s payload; call what this returns when the send has ended. An object
        removed meanwhile (replaced, evicted) stays counted against the budget until its last send ends."""
        if obj.transient and not obj.readers:  # a flash read's buffer: counted while it is being sent
            self.budget.used += obj.charge
            self.budget.sending += obj.charge
        obj.readers += 1
        released = False

        def release() -> None:
            nonlocal released
            if released:
                return
            released = True
            obj.readers -= 1
            if not obj.readers and not obj.live:
                self.budget.used -= obj.charge
                self.budget.sending -= obj.charge

        return release

    def get(self, tenant: str, bucket_name: str, key: str, *, record: bool = True) -> StoredObject:
        """The live object at ``key``. ``record``: count a hit or miss, mark it recently used, slide its TTL."""
        bucket = self.bucket(tenant, bucket_name)
        return self._get_live(bucket, key, self.clock(), record)

    def _get_live(self, bucket: Bucket, key: str, now: float, record: bool) -> StoredObject:
        obj = self._live(bucket, key, now)
        if obj is None:
            if record:
                bucket.stats.misses += 1
            raise errors.NoSuchKey(bucket=bucket.name, key=key)
        if record:
            self._record_hit(bucket, obj, now)
        return obj

    def _live(self, bucket: Bucket, key: str, now: float) -> StoredObject | None:
        obj = bucket.objects.get(key)
        if obj is not None and obj.expired(now):
            self._remove(obj, "expired")
            return None
        return obj

    def _record_hit(self, bucket: Bucket, obj: StoredObject, now: float) -> None:
        bucket.stats.hits += 1
        bucket.lru.move_to_end(obj)
        obj.tick = next(self._ticks)
        if bucket.sliding_ttl and now + obj.ttl > obj.expires_at:  # slide forward, never back
            self.expiry.extend(obj, now + obj.ttl)

    def lookup(self, tenant: str, bucket_name: str, keys: Iterable[str], *, count_misses: bool = True
               ) -> list[StoredObject | None]:
        """Live objects for many keys (None where absent); counts hits (and misses), touches LRU."""
        return self.lookup_in(self.bucket(tenant, bucket_name), keys, record=True, count_misses=count_misses)

    def lookup_in(self, bucket: Bucket, keys: Iterable[str], *, record: bool, count_misses: bool
                  ) -> list[StoredObject | None]:
        """Live objects of ``bucket`` for many keys. ``record``: count hits, touch LRU, slide TTLs (and count
        misses if ``count_misses``: the caller may count them itself once the flash tier was asked)."""
        now = self.clock()
        find = bucket.objects.get
        out = [find(key) for key in keys]
        # A lookup of 8192 keys is on a worker's path to its first token: one pass for what is usually the
        # whole answer, the rare expired object and each hit's bookkeeping after it.
        for i, obj in enumerate(out):
            if obj is not None and obj.expires_at <= now:
                self._remove(obj, "expired")  # once, even for a key asked twice (a removed object is not live)
                out[i] = None
        if not record:
            return out
        stats = bucket.stats
        touch = bucket.lru.move_to_end
        ticks = self._ticks
        sliding = bucket.sliding_ttl
        extend = self.expiry.extend
        hits = 0
        for obj in reversed(out):  # the first key the most recent: eviction takes a chain's tail before its head
            if obj is not None:
                hits += 1
                touch(obj)
                obj.tick = next(ticks)
                if sliding and now + obj.ttl > obj.expires_at:  # slide forward, never back
                    extend(obj, now + obj.ttl)
        stats.hits += hits
        if count_misses:
            stats.misses += len(out) - hits
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
        on_lower = self.lower.forget(bucket, (key,), "deleted") > 0
        if obj is None:
            if on_lower:
                bucket.stats.deletes += 1
            return on_lower
        was_live = not obj.expired(self.clock())
        self._remove(obj, "deleted" if was_live else "expired")
        return was_live or on_lower

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
            self.expiry.pin_ends(obj, until)
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
        elsewhere: list[str] = []
        for key in keys:
            obj = bucket.objects.get(key)
            if obj is None or obj.expired(now):
                elsewhere.append(key)
                continue
            count += 1
            life = self.resolve_ttl(bucket, ttl if ttl is not None else obj.ttl)
            if now + life > obj.expires_at:
                self.expiry.extend(obj, now + life)
        if elsewhere:  # below RAM: the requested (else the bucket's) TTL
            count += self.lower.touch(bucket.name, elsewhere, now + self.resolve_ttl(bucket, ttl))
        return count

