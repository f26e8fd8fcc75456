"""The flash tier as the engine uses it: RAM's eviction victims are demoted to flash, flash hits are read back
verified (and promoted into RAM), and deletes, overwrites, TTL changes and buckets apply to both tiers, so the
two are one store to every caller.

The storage itself (segments, index, recovery) is :mod:`ctxstore_server.flash`; this module is policy:

- **Write-back.** With ``disk_write_back`` every block written is copied to flash right away (:attr:`copying`)
  and stays in RAM: once the copy lands the object is ``on_disk`` and its eviction writes nothing, and a SIGKILL
  loses only the copies still queued. A delete or overwrite drops a copy on its way (the writer supersedes it).
- **Demotion.** An eviction victim with enough life left is handed to the flash writer instead of being dropped.
  It leaves RAM's accounting at once (so the write that needed room proceeds), but stays readable from
  :attr:`FlashTier.demoting` until its write lands. What waits for a write is bounded (``disk_queue``): a victim
  that finds the queue full stays in RAM and the write that needed its room waits for the queue
  (:meth:`FlashTier.with_write_room`, ``disk_write_wait``), then is refused: backpressure, never a dropped block.
  A block that came back from flash unchanged is still on flash: its demotion writes nothing.
  ``disk_direct_size`` sends large blocks down right after their write; one that finds the queue full stays in
  RAM and waits its turn, going down as earlier writes land.
- **Reads.** RAM first, then the demotion queue, then flash (verified by the flash store: header, key and
  payload XXH3; a record that fails is a miss and is dropped). A flash hit is promoted into RAM when the
  policy says so and room can be made; otherwise it is sent from a transient buffer that counts against the
  budget (as ``sending`` bytes) while its answer is being sent. A key already being read (a prefetch, a get,
  a promotion) is not read again: the reader joins the read in flight (:meth:`FlashTier.read`).
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
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgpack

from ctxstore.units import format_size

from ..flash import (
    SUPERSEDED,
    FlashBlock,
    FlashMeta,
    FlashRecord,
    FlashStats,
    FlashStore,
    RecoveryReport,
    Removal,
    WriteResult,
)
from . import errors
from .config import EngineConfig
from .lower import BlockRef, DiskListener, ManifestRestore
from .objects import Bucket, StoredObject
from .store import NODE_STATE, ObjectStore

log = logging.getLogger("ctxstore.flash")

T = TypeVar("T")

STORED = "stored"
REMOVED = "removed"

META_VERSION = 1
# Why a RAM victim may leave without being demoted: too little life left (--disk-min-ttl), larger than a segment
# or the whole queue, over its tenant's share of flash, or the tier not writing (not open, degraded, a failed
# write).
DROP_REASONS = ("short_ttl", "too_large", "over_share", "not_writing")
QUEUE_FULL = "queue_full"  # not a drop reason: the victim stays in RAM and the write waits
PREFETCH_TASKS = 4  # prefetches reading from flash at once; more are answered but not started
PREFETCH_KEYS = 1024  # keys one prefetch read asks the flash store for at a time
# Direct writes waiting for the demotion queue (keys only: the blocks are in RAM). Beyond this the oldest is
# forgotten and goes down when it is evicted instead; it bounds the list while flash cannot keep up for long.
DIRECT_WAITING = 1 << 16


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


class _Reading:
    """One flash read (distinct keys of one bucket), shared by every reader of its keys. It stays joinable
    until it is done and its last reader has taken its result: a key written or deleted until then is marked
    stale here, so no reader of it, early or late, is served the older version."""

    __slots__ = ("slots", "stale", "task", "waiters", "with_payload")

    def __init__(self, task: asyncio.Task[list[FlashMeta | None]], slots: list[tuple[str, str]],
                 with_payload: bool) -> None:
        self.task = task
        self.slots = slots  # (bucket, key) per place in the read
        self.with_payload = with_payload  # False: headers only, which a reader of the payload cannot use
        self.stale: set[int] = set()  # places of keys written, deleted or dropped since the read began
        self.waiters = 0  # readers that have not taken their result yet

    def block(self, pos: int) -> FlashMeta | None:
        """The verified block at ``pos`` of a finished read; None if it was a miss, or the read failed or was
        cancelled (the node is closing)."""
        task = self.task
        if task.cancelled() or task.exception() is not None:
            return None
        return task.result()[pos]


@dataclass
class TierCounters:
    """Node-wide counters of the flash tier the engine keeps (the flash store keeps the device's own)."""

    prefetches: int = 0  # blocks prefetch started reading from flash
    # Eviction victims not demoted, by reason (DROP_REASONS). Never for want of queue room: the write waits.
    dropped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DROP_REASONS, 0))
    write_waits: int = 0  # writes that waited for the demotion queue to drain
    write_refusals: int = 0  # writes refused (SlowDown) after waiting --disk-write-wait for it



def _wait_in_line(line: OrderedDict[tuple[str, str], None], obj: StoredObject) -> None:
    """Put ``obj``'s key at the back of ``line`` (a new version of a key waiting goes to the back); past
    ``DIRECT_WAITING`` keys the oldest is forgotten: it goes down when it is evicted instead."""
    slot = (obj.bucket, obj.key)
    line.pop(slot, None)
    line[slot] = None
    if len(line) > DIRECT_WAITING:
        line.popitem(last=False)


class FlashTier:
    """One node's flash tier, glued to its RAM store."""

    def __init__(self, config: EngineConfig, store: ObjectStore, clock: Callable[[], float]) -> None:
        assert config.disk_path, "a flash tier needs a directory"
        self.config = config
        self.store = store
        self.clock = clock
        self.queue_limit = config.disk_queue or min(256 << 20, max(8 << 20, config.budget // 16))
        try:
            self.flash = FlashStore(
                config.disk_path, config.disk_size, segment_bytes=config.disk_segment_size,
                queue_bytes=self.queue_limit, readers=config.disk_readers, clock=clock,
                read_buffer_bytes=min(1 << 30, config.budget // 8),
                on_remove=self._flash_removed,
            )
        except ValueError as exc:
            need = format_size(3 * config.disk_segment_size + (1 << 20))
            raise ValueError(f"--disk-size {format_size(config.disk_size)} is too small for --disk-segment-size "
                             f"{format_size(config.disk_segment_size)}: the flash tier needs at least 3 segments "
                             f"plus 1 MiB ({need}); raise --disk-size or lower --disk-segment-size ({exc})") from None
        self.max_block = config.disk_segment_size - (16 << 10)  # what a segment can hold (the store's own rule)
        self.demoting: dict[tuple[str, str], StoredObject] = {}
        # Write-back: RAM objects whose copy is on its way to flash (they stay in RAM); their bytes count in the
        # same queue as the victims', and the same device writes both.
        self.copying: dict[tuple[str, str], StoredObject] = {}
        self.copy_waiting: OrderedDict[tuple[str, str], None] = OrderedDict()  # no room in the queue yet
        self.queued = 0  # payload bytes in self.demoting and self.copying
        self.tenant_queued: dict[str, int] = {}  # the same per tenant (for the flash shares)
        self._batch: list[StoredObject] = []
        self.direct_waiting: OrderedDict[tuple[str, str], None] = OrderedDict()  # (bucket, key), oldest first
        self._flush_handle: asyncio.Handle | None = None
        self._progress: asyncio.Future[None] | None = None  # resolved when a flash write lands
        self.listeners: list[DiskListener] = []
        self.counters = TierCounters()
        self.recovery: RecoveryReport | None = None
        self.tenant_disk: dict[str, int] = {}  # payload bytes per tenant on flash, refreshed by housekeep()
        self.state_charged = 0  # the flash index's and read buffers' RAM, as last charged to the budget
        self._prefetching = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        # (bucket, key) -> the flash read in flight that fetches it and the key's place in it: a reader of a key
        # being read joins that read instead of reading the record again.
        self._reading: dict[tuple[str, str], tuple[_Reading, int]] = {}
        self._manifest_task: asyncio.Task[None] | None = None
        self._manifest_dirty = False
        self.manifest_source: Callable[[], dict[str, Any]] | None = None
        self._watchers: list[dict[str, list[str]]] = []

    # ------------------------------------------------------------------ lifecycle

    async def open(self, reset: bool, restore: ManifestRestore) -> RecoveryReport:
        """Rebuild the index, hand the manifest (buckets, policies, quotas) to ``restore``, forget blocks of
        buckets the manifest does not know. The node serves only after this returns."""
        report = await self.flash.open(reset=reset)
        self.recovery = report
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
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        spilled = await self._spill(time.monotonic() + spill_seconds) if spill_seconds > 0 else 0
        await self.save_manifest()
        await self.flash.close()
        return spilled

    async def _spill(self, deadline: float) -> int:
        """Write what only RAM holds, in batches of a quarter of the demotion queue with up to three in
        flight (the writer copies one while the device takes another), until done or past ``deadline`` (the
        batches appended by then are written: at most three quarters of the queue)."""
        if not self.flash_open:
            return 0
        t0 = time.monotonic()
        now = self.clock()
        spilled = spilled_bytes = 0
        in_flight: deque[asyncio.Future[tuple[int, int]]] = deque()
        batch: list[FlashRecord] = []
        size = 0
        stopped = False
        for bucket in list(self.store.buckets.values()):
            for obj in list(bucket.objects.values()):
                if obj.expired(now) or (obj.on_disk and self.flash.lookup(obj.bucket, obj.key) is not None):
                    continue
                if self._refusal(obj, queue=False) is not None:
                    continue
                batch.append(FlashRecord(obj.bucket, obj.key, obj.data, obj.expires_at, obj.created,
                                         encode_meta(obj), obj.xxh3))
                size += obj.size
                if size >= self.queue_limit // 4:
                    in_flight.append(self._spill_batch(batch))
                    batch, size = [], 0
                    if len(in_flight) >= 3:
                        n, nbytes = await in_flight.popleft()
                        spilled, spilled_bytes = spilled + n, spilled_bytes + nbytes
                    if time.monotonic() > deadline or self.flash.degraded is not None:
                        stopped = True
                        break
            if stopped:
                break
        if not stopped:
            in_flight.append(self._spill_batch(batch))
        for fut in in_flight:
            n, nbytes = await fut
            spilled, spilled_bytes = spilled + n, spilled_bytes + nbytes
        seconds = time.monotonic() - t0
        if stopped:
            log.warning("flash: shutdown spill stopped after %d blocks (time or device)", spilled)
        elif spilled:
            log.info("flash: %d blocks (%.1f MiB) written from RAM at shutdown in %.2f s", spilled,
                     spilled_bytes / (1 << 20), seconds)
        return spilled

    def _spill_batch(self, batch: list[FlashRecord]) -> asyncio.Future[tuple[int, int]]:
        """Append ``batch``; the future gives the blocks and payload bytes stored once all are written."""
        fut: asyncio.Future[tuple[int, int]] = asyncio.get_running_loop().create_future()

        def written(results: list[WriteResult]) -> None:
            stored = [r for r in results if r.stored]
            if not fut.done():
                fut.set_result((len(stored), sum(len(r.record.payload) for r in stored)))

        # force: the spill bounds what it has in flight itself (three batches); a block larger than a quarter of
        # the queue makes batches the store's own bound would refuse in part.
        if not batch or all(reason is not None for reason in self.flash.append(batch, written, force=True)):
            fut.set_result((0, 0))
        return fut

    def announce_recovered(self) -> None:
        """After a restart: a ``stored`` event (disk medium) for every block recovered, in the background, so
        a router that lost its view of this node (its event epoch changed) learns what it holds again."""
        if self.recovery is None or not self.recovery.blocks or not self.listeners:
            return
        task = asyncio.get_running_loop().create_task(self._announce_recovered())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

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
                self._announce(STORED, BlockRef(name, bucket.owner, key, entry.size, entry.expires_at), None)

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
                self.store.make_room(delta)
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
        self.tenant_disk = shares

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
        return self.recovery is not None

    @property
    def degraded(self) -> str | None:
        """Why the flash tier stopped writing (a device error), or None."""
        return self.flash.degraded

    # ------------------------------------------------------------------ demotion

    def after_write(self, obj: StoredObject) -> None:
        """``disk_direct_size``: a large object goes to flash right after its write (served from the demotion
        queue until it lands; in RAM while it waits for room in that queue) instead of taking RAM until it is
        evicted. Otherwise ``disk_write_back``: a copy goes to flash and the object stays in RAM."""
        threshold = self.config.disk_direct_size
        if threshold and obj.size >= threshold:
            self.send_direct(obj)
        elif self.config.disk_write_back:
            self.write_back(obj)

    async def with_write_room(self, attempt: Callable[[], T]) -> T:
        """``attempt()`` (a reservation opening or growing, before the bytes it holds room for are read), waiting
        while it needs a RAM victim demoted and the write queue is full: backpressure instead of a dropped
        block. Past ``disk_write_wait`` it raises InsufficientCapacity (503 SlowDown, a retryable bulk error).
        Reads never come here: a promotion that finds no room sends its block from a transient buffer."""
        deadline: float | None = None
        while True:
            try:
                return attempt()
            except errors.FlashQueueFull:
                now = time.monotonic()
                if deadline is None:
                    deadline = now + self.config.disk_write_wait
                    self.counters.write_waits += 1
                if now >= deadline:
                    self.counters.write_refusals += 1
                    raise errors.InsufficientCapacity(
                        f"RAM is full and the flash tier's write queue stayed full for {self.config.disk_write_wait:g} "
                        "s (the device is slower than the writes): retry", retry_after=1.0) from None
                await self.queue_progress(deadline - now)

    def demote(self, obj: StoredObject) -> bool:
        """Take an eviction victim to flash instead of dropping it. True: it is (or is becoming) flash-resident,
        so the store removes it as ``demoted``; False: drop it as evicted."""
        if obj.on_disk and self.flash.lookup(obj.bucket, obj.key) is not None:
            # Written back (or promoted) and unchanged since: flash has these bytes; only its expiry may have
            # moved on.
            self.flash.touch(obj.bucket, obj.key, obj.expires_at)
            self._announce_demoted(obj)
            return True
        slot = (obj.bucket, obj.key)
        if self.copying.get(slot) is obj:  # its copy is being written: that write is its demotion
            del self.copying[slot]
            self.demoting[slot] = obj
            return True
        refusal = self._refusal(obj)
        if refusal == QUEUE_FULL:  # kept in RAM: the write that needs its room waits, or is refused
            raise errors.FlashQueueFull("RAM is full and the flash tier's write queue too")
        if refusal is not None:
            self.counters.dropped[refusal] += 1
            return False
        self._enqueue(self.demoting, obj)
        return True

    def write_back(self, obj: StoredObject) -> None:
        """``disk_write_back``: copy a block just written to flash, keeping it in RAM; once the copy lands the
        object is ``on_disk`` and its eviction writes nothing. One the tier would not take (too short-lived,
        too large, over its tenant's share) stays RAM-only; with the queue full it waits in line
        (:meth:`_send_waiting`) and, if evicted first, is demoted as any victim."""
        if not obj.live or obj.on_disk or self._refusal(obj, queue=False) is not None:
            return
        if not self.copy_waiting and self.queued + obj.size <= self.queue_limit:
            self._enqueue(self.copying, obj)
        else:
            _wait_in_line(self.copy_waiting, obj)

    def _enqueue(self, queue: dict[tuple[str, str], StoredObject], obj: StoredObject) -> None:
        """Hand ``obj`` to the next flush, as a victim (``queue`` is :attr:`demoting`) or a write-back copy
        (:attr:`copying`); its bytes count in the queue either way."""
        queue[(obj.bucket, obj.key)] = obj
        self.queued += obj.size
        self.tenant_queued[obj.tenant] = self.tenant_queued.get(obj.tenant, 0) + obj.size
        self._batch.append(obj)
        if self._flush_handle is None:
            self._flush_handle = asyncio.get_running_loop().call_soon(self._flush)

    def _dequeue(self, queue: dict[tuple[str, str], StoredObject], slot: tuple[str, str],
                 obj: StoredObject | None = None) -> StoredObject | None:
        """Take ``slot`` off ``queue`` (written, refused, deleted or replaced); with ``obj``, only if that is the
        object queued there."""
        queued = queue.get(slot)
        if queued is None or (obj is not None and queued is not obj):
            return None
        del queue[slot]
        self.queued -= queued.size
        self.tenant_queued[queued.tenant] -= queued.size
        return queued

    def send_direct(self, obj: StoredObject) -> None:
        """``disk_direct_size``: demote a large block right after its write instead of when it is evicted. If
        the demotion queue is full (a burst of writes outrunning the device) it stays in RAM, in line behind the
        others waiting, and goes down as earlier writes land (:meth:`_send_waiting`)."""
        if not obj.live or obj.pinned(self.clock()) or self._refusal(obj, queue=False) is not None:
            return  # refused for good, not for room: it goes down (or not) when it is evicted
        if not self.direct_waiting and self.queued + obj.size <= self.queue_limit:
            self.store.demote_now(obj)
            return
        _wait_in_line(self.direct_waiting, obj)
        self._send_waiting()

    def _send_waiting(self) -> None:
        """Demote the direct writes that were waiting, then copy the writes-back that were, oldest first, while
        the queue has room."""
        waiting = self.direct_waiting
        if self.flash.degraded is not None:
            waiting.clear()  # flash takes nothing more: they stay in RAM
            self.copy_waiting.clear()
            return
        threshold = self.config.disk_direct_size
        for line, send in ((waiting, self.store.demote_now), (self.copy_waiting, self._send_copy)):
            while line:
                bucket_name, key = next(iter(line))
                bucket = self.store.buckets.get(bucket_name)
                obj = bucket.objects.get(key) if bucket is not None else None
                if obj is not None and obj.live and (line is not waiting or obj.size >= threshold):
                    if self.queued + obj.size > self.queue_limit:
                        return  # still no room: the next landed write calls again
                    send(obj)
                line.popitem(last=False)  # sent, refused for good, or no longer in RAM

    def _send_copy(self, obj: StoredObject) -> None:
        if not obj.on_disk and self._refusal(obj, queue=False) is None:
            self._enqueue(self.copying, obj)

    def _refusal(self, obj: StoredObject, *, queue: bool = True) -> str | None:
        """Why ``obj`` cannot be demoted now (a DROP_REASONS entry, or QUEUE_FULL), or None if it can."""
        if not self.flash_open or self.flash.degraded is not None:
            return "not_writing"
        if obj.expires_at - self.clock() < self.config.disk_min_ttl:
            return "short_ttl"
        if obj.size > self.max_block or obj.size > self.queue_limit:
            return "too_large"  # a segment, or the queue, could never take it
        quota = self.store.budget.tenant_quota.get(obj.tenant, 0)
        if quota and self.config.budget:
            share = quota * self.config.disk_size // self.config.budget
            if self.tenant_disk.get(obj.tenant, 0) + self.tenant_queued.get(obj.tenant, 0) + obj.size > share:
                return "over_share"
        if queue and self.queued + obj.size > self.queue_limit:
            return QUEUE_FULL
        return None

    async def queue_progress(self, timeout: float) -> None:
        """Until a flash write lands (the demotion queue shrank) or ``timeout`` passes."""
        if self._progress is None:
            self._progress = asyncio.get_running_loop().create_future()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._progress), timeout)

    def _wake_writers(self) -> None:
        if self._progress is not None:
            if not self._progress.done():
                self._progress.set_result(None)
            self._progress = None

    def _flush(self) -> None:
        """Hand the victims gathered since the last call to the flash writer, in one append."""
        self._flush_handle = None
        batch, self._batch = self._batch, []
        objects = [o for o in batch  # not deleted, replaced or expired meanwhile
                   if self.demoting.get((o.bucket, o.key)) is o or self.copying.get((o.bucket, o.key)) is o]
        if not objects:
            return
        records = [FlashRecord(o.bucket, o.key, o.data, o.expires_at, o.created, encode_meta(o), o.xxh3)
                   for o in objects]
        # The tier bounds its queue (demote); the store's own bound, which also counts headers, must not refuse
        # what it admitted: a direct write's block is out of RAM already, so a refusal here would lose it.
        refused = self.flash.append(records, self._written, force=True)
        for obj, reason in zip(objects, refused):
            if reason is None:
                continue
            if self._dequeue(self.copying, (obj.bucket, obj.key), obj) is None:  # a copy refused: the block is still in RAM
                self._demotion_failed(obj, reason)

    def _written(self, results: list[WriteResult]) -> None:
        for result in results:
            record = result.record
            slot = (record.bucket, record.key)
            copy = self.copying.get(slot)
            if copy is not None and copy.data is record.payload:
                self._dequeue(self.copying, slot, copy)
                if result.stored:
                    self.tenant_disk[copy.tenant] = self.tenant_disk.get(copy.tenant, 0) + copy.size
                    copy.on_disk = copy.live  # in RAM and on flash: its eviction writes nothing
                continue
            obj = self.demoting.get(slot)
            if obj is None or obj.data is not record.payload:  # deleted, replaced or demoted again since
                continue
            if result.stored:
                self._dequeue(self.demoting, slot)
                self.tenant_disk[obj.tenant] = self.tenant_disk.get(obj.tenant, 0) + obj.size
                self._announce_demoted(obj)
            elif result.reason != SUPERSEDED:
                self._demotion_failed(obj, result.reason or "refused")
        if self.direct_waiting or self.copy_waiting:
            self._send_waiting()
        self._wake_writers()

    def _demotion_failed(self, obj: StoredObject, reason: str) -> None:
        """The write did not happen: the block is gone from the node, an eviction after all."""
        slot = (obj.bucket, obj.key)
        if self.demoting.get(slot) is obj:
            self._dequeue(self.demoting, slot)
        self.counters.dropped["not_writing"] += 1
        log.debug("flash: %s/%s not demoted (%s)", obj.bucket, obj.key, reason)
        bucket = self.store.buckets.get(obj.bucket)
        if bucket is not None:
            bucket.stats.evictions += 1
        self.store.announce_removed(obj, "evicted")

    @contextlib.contextmanager
    def watch(self) -> Iterator[dict[str, list[str]]]:
        """Collect, per bucket, the keys demoted while the block runs (a snapshot lists flash meanwhile)."""
        fresh: dict[str, list[str]] = {}
        self._watchers.append(fresh)
        try:
            yield fresh
        finally:
            self._watchers.remove(fresh)

    def _announce_demoted(self, obj: StoredObject) -> None:
        for fresh in self._watchers:
            fresh.setdefault(obj.bucket, []).append(obj.key)
        bucket = self.store.buckets.get(obj.bucket)
        if bucket is not None:
            bucket.stats.demotions += 1
        ref = BlockRef(obj.bucket, obj.tenant, obj.key, obj.size, obj.expires_at)
        for listener in self.listeners:
            listener(REMOVED, ref, "demoted")
            listener(STORED, ref, None)

    # ------------------------------------------------------------------ presence

    def may_hold(self, bucket: str) -> bool:
        """Whether the tier may hold blocks of ``bucket``: the reads ask it per key (no cheaper answer yet)."""
        return True

    def queued_object(self, bucket: str, key: str) -> StoredObject | None:
        """The victim still waiting for its flash write at (bucket, key), if live."""
        obj = self.demoting.get((bucket, key))
        if obj is None or obj.expired(self.clock()):
            return None
        return obj

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
        self._stale(bucket.name, keys)
        held: list[str] = []
        copies: list[str] = []  # copies on their way: the block was only announced in RAM
        for key in keys:
            if self._dequeue(self.demoting, (bucket.name, key)) is not None:
                held.append(key)
            elif self._dequeue(self.copying, (bucket.name, key)) is not None:
                copies.append(key)
        if copies and self.flash_open:
            self.flash.delete_many(bucket.name, copies)  # so a copy still in the writer never lands as live
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
                self._announce(REMOVED, BlockRef(bucket.name, bucket.owner, key, size_of.get(key, 0), now), reason)
        return len(dict.fromkeys(held + on_flash))

    def drop_bucket(self, name: str) -> int:
        """A bucket deleted or flushed: every block of it on flash goes at once."""
        self._stale(name, [k for (b, k) in self._reading if b == name])
        for slot in [s for s in self.demoting if s[0] == name]:
            self._dequeue(self.demoting, slot)
        for slot in [s for s in self.copying if s[0] == name]:
            self._dequeue(self.copying, slot)  # the bucket's floor makes whatever of it the writer still holds dead
        self.copy_waiting = OrderedDict((s, None) for s in self.copy_waiting if s[0] != name)
        return self.flash.drop_bucket(name) if self.flash_open else 0

    def live_blocks(self, name: str) -> int:
        """Live blocks of a bucket on flash (queued writes included)."""
        queued = sum(1 for (b, _) in self.demoting if b == name)
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
        for key in keys:
            queued = self.demoting.get((bucket, key))
            if queued is not None and queued.expires_at < expires_at:
                queued.expires_at = expires_at
        return sum(e is not None for e in entries)

    async def expire(self, bucket: Bucket, prefix: str) -> int:
        """Operator verb: blocks under ``prefix`` on flash are expired now (announced as expired)."""
        keys = await self.keys_under(bucket.name, prefix)
        return self.forget(bucket, keys, "expired")

    async def keys_under(self, name: str, prefix: str) -> list[str]:
        """Every key of bucket ``name`` on flash (or queued for it) starting with ``prefix``."""
        out = [k for (b, k) in self.demoting if b == name and k.startswith(prefix)]
        if not self.flash_open:
            return out
        async for key in self.flash.iter_keys(name, start_after=prefix[:-1]):
            if not key.startswith(prefix):
                if key > prefix:
                    break
                continue
            out.append(key)
        return list(dict.fromkeys(out))

    # ------------------------------------------------------------------ reads

    async def read(self, bucket: Bucket, keys: Sequence[str], *, with_payload: bool = True
                   ) -> list[StoredObject | None]:
        """Flash-resident blocks of ``keys`` as objects (None: not on flash, expired, or failed verification),
        read without blocking the loop. Not recorded as hits, not promoted: see :meth:`promote`.

        One device read per record: a key another caller is reading already (a prefetch, a get, a promotion)
        joins that read. The read runs as a task of its own, so a reader that is cancelled (its client went
        away) cancels nobody else's; a read that fails is a miss for every reader. A key written or deleted
        while it is being read is dropped from that read (:meth:`_stale`): no reader is served that result,
        nor joins it later; its readers get the newer version (queued, or read again) or a miss."""
        out, again = await self._read(bucket, keys, with_payload)
        if again:  # written while being read, the new version neither in RAM nor queued: flash has it, or none
            for i, obj in zip(again, (await self._read(bucket, [keys[i] for i in again], with_payload))[0]):
                out[i] = obj  # written yet again meanwhile: a miss this time
        return out

    async def _read(self, bucket: Bucket, keys: Sequence[str], with_payload: bool
                    ) -> tuple[list[StoredObject | None], list[int]]:
        """:meth:`read` once: the objects, and the places of the keys to read again (stale, see there)."""
        out: list[StoredObject | None] = [None] * len(keys)
        again: list[int] = []
        name = bucket.name
        joined: list[tuple[int, _Reading, int]] = []  # (place in keys, the read, the key's place in it)
        fresh: dict[str, int] = {}  # keys to read now -> their place in the new read
        fresh_at: list[int] = []
        for i, key in enumerate(keys):
            queued = self.queued_object(name, key)
            if queued is not None:
                out[i] = queued
                continue
            if not self.flash_open:
                continue
            shared = self._reading.get((name, key))
            if shared is not None and (shared[0].with_payload or not with_payload):
                joined.append((i, *shared))
            else:
                fresh.setdefault(key, len(fresh))
                fresh_at.append(i)
        if fresh:
            reading = self._start_read(bucket, list(fresh), with_payload)
            joined.extend((i, reading, fresh[keys[i]]) for i in fresh_at)
        if not joined:
            return out, again
        readings = {reading for _, reading, _ in joined}
        for reading in readings:
            reading.waiters += 1
        try:
            # wait() never cancels what it waits for: a cancelled reader leaves the reads to the others.
            await asyncio.wait({reading.task for reading in readings})
            if self.store.buckets.get(name) is not bucket:  # deleted (and maybe re-created) meanwhile
                return [None] * len(keys), again
            now = self.clock()
            for i, reading, pos in joined:
                if pos in reading.stale:  # written or deleted since the read began
                    out[i] = self.queued_object(name, keys[i])
                    ram = bucket.objects.get(keys[i])
                    if out[i] is None and (ram is None or ram.expired(now)):
                        again.append(i)
                    continue
                block = reading.block(pos)
                if block is None or block.expires_at <= now:
                    continue
                try:
                    out[i] = self._object(bucket, block, payload=with_payload)
                except ValueError:  # dropped by the read that found it (_read_shared)
                    continue
            return out, again
        finally:
            for reading in readings:
                reading.waiters -= 1
                if not reading.waiters and reading.task.done():
                    self._unregister(reading)

    def _start_read(self, bucket: Bucket, names: list[str], with_payload: bool) -> _Reading:
        """Read ``names`` (distinct keys) from flash in a task of its own, registered so that readers of the
        same keys join it until it is done."""
        task = asyncio.get_running_loop().create_task(self._read_shared(bucket, names, with_payload))
        reading = _Reading(task, [(bucket.name, key) for key in names], with_payload)
        for pos, slot in enumerate(reading.slots):
            self._reading[slot] = (reading, pos)
        self._tasks.add(task)

        def done(_task: object) -> None:
            self._tasks.discard(task)
            if not reading.waiters:  # every reader was cancelled
                self._unregister(reading)

        task.add_done_callback(done)
        return reading

    def _unregister(self, reading: _Reading) -> None:
        """A finished read whose readers all have their results: later readers read again."""
        registry = self._reading
        for slot in reading.slots:
            shared = registry.get(slot)
            if shared is not None and shared[0] is reading:  # not stale, nor taken over by a later read
                del registry[slot]

    async def _read_shared(self, bucket: Bucket, names: list[str], with_payload: bool
                           ) -> list[FlashMeta | None]:
        """The verified blocks (or headers) of ``names``; a read that fails is a miss for every key, and a
        record whose metadata cannot be decoded is dropped from flash (once, for every reader)."""
        try:
            blocks: Sequence[FlashMeta | None]
            if with_payload:
                blocks = await self.flash.read_many(bucket.name, names)
            else:
                blocks = await self.flash.read_meta_many(bucket.name, names)
        except Exception:  # the flash store reports device errors itself; whatever else, readers see misses
            log.exception("flash: a read of %d blocks of %s failed", len(names), bucket.name)
            return [None] * len(names)
        out = list(blocks)
        if self.store.buckets.get(bucket.name) is not bucket:
            return out  # every reader sees the bucket changed; never delete from a re-created one
        for pos, block in enumerate(out):
            if block is None:
                continue
            try:
                decode_meta(block.metadata)
            except ValueError as exc:  # verified bytes we cannot decode: never serve them
                log.warning("flash: %s/%s: %s; dropped", bucket.name, block.key, exc)
                self.flash.delete(bucket.name, block.key)
                out[pos] = None
        return out

    def _stale(self, name: str, keys: Iterable[str]) -> None:
        """Keys of bucket ``name`` written, deleted or dropped: a read of them in flight is of an older version,
        which no reader may be served (and no later reader joins)."""
        registry = self._reading
        if not registry:
            return
        for key in keys:
            shared = registry.pop((name, key), None)
            if shared is not None:
                shared[0].stale.add(shared[1])

    def _object(self, bucket: Bucket, block: FlashMeta, *, payload: bool = True) -> StoredObject:
        """A transient object for a verified block (every reader gets its own; the payload is shared).
        ``payload=False``: metadata only (HEAD, listing), even from a block read whole."""
        etag, ctype, headers, user_meta, checksums, parts, ttl = decode_meta(block.metadata)
        data = block.payload if payload and isinstance(block, FlashBlock) else memoryview(b"")
        obj = StoredObject(bucket=bucket.name, key=block.key, data=data, etag=etag, xxh3=block.xxh3,
                           created=block.created, ttl=ttl, content_type=ctype, headers=headers,
                           user_meta=user_meta, checksums=checksums, parts_count=parts, tenant=bucket.owner)
        obj.size = block.size
        obj.expires_at = block.expires_at
        obj.live = False  # not in RAM's tables: a transient copy until promoted
        obj.transient = True
        obj.on_disk = True
        return obj

    def promote(self, bucket: Bucket, obj: StoredObject) -> bool:
        """Copy a block read from flash into RAM (it stays on flash). False if RAM has no room for it or a
        newer version arrived meanwhile; the caller then sends the transient copy."""
        if not obj.transient or not self.config.disk_promote:
            return False
        current = bucket.objects.get(obj.key)
        if current is not None and not current.expired(self.clock()):
            return False
        data = obj.data
        if isinstance(data, memoryview) and data.nbytes != memoryview(data.obj).nbytes:
            # A view into a coalesced read buffer: copy, so the rest of that buffer is not kept alive (it goes
            # back to the flash store's pool once the reads that share it are sent). The copy goes into a payload
            # buffer like a write's, not onto the C heap, where freed blocks would leave the heap fragmented.
            copy = self.store.buffers.take(len(data))
            copy[:] = data
            data = copy
        read_view = obj.data
        obj.data = data
        try:
            self.store.admit(bucket, obj)
        except errors.StorageError:
            obj.data = read_view  # sent from the read buffer after all: the copy goes back at once
            return False
        obj.transient = False
        bucket.stats.promotions += 1
        return True

    # ------------------------------------------------------------------ prefetch

    def prefetch(self, bucket: Bucket, keys: Sequence[str]) -> int:
        """Start promoting the flash-resident ``keys`` (not in RAM) into RAM; returns how many it will read.
        Returns at once; the reads run in the background, bounded (``PREFETCH_TASKS`` at a time)."""
        if not self.flash_open or not self.config.disk_promote:
            return 0
        now = self.clock()
        todo = [k for k in keys if (o := bucket.objects.get(k)) is None or o.expired(now)]
        present, _ = self.flash.present_many(bucket.name, todo)
        todo = [k for k, p in zip(todo, present) if p]
        if not todo or self._prefetching >= PREFETCH_TASKS:
            return 0
        self._prefetching += 1
        self.counters.prefetches += len(todo)
        task = asyncio.get_running_loop().create_task(self._prefetch(bucket, todo))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return len(todo)

    async def _prefetch(self, bucket: Bucket, keys: list[str]) -> None:
        try:
            for start in range(0, len(keys), PREFETCH_KEYS):
                now = self.clock()
                # What a get promoted meanwhile is not read again (and what one is reading is joined: read()).
                chunk = [k for k in keys[start:start + PREFETCH_KEYS]
                         if (o := bucket.objects.get(k)) is None or o.expired(now)]
                for obj in await self.read(bucket, chunk) if chunk else []:
                    if obj is None or not obj.transient or self.promote(bucket, obj):
                        continue
                    current = bucket.objects.get(obj.key)
                    if current is None or current.expired(self.clock()):
                        return  # RAM is full of what is pinned or being written: stop, the restore reads flash
        except Exception:  # a prefetch is advisory: never let it fail loudly
            log.exception("flash: prefetch of %d blocks of %s failed", len(keys), bucket.name)
        finally:
            self._prefetching -= 1

    # ------------------------------------------------------------------ listing

    async def list_page(self, name: str, start_after: str, limit: int) -> list[str]:
        """Sorted flash keys of bucket ``name`` after ``start_after`` (queued ones included), at most ``limit``."""
        keys = await self.flash.list_keys(name, start_after, limit) if self.flash_open else []
        queued = [k for (b, k) in self.demoting if b == name and k > start_after]
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
            self._announce(REMOVED, BlockRef(bucket.name, bucket.owner, removal.key, 0, now), removal.reason)

    def _announce(self, kind: str, ref: BlockRef, reason: str | None) -> None:
        for listener in self.listeners:
            listener(kind, ref, reason)

    # ------------------------------------------------------------------ stats

    def stats(self) -> dict[str, Any]:
        """The flash tier's levels and counters for the engine's stats document."""
        s = self.flash.stats() if self.flash_open else FlashStats(capacity_bytes=self.config.disk_size)
        report = self.recovery
        return {
            "disk_budget": s.capacity_bytes, "disk_used": s.disk_bytes, "disk_objects": s.blocks,
            "disk_bytes": s.bytes, "disk_segments": s.segments, "disk_queued_bytes": self.queued,
            "disk_direct_waiting": len(self.direct_waiting),
            "disk_index_bytes": s.index_bytes, "disk_degraded": int(s.degraded is not None),
            "prefetches": self.counters.prefetches, "disk_bytes_read": s.device_bytes_read,
            **{f"disk_dropped_{reason}": n for reason, n in self.counters.dropped.items()},
            "disk_write_waits": self.counters.write_waits, "disk_write_refusals": self.counters.write_refusals,
            "disk_bytes_written": s.bytes_written, "disk_evictions": s.evicted, "disk_expirations": s.expired,
            "disk_corrupt": s.corrupt, "disk_compactions": s.compactions,
            "disk_degraded_reason": s.degraded,
            "disk_recovery": None if report is None else {
                "blocks": report.blocks, "bytes": report.bytes, "seconds": round(report.seconds, 3),
                "discarded_records": report.discarded_records, "corrupt_segments": report.corrupt_segments,
                "expired": report.expired, "reset": report.reset},
            "disk_buckets": {name: (b.blocks, b.bytes) for name, b in s.buckets.items()},
        }

