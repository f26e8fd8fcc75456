"""Room in the RAM store: reservations opened before a body is read, the bucket's and tenant's byte quotas, and
making room in the node's budget.

Making room frees what costs least first: kept payload buffers, then expired objects (see :mod:`.expiry`), then
the least recently used unpinned objects (see :mod:`.eviction`). A quota is made room for within itself: a
tenant over its quota evicts its own objects, never another tenant's.
"""

from __future__ import annotations

from collections.abc import Callable

from . import errors
from .budget import Budget, Reservation
from .buffers import PayloadBuffers
from .config import EngineConfig
from .eviction import Eviction
from .expiry import Expiry
from .objects import OBJECT_OVERHEAD, Bucket, StoredObject

Clock = Callable[[], float]


class Capacity:
    """Reservations, quotas and room-making over a :class:`Budget`. ``bucket(tenant, name)``: the store's bucket
    lookup (NoSuchBucket, AccessDenied)."""

    def __init__(self, config: EngineConfig, budget: Budget, clock: Clock, buffers: PayloadBuffers,
                 expiry: Expiry, eviction: Eviction, bucket: Callable[[str, str], Bucket]) -> None:
        self.config = config
        self.budget = budget
        self.clock = clock
        self.buffers = buffers
        self.expiry = expiry
        self.eviction = eviction
        self._bucket = bucket

    # ------------------------------------------------------------------ reservations

    def reserve(self, tenant: str, bucket_name: str, nbytes: int | None,
                fixed: int = OBJECT_OVERHEAD, *, key: str | None = None, same_request: bool = False) -> Reservation:
        """Open a reservation for an object (or part) of ``nbytes`` payload (None: not known until it has all
        arrived), charged ``fixed`` more, before its body is read. What could never be stored is refused now
        (EntityTooLarge: over the object size, the budget, the bucket's or the tenant's quota); the reservation
        holds budget only as the body arrives (:meth:`Reservation.grow`), making room within what the tenant
        may use. ``key``: the object it will replace, whose bytes count as free (replacing a block at the quota
        evicts nothing else)."""
        bucket = self.check_fits(tenant, bucket_name, nbytes or 0, fixed)
        largest = self.config.max_object_size

        def room(reservation: Reservation, more: int) -> None:
            self._make_reserved_room(bucket, key, more)

        cap = None if nbytes is not None else min(largest + fixed, self.budget.limit)
        return self.budget.open(tenant, nbytes or 0, fixed, room, cap=cap, same_request=same_request)

    def reserve_run(self, tenant: str, bucket_name: str, nbytes: int, fixed: int, *,
                    same_request: bool = False) -> Reservation:
        """A reservation for several new objects whose sizes were checked one by one (see :meth:`reserve`)."""
        bucket = self._bucket(tenant, bucket_name)

        def room(reservation: Reservation, more: int) -> None:
            self._make_reserved_room(bucket, None, more)

        return self.budget.open(tenant, nbytes, fixed, room, same_request=same_request)

    def check_fits(self, tenant: str, bucket_name: str, nbytes: int, fixed: int = OBJECT_OVERHEAD) -> Bucket:
        """EntityTooLarge unless an object of ``nbytes`` payload (charged ``fixed`` more) could be stored: under
        the object size limit, the budget, the bucket's and the tenant's quotas. Returns the bucket."""
        if nbytes > self.config.max_object_size:
            raise errors.EntityTooLarge(f"object of {nbytes} bytes exceeds the maximum {self.config.max_object_size}")
        bucket = self._bucket(tenant, bucket_name)
        charge = nbytes + fixed
        if charge > self.budget.limit:
            raise errors.EntityTooLarge(f"{charge} bytes cannot fit in a budget of {self.budget.limit}")
        self._check_quotas(bucket, charge)
        return bucket

    def _check_quotas(self, bucket: Bucket, charge: int) -> None:
        quota, _ = self.budget.tenant_usage(bucket.owner)
        if bucket.quota and charge > bucket.quota:
            raise errors.EntityTooLarge(f"{charge} bytes exceed the bucket quota of {bucket.quota}")
        if quota and charge > quota:
            raise errors.EntityTooLarge(f"{charge} bytes exceed the tenant quota of {quota}")

    def _make_reserved_room(self, bucket: Bucket, key: str | None, more: int) -> None:
        """Room for ``more`` bytes of a body in flight: within the tenant's quota (evicting its own objects),
        then within the node's budget; the live object at ``key`` (the one it replaces) counts as free."""
        now = self.clock()
        old = bucket.objects.get(key) if key is not None else None
        replacing = old if old is not None and not old.expired(now) else None
        credit = replacing.charge if replacing is not None else 0
        quota, _ = self.budget.tenant_usage(bucket.owner)
        if quota:
            self.evict_within_tenant(bucket.owner, quota, now, more - credit, replacing)
        self.make_room(more, replacing=replacing)

    # ------------------------------------------------------------------ room

    def make_state_room(self, tenant: str, need: int) -> None:
        """Room for ``need`` bytes of a tenant's unevictable state (a bucket, an upload, a part): within its
        quota (evicting its own objects), then within the node's budget."""
        quota, _ = self.budget.tenant_usage(tenant)
        if quota:
            if need > quota:
                raise errors.EntityTooLarge(f"{need} bytes exceed the tenant quota of {quota}")
            self.evict_within_tenant(tenant, quota, self.clock(), need)
        self.make_room(need)

    def make_room(self, need: int, replacing: StoredObject | None = None) -> None:
        """Evict until ``need`` more bytes fit in the budget.

        ``replacing``: the live object the new one replaces; its bytes count as free and it is not evicted."""
        budget = self.budget
        if need > budget.limit:
            raise errors.EntityTooLarge(f"{need} bytes cannot fit in a budget of {budget.limit}")
        credit = replacing.charge if replacing is not None else 0
        if budget.fits(need, credit):
            return
        self.buffers.make_room(need - credit)  # kept payload buffers go before any block
        if budget.fits(need, credit):
            return
        now = self.clock()
        self.expiry.reap(now, limit=None, stop_when_fits=need - credit)
        if budget.fits(need, credit):
            return
        self.expiry.drain_pins(now)
        evictable = budget.evictable()
        if replacing is not None and not replacing.pinned(now):
            evictable -= credit
        if budget.used - credit - evictable + need > budget.limit:
            raise errors.InsufficientCapacity("everything left in the budget is pinned or being written")
        self.eviction.evict_lru(lambda: budget.fits(need, credit), None, now, replacing)

    def within_quotas(self, bucket: Bucket, need: int, replacing: StoredObject | None, now: float) -> None:
        """Make room under the bucket's and the tenant's byte quotas by evicting their own LRU objects."""
        credit = replacing.charge if replacing is not None else 0
        # Both size checks come before any eviction: a write refused by one quota must not evict for the other.
        self._check_quotas(bucket, need)
        quota, _ = self.budget.tenant_usage(bucket.owner)
        if bucket.quota:
            self.eviction.evict_lru(lambda: bucket.stats.charged - credit + need <= bucket.quota, bucket, now,
                                    replacing)
        if quota:
            self.evict_within_tenant(bucket.owner, quota, now, need - credit, replacing)

    def evict_within_tenant(self, tenant: str, quota: int, now: float, need: int = 0,
                            spare: StoredObject | None = None) -> None:
        """Evict the tenant's own LRU objects until what it holds plus ``need`` fits its quota."""
        self.eviction.evict_lru(lambda: self.budget.tenant_usage(tenant)[1] + need <= quota, tenant, now, spare)
