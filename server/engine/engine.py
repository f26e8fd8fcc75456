"""The engine's facade: one node's buckets, objects, uploads and budget, built from its parts.

The parts (each readable alone):

==============  ==============================================================================
``budget``      :class:`~.budget.Budget` — what is charged against the byte budget; reservations
``store``       :class:`~.store.ObjectStore` — buckets, objects, TTLs, pins, eviction
``multipart``   :class:`~.multipart.Multipart` — uploads in progress and their parts
``operator``    :class:`~.operator.Operator` — stats and the operator verbs
==============  ==============================================================================

The protocol layers, the admin API, events and metrics talk to :class:`Engine` only. Every method is
synchronous and runs to completion on the caller's thread, so each call is atomic with respect to every other
call made from the same event loop.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Any

from .budget import Budget, Reservation
from .config import EngineConfig
from .multipart import Multipart
from .objects import Bucket, Part, Payload, StoredObject, Upload
from .operator import Operator
from .store import Clock, ObjectStore, RemovalListener, StoreListener


class Engine:
    """All buckets and objects of one node."""

    def __init__(self, config: EngineConfig | None = None, clock: Clock = time.time) -> None:
        self.config = config or EngineConfig()
        self.clock = clock
        self.budget = Budget(self.config)
        self.store = ObjectStore(self.config, self.budget, clock)
        self.multipart = Multipart(self.config, self.budget, self.store, clock)
        self.operator = Operator(self.config, self.budget, self.store, self.multipart)

    # ------------------------------------------------------------------ listeners

    def subscribe(self, on_store: StoreListener | None = None, on_remove: RemovalListener | None = None) -> None:
        """Call ``on_store(obj)`` after every commit and ``on_remove(obj, reason)`` after every removal
        (synchronously: keep them cheap). Reasons are :data:`~.store.REMOVAL_REASONS`."""
        if on_store is not None:
            self.store.on_store.append(on_store)
        if on_remove is not None:
            self.store.on_remove.append(on_remove)

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

    # ------------------------------------------------------------------ buckets

    def create_bucket(self, tenant: str, name: str) -> bool:
        """Create ``name`` for ``tenant``; False if the tenant owns it already (not an error in S3)."""
        return self.store.create_bucket(tenant, name)

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

    def owner_of(self, name: str) -> str | None:
        """The tenant owning bucket ``name``, or None."""
        bucket = self.store.buckets.get(name)
        return None if bucket is None else bucket.owner

    def live_keys(self, name: str | None = None) -> dict[str, tuple[str, list[str]]]:
        """Bucket → (owner, its live keys in order), for one bucket (``name``) or all."""
        now = self.clock()
        buckets = self.store.buckets
        chosen = [buckets[name]] if name is not None and name in buckets else (
            [] if name is not None else list(buckets.values()))
        return {b.name: (b.owner, [k for k, o in b.objects.items() if not o.expired(now)]) for b in chosen}

    # ------------------------------------------------------------------ objects

    def reserve(self, nbytes: int) -> Reservation:
        """Set aside room for an object of ``nbytes`` payload before its body is read."""
        return self.store.reserve(nbytes)

    def put(self, tenant: str, bucket_name: str, key: str, data: Payload, *, etag: str, ttl: float | None = None,
            content_type: str = "binary/octet-stream", headers: dict[str, str] | None = None,
            user_meta: dict[str, str] | None = None, checksums: dict[str, str] | None = None,
            parts_count: int = 0, if_none_match: bool = False, if_match: str | None = None,
            reservation: Reservation | None = None, xxh3: int | None = None) -> StoredObject:
        """Commit a whole object atomically (see :meth:`.store.ObjectStore.put`)."""
        return self.store.put(tenant, bucket_name, key, data, etag=etag, ttl=ttl, content_type=content_type,
                              headers=headers, user_meta=user_meta, checksums=checksums, parts_count=parts_count,
                              if_none_match=if_none_match, if_match=if_match, reservation=reservation, xxh3=xxh3)

    def get(self, tenant: str, bucket_name: str, key: str, *, record: bool = True) -> StoredObject:
        """The live object at ``key``; ``record`` counts a hit/miss, refreshes LRU and slides the TTL."""
        return self.store.get(tenant, bucket_name, key, record=record)

    def lookup(self, tenant: str, bucket_name: str, keys: Iterable[str]) -> list[StoredObject | None]:
        """Live objects for many keys (None where absent); counts hits and misses, touches LRU."""
        return self.store.lookup(tenant, bucket_name, keys)

    def record_read(self, obj: StoredObject, nbytes: int) -> None:
        """Count payload bytes sent to a reader."""
        self.store.record_read(obj, nbytes)

    def delete(self, tenant: str, bucket_name: str, key: str) -> bool:
        """Remove ``key``; whether a live object was removed."""
        return self.store.delete(tenant, bucket_name, key)

    def iter_objects(self, tenant: str, bucket_name: str, start: str = "", inclusive: bool = True
                     ) -> Iterator[StoredObject]:
        """Live objects in key order from ``start``."""
        return self.store.iter_objects(tenant, bucket_name, start, inclusive)

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

    def uploads_in(self, tenant: str, bucket_name: str, prefix: str = "") -> list[Upload]:
        """The tenant's uploads into a bucket, by key then age."""
        self.store.bucket(tenant, bucket_name)
        return self.multipart.in_bucket(bucket_name, prefix)

    def put_part(self, tenant: str, bucket_name: str, key: str, upload_id: str, number: int, data: Payload, *,
                 md5: bytes, checksums: dict[str, str], reservation: Reservation | None = None) -> Part:
        return self.multipart.put_part(tenant, bucket_name, key, upload_id, number, data, md5=md5,
                                       checksums=checksums, reservation=reservation)

    def complete_upload(self, tenant: str, bucket_name: str, key: str, upload_id: str, parts: list[tuple[int, str]],
                        *, if_none_match: bool = False, if_match: str | None = None,
                        checksums: dict[str, str] | None = None) -> StoredObject:
        return self.multipart.complete(tenant, bucket_name, key, upload_id, parts, if_none_match=if_none_match,
                                       if_match=if_match, checksums=checksums)

    def abort_upload(self, tenant: str, bucket_name: str, key: str, upload_id: str) -> None:
        self.multipart.abort(tenant, bucket_name, key, upload_id)

    # ------------------------------------------------------------------ housekeeping

    def reap(self, limit: int = 10000) -> int:
        """Drop up to ``limit`` expired objects and stale uploads; returns the objects dropped."""
        removed = self.store.reap_expired(limit)
        self.store.drain_pins(self.clock())
        self.multipart.reap_stale(limit)
        self.store.compact_expiry_heap()
        return removed

    # ------------------------------------------------------------------ operator verbs

    def stats(self, reset: bool = False) -> dict[str, Any]:
        """Global and per-bucket counters; ``reset`` zeroes the counters after reading."""
        return self.operator.stats(reset)

    def bucket_summaries(self) -> list[dict[str, Any]]:
        return self.operator.bucket_summaries()

    def set_bucket_policy(self, name: str, *, default_ttl: float | None = None, sliding_ttl: bool | None = None,
                          quota: int | None = None) -> dict[str, Any]:
        return self.operator.set_bucket_policy(name, default_ttl=default_ttl, sliding_ttl=sliding_ttl, quota=quota)

    def set_tenant_quota(self, tenant: str, quota: int) -> None:
        self.operator.set_tenant_quota(tenant, quota)

    def tenant_usage(self, tenant: str) -> tuple[int, int]:
        """(quota, charged bytes) of a tenant; a quota of 0 means none."""
        return self.budget.tenant_usage(tenant)

    def flush(self, name: str, prefix: str = "") -> int:
        return self.operator.flush(name, prefix)

    def expire_now(self, name: str, prefix: str = "") -> int:
        return self.operator.expire_now(name, prefix)

    def set_limits(self, *, budget: int | None = None, default_ttl: float | None = None,
                   max_ttl: float | None = None) -> dict[str, Any]:
        return self.operator.set_limits(budget=budget, default_ttl=default_ttl, max_ttl=max_ttl)
