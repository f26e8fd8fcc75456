"""What the flash tier's parts share: the state handed to the write queue (:mod:`.flash_writes`), the joined
reads (:mod:`.flash_reads`) and the facade that composes them (:class:`~.tier.FlashTier`), and the metadata
every flash record carries. One object, passed to each part explicitly: no part reaches into another."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import msgpack

from ..flash import FlashStore, RecoveryReport
from .config import EngineConfig
from .lower import BlockRef, DiskListener
from .objects import StoredObject
from .store import ObjectStore

STORED = "stored"
REMOVED = "removed"

META_VERSION = 1
# Why a RAM victim may leave without being demoted: too little life left (--disk-min-ttl), larger than a segment
# or the whole queue, over its tenant's share of flash, or the tier not writing (not open, degraded, a failed
# write).
DROP_REASONS = ("short_ttl", "too_large", "over_share", "not_writing")


def encode_meta(obj: StoredObject) -> bytes:
    """The object's metadata as its flash record carries it (opaque to the flash store)."""
    return msgpack.packb([META_VERSION, obj.etag, obj.content_type, dict(obj.headers), dict(obj.user_meta),
                          dict(obj.checksums), obj.parts_count, obj.ttl])


def decode_meta(data: bytes) -> tuple[str, str, dict[str, str], dict[str, str], dict[str, str], int, float]:
    """(etag, content type, headers, user metadata, checksums, parts count, ttl); ValueError if unreadable."""
    try:
        fields = msgpack.unpackb(data)
        version, etag, ctype, headers, user_meta, checksums, parts, ttl = fields
    except Exception as exc:  # msgpack raises several types; any of them means "not ours"
        raise ValueError(f"unreadable flash metadata: {exc}") from None
    if version != META_VERSION:
        raise ValueError(f"flash metadata version {version!r}")
    return str(etag), str(ctype), dict(headers), dict(user_meta), dict(checksums), int(parts), float(ttl)


@dataclass
class TierCounters:
    """Node-wide counters of the flash tier the engine keeps (the flash store keeps the device's own)."""

    prefetches: int = 0  # blocks prefetch started reading from flash
    # Eviction victims not demoted, by reason (DROP_REASONS). Never for want of queue room: the write waits.
    dropped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DROP_REASONS, 0))
    write_waits: int = 0  # writes that waited for the demotion queue to drain
    write_refusals: int = 0  # writes refused (SlowDown) after waiting --disk-write-wait for it


@dataclass
class FlashContext:
    """One node's flash tier state that more than one part uses."""

    config: EngineConfig
    store: ObjectStore  # RAM: its buckets, budget and payload buffers
    flash: FlashStore
    clock: Callable[[], float]
    counters: TierCounters = field(default_factory=TierCounters)
    listeners: list[DiskListener] = field(default_factory=list)  # the engine's, told of stored/removed blocks
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)  # background work, cancelled at close
    tenant_disk: dict[str, int] = field(default_factory=dict)  # payload bytes per tenant on flash (housekeep)
    recovery: RecoveryReport | None = None  # set once the flash store is open

    @property
    def open(self) -> bool:
        return self.recovery is not None

    def announce(self, kind: str, ref: BlockRef, reason: str | None) -> None:
        for listener in self.listeners:
            listener(kind, ref, reason)

    def spawn(self, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` in the background, cancelled if still running at close."""
        task = asyncio.get_running_loop().create_task(work)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
