"""The flash tier as the engine uses it: RAM's eviction victims are demoted to flash, flash hits are read back
verified (and promoted into RAM), and deletes, overwrites, TTL changes and buckets apply to both tiers, so the
two are one store to every caller.

The storage itself (segments, index, recovery) is :mod:`ctxstore_server.flash`; the policy is split by what
each part owns, the parts sharing one :class:`~.flash_context.FlashContext`:

- **Writes** (:mod:`.flash_writes`): write-back copies, demotion of RAM's victims, the bounded queue both wait in
  and the backpressure it puts on writes, the shutdown spill.
- **Reads** (:mod:`.flash_reads`): RAM first, then the demotion queue, then flash, verified; reads joined per key,
  promotion into RAM, prefetch.
- **The facade** (:class:`FlashTier`, here: the engine's :class:`~.lower.LowerTier`, composing the two):
  lifecycle, the manifest, presence, the changes that apply to both tiers, removals the flash store made, stats.

Across the parts:

- **Events.** A demotion is a medium change: the block's RAM copy is announced removed (reason ``demoted``)
  immediately followed by a ``stored`` event with the disk medium, so a consumer that ignores the medium sees
  the key present throughout. Blocks the flash tier drops are ``removed`` with the disk medium.
- **Capacity.** Flash space is the flash store's (never exceeded; the oldest segment goes when full). A
  tenant with a RAM quota may hold at most the same share of the flash tier (quota x disk size / memory):
  beyond it its victims are dropped, so one tenant cannot push another's blocks off flash.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from ctxstore.units import format_size

from ..flash import FlashStats, FlashStore, RecoveryReport, Removal
from . import errors
from .config import EngineConfig
from .flash_context import REMOVED, STORED, FlashContext
from .flash_reads import PREFETCH_KEYS, FlashReads
from .flash_writes import FlashWrites
from .lower import BlockRef, DiskListener, ManifestRestore
from .objects import Bucket, StoredObject
from .store import NODE_STATE, ObjectStore

log = logging.getLogger("ctxstore.flash")

T = TypeVar("T")


class FlashTier:
    """One node's flash tier, glued to its RAM store: the write queue and the reads, composed."""

    def __init__(self, config: EngineConfig, store: ObjectStore, clock: Callable[[], float]) -> None:
        assert config.disk_path, "a flash tier needs a directory"
        self.config = config
        self.store = store
        self.clock = clock
        queue_limit = config.disk_queue or min(256 << 20, max(8 << 20, config.budget // 16))
        try:
            self.flash = FlashStore(
                config.disk_path, config.disk_size, segment_bytes=config.disk_segment_size,
                queue_bytes=queue_limit, readers=config.disk_readers, clock=clock,
                read_buffer_bytes=min(1 << 30, config.budget // 8),
                on_remove=self._flash_removed,
            )
        except ValueError as exc:
            need = format_size(3 * config.disk_segment_size + (1 << 20))
            raise ValueError(f"--disk-size {format_size(config.disk_size)} is too small for --disk-segment-size "
                             f"{format_size(config.disk_segment_size)}: the flash tier needs at least 3 segments "
                             f"plus 1 MiB ({need}); raise --disk-size or lower --disk-segment-size ({exc})") from None
        self.context = FlashContext(config, store, self.flash, clock)
        self.listeners: list[DiskListener] = self.context.listeners  # one list: the engine appends, the parts call
        self.writes = FlashWrites(self.context, queue_limit)
        self.reads = FlashReads(self.context, self.writes.queued_object)
        self.state_charged = 0  # the flash index's and read buffers' RAM, as last charged to the budget
        self._manifest_task: asyncio.Task[None] | None = None
        self._manifest_dirty = False
        self.manifest_source: Callable[[], dict[str, Any]] | None = None

    # ------------------------------------------------------------------ lifecycle

    async def open(self, reset: bool, restore: ManifestRestore) -> RecoveryReport:
        """Rebuild the index, hand the manifest (buckets, policies, quotas) to ``restore``, forget blocks of
        buckets the manifest does not know. The node serves only after this returns."""
        report = await self.flash.open(reset=reset)
        self.context.recovery = report
        restore(report.manifest or {})
        for name in self.flash.buckets():
            if name not in self.store.buckets:
                self.flash.drop_bucket(name)
        self.refresh(self.flash.stats())
        await self.save_manifest()
        return report

    async def close(self, spill_seconds: float = 0.0) -> int:
        """Stop: write what waits for flash, then (``spill_seconds`` > 0) what only RAM holds, for at most that
        long, so a planned restart comes back with it; save the manifest, seal the segments. Returns the
        blocks spilled."""
        self.writes.flush_now()
        tasks = self.context.tasks
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        spilled = await self.writes.spill(time.monotonic() + spill_seconds) if spill_seconds > 0 else 0
        await self.save_manifest()
        await self.flash.close()
        return spilled

    def announce_recovered(self) -> None:
        """After a restart: a ``stored`` event (disk medium) for every block recovered, in the background, so
        a router that lost its view of this node (its event epoch changed) learns what it holds again."""
        recovery = self.context.recovery
        if recovery is None or not recovery.blocks or not self.listeners:
            return
        self.context.spawn(self._announce_recovered())

    async def _announce_recovered(self) -> None:
        try:
            for name in list(self.store.buckets):
                # A segment's keys at a time: a sorted listing of every key would hold ~80 B per block.
                async for keys in self.flash.keys_by_segment(name):
                    for i in range(0, len(keys), PREFETCH_KEYS):
                        self._announce_present(name, keys[i:i + PREFETCH_KEYS])
                        await asyncio.sleep(0)
        except Exception:  # advisory: a router that misses them sees misses, never wrong blocks
            log.exception("flash: announcing the recovered blocks failed")

    def _announce_present(self, name: str, keys: list[str]) -> None:
        bucket = self.store.buckets.get(name)
        if bucket is None or not keys:
            return
        for key, entry in zip(keys, self.flash.lookup_many(name, keys)):
            ram = bucket.objects.get(key)
            if entry is not None and (ram is None or not ram.live):
                self.context.announce(STORED, BlockRef(name, bucket.owner, key, entry.size, entry.expires_at), None)

    async def housekeep(self) -> None:
        """Bounded background work of the flash store, and the per-tenant shares it is checked against."""
        await self.flash.housekeep()
        self.refresh(self.flash.stats())

    def refresh(self, stats: FlashStats) -> None:
        """Bring the tenants' flash shares and the charge of the index and the kept read buffers up to date
        (both live in RAM: they count against ``--memory`` like the records of buckets and uploads).

        Room is made for what they grew by, as for any other state, so RAM at rest stays within the budget
        (charging the buffers that reads handed back to a full node left it over the budget until the next write).
        The index must be held; the read buffers are a cache: if no room can be made (what is left is pinned,
        being written or sent), the buffers beyond the room left are given back instead."""
        self._refresh_shares(stats)
        budget = self.store.budget
        held = stats.index_bytes + stats.buffer_bytes
        delta = held - self.state_charged
        if delta > 0 and not budget.fits(delta):
            try:
                self.store.capacity.make_room(delta)
            except errors.StorageError:
                room = budget.limit - budget.used + self.state_charged - stats.index_bytes
                kept = self.flash.trim_buffers(max(0, min(stats.buffer_bytes, room)))
                held = stats.index_bytes + kept
                delta = held - self.state_charged
        if delta:
            budget.charge(NODE_STATE, delta, "state")
            self.state_charged = held

    def _refresh_shares(self, stats: FlashStats) -> None:
        shares: dict[str, int] = {}
        for name, bstats in stats.buckets.items():
            bucket = self.store.buckets.get(name)
            if bucket is not None:
                shares[bucket.owner] = shares.get(bucket.owner, 0) + bstats.bytes
        self.context.tenant_disk = shares

    # ------------------------------------------------------------------ the manifest

    def manifest_changed(self) -> None:
        """Buckets, their policies or quotas changed: save the manifest soon (coalesced, off the caller)."""
        self._manifest_dirty = True
        if self._manifest_task is None or self._manifest_task.done():
            try:
                self._manifest_task = asyncio.get_running_loop().create_task(self._save_soon())
            except RuntimeError:  # no loop (not serving): saved at close
                pass

    async def _save_soon(self) -> None:
        while self._manifest_dirty:
            await self.save_manifest()

    async def save_manifest(self) -> None:
        if self.manifest_source is None or not self.flash_open:
            return
        self._manifest_dirty = False
        if not await self.flash.save_manifest(self.manifest_source()):
            log.warning("flash: the manifest could not be saved (%s)", self.flash.degraded or "device refused")

    @property
    def flash_open(self) -> bool:
        return self.context.open

    @property
    def degraded(self) -> str | None:
        """Why the flash tier stopped writing (a device error), or None."""
        return self.flash.degraded

    # ------------------------------------------------------------------ writes (flash_writes)

    def after_write(self, obj: StoredObject) -> None:
        self.writes.after_write(obj)

    async def with_write_room(self, attempt: Callable[[], T]) -> T:
        return await self.writes.with_write_room(attempt)

    def demote(self, obj: StoredObject) -> bool:
        return self.writes.demote(obj)

    def watch(self) -> contextlib.AbstractContextManager[dict[str, list[str]]]:
        return self.writes.watch()

    # ------------------------------------------------------------------ reads (flash_reads)

    async def read(self, bucket: Bucket, keys: Sequence[str], *, with_payload: bool = True
                   ) -> list[StoredObject | None]:
        return await self.reads.read(bucket, keys, with_payload=with_payload)

    def promote(self, bucket: Bucket, obj: StoredObject) -> bool:
        return self.reads.promote(bucket, obj)

    def prefetch(self, bucket: Bucket, keys: Sequence[str]) -> int:
        return self.reads.prefetch(bucket, keys)

    # ------------------------------------------------------------------ presence

    def may_hold(self, bucket: str) -> bool:
        """Whether the tier may hold blocks of ``bucket``: the reads ask it per key (no cheaper answer yet)."""
        return True

    def queued_object(self, bucket: str, key: str) -> StoredObject | None:
        """The victim still waiting for its flash write at (bucket, key), if live."""
        return self.writes.queued_object(bucket, key)

    def holds(self, bucket: str, key: str) -> bool:
        """Whether the flash tier has (or is writing) a live block at (bucket, key)."""
        return self.queued_object(bucket, key) is not None or self.flash.lookup(bucket, key) is not None

    def sizes(self, bucket: str, keys: Sequence[str]) -> list[int | None]:
        """Per key the payload size of the flash tier's live block (queued or written), or None. No I/O."""
        out: list[int | None] = [None] * len(keys)
        if not self.flash_open:
            return out
        present, sizes = self.flash.present_many(bucket, keys)
        for i, key in enumerate(keys):
            queued = self.queued_object(bucket, key)
            if queued is not None:
                out[i] = queued.size
            elif present[i]:
                out[i] = int(sizes[i])
        return out

    # ------------------------------------------------------------------ changes that apply to both tiers

    def forget(self, bucket: Bucket, keys: Iterable[str], reason: str | None) -> int:
        """Keys deleted or overwritten: their flash copies (written or queued) go. ``reason``: announce each
        block the flash tier held as removed (None: say nothing, e.g. an overwrite whose new version is
        announced). Returns how many it held."""
        keys = list(keys)
        self.reads.stale(bucket.name, keys)
        held = self.writes.forget(bucket.name, keys)
        if not self.flash_open:
            return len(held)
        if len(keys) == 1 and not held:  # every write asks about its key: the scalar probe, no arrays
            entry = self.flash.lookup(bucket.name, keys[0])
            if entry is None:
                return 0
        present, sizes = self.flash.present_many(bucket.name, keys)
        on_flash = [k for k, p in zip(keys, present) if p]
        if on_flash or held:
            self.flash.delete_many(bucket.name, list(dict.fromkeys(held + on_flash)))
        if reason is not None:
            now = self.clock()
            gone = dict.fromkeys(held + on_flash)
            size_of = dict(zip(keys, (int(s) for s in sizes)))
            for key in gone:
                self.context.announce(REMOVED, BlockRef(bucket.name, bucket.owner, key, size_of.get(key, 0), now),
                                      reason)
        return len(dict.fromkeys(held + on_flash))

    def drop_bucket(self, name: str) -> int:
        """A bucket deleted or flushed: every block of it on flash goes at once."""
        self.reads.stale_bucket(name)
        self.writes.drop_bucket(name)
        return self.flash.drop_bucket(name) if self.flash_open else 0

    def live_blocks(self, name: str) -> int:
        """Live blocks of a bucket on flash (queued writes included)."""
        queued = len(self.writes.demoting_keys(name))
        if not self.flash_open:
            return queued
        bstats = self.flash.stats().buckets.get(name)
        return queued + (bstats.blocks if bstats is not None else 0)

    def touch(self, bucket: str, keys: Sequence[str], expires_at: float) -> int:
        """Extend flash-resident blocks' lives (never shortens); returns how many were live on flash."""
        if not self.flash_open:
            return 0
        entries = self.flash.lookup_many(bucket, keys)
        longer = [k for k, e in zip(keys, entries) if e is not None and e.expires_at < expires_at]
        if longer:
            self.flash.touch_many(bucket, longer, expires_at)
        self.writes.extend(bucket, keys, expires_at)
        return sum(e is not None for e in entries)

    async def expire(self, bucket: Bucket, prefix: str) -> int:
        """Operator verb: blocks under ``prefix`` on flash are expired now (announced as expired)."""
        keys = await self.keys_under(bucket.name, prefix)
        return self.forget(bucket, keys, "expired")

    async def keys_under(self, name: str, prefix: str) -> list[str]:
        """Every key of bucket ``name`` on flash (or queued for it) starting with ``prefix``."""
        out = [k for k in self.writes.demoting_keys(name) if k.startswith(prefix)]
        if not self.flash_open:
            return out
        async for key in self.flash.iter_keys(name, start_after=prefix[:-1]):
            if not key.startswith(prefix):
                if key > prefix:
                    break
                continue
            out.append(key)
        return list(dict.fromkeys(out))

    # ------------------------------------------------------------------ listing

    async def list_page(self, name: str, start_after: str, limit: int) -> list[str]:
        """Sorted flash keys of bucket ``name`` after ``start_after`` (queued ones included), at most ``limit``."""
        keys = await self.flash.list_keys(name, start_after, limit) if self.flash_open else []
        queued = [k for k in self.writes.demoting_keys(name) if k > start_after]
        if queued:
            keys = sorted(set(keys) | set(queued))[:limit]
        return keys

    # ------------------------------------------------------------------ removals the flash store made

    def _flash_removed(self, removals: list[Removal]) -> None:
        now = self.clock()
        for removal in removals:
            bucket = self.store.buckets.get(removal.bucket)
            if bucket is None:
                continue
            ram = bucket.objects.get(removal.key)
            if ram is not None and not ram.expired(now):
                ram.on_disk = False  # RAM still has it: no event; its next eviction writes it again
                continue
            if removal.reason == "evicted":
                bucket.stats.evictions += 1
            elif removal.reason == "expired":
                bucket.stats.expirations += 1
            self.context.announce(REMOVED, BlockRef(bucket.name, bucket.owner, removal.key, 0, now), removal.reason)

    # ------------------------------------------------------------------ stats

    def stats(self) -> dict[str, Any]:
        """The flash tier's levels and counters for the engine's stats document."""
        s = self.flash.stats() if self.flash_open else FlashStats(capacity_bytes=self.config.disk_size)
        report = self.context.recovery
        counters = self.context.counters
        return {
            "disk_budget": s.capacity_bytes, "disk_used": s.disk_bytes, "disk_objects": s.blocks,
            "disk_bytes": s.bytes, "disk_segments": s.segments, "disk_queued_bytes": self.writes.queued,
            "disk_direct_waiting": len(self.writes.direct_waiting),
            "disk_index_bytes": s.index_bytes, "disk_degraded": int(s.degraded is not None),
            "prefetches": counters.prefetches, "disk_bytes_read": s.device_bytes_read,
            **{f"disk_dropped_{reason}": n for reason, n in counters.dropped.items()},
            "disk_write_waits": counters.write_waits, "disk_write_refusals": counters.write_refusals,
            "disk_bytes_written": s.bytes_written, "disk_evictions": s.evicted, "disk_expirations": s.expired,
            "disk_corrupt": s.corrupt, "disk_compactions": s.compactions,
            "disk_degraded_reason": s.degraded,
            "disk_recovery": None if report is None else {
                "blocks": report.blocks, "bytes": report.bytes, "seconds": round(report.seconds, 3),
                "discarded_records": report.discarded_records, "corrupt_segments": report.corrupt_segments,
                "expired": report.expired, "reset": report.reset},
            "disk_buckets": {name: (b.blocks, b.bytes) for name, b in s.buckets.items()},
        }

