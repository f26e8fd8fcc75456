"""The flash tier's write side: the one queue of blocks on their way to flash, bounded, and what waits for it.

- **Write-back.** With ``disk_write_back`` every block written is copied to flash right away
  (:attr:`FlashWrites.copying`) and stays in RAM: once the copy lands the object is ``on_disk`` and its eviction
  writes nothing, and a SIGKILL loses only the copies still queued. A delete or overwrite drops a copy on its way (the writer supersedes it).
- **Demotion.** An eviction victim with enough life left is handed to the flash writer instead of being dropped.
  It leaves RAM's accounting at once (so the write that needed room proceeds), but stays readable from
  :attr:`FlashWrites.demoting` until its write lands. What waits for a write is bounded (``disk_queue``): a victim
  that finds the queue full stays in RAM and the write that needed its room waits for the queue
  (:meth:`FlashWrites.with_write_room`, ``disk_write_wait``), then is refused: backpressure, never a dropped block.
  A block that came back from flash unchanged is still on flash: its demotion writes nothing.
  ``disk_direct_size`` sends large blocks down right after their write; one that finds the queue full stays in
  RAM and waits its turn, going down as earlier writes land.
- **Shutdown.** What only RAM holds may be spilled to flash before the node stops (:meth:`FlashWrites.spill`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

from ..flash import SUPERSEDED, FlashRecord, WriteResult
from . import errors
from .flash_context import REMOVED, STORED, FlashContext, encode_meta
from .lower import BlockRef
from .objects import StoredObject

log = logging.getLogger("ctxstore.flash")

T = TypeVar("T")

QUEUE_FULL = "queue_full"  # not a drop reason: the victim stays in RAM and the write waits
# Direct writes waiting for the demotion queue (keys only: the blocks are in RAM). Beyond this the oldest is
# forgotten and goes down when it is evicted instead; it bounds the list while flash cannot keep up for long.
DIRECT_WAITING = 1 << 16


def _wait_in_line(line: OrderedDict[tuple[str, str], None], obj: StoredObject) -> None:
    """Put ``obj``'s key at the back of ``line`` (a new version of a key waiting goes to the back); past
    ``DIRECT_WAITING`` keys the oldest is forgotten: it goes down when it is evicted instead."""
    slot = (obj.bucket, obj.key)
    line.pop(slot, None)
    line[slot] = None
    if len(line) > DIRECT_WAITING:
        line.popitem(last=False)


class FlashWrites:
    """The demotion and write-back queue of one node's flash tier."""

    def __init__(self, context: FlashContext, queue_limit: int) -> None:
        self.context = context
        self.queue_limit = queue_limit
        # Below this a block always fits a segment: keys (1 KiB at most), bucket and metadata (an ETag, a content
        # type, 2 KiB of user metadata) take far less than 64 KiB of a record. Above it the store's own rule
        # decides (FlashOptions.fits), so nothing is taken from RAM that the store would then refuse.
        self.surely_fits = context.flash.options.max_record_bytes - (64 << 10)
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
        self._watchers: list[dict[str, list[str]]] = []

    # ------------------------------------------------------------------ what the engine hands down

    def after_write(self, obj: StoredObject) -> None:
        """``disk_direct_size``: a large object goes to flash right after its write (served from the demotion
        queue until it lands; in RAM while it waits for room in that queue) instead of taking RAM until it is
        evicted. Otherwise ``disk_write_back``: a copy goes to flash and the object stays in RAM."""
        config = self.context.config
        threshold = config.disk_direct_size
        if threshold and obj.size >= threshold:
            self.send_direct(obj)
        elif config.disk_write_back:
            self.write_back(obj)

    async def with_write_room(self, attempt: Callable[[], T]) -> T:
        """``attempt()`` (a reservation opening or growing, before the bytes it holds room for are read), waiting
        while it needs a RAM victim demoted and the write queue is full: backpressure instead of a dropped
        block. Past ``disk_write_wait`` it raises InsufficientCapacity (503 SlowDown, a retryable bulk error).
        Reads never come here: a promotion that finds no room sends its block from a transient buffer."""
        config, counters = self.context.config, self.context.counters
        deadline: float | None = None
        while True:
            try:
                return attempt()
            except errors.FlashQueueFull:
                now = time.monotonic()
                if deadline is None:
                    deadline = now + config.disk_write_wait
                    counters.write_waits += 1
                if now >= deadline:
                    counters.write_refusals += 1
                    raise errors.InsufficientCapacity(
                        f"RAM is full and the flash tier's write queue stayed full for {config.disk_write_wait:g} "
                        "s (the device is slower than the writes): retry", retry_after=1.0) from None
                await self.queue_progress(deadline - now)

    def demote(self, obj: StoredObject) -> bool:
        """Take an eviction victim to flash instead of dropping it. True: it is (or is becoming) flash-resident,
        so the store removes it as ``demoted``; False: drop it as evicted."""
        flash = self.context.flash
        if obj.on_disk and flash.lookup(obj.bucket, obj.key) is not None:
            # Written back (or promoted) and unchanged since: flash has these bytes; only its expiry may have
            # moved on.
            flash.touch(obj.bucket, obj.key, obj.expires_at)
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
            self.context.counters.dropped[refusal] += 1
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

    def send_direct(self, obj: StoredObject) -> None:
        """``disk_direct_size``: demote a large block right after its write instead of when it is evicted. If
        the demotion queue is full (a burst of writes outrunning the device) it stays in RAM, in line behind the
        others waiting, and goes down as earlier writes land (:meth:`_send_waiting`)."""
        if not obj.live or obj.pinned(self.context.clock()) or self._refusal(obj, queue=False) is not None:
            return  # refused for good, not for room: it goes down (or not) when it is evicted
        if not self.direct_waiting and self.queued + obj.size <= self.queue_limit:
            self.context.store.demote_now(obj)
            return
        _wait_in_line(self.direct_waiting, obj)
        self._send_waiting()

    def _refusal(self, obj: StoredObject, *, queue: bool = True) -> str | None:
        """Why ``obj`` cannot be demoted now (a DROP_REASONS entry, or QUEUE_FULL), or None if it can."""
        ctx = self.context
        config = ctx.config
        if not ctx.open or ctx.flash.degraded is not None:
            return "not_writing"
        if obj.expires_at - ctx.clock() < config.disk_min_ttl:
            return "short_ttl"
        if obj.size > self.queue_limit or (obj.size > self.surely_fits and not ctx.flash.options.fits(
                obj.bucket.encode(), obj.key.encode(), encode_meta(obj), obj.size)):
            return "too_large"  # a segment, or the queue, could never take it
        quota = ctx.store.budget.tenant_quota.get(obj.tenant, 0)
        if quota and config.budget:
            share = quota * config.disk_size // config.budget
            if ctx.tenant_disk.get(obj.tenant, 0) + self.tenant_queued.get(obj.tenant, 0) + obj.size > share:
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

    # ------------------------------------------------------------------ the queue

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

    def _send_waiting(self) -> None:
        """Demote the direct writes that were waiting, then copy the writes-back that were, oldest first, while
        the queue has room."""
        waiting = self.direct_waiting
        store = self.context.store
        if self.context.flash.degraded is not None:
            waiting.clear()  # flash takes nothing more: they stay in RAM
            self.copy_waiting.clear()
            return
        threshold = self.context.config.disk_direct_size
        for line, send in ((waiting, store.demote_now), (self.copy_waiting, self._send_copy)):
            while line:
                bucket_name, key = next(iter(line))
                bucket = store.buckets.get(bucket_name)
                obj = bucket.objects.get(key) if bucket is not None else None
                if obj is not None and obj.live and (line is not waiting or obj.size >= threshold):
                    if self.queued + obj.size > self.queue_limit:
                        return  # still no room: the next landed write calls again
                    send(obj)
                line.popitem(last=False)  # sent, refused for good, or no longer in RAM

    def _send_copy(self, obj: StoredObject) -> None:
        if not obj.on_disk and self._refusal(obj, queue=False) is None:
            self._enqueue(self.copying, obj)

    def _wake_writers(self) -> None:
        if self._progress is not None:
            if not self._progress.done():
                self._progress.set_result(None)
            self._progress = None

    def flush_now(self) -> None:
        """Hand what is gathered for the next flush to the flash writer now (the node is closing)."""
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush()

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
        refused = self.context.flash.append(records, self._written, force=True)
        for obj, reason in zip(objects, refused):
            if reason is None:
                continue
            # A copy refused leaves the block in RAM; a victim refused is gone.
            if self._dequeue(self.copying, (obj.bucket, obj.key), obj) is None:
                self._demotion_failed(obj, reason)

    def _written(self, results: list[WriteResult]) -> None:
        tenant_disk = self.context.tenant_disk
        for result in results:
            record = result.record
            slot = (record.bucket, record.key)
            copy = self.copying.get(slot)
            if copy is not None and copy.data is record.payload:
                self._dequeue(self.copying, slot, copy)
                if result.stored:
                    tenant_disk[copy.tenant] = tenant_disk.get(copy.tenant, 0) + copy.size
                    copy.on_disk = copy.live  # in RAM and on flash: its eviction writes nothing
                continue
            obj = self.demoting.get(slot)
            if obj is None or obj.data is not record.payload:  # deleted, replaced or demoted again since
                continue
            if result.stored:
                self._dequeue(self.demoting, slot)
                tenant_disk[obj.tenant] = tenant_disk.get(obj.tenant, 0) + obj.size
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
        self.context.counters.dropped["not_writing"] += 1
        log.debug("flash: %s/%s not demoted (%s)", obj.bucket, obj.key, reason)
        store = self.context.store
        bucket = store.buckets.get(obj.bucket)
        if bucket is not None:
            bucket.stats.evictions += 1
        store.announce_removed(obj, "evicted")

    # ------------------------------------------------------------------ demotion events

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
        bucket = self.context.store.buckets.get(obj.bucket)
        if bucket is not None:
            bucket.stats.demotions += 1
        ref = BlockRef(obj.bucket, obj.tenant, obj.key, obj.size, obj.expires_at)
        self.context.announce(REMOVED, ref, "demoted")  # a move: out of RAM's medium, into the disk's
        self.context.announce(STORED, ref, None)

    # ------------------------------------------------------------------ what waits in the queue

    def queued_object(self, bucket: str, key: str) -> StoredObject | None:
        """The victim still waiting for its flash write at (bucket, key), if live."""
        obj = self.demoting.get((bucket, key))
        if obj is None or obj.expired(self.context.clock()):
            return None
        return obj

    def demoting_keys(self, name: str) -> list[str]:
        """Keys of bucket ``name`` whose victims wait for their flash write."""
        return [k for (b, k) in self.demoting if b == name]

    def forget(self, name: str, keys: Sequence[str]) -> list[str]:
        """Keys of bucket ``name`` deleted or overwritten: off the queue. Returns those queued as victims (the
        flash tier held them); a copy on its way is dropped from flash too (it was only announced in RAM)."""
        held: list[str] = []
        copies: list[str] = []
        for key in keys:
            if self._dequeue(self.demoting, (name, key)) is not None:
                held.append(key)
            elif self._dequeue(self.copying, (name, key)) is not None:
                copies.append(key)
        if copies and self.context.open:
            self.context.flash.delete_many(name, copies)  # so a copy still in the writer never lands as live
        return held

    def drop_bucket(self, name: str) -> None:
        """A bucket deleted or flushed: nothing of it waits for flash any more."""
        for slot in [s for s in self.demoting if s[0] == name]:
            self._dequeue(self.demoting, slot)
        for slot in [s for s in self.copying if s[0] == name]:
            self._dequeue(self.copying, slot)  # the bucket's floor makes whatever of it the writer still holds dead
        self.copy_waiting = OrderedDict((s, None) for s in self.copy_waiting if s[0] != name)

    def extend(self, bucket: str, keys: Sequence[str], expires_at: float) -> None:
        """Queued victims of ``keys`` live at least until ``expires_at`` (never shortens)."""
        for key in keys:
            queued = self.demoting.get((bucket, key))
            if queued is not None and queued.expires_at < expires_at:
                queued.expires_at = expires_at

    # ------------------------------------------------------------------ shutdown spill

    async def spill(self, deadline: float) -> int:
        """Write what only RAM holds, in batches of a quarter of the demotion queue with up to three in
        flight (the writer copies one while the device takes another), until done or past ``deadline`` (the
        batches appended by then are written: at most three quarters of the queue)."""
        ctx = self.context
        if not ctx.open:
            return 0
        flash = ctx.flash
        t0 = time.monotonic()
        now = ctx.clock()
        spilled = spilled_bytes = 0
        in_flight: deque[asyncio.Future[tuple[int, int]]] = deque()
        batch: list[FlashRecord] = []
        size = 0
        stopped = False
        for bucket in list(ctx.store.buckets.values()):
            for obj in list(bucket.objects.values()):
                if obj.expired(now) or (obj.on_disk and flash.lookup(obj.bucket, obj.key) is not None):
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
                    if time.monotonic() > deadline or flash.degraded is not None:
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
        if not batch or all(reason is not None for reason in self.context.flash.append(batch, written, force=True)):
            fut.set_result((0, 0))
        return fut
