"""The byte budget of a node: what is charged against it, by what holds it, and room set aside for uploads.

``used`` counts committed objects (payload, key, metadata, fixed overhead), multipart parts and
*reservations* taken by bodies still arriving. The budget only counts; making room (eviction) is the object
store's job, which consults these counters.
"""

from __future__ import annotations

from .config import EngineConfig


class Budget:
    """Byte counters of one node. ``reserved``, ``parts`` and ``pinned`` are parts of ``used``."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config  # the limit is config.budget (an operator may change it at run time)
        self.used = 0
        self.reserved = 0  # room set aside for bodies in flight
        self.parts = 0  # multipart parts of unfinished uploads
        self.pinned = 0  # objects pinned right now (ended pins are subtracted lazily, when drained)
        self.tenant_quota: dict[str, int] = {}  # tenant -> bytes its objects may hold (absent = no quota)
        self.tenant_charged: dict[str, int] = {}  # tenant -> bytes its objects count

    @property
    def limit(self) -> int:
        return self.config.budget

    def fits(self, need: int, credit: int = 0) -> bool:
        """Whether ``need`` more bytes fit, counting ``credit`` bytes (an object being replaced) as free."""
        return self.used - credit + need <= self.config.budget

    def evictable(self) -> int:
        """Bytes eviction could free: committed, unpinned objects."""
        return self.used - self.reserved - self.parts - self.pinned

    # ------------------------------------------------------------------ reservations

    def hold(self, nbytes: int) -> Reservation:
        """Set ``nbytes`` aside (the caller has made room)."""
        self.used += nbytes
        self.reserved += nbytes
        return Reservation(self, nbytes)

    def _release(self, nbytes: int) -> None:
        self.used -= nbytes
        self.reserved -= nbytes

    # ------------------------------------------------------------------ charges

    def charge_object(self, tenant: str, nbytes: int) -> None:
        self.used += nbytes
        self.tenant_charged[tenant] = self.tenant_charged.get(tenant, 0) + nbytes

    def uncharge_object(self, tenant: str, nbytes: int) -> None:
        self.used -= nbytes
        self.tenant_charged[tenant] -= nbytes

    def charge_parts(self, nbytes: int) -> None:
        self.used += nbytes
        self.parts += nbytes

    def tenant_usage(self, tenant: str) -> tuple[int, int]:
        """(quota, charged) of a tenant; a quota of 0 means none."""
        return self.tenant_quota.get(tenant, 0), self.tenant_charged.get(tenant, 0)


class Reservation:
    """Budget set aside for an upload in flight; released on commit or on failure (idempotent)."""

    __slots__ = ("_budget", "nbytes")

    def __init__(self, budget: Budget, nbytes: int) -> None:
        self._budget = budget
        self.nbytes = nbytes

    def release(self) -> None:
        if self.nbytes:
            self._budget._release(self.nbytes)
            self.nbytes = 0

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
