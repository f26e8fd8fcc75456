"""Operator verbs (what the admin API calls): stats, bucket policies, quotas, flush, expire-now and runtime
limits. Operators act across tenants, so buckets are named without a tenant check."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

from ..settings import check_ttls
from . import errors
from .budget import Budget
from .config import EngineConfig
from .lower import LowerTier
from .multipart import Multipart
from .objects import Bucket, BucketStats
from .store import ObjectStore


class Operator:
    """Stats and operator verbs over the object store, the uploads and the budget."""

    def __init__(self, config: EngineConfig, budget: Budget, store: ObjectStore, multipart: Multipart,
                 tier: LowerTier) -> None:
        self.config = config
        self.budget = budget
        self.store = store
        self.multipart = multipart
        self.tier = tier
        self.removed_stats = BucketStats()  # counters of deleted buckets, so global totals never go back

    def forget_bucket(self, bucket: Bucket) -> None:
        """Keep a deleted bucket's counters in the totals."""
        add_counters(self.removed_stats, bucket.stats)

    def bucket_summaries(self) -> list[dict[str, Any]]:
        self.store.expiry.drain_pins(self.store.clock())
        return [
            {"name": b.name, "owner": b.owner, "created": b.created, "policy": b.policy(),
             **b.stats.as_dict(), "hit_ratio": _ratio(b.stats)}
            for b in sorted(self.store.buckets.values(), key=lambda b: b.name)
        ]

    def set_bucket_policy(self, name: str, *, default_ttl: float | None = None, sliding_ttl: bool | None = None,
                          quota: int | None = None) -> dict[str, Any]:
        """Change a bucket's default TTL, sliding TTL or byte quota (a lower quota evicts down to it)."""
        bucket = self.store.bucket_named(name)
        if default_ttl is not None:
            if not default_ttl > 0:
                raise errors.InvalidArgument("default_ttl must be positive")
            bucket.default_ttl = min(default_ttl, self.config.max_ttl)
        if sliding_ttl is not None:
            bucket.sliding_ttl = sliding_ttl
        if quota is not None:
            bucket.quota = quota
            if quota:
                self.store.eviction.evict_lru(lambda: bucket.stats.charged <= quota, bucket, self.store.clock(), None)
        return {"name": name, "policy": bucket.policy()}

    def set_tenant_quota(self, tenant: str, quota: int) -> None:
        """Bytes a tenant's objects may hold (0 = none); a lower quota evicts its own LRU objects down to it."""
        if quota:
            self.budget.tenant_quota[tenant] = quota
            with contextlib.suppress(errors.InsufficientCapacity):  # the rest goes as the tenant's writes make room
                self.store.capacity.evict_within_tenant(tenant, quota, self.store.clock())
        else:
            self.budget.tenant_quota.pop(tenant, None)

    def flush(self, name: str, prefix: str = "") -> int:
        """Remove every object of a bucket (or under ``prefix``), pinned or not. Returns how many were live."""
        now = self.store.clock()
        victims = self.store.under(name, prefix)
        live = sum(1 for o in victims if not o.expired(now))
        for obj in victims:
            self.store.remove(obj, "flushed" if not obj.expired(now) else "expired")
        return live

    def expire_now(self, name: str, prefix: str = "") -> int:
        """Expire every object of a bucket (or under ``prefix``) now. Returns how many were live."""
        now = self.store.clock()
        victims = [o for o in self.store.under(name, prefix) if not o.expired(now)]
        for obj in victims:
            self.store.remove(obj, "expired")
        return len(victims)

    def set_limits(self, *, budget: int | None = None, default_ttl: float | None = None,
                   max_ttl: float | None = None) -> dict[str, Any]:
        """Change the budget and TTL defaults at run time. A budget cut evicts down to it (pinned objects and
        uploads in flight stay: the result says by how much the node is still over)."""
        config = self.config
        new_max = max_ttl if max_ttl is not None else config.max_ttl
        new_default = default_ttl if default_ttl is not None else config.default_ttl
        try:
            check_ttls(new_default, new_max)
        except ValueError as exc:
            raise errors.InvalidArgument(str(exc)) from None
        config.max_ttl, config.default_ttl = new_max, new_default
        evicted_before = self.stats()["evictions"]
        if budget is not None:
            config.budget = budget
            now = self.store.clock()
            self.store.expiry.reap(now, None)
            self.store.buffers.make_room(0)  # kept payload buffers go before any block
            try:
                self.store.eviction.evict_lru(lambda: self.budget.used <= budget, None, now, None)
            except errors.InsufficientCapacity:
                pass  # what is left is pinned or in flight: reported below
        return {"evicted": self.stats()["evictions"] - evicted_before,
                "over_budget": max(0, self.budget.used - config.budget)}

    def disk_stats(self) -> dict[str, Any]:
        """The lower tier's levels and counters (all zero on a RAM-only node)."""
        return self.tier.stats()

    def stats(self, reset: bool = False) -> dict[str, Any]:
        """Global counters and per-bucket counters (with hit ratios); ``reset`` zeroes counters after reading."""
        self.store.expiry.drain_pins(self.store.clock())
        total = BucketStats()
        add_counters(total, self.removed_stats)
        for level in BucketStats.LEVELS:
            setattr(total, level, 0)
        disk = self.disk_stats()
        on_disk: dict[str, tuple[int, int]] = disk.pop("disk_buckets")
        per_bucket = {}
        for bucket in self.store.buckets.values():
            bucket.stats.disk_objects, bucket.stats.disk_bytes = on_disk.get(bucket.name, (0, 0))
            add_counters(total, bucket.stats)
            per_bucket[bucket.name] = {**bucket.stats.as_dict(), "hit_ratio": _ratio(bucket.stats)}
        budget = self.budget
        out = {
            **total.as_dict(),
            "hit_ratio": _ratio(total),
            "budget": self.config.budget,
            "used": budget.used,
            "reserved": budget.reserved,
            "parts_bytes": budget.parts,
            "pinned_bytes": budget.pinned,
            "state_bytes": budget.state,
            "sending_bytes": budget.sending,
            "buffer_bytes": self.store.buffers.kept,
            "buffer_reuses": self.store.buffers.reused,
            "uploads": len(self.multipart.uploads),
            **disk,
            "buckets": per_bucket,
        }
        if reset:
            self.store.buffers.reused = 0
            self.removed_stats.reset()
            for bucket in self.store.buckets.values():
                bucket.stats.reset()
        return out


def _ratio(stats: BucketStats) -> float | None:
    lookups = stats.hits + stats.misses
    return stats.hits / lookups if lookups else None


def add_counters(into: BucketStats, other: BucketStats) -> None:
    for f in dataclasses.fields(BucketStats):
        setattr(into, f.name, getattr(into, f.name) + getattr(other, f.name))
