"""The engine's facade: one node's buckets, objects, uploads and budget, built from its parts.

The parts (each readable alone):

==============  ==============================================================================
``budget``      :class:`~.budget.Budget` — what is charged against the byte budget; reservations
``store``       :class:`~.store.ObjectStore` — buckets, objects, TTLs, pins, eviction
``multipart``   :class:`~.multipart.Multipart` — uploads in progress and their parts
``operator``    :class:`~.operator.Operator` — stats and the operator verbs
``tier``        :class:`~.lower.LowerTier` — the tier below RAM: :class:`~.tier.FlashTier` on a node with a
                flash directory, :class:`~.lower.NoLowerTier` (holds nothing) on a RAM-only node
``reads``       :class:`~.reads.TierReads` — the reads that span both tiers (locate, fetch, list, prefetch)
==============  ==============================================================================

The protocol layers, the admin API, events and metrics talk to :class:`Engine` and, for what the engine only
passes on, to its parts (``engine.store``, ``engine.budget``, ``engine.multipart``, ``engine.operator``): a
method here earns its place by doing more than forwarding (a tenant's bucket resolved for a read across tiers,
the manifest saved after a change, a write handed on to the lower tier). Every synchronous method
runs to completion on the caller's thread, so each call is atomic with respect to every other call made from
the same event loop. The ``async`` ones are those that may read the lower tier (:meth:`Engine.fetch`,
:meth:`Engine.fetch_many`, listing, the operator's flush): after their await they check again what RAM holds,
so a write that landed meanwhile wins. Nothing here asks whether the node has a flash tier: the lower tier
always exists, and a new engine operation is written once, against :class:`~.lower.LowerTier`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any, TypeVar

from ..flash import RecoveryReport
from . import errors
from .budget import Budget, Reservation
from .config import EngineConfig
from .lower import DiskListener, LowerTier, NoLowerTier
from .multipart import Multipart
from .objects import Completion, Payload, StoredObject, Upload
from .operator import Operator
from .reads import TierReads
from .store import BlockWrite, Clock, ObjectStore, RemovalListener, StoreListener
from .tier import FlashTier

T = TypeVar("T")

log = logging.getLogger("ctxstore.engine")


class Engine:
    """All buckets and objects of one node."""

    def __init__(self, config: EngineConfig | None = None, clock: Clock = time.time) -> None:
        self.config = config or EngineConfig()
        self.clock = clock
        self.budget = Budget(self.config)
        self.store = ObjectStore(self.config, self.budget, clock)
        self.multipart = Multipart(self.config, self.budget, self.store, clock)
        self.tier: LowerTier = NoLowerTier()
        if self.config.disk_path:
            flash = FlashTier(self.config, self.store, clock)
            flash.manifest_source = self.manifest
            self.tier = flash
        self.store.lower = self.tier
        self.operator = Operator(self.config, self.budget, self.store, self.multipart, self.tier)
        self.reads = TierReads(self.config, self.store, self.tier, clock)

    # ------------------------------------------------------------------ lifecycle (the flash tier)

    async def open(self) -> RecoveryReport | None:
        """Bring the lower tier up: rebuild its index, restore buckets, policies and quotas from its manifest,
        forget blocks of buckets the manifest does not know. Serve only after this returns. None: the node
        has no flash tier (nothing to recover)."""
        return await self.tier.open(self.config.disk_reset, self._restore)

    def announce_recovered(self) -> None:
        """Send a ``stored`` event (disk medium) for every block the lower tier recovered, in the background:
        call once the event publishers run, so routers that lost this node's view learn it again."""
        self.tier.announce_recovered()

    async def close(self, spill_seconds: float = 0.0) -> int:
        """A clean shutdown of the lower tier: write what waits for it, and for up to ``spill_seconds`` what
        only RAM holds (so a planned restart keeps it), save the manifest, seal the segments. Returns how many
        blocks were spilled from RAM."""
        return await self.tier.close(spill_seconds)

    async def housekeep_disk(self) -> None:
        """The lower tier's bounded background work (expiry, eviction, compaction); call it every second."""
        await self.tier.housekeep()

    @property
    def disk_degraded(self) -> str | None:
        """Why the flash tier stopped writing (a device error), or None."""
        return self.tier.degraded

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
        if on_disk is not None:
            self.tier.listeners.append(on_disk)

    # ------------------------------------------------------------------ buckets

    def create_bucket(self, tenant: str, name: str) -> bool:
        """Create ``name`` for ``tenant``; False if the tenant owns it already (not an error in S3)."""
        created = self.store.create_bucket(tenant, name)
        if created:
            self._manifest_changed()
        return created

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
        return await self.reads.live_keys(chosen, at)

    # ------------------------------------------------------------------ objects

    def put(self, tenant: str, bucket_name: str, key: str, data: Payload, *, etag: str, ttl: float | None = None,
            content_type: str = "binary/octet-stream", headers: dict[str, str] | None = None,
            user_meta: dict[str, str] | None = None, checksums: dict[str, str] | None = None,
            parts_count: int = 0, if_none_match: bool | str = False, if_match: str | None = None,
            reservation: Reservation | None = None, xxh3: int | None = None) -> StoredObject:
        """Commit a whole object atomically (see :meth:`.store.ObjectStore.put`)."""
        obj = self.store.put(tenant, bucket_name, key, data, etag=etag, ttl=ttl, content_type=content_type,
                             headers=headers, user_meta=user_meta, checksums=checksums, parts_count=parts_count,
                             if_none_match=if_none_match, if_match=if_match, reservation=reservation, xxh3=xxh3)
        self.tier.after_write(obj)
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
                self.tier.after_write(obj)
        return out

    def exists(self, tenant: str, bucket_name: str, key: str) -> bool:
        """Whether either tier holds a live object at ``key`` (not counted as a read)."""
        return self.existing(tenant, bucket_name, [key])[0]

    def existing(self, tenant: str, bucket_name: str, keys: list[str]) -> list[bool]:
        """Per key, whether either tier holds a live object there (not counted as a read)."""
        return self.reads.existing(self.store.bucket(tenant, bucket_name), keys)

    def tiers(self, tenant: str, bucket_name: str, keys: list[str]) -> list[str | None]:
        """Per key the tier holding a live object there (``ram``, ``disk``) or None; not counted as a read (see
        :meth:`.reads.TierReads.tiers`)."""
        return self.reads.tiers(self.store.bucket(tenant, bucket_name), keys)

    def locate(self, tenant: str, bucket_name: str, keys: list[str]) -> tuple[list[int], list[str | None] | None]:
        """Per key the live block's payload size (-1 where absent) and its tier (``ram``, ``disk`` or None;
        None for all when every present block is in RAM); counts hits and misses (see
        :meth:`.reads.TierReads.locate`)."""
        return self.reads.locate(self.store.bucket(tenant, bucket_name), keys)

    async def fetch(self, tenant: str, bucket_name: str, key: str, *, record: bool = True,
                    meta_only: bool = False) -> StoredObject:
        """The live object at ``key`` from RAM or the lower tier (NoSuchKey if neither has it). ``record``:
        count the hit or miss, refresh LRU, slide the TTL, promote a lower-tier hit into RAM. ``meta_only``: a
        lower-tier hit reads only the record's header (HEAD); its ``data`` is then empty."""
        bucket = self.store.bucket(tenant, bucket_name)
        [found] = await self.reads.fetch(bucket, [key], record=record, meta_only=meta_only)
        if found is None:
            raise errors.NoSuchKey(bucket=bucket_name, key=key)
        return found

    async def fetch_many(self, tenant: str, bucket_name: str, keys: list[str]) -> list[StoredObject | None]:
        """Live objects for many keys from RAM or the lower tier (None where absent), recorded as reads. The
        lower tier's reads of one call are bounded to half the budget; keys beyond that are answered as misses."""
        return await self.reads.fetch(self.store.bucket(tenant, bucket_name), keys, record=True, meta_only=False)

    async def resident(self, tenant: str, bucket_name: str, key: str) -> None:
        """Bring an object only the lower tier holds into RAM (before a write conditional on its ETag)."""
        await self.reads.resident(self.store.bucket(tenant, bucket_name), key)

    def prefetch(self, tenant: str, bucket_name: str, keys: list[str]) -> dict[str, int]:
        """Start promoting the lower tier's ``keys`` into RAM ahead of a restore; returns at once how many keys
        are in RAM, below it, in neither tier, and how many it started reading."""
        return self.reads.prefetch(self.store.bucket(tenant, bucket_name), keys)

    def list_objects(self, tenant: str, bucket_name: str, start: str = "", inclusive: bool = True
                     ) -> AsyncGenerator[StoredObject, None]:
        """Live objects of both tiers in key order from ``start`` (a key in both is listed once, from RAM);
        the lower tier's come with their metadata and no payload."""
        return self.reads.list_objects(tenant, self.store.bucket(tenant, bucket_name), start, inclusive)

    # ------------------------------------------------------------------ multipart

    def uploads_in(self, tenant: str, bucket_name: str, prefix: str = "") -> list[Upload]:
        """The tenant's uploads into a bucket, by key then age."""
        self.store.bucket(tenant, bucket_name)
        return self.multipart.in_bucket(bucket_name, prefix)

    def complete_upload(self, tenant: str, bucket_name: str, key: str, upload_id: str, parts: list[tuple[int, str]],
                        *, if_none_match: bool | str = False, if_match: str | None = None,
                        checksums: dict[str, str] | None = None) -> StoredObject | Completion:
        done = self.multipart.complete(tenant, bucket_name, key, upload_id, parts, if_none_match=if_none_match,
                                       if_match=if_match, checksums=checksums)
        if isinstance(done, StoredObject):
            self.tier.after_write(done)
        return done

    # ------------------------------------------------------------------ housekeeping

    def reap(self, limit: int = 10000) -> int:
        """Drop up to ``limit`` expired objects and stale uploads; returns the objects dropped."""
        removed = self.store.expiry.reap(self.clock(), limit)
        self.store.expiry.drain_pins(self.clock())
        self.multipart.reap_stale(limit)
        self.store.expiry.compact()
        self.store.buffers.housekeep()
        return removed

    # ------------------------------------------------------------------ operator verbs

    def set_bucket_policy(self, name: str, *, default_ttl: float | None = None, sliding_ttl: bool | None = None,
                          quota: int | None = None) -> dict[str, Any]:
        policy = self.operator.set_bucket_policy(name, default_ttl=default_ttl, sliding_ttl=sliding_ttl, quota=quota)
        self._manifest_changed()
        return policy

    def set_tenant_quota(self, tenant: str, quota: int) -> None:
        self.operator.set_tenant_quota(tenant, quota)
        self._manifest_changed()

    async def flush(self, name: str, prefix: str = "") -> int:
        """Remove every object of a bucket (or under ``prefix``) from both tiers, pinned or not. Returns how
        many were live in RAM plus how many the flash tier held."""
        ram = self.operator.flush(name, prefix)
        tier = self.tier
        bucket = self.store.bucket_named(name)
        held = tier.forget(bucket, await tier.keys_under(name, prefix), "flushed")
        if not prefix:
            tier.drop_bucket(name)
        return ram + held

    async def expire_now(self, name: str, prefix: str = "") -> int:
        """Expire every object of a bucket (or under ``prefix``) in both tiers now; how many were live (RAM
        plus flash)."""
        ram = self.operator.expire_now(name, prefix)
        return ram + await self.tier.expire(self.store.bucket_named(name), prefix)
