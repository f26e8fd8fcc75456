"""The engine's facade: one node's buckets, objects, uploads and budget, built from its parts.

The parts (each readable alone):

==============  ==============================================================================
``budget``      :class:`~.budget.Budget` — what is charged against the byte budget; reservations
``store``       :class:`~.store.ObjectStore` — buckets, objects, TTLs, pins, eviction
``multipart``   :class:`~.multipart.Multipart` — uploads in progress and their parts
``operator``    :class:`~.operator.Operator` — stats and the operator verbs
``tier``        :class:`~.tier.FlashTier` — the flash tier below RAM, when the node has one
==============  ==============================================================================

The protocol layers, the admin API, events and metrics talk to :class:`Engine` only. Every synchronous method
runs to completion on the caller's thread, so each call is atomic with respect to every other call made from
the same event loop. The ``async`` ones are those that may read the flash tier (:meth:`Engine.fetch`,
:meth:`Engine.fetch_many`, listing, the operator's flush): after their await they check again what RAM holds,
so a write that landed meanwhile wins.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import AsyncGenerator, Callable, Iterable, Iterator
from typing import Any, TypeVar

from ..flash import RecoveryReport
from . import errors
from .budget import Budget, Reservation
from .config import EngineConfig
from .multipart import Multipart
from .objects import OBJECT_OVERHEAD, Bucket, Completion, Part, Payload, StoredObject, Upload
from .operator import Operator
from .store import BlockWrite, Clock, ObjectStore, RemovalListener, StoreListener
from .tier import DISK, RAM, DiskListener, FlashTier

T = TypeVar("T")

log = logging.getLogger("ctxstore.engine")

LIST_CHUNK = 1000  # keys taken from RAM (or flash) at a time when a listing merges the tiers


class Engine:
    """All buckets and objects of one node."""

    def __init__(self, config: EngineConfig | None = None, clock: Clock = time.time) -> None:
        self.config = config or EngineConfig()
        self.clock = clock
        self.budget = Budget(self.config)
        self.store = ObjectStore(self.config, self.budget, clock)
        self.multipart = Multipart(self.config, self.budget, self.store, clock)
        self.operator = Operator(self.config, self.budget, self.store, self.multipart)
        self.tier: FlashTier | None = None
        if self.config.disk_path:
            self.tier = FlashTier(self.config, self.store, clock)
            self.tier.manifest_source = self.manifest
            self.store.lower = self.tier
            self.operator.tier_stats = self.tier.stats

    # ------------------------------------------------------------------ lifecycle (the flash tier)

    async def open(self) -> RecoveryReport | None:
        """Bring the flash tier up: rebuild its index, restore buckets, policies and quotas from its manifest,
        forget blocks of buckets the manifest does not know. Serve only after this returns."""
        tier = self.tier
        if tier is None:
            return None
        report = await tier.open(self.config.disk_reset)
        self._restore(report.manifest or {})
        for name in tier.flash.buckets():
            if name not in self.store.buckets:
                tier.flash.drop_bucket(name)
        tier.refresh(tier.flash.stats())
        await tier.save_manifest()
        return report

    def announce_recovered(self) -> None:
        """Send a ``stored`` event (disk medium) for every block the flash tier recovered, in the background:
        call once the event publishers run, so routers that lost this node's view learn it again."""
        tier = self.tier
        if tier is not None and tier.recovery is not None and tier.recovery.blocks and tier.listeners:
            tier.announce_recovered()

    async def close(self, spill_seconds: float = 0.0) -> int:
        """A clean shutdown of the flash tier: write what waits for it, and for up to ``spill_seconds`` what
        only RAM holds (so a planned restart keeps it), save the manifest, seal the segments. Returns how many
        blocks were spilled from RAM."""
        if self.tier is None:
            return 0
        return await self.tier.close(spill_seconds)

    async def housekeep_disk(self) -> None:
        """The flash tier's bounded background work (expiry, eviction, compaction); call it every second."""
        if self.tier is not None:
            await self.tier.housekeep()

    @property
    def disk_degraded(self) -> str | None:
        """Why the flash tier stopped writing (a device error), or None."""
        return None if self.tier is None else self.tier.flash.degraded

    def manifest(self) -> dict[str, Any]:
        """What a restart needs besides the blocks: buckets with their owners and policies, tenant quotas."""
        return {
            "v": 1,
            "buckets": [{"name": b.name, "owner": b.owner, "created": b.created, "default_ttl": b.default_ttl,
                         "sliding_ttl": b.sliding_ttl, "quota": b.quota} for b in self.store.buckets.values()],
            "tenant_quotas": dict(self.budget.tenant_quota),
        }

    def _restore(self, manifest: dict[str, Any]) -> None:
        for row in manifest.get("buckets", []):
            try:
                name, owner = str(row["name"]), str(row["owner"])
                if name in self.store.buckets:
                    continue
                self.store.create_bucket(owner, name)
                bucket = self.store.buckets[name]
                bucket.created = float(row.get("created") or bucket.created)
                self.operator.set_bucket_policy(name, default_ttl=row.get("default_ttl"),
                                                sliding_ttl=bool(row.get("sliding_ttl")), quota=row.get("quota"))
            except (KeyError, TypeError, ValueError, errors.StorageError) as exc:
                log.warning("flash manifest: bucket %r not restored: %s", row, exc)
        for tenant, quota in dict(manifest.get("tenant_quotas", {})).items():
            self.operator.set_tenant_quota(str(tenant), int(quota))

    def _manifest_changed(self) -> None:
        if self.tier is not None:
            self.tier.manifest_changed()

    # ------------------------------------------------------------------ listeners

    def subscribe(self, on_store: StoreListener | None = None, on_remove: RemovalListener | None = None,
                  on_disk: DiskListener | None = None) -> None:
        """Call ``on_store(obj)`` after every commit to RAM and ``on_remove(obj, reason)`` after every removal
        from RAM (synchronously: keep them cheap); reasons are :data:`~.store.REMOVAL_REASONS`. ``on_disk(type,
        block, reason)``: the flash tier's events (a demotion: ``removed``/``demoted`` then ``stored``)."""
        if on_store is not None:
            self.store.on_store.append(on_store)
        if on_remove is not None:
            self.store.on_remove.append(on_remove)
        if on_disk is not None and self.tier is not None:
            self.tier.listeners.append(on_disk)

    # ------------------------------------------------------------------ budget levels

    @property
    def used(self) -> int:
        return self.budget.used

    @property
    def reserved(self) -> int:
        return self.budget.reserved

    @property
    def parts_bytes(self) -> int:
        return self.budget.parts

    @property
    def pinned_bytes(self) -> int:
        return self.budget.pinned

    @property
    def state_bytes(self) -> int:
        return self.budget.state

    @property
    def sending_bytes(self) -> int:
        return self.budget.sending

    # ------------------------------------------------------------------ buckets

    def create_bucket(self, tenant: str, name: str) -> bool:
        """Create ``name`` for ``tenant``; False if the tenant owns it already (not an error in S3)."""
        created = self.store.create_bucket(tenant, name)
        if created:
            self._manifest_changed()
        return created

    def bucket(self, tenant: str, name: str) -> Bucket:
        """The bucket if ``tenant`` owns it (NoSuchBucket / AccessDenied otherwise)."""
        return self.store.bucket(tenant, name)

    def list_buckets(self, tenant: str) -> list[Bucket]:
        return self.store.list_buckets(tenant)

    def delete_bucket(self, tenant: str, name: str) -> None:
        """Delete an empty bucket; its unfinished uploads go with it."""
        bucket = self.store.remove_bucket(tenant, name)
        self.multipart.drop_bucket(name)
        self.operator.forget_bucket(bucket)
        self._manifest_changed()

    def owner_of(self, name: str) -> str | None:
        """The tenant owning bucket ``name``, or None."""
        bucket = self.store.buckets.get(name)
        return None if bucket is None else bucket.owner

    async def live_keys(self, name: str | None = None, at: Callable[[], None] = lambda: None
                        ) -> dict[str, tuple[str, list[str], list[str]]]:
        """Bucket → (owner, its live keys in order, those of them held only by the flash tier), for one bucket
        (``name``) or all, exactly as of the moment ``at()`` is called (synchronously, after any flash
        listing: the event stream takes its sequence number there)."""
        buckets = self.store.buckets
        chosen = [buckets[name]] if name is not None and name in buckets else (
            [] if name is not None else list(buckets.values()))
        tier = self.tier
        listed: dict[str, list[str]] = {}
        if tier is not None:
            with tier.watch() as fresh:  # blocks demoted while flash is listed are added from here
                for b in chosen:
                    listed[b.name] = await tier.keys_under(b.name, "")
                at()
                now = self.clock()
                out = {}
                for b in chosen:
                    if buckets.get(b.name) is not b:
                        continue
                    ram = [k for k, o in b.objects.items() if not o.expired(now)]
                    in_ram = set(ram)
                    maybe = [k for k in dict.fromkeys(listed[b.name] + fresh.get(b.name, [])) if k not in in_ram]
                    disk = sorted(k for k, size in zip(maybe, tier.sizes(b.name, maybe)) if size is not None)
                    out[b.name] = (b.owner, sorted(in_ram.union(disk)), disk)
                return out
        at()
        now = self.clock()
        return {b.name: (b.owner, [k for k, o in b.objects.items() if not o.expired(now)], []) for b in chosen}

    # ------------------------------------------------------------------ objects

    def check_fits(self, tenant: str, bucket_name: str, nbytes: int, fixed: int = OBJECT_OVERHEAD) -> None:
        """EntityTooLarge unless an object of ``nbytes`` (``fixed`` more once stored) could ever be stored."""
        self.store.check_fits(tenant, bucket_name, nbytes, fixed)

    async def with_write_room(self, attempt: Callable[[], T]) -> T:
        """``attempt()`` (a reservation opening or growing, before the bytes it holds room for are read), waiting
        while it needs a RAM victim demoted and the flash write queue is full: backpressure instead of a dropped
        block. Past ``disk_write_wait`` it raises InsufficientCapacity (503 SlowDown, a retryable bulk error).
        Reads never come here: a promotion that finds no room sends its block from a transient buffer."""
        deadline: float | None = None
        while True:
            try:
                return attempt()
            except errors.FlashQueueFull:
                tier = self.tier
                assert tier is not None
                now = time.monotonic()
                if deadline is None:
                    deadline = now + self.config.disk_write_wait
                    tier.counters.write_waits += 1
                if now >= deadline:
                    tier.counters.write_refusals += 1
                    raise errors.InsufficientCapacity(
                        f"RAM is full and the flash tier's write queue stayed full for {self.config.disk_write_wait:g} "
                        "s (the device is slower than the writes): retry", retry_after=1.0) from None
                await tier.queue_progress(deadline - now)

    def reserve(self, tenant: str, bucket_name: str, nbytes: int | None, fixed: int = OBJECT_OVERHEAD, *,
                key: str | None = None, same_request: bool = False) -> Reservation:
        """A reservation for a body of ``nbytes`` (``fixed`` more once stored), opened before the body is read:
        what could never be stored is refused now; it holds budget as the body arrives (``grow``).
        ``same_request``: a later block of a request that already holds one (the tenant's in-flight limit is
        checked once per request). ``key``: the object it replaces (its bytes count as free)."""
        return self.store.reserve(tenant, bucket_name, nbytes, fixed, key=key, same_request=same_request)

    def reserve_run(self, tenant: str, bucket_name: str, nbytes: int, fixed: int, *,
                    same_request: bool = False) -> Reservation:
        """One reservation for a run of new objects of ``nbytes`` payload in all (``fixed`` more once stored),
        each already found to fit (:meth:`check_fits`): a bulk put of many small blocks holds budget for a run
        of them at a time instead of one reservation each. Replaces nothing (no credit for live objects)."""
        return self.store.reserve_run(tenant, bucket_name, nbytes, fixed, same_request=same_request)

    def payload_buffer(self, size: int) -> bytearray | memoryview:
        """A writable buffer of ``size`` bytes for a payload about to arrive, reused from a block that died
        when one of the size is kept (:mod:`.buffers`). It holds stale bytes: fill all of it, or drop it."""
        return self.store.buffers.take(size)

    def payload_buffers(self, sizes: list[int]) -> list[bytearray | memoryview]:
        """:meth:`payload_buffer` for each of ``sizes`` (a run of blocks), at once."""
        return self.store.buffers.take_many(sizes)

    def lease(self, obj: StoredObject) -> Callable[[], None]:
        """Count a response sending ``obj``'s payload until the returned function is called (a removed object
        stays charged to the budget until its last send ends)."""
        return self.store.lease(obj)

    def put(self, tenant: str, bucket_name: str, key: str, data: Payload, *, etag: str, ttl: float | None = None,
            content_type: str = "binary/octet-stream", headers: dict[str, str] | None = None,
            user_meta: dict[str, str] | None = None, checksums: dict[str, str] | None = None,
            parts_count: int = 0, if_none_match: bool | str = False, if_match: str | None = None,
            reservation: Reservation | None = None, xxh3: int | None = None) -> StoredObject:
        """Commit a whole object atomically (see :meth:`.store.ObjectStore.put`)."""
        obj = self.store.put(tenant, bucket_name, key, data, etag=etag, ttl=ttl, content_type=content_type,
                             headers=headers, user_meta=user_meta, checksums=checksums, parts_count=parts_count,
                             if_none_match=if_none_match, if_match=if_match, reservation=reservation, xxh3=xxh3)
        self._to_flash_after_write(obj)
        return obj

    def put_blocks(self, tenant: str, bucket_name: str, blocks: list[BlockWrite], *, ttl: float | None,
                   if_absent: bool) -> list[errors.StorageError | StoredObject]:
        """Commit many verified blocks of one bucket, each on its own: per block the stored object, or the
        ``PreconditionFailed`` / capacity error that kept it out (see :meth:`.store.ObjectStore.put_blocks`)."""
        out = self.store.put_blocks(tenant, bucket_name, blocks, ttl=ttl, if_absent=if_absent)
        # Last key first: a call's keys are a chain's blocks in order, and a full flash tier drops its oldest
        # segment first, so the chain's head must be the last of them written (what goes is then its tail).
        for obj in reversed(out):
            if isinstance(obj, StoredObject):
                self._to_flash_after_write(obj)
        return out

    def _to_flash_after_write(self, obj: StoredObject) -> None:
        """``disk_direct_size``: a large object goes to flash right after its write (served from the demotion
        queue until it lands; in RAM while it waits for room in that queue) instead of taking RAM until it is
        evicted. Otherwise ``disk_write_back``: a copy goes to flash and the object stays in RAM."""
        tier = self.tier
        if tier is None:
            return
        threshold = self.config.disk_direct_size
        if threshold and obj.size >= threshold:
            tier.send_direct(obj)
        elif self.config.disk_write_back:
            tier.write_back(obj)

    def exists(self, tenant: str, bucket_name: str, key: str) -> bool:
        """Whether either tier holds a live object at ``key`` (not counted as a read)."""
        return self.existing(tenant, bucket_name, [key])[0]

    def existing(self, tenant: str, bucket_name: str, keys: list[str]) -> list[bool]:
        """Per key, whether either tier holds a live object there (not counted as a read)."""
        bucket = self.store.bucket(tenant, bucket_name)
        found = [obj is not None for obj in self.store.lookup_in(bucket, keys, record=False, count_misses=False)]
        tier = self.tier
        if tier is not None:
            found = [hit or tier.holds(bucket_name, key) for hit, key in zip(found, keys, strict=True)]
        return found

    def get(self, tenant: str, bucket_name: str, key: str, *, record: bool = True) -> StoredObject:
        """The live object at ``key``; ``record`` counts a hit/miss, refreshes LRU and slides the TTL."""
        return self.store.get(tenant, bucket_name, key, record=record)

    def lookup(self, tenant: str, bucket_name: str, keys: Iterable[str]) -> list[StoredObject | None]:
        """Live objects in RAM for many keys (None where absent); counts hits and misses, touches LRU."""
        return self.store.lookup(tenant, bucket_name, keys)

    def locate(self, tenant: str, bucket_name: str, keys: list[str]) -> tuple[list[int], list[str | None] | None]:
        """Per key the live block's payload size (-1 where absent) and its tier (``ram``, ``disk`` or None),
        RAM first; the tiers are None on a node without a flash tier (every present block is in RAM). Counts
        hits (and flash hits) and misses, touches LRU. No I/O: the flash tier answers from its index. Flat
        lists, not a tuple per key: a lookup of 8192 keys is on the hot path."""
        bucket = self.store.bucket(tenant, bucket_name)
        tier = self.tier
        ram = self.store.lookup(tenant, bucket_name, keys, count_misses=tier is None)
        sizes = [-1 if o is None else o.size for o in ram]
        if tier is None:
            return sizes, None
        if -1 not in sizes:
            return sizes, [RAM] * len(sizes)
        tiers: list[str | None] = [None if o is None else RAM for o in ram]
        absent = [i for i, size in enumerate(sizes) if size < 0]
        stats = bucket.stats
        for i, size in zip(absent, tier.sizes(bucket.name, [keys[i] for i in absent])):
            if size is None:
                stats.misses += 1
            else:
                stats.hits += 1
                stats.disk_hits += 1
                sizes[i], tiers[i] = size, DISK
        return sizes, tiers

    async def fetch(self, tenant: str, bucket_name: str, key: str, *, record: bool = True,
                    meta_only: bool = False) -> StoredObject:
        """The live object at ``key`` from RAM or the flash tier (NoSuchKey if neither has it). ``record``:
        count the hit or miss, refresh LRU, slide the TTL, promote a flash hit into RAM. ``meta_only``: a flash
        hit reads only the record's header (HEAD); its ``data`` is then empty."""
        tier = self.tier
        if tier is None:
            return self.store.get(tenant, bucket_name, key, record=record)
        bucket = self.store.bucket(tenant, bucket_name)
        found = await self._fetch(bucket, [key], record=record, meta_only=meta_only)
        if found[0] is None:
            raise errors.NoSuchKey(bucket=bucket_name, key=key)
        return found[0]

    async def fetch_many(self, tenant: str, bucket_name: str, keys: list[str]) -> list[StoredObject | None]:
        """Live objects for many keys from RAM or the flash tier (None where absent), recorded as reads. The
        flash reads of one call are bounded to half the budget; keys beyond that are answered as misses."""
        if self.tier is None:
            return self.store.lookup(tenant, bucket_name, keys)
        bucket = self.store.bucket(tenant, bucket_name)
        return await self._fetch(bucket, keys, record=True, meta_only=False)

    async def _fetch(self, bucket: Bucket, keys: list[str], *, record: bool, meta_only: bool
                     ) -> list[StoredObject | None]:
        tier = self.tier
        assert tier is not None
        store = self.store
        out = store.lookup_in(bucket, keys, record=record, count_misses=False)
        absent = [i for i, o in enumerate(out) if o is None]
        if absent:
            names = [keys[i] for i in absent]
            if not meta_only:  # a bounded read: what does not fit is a miss (a recompute, never an error)
                room, chosen = self.config.budget // 2, []
                for i, size in zip(absent, tier.sizes(bucket.name, names)):
                    if size is not None and size <= room:
                        room -= size
                        chosen.append(i)
                absent, names = chosen, [keys[i] for i in chosen]
            read = await tier.read(bucket, names, with_payload=not meta_only) if names else []
            # RAM may have got a newer version during the read: it wins.
            again = store.lookup_in(bucket, names, record=record, count_misses=False)
            now = self.clock()
            for i, ram, obj in zip(absent, again, read):
                if ram is not None:
                    out[i] = ram
                elif obj is not None:
                    out[i] = obj
                    if record:
                        self._record_disk_hit(bucket, obj, now, promote=not meta_only)
        if record:
            bucket.stats.misses += sum(1 for o in out if o is None)
        return out

    def _record_disk_hit(self, bucket: Bucket, obj: StoredObject, now: float, *, promote: bool) -> None:
        tier = self.tier
        assert tier is not None
        stats = bucket.stats
        stats.hits += 1
        stats.disk_hits += 1
        if bucket.sliding_ttl and now + obj.ttl > obj.expires_at:
            obj.expires_at = now + obj.ttl
            tier.touch(bucket.name, [obj.key], obj.expires_at)
        if promote:
            tier.promote(bucket, obj)

    async def resident(self, tenant: str, bucket_name: str, key: str) -> None:
        """Bring a flash-only object into RAM (before a write conditional on its ETag); a no-op otherwise."""
        if self.tier is None:
            return
        bucket = self.store.bucket(tenant, bucket_name)
        if self.store.lookup_in(bucket, [key], record=False, count_misses=False)[0] is None:
            [obj] = await self.tier.read(bucket, [key])
            if obj is not None and obj.transient:
                self.tier.promote(bucket, obj)

    def prefetch(self, tenant: str, bucket_name: str, keys: list[str]) -> dict[str, int]:
        """Start promoting the flash-resident ``keys`` into RAM ahead of a restore; returns at once how many
        keys are in RAM, on flash, in neither tier, and how many it started reading (0 when the node's
        prefetches are all busy, or it has no flash tier)."""
        bucket = self.store.bucket(tenant, bucket_name)
        now = self.clock()
        in_ram = sum(1 for k in keys if (o := bucket.objects.get(k)) is not None and not o.expired(now))
        if self.tier is None:
            return {"ram": in_ram, "disk": 0, "missing": len(keys) - in_ram, "started": 0}
        on_disk = sum(1 for size in self.tier.sizes(bucket.name, keys) if size is not None)
        started = self.tier.prefetch(bucket, keys)
        return {"ram": in_ram, "disk": on_disk, "missing": max(0, len(keys) - in_ram - on_disk), "started": started}

    def record_read(self, obj: StoredObject, nbytes: int) -> None:
        """Count payload bytes sent to a reader."""
        self.store.record_read(obj, nbytes)

    def delete(self, tenant: str, bucket_name: str, key: str) -> bool:
        """Remove ``key``; whether a live object was removed."""
        return self.store.delete(tenant, bucket_name, key)

    def iter_objects(self, tenant: str, bucket_name: str, start: str = "", inclusive: bool = True
                     ) -> Iterator[StoredObject]:
        """Live objects in RAM in key order from ``start``."""
        return self.store.iter_objects(tenant, bucket_name, start, inclusive)

    async def list_objects(self, tenant: str, bucket_name: str, start: str = "", inclusive: bool = True
                           ) -> AsyncGenerator[StoredObject, None]:
        """Live objects of both tiers in key order from ``start`` (a key in both is listed once, from RAM).
        Flash-resident ones come with their metadata (read from their record headers) and no payload."""
        bucket = self.store.bucket(tenant, bucket_name)
        tier = self.tier
        if tier is None:
            for obj in self.store.iter_objects(tenant, bucket_name, start, inclusive):
                yield obj
            return
        cursor, first = start, inclusive  # keys > cursor (>= on the first round when inclusive)
        while True:
            # A chunk from RAM, taken at once: the bucket may change while flash is read below.
            ram = list(itertools.islice(self.store.iter_objects(tenant, bucket_name, cursor, first), LIST_CHUNK))
            raw = await tier.list_page(bucket.name, _before(cursor) if first else cursor, LIST_CHUNK)
            names = [k for k in raw if k >= cursor] if first else raw
            # Emit up to the first point where either source may have more keys it has not shown yet.
            ends = [ram[-1].key] if len(ram) == LIST_CHUNK else []
            if len(raw) == LIST_CHUNK:
                ends.append(raw[-1])
            bound = min(ends) if ends else None
            ram_keys = {o.key for o in ram}
            names = [k for k in names if k not in ram_keys and (bound is None or k <= bound)]
            disk = [o for o in await tier.read(bucket, names, with_payload=False) if o is not None] if names else []
            merged = [o for o in ram if bound is None or o.key <= bound] + disk
            merged.sort(key=lambda o: o.key)
            for obj in merged:
                yield obj
            if bound is None:
                return
            cursor, first = bound, False

    def pin(self, tenant: str, bucket_name: str, keys: Iterable[str], seconds: float) -> int:
        return self.store.pin(tenant, bucket_name, keys, seconds)

    def unpin(self, tenant: str, bucket_name: str, keys: Iterable[str]) -> int:
        return self.store.unpin(tenant, bucket_name, keys)

    def touch(self, tenant: str, bucket_name: str, keys: Iterable[str], ttl: float | None = None) -> int:
        return self.store.touch(tenant, bucket_name, keys, ttl)

    # ------------------------------------------------------------------ multipart

    def create_upload(self, tenant: str, bucket_name: str, key: str, *, ttl: float | None, content_type: str,
                      headers: dict[str, str], user_meta: dict[str, str],
                      checksum_algorithm: str | None = None) -> Upload:
        return self.multipart.create(tenant, bucket_name, key, ttl=ttl, content_type=content_type,
                                     headers=headers, user_meta=user_meta, checksum_algorithm=checksum_algorithm)

    def upload(self, tenant: str, bucket_name: str, key: str, upload_id: str) -> Upload:
        return self.multipart.get(tenant, bucket_name, key, upload_id)

    def check_part(self, tenant: str, bucket_name: str, key: str, upload_id: str, number: int,
                   nbytes: int) -> Upload:
        """The upload, unless a part of ``nbytes`` could never join it (EntityTooLarge: the upload would outgrow
        the budget or a quota; its parts cannot be evicted). Before the part's body is read."""
        return self.multipart.check_part(tenant, bucket_name, key, upload_id, number, nbytes)

    def completion(self, tenant: str, bucket_name: str, key: str, upload_id: str) -> Completion | None:
        """The remembered answer of an upload completed before, so a retried Complete can succeed again."""
        return self.multipart.completion(tenant, bucket_name, key, upload_id)

    def uploads_in(self, tenant: str, bucket_name: str, prefix: str = "") -> list[Upload]:
        """The tenant's uploads into a bucket, by key then age."""
        self.store.bucket(tenant, bucket_name)
        return self.multipart.in_bucket(bucket_name, prefix)

    def put_part(self, tenant: str, bucket_name: str, key: str, upload_id: str, number: int, data: Payload, *,
                 md5: bytes, checksums: dict[str, str], reservation: Reservation | None = None) -> Part:
        return self.multipart.put_part(tenant, bucket_name, key, upload_id, number, data, md5=md5,
                                       checksums=checksums, reservation=reservation)

    def complete_upload(self, tenant: str, bucket_name: str, key: str, upload_id: str, parts: list[tuple[int, str]],
                        *, if_none_match: bool | str = False, if_match: str | None = None,
                        checksums: dict[str, str] | None = None) -> StoredObject | Completion:
        done = self.multipart.complete(tenant, bucket_name, key, upload_id, parts, if_none_match=if_none_match,
                                       if_match=if_match, checksums=checksums)
        if isinstance(done, StoredObject):
            self._to_flash_after_write(done)
        return done

    def abort_upload(self, tenant: str, bucket_name: str, key: str, upload_id: str) -> None:
        self.multipart.abort(tenant, bucket_name, key, upload_id)

    # ------------------------------------------------------------------ housekeeping

    def reap(self, limit: int = 10000) -> int:
        """Drop up to ``limit`` expired objects and stale uploads; returns the objects dropped."""
        removed = self.store.reap_expired(limit)
        self.store.drain_pins(self.clock())
        self.multipart.reap_stale(limit)
        self.store.compact_expiry_heap()
        self.store.buffers.housekeep()
        return removed

    # ------------------------------------------------------------------ operator verbs

    def stats(self, reset: bool = False) -> dict[str, Any]:
        """Global and per-bucket counters; ``reset`` zeroes the counters after reading."""
        return self.operator.stats(reset)

    def bucket_summaries(self) -> list[dict[str, Any]]:
        return self.operator.bucket_summaries()

    def set_bucket_policy(self, name: str, *, default_ttl: float | None = None, sliding_ttl: bool | None = None,
                          quota: int | None = None) -> dict[str, Any]:
        policy = self.operator.set_bucket_policy(name, default_ttl=default_ttl, sliding_ttl=sliding_ttl, quota=quota)
        self._manifest_changed()
        return policy

    def set_tenant_quota(self, tenant: str, quota: int) -> None:
        self.operator.set_tenant_quota(tenant, quota)
        self._manifest_changed()

    def tenant_usage(self, tenant: str) -> tuple[int, int]:
        """(quota, charged bytes) of a tenant; a quota of 0 means none."""
        return self.budget.tenant_usage(tenant)

    async def flush(self, name: str, prefix: str = "") -> int:
        """Remove every object of a bucket (or under ``prefix``) from both tiers, pinned or not. Returns how
        many were live in RAM plus how many the flash tier held."""
        ram = self.operator.flush(name, prefix)
        tier = self.tier
        if tier is None:
            return ram
        bucket = self.store.bucket_named(name)
        held = tier.forget(bucket, await tier.keys_under(name, prefix), "flushed")
        if not prefix:
            tier.drop_bucket(name)
        return ram + held

    async def expire_now(self, name: str, prefix: str = "") -> int:
        """Expire every object of a bucket (or under ``prefix``) in both tiers now; how many were live (RAM
        plus flash)."""
        ram = self.operator.expire_now(name, prefix)
        if self.tier is None:
            return ram
        return ram + await self.tier.expire(self.store.bucket_named(name), prefix)

    def set_limits(self, *, budget: int | None = None, default_ttl: float | None = None,
                   max_ttl: float | None = None) -> dict[str, Any]:
        return self.operator.set_limits(budget=budget, default_ttl=default_ttl, max_ttl=max_ttl)


def _before(key: str) -> str:
    """A string just below ``key`` in code-point order, so a listing "after" it includes ``key`` itself."""
    if not key:
        return ""
    last = ord(key[-1])
    return key[:-1] if last == 0 else key[:-1] + chr(last - 1) + "\U0010ffff"
