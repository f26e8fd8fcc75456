"""The tier below RAM, as the engine sees it: one seam that always exists.

A node with a flash directory has a :class:`~.tier.FlashTier` there; a RAM-only node has :class:`NoLowerTier`,
which holds nothing, accepts nothing and costs nothing. The engine (:mod:`.engine`), the RAM store
(:mod:`.store`) and the reads that span both tiers (:mod:`.reads`) talk to :class:`LowerTier` only, so no code
outside the tier itself asks whether the node has one, and an engine operation is written once. A new tier is a
new implementation of this protocol.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple, Protocol, TypeVar

from ..flash import RecoveryReport
from .objects import Bucket, StoredObject

T = TypeVar("T")

RAM = "ram"  # where a block is, as locate() reports it
DISK = "disk"


class BlockRef(NamedTuple):
    """What an event says about a block the lower tier holds (or held)."""

    bucket: str
    tenant: str
    key: str
    size: int
    expires_at: float


# (type: "stored" | "removed", block, reason or None): events of the lower tier's medium, and of demotion.
DiskListener = Callable[[str, BlockRef, str | None], None]
# Restores buckets, policies and quotas from a manifest the lower tier kept across a restart.
ManifestRestore = Callable[[dict[str, Any]], None]


class LowerTier(Protocol):
    """What the engine asks of the tier below RAM. Synchronous methods answer from memory (no I/O)."""

    listeners: list[DiskListener]

    # lifecycle
    async def open(self, reset: bool, restore: ManifestRestore) -> RecoveryReport | None:
        """Bring the tier up (its blocks, and the manifest handed to ``restore``); None: it holds nothing."""
        ...
    def announce_recovered(self) -> None: ...
    async def close(self, spill_seconds: float) -> int: ...
    async def housekeep(self) -> None: ...
    @property
    def degraded(self) -> str | None: ...
    def manifest_changed(self) -> None: ...
    def stats(self) -> dict[str, Any]: ...

    # writes
    def after_write(self, obj: StoredObject) -> None:
        """A block just committed to RAM (the tier may copy it down now)."""
        ...
    async def with_write_room(self, attempt: Callable[[], T]) -> T:
        """``attempt()``, waiting (bounded) while it needs the tier to take a RAM victim it has no room for."""
        ...
    def demote(self, obj: StoredObject) -> bool:
        """Take a RAM eviction victim; False: it is dropped."""
        ...

    # presence and reads
    def may_hold(self, bucket: str) -> bool:
        """False only if the tier holds no block of ``bucket`` (then the reads below skip asking per key)."""
        ...
    def queued_object(self, bucket: str, key: str) -> StoredObject | None: ...
    def holds(self, bucket: str, key: str) -> bool: ...
    def sizes(self, bucket: str, keys: Sequence[str]) -> list[int | None]: ...
    async def read(self, bucket: Bucket, keys: Sequence[str], *, with_payload: bool = True
                   ) -> list[StoredObject | None]: ...
    def promote(self, bucket: Bucket, obj: StoredObject) -> bool: ...
    def prefetch(self, bucket: Bucket, keys: Sequence[str]) -> int: ...
    async def keys_under(self, name: str, prefix: str) -> list[str]: ...
    async def list_page(self, name: str, start_after: str, limit: int) -> list[str]: ...
    def watch(self) -> contextlib.AbstractContextManager[dict[str, list[str]]]: ...

    # changes that apply to both tiers
    def forget(self, bucket: Bucket, keys: Iterable[str], reason: str | None) -> int: ...
    def drop_bucket(self, name: str) -> int: ...
    def live_blocks(self, name: str) -> int: ...
    def touch(self, bucket: str, keys: Sequence[str], expires_at: float) -> int: ...
    async def expire(self, bucket: Bucket, prefix: str) -> int: ...


def empty_disk_stats() -> dict[str, Any]:
    """The lower tier's part of the stats document when it holds nothing (every level and counter zero)."""
    return {"disk_budget": 0, "disk_used": 0, "disk_objects": 0, "disk_bytes": 0, "disk_segments": 0,
            "disk_queued_bytes": 0, "disk_direct_waiting": 0, "disk_index_bytes": 0, "disk_degraded": 0,
            "prefetches": 0,
            "disk_bytes_read": 0, "disk_bytes_written": 0, "disk_evictions": 0, "disk_expirations": 0,
            "disk_corrupt": 0, "disk_compactions": 0, "disk_degraded_reason": None, "disk_recovery": None,
            "disk_dropped_short_ttl": 0, "disk_dropped_too_large": 0, "disk_dropped_over_share": 0,
            "disk_dropped_not_writing": 0, "disk_write_waits": 0, "disk_write_refusals": 0,
            "disk_buckets": {}}


class NoLowerTier:
    """A RAM-only node's lower tier: holds nothing, accepts nothing (a victim is dropped), costs nothing."""

    def __init__(self) -> None:
        self.listeners: list[DiskListener] = []  # never called: nothing is ever stored here

    async def open(self, reset: bool, restore: ManifestRestore) -> RecoveryReport | None:
        return None

    def announce_recovered(self) -> None:
        pass

    async def close(self, spill_seconds: float) -> int:
        return 0

    async def housekeep(self) -> None:
        pass

    @property
    def degraded(self) -> str | None:
        return None

    def manifest_changed(self) -> None:
        pass

    def stats(self) -> dict[str, Any]:
        return empty_disk_stats()

    def after_write(self, obj: StoredObject) -> None:
        pass

    async def with_write_room(self, attempt: Callable[[], T]) -> T:
        return attempt()

    def demote(self, obj: StoredObject) -> bool:
        return False

    def may_hold(self, bucket: str) -> bool:
        return False

    def queued_object(self, bucket: str, key: str) -> StoredObject | None:
        return None

    def holds(self, bucket: str, key: str) -> bool:
        return False

    def sizes(self, bucket: str, keys: Sequence[str]) -> list[int | None]:
        return [None] * len(keys)

    async def read(self, bucket: Bucket, keys: Sequence[str], *, with_payload: bool = True
                   ) -> list[StoredObject | None]:
        return [None] * len(keys)

    def promote(self, bucket: Bucket, obj: StoredObject) -> bool:
        return False

    def prefetch(self, bucket: Bucket, keys: Sequence[str]) -> int:
        return 0

    async def keys_under(self, name: str, prefix: str) -> list[str]:
        return []

    async def list_page(self, name: str, start_after: str, limit: int) -> list[str]:
        return []

    @contextlib.contextmanager
    def watch(self) -> Iterator[dict[str, list[str]]]:
        yield {}

    def forget(self, bucket: Bucket, keys: Iterable[str], reason: str | None) -> int:
        return 0

    def drop_bucket(self, name: str) -> int:
        return 0

    def live_blocks(self, name: str) -> int:
        return 0

    def touch(self, bucket: str, keys: Sequence[str], expires_at: float) -> int:
        return 0

    async def expire(self, bucket: Bucket, prefix: str) -> int:
        return 0

