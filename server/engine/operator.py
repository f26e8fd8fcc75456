"""Operator verbs of the engine (what the admin API calls): stats, bucket policies, quotas, flush,
expire-now and runtime limits. Operators act across tenants, so buckets are named without a tenant check."""

from __future__ import annotations

from typing import Any

from . import errors
from .objects import Bucket, BucketStats, StoredObject


class OperatorMixin:
    """Stats and operator verbs (part of :class:`~.store.Engine`)."""


    def bucket_named(self, name: str) -> Bucket:
        """A bucket whoever owns it (operators act across tenants)."""
        bucket = self.buckets.get(name)
        if bucket is None:
            raise errors.NoSuchBucket(bucket=name)
        return bucket

    def bucket_summaries(self) -> list[dict[str, Any]]:
        self._drain_pins(self.clock())
        return [
            {"name": b.name, "owner": b.owner, "created": b.created, "policy": b.policy(),
             **b.stats.as_dict(), "hit_ratio": _ratio(b.stats)}
            for b in sorted(self.buckets.values(), key=lambda b: b.name)
        ]

    def set_bucket_policy(self, name: str, *, default_ttl: float | None = None, sliding_ttl: bool | None = None,
                          quota: int | None = None) -> dict[str, Any]:
        """Change a bucket's default TTL, sliding TTL or byte quota (a lower quota evicts down to it)."""
        bucket = self.bucket_named(name)
        if default_ttl is not None:
            if not default_ttl > 0:
                raise errors.InvalidArgument("default_ttl must be positive")
            bucket.default_ttl = min(default_ttl, self.config.max_ttl)
        if sliding_ttl is not None:
            bucket.sliding_ttl = sliding_ttl
        if quota is not None:
            bucket.quota = quota
            if quota:
                self._evict_lru(lambda: bucket.stats.charged <= quota, [bucket], self.clock(), None)
        return {"name": name, "policy": bucket.policy()}

    def set_tenant_quota(self, tenant: str, quota: int) -> None:
        """Bytes a tenant's objects may hold (0 = none); a lower quota evicts its own LRU objects down to it."""
        if quota:
            self.tenant_quota[tenant] = quota
            owned = [b for b in self.buckets.values() if b.owner == tenant]
            self._evict_lru(lambda: self.tenant_charged.get(tenant, 0) <= quota, owned, self.clock(), None)
        else:
            self.tenant_quota.pop(tenant, None)

    def _under(self, name: str, prefix: str) -> list[StoredObject]:
        bucket = self.bucket_named(name)
        if not prefix:
            return list(bucket.objects.values())
        out = []
        for key in bucket.objects.irange(minimum=prefix):
            if not key.startswith(prefix):
                break
            out.append(bucket.objects[key])
        return out

    def flush(self, name: str, prefix: str = "") -> int:
        """Remove every object of a bucket (or under ``prefix``), pinned or not. Returns how many were live."""
        now = self.clock()
        victims = self._under(name, prefix)
        live = sum(1 for o in victims if not o.expired(now))
        for obj in victims:
            self._remove(obj, "flushed" if not obj.expired(now) else "expired")
        return live

    def expire_now(self, name: str, prefix: str = "") -> int:
        """Expire every object of a bucket (or under ``prefix``) now. Returns how many were live."""
        now = self.clock()
        victims = [o for o in self._under(name, prefix) if not o.expired(now)]
        for obj in victims:
            self._remove(obj, "expired")
        return len(victims)

    def set_limits(self, *, budget: int | None = None, default_ttl: float | None = None,
                   max_ttl: float | None = None) -> dict[str, Any]:
        """Change the budget and TTL defaults at run time. A budget cut evicts down to it (pinned objects and
        uploads in flight stay: the result says by how much the node is still over)."""
        config = self.config
        new_max = max_ttl if max_ttl is not None else config.max_ttl
        new_default = default_ttl if default_ttl is not None else config.default_ttl
        if new_default > new_max:
            raise errors.InvalidArgument(f"default_ttl {new_default:g} exceeds max_ttl {new_max:g}")
        config.max_ttl, config.default_ttl = new_max, new_default
        evicted_before = self.stats()["evictions"]
        if budget is not None:
            config.budget = budget
            now = self.clock()
            self._reap_expired(now, limit=None)
            try:
                self._evict_lru(lambda: self.used <= budget, self.buckets.values(), now, None)
            except errors.InsufficientCapacity:
                pass  # what is left is pinned or in flight: reported below
        return {"evicted": self.stats()["evictions"] - evicted_before, "over_budget": max(0, self.used - config.budget)}

    def stats(self, reset: bool = False) -> dict[str, Any]:
        """Global counters and per-bucket counters (with hit ratios); ``reset`` zeroes counters after reading."""
        self._drain_pins(self.clock())
        total = BucketStats()
        add_counters(total, self.removed_stats)
        for level in BucketStats.LEVELS:
            setattr(total, level, 0)
        per_bucket = {}
        for bucket in self.buckets.values():
            add_counters(total, bucket.stats)
            per_bucket[bucket.name] = {**bucket.stats.as_dict(), "hit_ratio": _ratio(bucket.stats)}
        out = {
            **total.as_dict(),
            "hit_ratio": _ratio(total),
            "budget": self.config.budget,
            "used": self.used,
            "reserved": self.reserved,
            "parts_bytes": self.parts_bytes,
            "pinned_bytes": self.pinned_bytes,
            "uploads": len(self.uploads),
            "buckets": per_bucket,
        }
        if reset:
            self.removed_stats.reset()
            for bucket in self.buckets.values():
                bucket.stats.reset()
        return out


def _ratio(stats: BucketStats) -> float | None:
    lookups = stats.hits + stats.misses
    return stats.hits / lookups if lookups else None


def add_counters(into: BucketStats, other: BucketStats) -> None:
    for name, value in other.as_dict().items():
        setattr(into, name, getattr(into, name) + value)
