"""The byte budget of a node: what is charged against it, by what holds it, and room set aside for bodies
still arriving.

``used`` counts committed objects (payload, key, metadata, fixed overhead), multipart parts, the state of
buckets and uploads, *reservations* held by bodies in flight, and removed objects whose bytes are still being
sent to a reader. Only committed, unpinned objects can be evicted. The budget only counts; making room
(eviction) is the object store's job, which consults these counters.

A reservation is opened for a body's declared size before the body is read (what could never commit is
refused then), but holds budget only as the body's bytes arrive: a request that sends its headers and no
body makes nothing be evicted. Each tenant may have at most ``reserve_limit`` declared bytes in flight.
"""

from __future__ import annotations

from collections.abc import Callable

from . import errors
from .config import EngineConfig

GROW_STEP = 1 << 20  # a reservation grows by at least this much at a time (fewer evictions, same bound)


class Budget:
    """Byte counters of one node. ``reserved``, ``parts``, ``state``, ``pinned`` and ``sending`` are parts of
    ``used``; per tenant, ``charged`` counts its objects, parts and state, ``held`` its reservations."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config  # the limit is config.budget (an operator may change it at run time)
        self.used = 0
        self.reserved = 0  # held by bodies in flight
        self.parts = 0  # multipart parts of unfinished uploads
        self.state = 0  # buckets and uploads themselves (their records and metadata)
        self.pinned = 0  # objects pinned right now (ended pins are subtracted lazily, when drained)
        self.sending = 0  # removed objects whose payload is still being sent to a reader
        self.tenant_quota: dict[str, int] = {}  # tenant -> bytes it may hold (absent = no quota)
        self.tenant_charged: dict[str, int] = {}  # tenant -> bytes of its objects, parts and state
        self.tenant_held: dict[str, int] = {}  # tenant -> bytes its reservations hold now
        self.tenant_declared: dict[str, int] = {}  # tenant -> bytes its bodies in flight announced

    @property
    def limit(self) -> int:
        return self.config.budget

    @property
    def reserve_limit(self) -> int:
        return self.config.tenant_reserve_limit or self.config.budget // 4

    def fits(self, need: int, credit: int = 0) -> bool:
        """Whether ``need`` more bytes fit, counting ``credit`` bytes (an object being replaced) as free."""
        return self.used - credit + need <= self.config.budget

    def evictable(self) -> int:
        """Bytes eviction could free: committed, unpinned objects."""
        return self.used - self.reserved - self.parts - self.state - self.pinned - self.sending

    def tenant_usage(self, tenant: str) -> tuple[int, int]:
        """(quota, bytes the tenant holds: charged plus held reservations); a quota of 0 means none."""
        return self.tenant_quota.get(tenant, 0), self.tenant_charged.get(tenant, 0) + self.tenant_held.get(tenant, 0)

    # ------------------------------------------------------------------ charges

    def charge(self, tenant: str, nbytes: int, kind: str = "object") -> None:
        """Count ``nbytes`` (negative: uncount) of the tenant's ``object``, ``part`` or ``state`` bytes."""
        self.used += nbytes
        self.tenant_charged[tenant] = self.tenant_charged.get(tenant, 0) + nbytes
        if kind == "part":
            self.parts += nbytes
        elif kind == "state":
            self.state += nbytes

    # ------------------------------------------------------------------ reservations

    def open(self, tenant: str, body: int, fixed: int, room: Callable[[Reservation, int], None], *,
             cap: int | None = None, same_request: bool = False) -> Reservation:
        """A reservation for a body of ``body`` bytes charged ``fixed`` bytes more once stored; it holds
        nothing yet and at most ``cap`` (default: body plus fixed; larger for a body of unknown length).
        ``room(reservation, n)`` makes room for ``n`` more bytes of it (evicting). InsufficientCapacity when
        the tenant already has ``reserve_limit`` bytes in flight (one request in flight is always allowed:
        ``same_request`` for the later blocks of one that holds several)."""
        declared = self.tenant_declared.get(tenant, 0)
        if declared and not same_request and declared + body + fixed > self.reserve_limit:
            raise errors.InsufficientCapacity(
                f"uploads of {declared} bytes are in flight for this tenant; at most {self.reserve_limit} may be")
        self.tenant_declared[tenant] = declared + body + fixed
        return Reservation(self, tenant, body + fixed, fixed, room, cap)

    def _hold(self, reservation: Reservation, nbytes: int) -> None:
        self.used += nbytes
        self.reserved += nbytes
        self.tenant_held[reservation.tenant] = self.tenant_held.get(reservation.tenant, 0) + nbytes

    def _close(self, reservation: Reservation) -> None:
        tenant = reservation.tenant
        self._hold(reservation, -reservation.held)
        self.tenant_declared[tenant] -= reservation.declared


class Reservation:
    """Budget for a body in flight: ``grow`` as its bytes arrive, ``release`` once committed or failed
    (idempotent). ``nbytes`` is what it holds now."""

    __slots__ = ("_budget", "_room", "cap", "declared", "fixed", "held", "open", "tenant")

    def __init__(self, budget: Budget, tenant: str, declared: int, fixed: int,
                 room: Callable[[Reservation, int], None], cap: int | None) -> None:
        self._budget = budget
        self._room = room
        self.tenant = tenant
        self.declared = declared  # the body as announced plus its fixed charge
        self.cap = declared if cap is None else cap  # the most it may hold
        self.fixed = fixed  # key, metadata and per-object overhead: held with the first byte
        self.held = 0
        self.open = True

    @property
    def nbytes(self) -> int:
        return self.held

    def grow(self, arrived: int) -> None:
        """Hold room for ``arrived`` bytes of the body (plus its fixed charge), making room as needed; raises
        InsufficientCapacity (or a quota's EntityTooLarge) if it cannot be made."""
        if not self.open:
            raise errors.InvalidArgument("the reservation was released")
        need = arrived + self.fixed
        if need <= self.held:
            return
        if need > self.cap:
            raise errors.EntityTooLarge(f"the body is larger than the {self.cap - self.fixed} bytes it may have")
        want = min(self.cap, max(need, self.held + GROW_STEP))
        self._room(self, want - self.held)
        self._budget._hold(self, want - self.held)
        self.held = want

    def grow_all(self) -> None:
        """Hold the whole declared body now (one that is made in memory at once)."""
        self.grow(self.declared - self.fixed)

    def release(self) -> None:
        if self.open:
            self.open = False
            self._budget._close(self)
            self.held = 0

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
