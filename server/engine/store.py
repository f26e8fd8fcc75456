"""The in-memory block engine: buckets, objects, byte budget, TTL, pins, eviction and multipart uploads.

No HTTP here. Every method runs to completion on the caller's thread without yielding, so a call is atomic
with respect to every other call made from the same event loop: a conditional write is checked and applied
in one step, and a reader never sees half an object.

Capacity: ``used`` counts committed objects (payload, key, metadata, fixed overhead), multipart parts and
reservations taken by uploads still in flight. Room is made *before* a body is read, so memory never
exceeds the budget by more than the object being committed. Making room evicts expired objects first,
then the least recently used unpinned ones; every step is O(log n) and a write evicts only what it needs.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from types import MappingProxyType

import xxhash

from . import errors
from .objects import OBJECT_OVERHEAD, Bucket, BucketStats, Part, Payload, StoredObject, Upload

# Shared by every object without metadata of a kind: three empty dicts per object would cost ~200 bytes.
_EMPTY: dict[str, str] = MappingProxyType({})  # type: ignore[assignment]

# Why an object left the store; also the `reason` of a removal event.
REMOVAL_REASONS = ("evicted", "expired", "deleted", "flushed", "replaced")

RemovalListener = Callable[[StoredObject, str], None]
StoreListener = Callable[[StoredObject], None]


@dataclass
class EngineConfig:
    """Engine limits. Byte figures are bytes, durations seconds."""

    budget: int = 1 << 30
    default_ttl: float = 3600.0
    max_ttl: float = 7 * 86400.0
    max_pin: float = 86400.0
    max_object_size: int = 5 << 30
    min_part_size: int = 5 << 20
    max_parts: int = 10000
    upload_ttl: float = 3600.0  # an abandoned multipart upload is dropped after this
    max_pinned_scan: int = 10000  # pinned objects one write may step over before it gives up


class Reservation:
    """Budget set aside for an upload in flight; released on commit or on failure (idempotent)."""

    __slots__ = ("_engine", "nbytes")

    def __init__(self, engine: Engine, nbytes: int) -> None:
        self._engine = engine
        self.nbytes = nbytes

    def release(self) -> None:
        if self.nbytes:
            self._engine._release(self.nbytes)
            self.nbytes = 0

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class Engine:
    """All buckets and objects of one node. See the module docstring for the guarantees."""

    def __init__(self, config: EngineConfig | None = None, clock: Callable[[], float] = time.time) -> None:
        self.config = config or EngineConfig()
        self.clock = clock
        self.buckets: dict[str, Bucket] = {}
        self.uploads: dict[str, Upload] = {}
        self.used = 0  # bytes charged: objects + parts + reservations
        self.reserved = 0  # of which: reservations for uploads in flight
        self.parts_bytes = 0  # of which: multipart parts
        self.pinned_bytes = 0  # of which: objects pinned right now (refreshed lazily)
        self._lru: OrderedDict[StoredObject, None] = OrderedDict()  # least recently used first
        # Heaps of (time, seq, bucket, key). They name objects rather than hold them, so a removed object's
        # payload is freed at once instead of lingering until its old expiry; stale entries are skipped.
        self._expiry: list[tuple[float, int, str, str]] = []
        self._pins: list[tuple[float, int, str, str]] = []  # pin ends
        self._seq = itertools.count()
        self.on_store: list[StoreListener] = []
        self.on_remove: list[RemovalListener] = []
        self.removed_stats = BucketStats()  # counters of deleted buckets, so global totals never go back

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

    def list_buckets(self, tenant: str) -> list[Bucket]:
        return sorted((b for b in self.buckets.values() if b.owner == tenant), key=lambda b: b.name)

    def delete_bucket(self, tenant: str, name: str) -> None:
        bucket = self.bucket(tenant, name)
        now = self.clock()
        if any(not obj.expired(now) for obj in bucket.objects.values()):
            raise errors.BucketNotEmpty(bucket=name)
        for obj in list(bucket.objects.values()):
            self._remove(obj, "expired")
        for upload in [u for u in self.uploads.values() if u.bucket == name]:
            self._drop_upload(upload)
        _add_counters(self.removed_stats, bucket.stats)
        del self.buckets[name]

    # ------------------------------------------------------------------ capacity

    def reserve(self, nbytes: int) -> Reservation:
        """Set aside room for an object of ``nbytes`` payload before its body is read.

        Raises InsufficientCapacity when eviction cannot make room (everything left pinned or in flight)
        and EntityTooLarge when the object could never fit."""
        if nbytes > self.config.max_object_size:
            raise errors.EntityTooLarge(f"object of {nbytes} bytes exceeds the maximum {self.config.max_object_size}")
        charge = nbytes + OBJECT_OVERHEAD
        self._make_room(charge)
        self.used += charge
        self.reserved += charge
        return Reservation(self, charge)

    def _release(self, nbytes: int) -> None:
        self.used -= nbytes
        self.reserved -= nbytes

    def _make_room(self, need: int, replacing: StoredObject | None = None) -> None:
        """``replacing``: the live object the new one replaces; its bytes count as free and it is not evicted."""
        budget = self.config.budget
        if need > budget:
            raise errors.EntityTooLarge(f"{need} bytes cannot fit in a budget of {budget}")
        credit = replacing.charge if replacing is not None else 0
        if self.used - credit + need <= budget:
            return
        now = self.clock()
        self._reap_expired(now, limit=None, stop_when_fits=need - credit)
        if self.used - credit + need <= budget:
            return
        self._drain_pins(now)
        evictable = self.used - self.reserved - self.parts_bytes - self.pinned_bytes
        if replacing is not None and not replacing.pinned(now):
            evictable -= credit
        if self.used - credit - evictable + need > budget:
            raise errors.InsufficientCapacity("everything left in the budget is pinned or being written")
        stepped_over = 0
        while self.used - credit + need > budget:
            if not self._lru:
                raise errors.InsufficientCapacity("nothing left to evict")
            obj, _ = self._lru.popitem(last=False)
            if obj.pinned(now) or obj is replacing:
                # Pinned: step over it. It goes to the recent end; it is revisited only after everything else.
                self._lru[obj] = None
                stepped_over += 1
                if stepped_over > self.config.max_pinned_scan:
                    raise errors.InsufficientCapacity("too many pinned objects to step over")
                continue
            self._remove(obj, "evicted")

    def _reap_expired(self, now: float, limit: int | None, stop_when_fits: int | None = None) -> int:
        removed = 0
        heap = self._expiry
        while heap and heap[0][0] <= now:
            if limit is not None and removed >= limit:
                break
            if stop_when_fits is not None and self.used + stop_when_fits <= self.config.budget:
                break
            expires_at, _, bucket, key = heapq.heappop(heap)
            obj = self._find(bucket, key)
            if obj is not None and obj.expires_at == expires_at:
                self._remove(obj, "expired")
                removed += 1
        return removed

    def _find(self, bucket: str, key: str) -> StoredObject | None:
        """The live object at (bucket, key) whatever its expiry, or None."""
        b = self.buckets.get(bucket)
        return None if b is None else b.objects.get(key)

    def _drain_pins(self, now: float) -> None:
        heap = self._pins
        while heap and heap[0][0] <= now:
            until, _, bucket, key = heapq.heappop(heap)
            obj = self._find(bucket, key)
            if obj is not None and obj.pinned_until == until:
                self.pinned_bytes -= obj.charge
                obj.pinned_until = 0.0  # drained: no longer counted in pinned_bytes

    def reap(self, limit: int = 10000) -> int:
        """Background housekeeping: drop up to ``limit`` expired objects and stale uploads. Returns the count."""
        now = self.clock()
        removed = self._reap_expired(now, limit)
        self._drain_pins(now)
        stale = [u for u in self.uploads.values() if u.created + self.config.upload_ttl <= now]
        for upload in stale[:limit]:
            self._drop_upload(upload)
        if len(self._expiry) > 2 * len(self._lru) + 1024:  # stale entries from TTL changes: compact
            self._expiry = [e for e in self._expiry if (o := self._find(e[2], e[3])) and o.expires_at == e[0]]
            heapq.heapify(self._expiry)
        return removed

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
        self._check_conditions(bucket, key, now, if_none_match, if_match)
        ttl_s = self.resolve_ttl(bucket, ttl)
        obj = StoredObject(
            bucket=bucket_name, key=key, data=data, etag=etag,
            xxh3=xxhash.xxh3_64_intdigest(data) if xxh3 is None else xxh3,
            created=now, ttl=ttl_s, content_type=content_type, headers=headers or _EMPTY,
            user_meta=user_meta or _EMPTY, checksums=checksums or _EMPTY, parts_count=parts_count,
        )
        old = bucket.objects.get(key)
        if old is not None and old.expired(now):
            self._remove(old, "expired")
            old = None
        self._make_room(obj.charge, replacing=old)
        if old is not None:
            self._remove(old, "replaced")
        self._insert(bucket, obj)
        bucket.stats.puts += 1
        bucket.stats.bytes_in += obj.size
        for listener in self.on_store:
            listener(obj)
        return obj

    def _check_conditions(
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
        self._lru[obj] = None
        heapq.heappush(self._expiry, (obj.expires_at, next(self._seq), obj.bucket, obj.key))
        self.used += obj.charge
        bucket.stats.objects += 1
        bucket.stats.bytes += obj.size

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
            if reason == "evicted":
                stats.evictions += 1
            elif reason == "expired":
                stats.expirations += 1
            elif reason == "deleted":
                stats.deletes += 1
        self._lru.pop(obj, None)
        self.used -= obj.charge
        if obj.pinned_until:  # counted until drained, even once ended
            self.pinned_bytes -= obj.charge
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
            self._lru.move_to_end(obj)
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
                self.pinned_bytes += obj.charge
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
                self.pinned_bytes -= obj.charge
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

    # ------------------------------------------------------------------ multipart uploads

    def create_upload(
        self, tenant: str, bucket_name: str, key: str, *, ttl: float | None, content_type: str,
        headers: dict[str, str], user_meta: dict[str, str], checksum_algorithm: str | None = None,
    ) -> Upload:
        bucket = self.bucket(tenant, bucket_name)
        if ttl is not None:
            self.resolve_ttl(bucket, ttl)  # validate now, not at completion
        upload = Upload(
            upload_id=secrets.token_urlsafe(24), bucket=bucket_name, key=key, owner=tenant,
            created=self.clock(), ttl=ttl, content_type=content_type, headers=headers, user_meta=user_meta,
            checksum_algorithm=checksum_algorithm,
        )
        self.uploads[upload.upload_id] = upload
        return upload

    def upload(self, tenant: str, bucket_name: str, key: str, upload_id: str) -> Upload:
        self.bucket(tenant, bucket_name)
        upload = self.uploads.get(upload_id)
        if upload is None or upload.bucket != bucket_name or upload.key != key or upload.owner != tenant:
            raise errors.NoSuchUpload(bucket=bucket_name, key=key, upload_id=upload_id)
        return upload

    def put_part(
        self, tenant: str, bucket_name: str, key: str, upload_id: str, number: int, data: Payload, *,
        md5: bytes, checksums: dict[str, str], reservation: Reservation | None = None,
    ) -> Part:
        if reservation is not None:
            reservation.release()  # first: a part that fails must not keep the budget
        if not 1 <= number <= self.config.max_parts:
            raise errors.InvalidArgument(f"part number must be an integer between 1 and {self.config.max_parts}")
        upload = self.upload(tenant, bucket_name, key, upload_id)
        part = Part(number=number, data=data, etag=f'"{md5.hex()}"', md5=md5, last_modified=self.clock(),
                    checksums=checksums)
        self._make_room(part.size)
        old = upload.parts.pop(number, None)
        if old is not None:
            self._uncharge_part(upload, old.size)
        upload.parts[number] = part
        upload.charged += part.size
        self.used += part.size
        self.parts_bytes += part.size
        return part

    def _charge_part(self, upload: Upload, nbytes: int) -> None:
        upload.charged += nbytes
        self.used += nbytes
        self.parts_bytes += nbytes

    def _uncharge_part(self, upload: Upload, nbytes: int) -> None:
        upload.charged -= nbytes
        self.used -= nbytes
        self.parts_bytes -= nbytes

    def complete_upload(
        self, tenant: str, bucket_name: str, key: str, upload_id: str, parts: list[tuple[int, str]], *,
        if_none_match: bool = False, if_match: str | None = None, checksums: dict[str, str] | None = None,
    ) -> StoredObject:
        """Assemble the listed parts (ascending numbers, matching ETags) into one object, atomically.

        ``checksums``: the composite checksums the protocol layer computed from the parts' own."""
        upload = self.upload(tenant, bucket_name, key, upload_id)
        if not parts:
            raise errors.InvalidPart("you must specify at least one part")
        chosen: list[Part] = []
        last = 0
        for number, etag in parts:
            if number <= last:
                raise errors.InvalidPartOrder()
            last = number
            part = upload.parts.get(number)
            if part is None or not etag_matches(etag, part.etag):
                raise errors.InvalidPart(f"part {number} is missing or its ETag does not match")
            chosen.append(part)
        for part in chosen[:-1]:
            if part.size < self.config.min_part_size:
                raise errors.EntityTooSmall(f"part {part.number} is smaller than {self.config.min_part_size} bytes")
        total = sum(p.size for p in chosen)
        bucket = self.bucket(tenant, bucket_name)
        self._check_conditions(bucket, key, self.clock(), if_none_match, if_match)
        # The listed parts become the object: stop counting them as parts before reserving its room, so an
        # upload larger than half the budget can still complete. If there is no room, they count again.
        charged = upload.charged
        self._uncharge_part(upload, charged)
        try:
            reservation = self.reserve(total)
        except errors.StorageError:
            self._charge_part(upload, charged)
            raise
        with reservation:
            data = bytearray(total)
            view = memoryview(data)
            pos = 0
            hasher = xxhash.xxh3_64()
            for part in chosen:
                view[pos:pos + part.size] = part.data
                hasher.update(part.data)
                pos += part.size
            etag = f'"{hashlib.md5(b"".join(p.md5 for p in chosen)).hexdigest()}-{len(chosen)}"'
            self._drop_upload(upload)
            return self.put(
                tenant, bucket_name, key, data, etag=etag, ttl=upload.ttl, content_type=upload.content_type,
                headers=upload.headers, user_meta=upload.user_meta, checksums=checksums or {},
                parts_count=len(chosen), xxh3=hasher.intdigest(), reservation=reservation,
            )

    def abort_upload(self, tenant: str, bucket_name: str, key: str, upload_id: str) -> None:
        self._drop_upload(self.upload(tenant, bucket_name, key, upload_id))

    def _drop_upload(self, upload: Upload) -> None:
        if self.uploads.pop(upload.upload_id, None) is not None:
            self._uncharge_part(upload, upload.charged)
            upload.parts.clear()

    # ------------------------------------------------------------------ stats

    def stats(self) -> dict[str, object]:
        """Global counters and per-bucket counters."""
        total = BucketStats()
        _add_counters(total, self.removed_stats)
        total.objects = total.bytes = 0
        per_bucket = {}
        for bucket in self.buckets.values():
            _add_counters(total, bucket.stats)
            per_bucket[bucket.name] = bucket.stats.as_dict()
        self._drain_pins(self.clock())
        return {
            "budget": self.config.budget,
            "used": self.used,
            "reserved": self.reserved,
            "parts_bytes": self.parts_bytes,
            "pinned_bytes": self.pinned_bytes,
            "uploads": len(self.uploads),
            **total.as_dict(),
            "buckets": per_bucket,
        }


def etag_matches(condition: str, etag: str) -> bool:
    """If-Match / If-None-Match semantics: a list of (possibly weak, quoted or not) ETags, or ``*``."""
    for candidate in condition.split(","):
        candidate = candidate.strip()
        if candidate == "*":
            return True
        if candidate.startswith("W/"):
            candidate = candidate[2:]
        if candidate.strip('"') == etag.strip('"'):
            return True
    return False


def _add_counters(into: BucketStats, other: BucketStats) -> None:
    for name, value in other.as_dict().items():
        setattr(into, name, getattr(into, name) + value)

