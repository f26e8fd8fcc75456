"""The flash tier's read side: joined reads of flash-resident blocks, their promotion into RAM, and prefetch.

RAM first (the caller's), then the demotion queue, then flash (verified by the flash store: header, key and
payload XXH3; a record that fails is a miss and is dropped). A flash hit is promoted into RAM when the policy says
so and room can be made; otherwise it is sent from a transient buffer that counts against the budget (as
``sending`` bytes) while its answer is being sent. A key already being read (a prefetch, a get, a promotion) is
not read again: the reader joins the read in flight (:meth:`FlashReads.read`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Sequence

from ..flash import FlashBlock, FlashMeta
from . import errors
from .flash_context import FlashContext, decode_meta
from .objects import Bucket, StoredObject

log = logging.getLogger("ctxstore.flash")

PREFETCH_TASKS = 4  # prefetches reading from flash at once; more are answered but not started
PREFETCH_KEYS = 1024  # keys one prefetch read asks the flash store for at a time

# (bucket, key) -> the victim still waiting for its flash write there, if live (the write queue answers).
QueuedObject = Callable[[str, str], StoredObject | None]


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


class FlashReads:
    """Reads of one node's flash tier, joined per key, and the promotions and prefetches they serve."""

    def __init__(self, context: FlashContext, queued_object: QueuedObject) -> None:
        self.context = context
        self.queued_object = queued_object
        self._prefetching = 0
        # (bucket, key) -> the flash read in flight that fetches it and the key's place in it: a reader of a key
        # being read joins that read instead of reading the record again.
        self._reading: dict[tuple[str, str], tuple[_Reading, int]] = {}

    async def read(self, bucket: Bucket, keys: Sequence[str], *, with_payload: bool = True
                   ) -> list[StoredObject | None]:
        """Flash-resident blocks of ``keys`` as objects (None: not on flash, expired, or failed verification),
        read without blocking the loop. Not recorded as hits, not promoted: see :meth:`promote`.

        One device read per record: a key another caller is reading already (a prefetch, a get, a promotion)
        joins that read. The read runs as a task of its own, so a reader that is cancelled (its client went
        away) cancels nobody else's; a read that fails is a miss for every reader. A key written or deleted
        while it is being read is dropped from that read (:meth:`stale`): no reader is served that result,
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
            if not self.context.open:
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
            if self.context.store.buckets.get(name) is not bucket:  # deleted (and maybe re-created) meanwhile
                return [None] * len(keys), again
            now = self.context.clock()
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
        tasks = self.context.tasks
        tasks.add(task)

        def done(_task: object) -> None:
            tasks.discard(task)
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
        flash = self.context.flash
        try:
            blocks: Sequence[FlashMeta | None]
            if with_payload:
                blocks = await flash.read_many(bucket.name, names)
            else:
                blocks = await flash.read_meta_many(bucket.name, names)
        except Exception:  # the flash store reports device errors itself; whatever else, readers see misses
            log.exception("flash: a read of %d blocks of %s failed", len(names), bucket.name)
            return [None] * len(names)
        out = list(blocks)
        if self.context.store.buckets.get(bucket.name) is not bucket:
            return out  # every reader sees the bucket changed; never delete from a re-created one
        for pos, block in enumerate(out):
            if block is None:
                continue
            try:
                decode_meta(block.metadata)
            except ValueError as exc:  # verified bytes we cannot decode: never serve them
                log.warning("flash: %s/%s: %s; dropped", bucket.name, block.key, exc)
                flash.delete(bucket.name, block.key)
                out[pos] = None
        return out

    def stale(self, name: str, keys: Iterable[str]) -> None:
        """Keys of bucket ``name`` written, deleted or dropped: a read of them in flight is of an older version,
        which no reader may be served (and no later reader joins)."""
        registry = self._reading
        if not registry:
            return
        for key in keys:
            shared = registry.pop((name, key), None)
            if shared is not None:
                shared[0].stale.add(shared[1])

    def stale_bucket(self, name: str) -> None:
        """A bucket deleted or flushed: every read of it in flight is stale."""
        self.stale(name, [k for (b, k) in self._reading if b == name])

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

    # ------------------------------------------------------------------ promotion

    def promote(self, bucket: Bucket, obj: StoredObject) -> bool:
        """Copy a block read from flash into RAM (it stays on flash). False if RAM has no room for it or a
        newer version arrived meanwhile; the caller then sends the transient copy."""
        store = self.context.store
        if not obj.transient or not self.context.config.disk_promote:
            return False
        current = bucket.objects.get(obj.key)
        if current is not None and not current.expired(self.context.clock()):
            return False
        data = obj.data
        if isinstance(data, memoryview) and data.nbytes != memoryview(data.obj).nbytes:
            # A view into a coalesced read buffer: copy, so the rest of that buffer is not kept alive (it goes
            # back to the flash store's pool once the reads that share it are sent). The copy goes into a payload
            # buffer like a write's, not onto the C heap, where freed blocks would leave the heap fragmented.
            copy = store.buffers.take(len(data))
            copy[:] = data
            data = copy
        read_view = obj.data
        obj.data = data
        try:
            store.admit(bucket, obj)
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
        ctx = self.context
        if not ctx.open or not ctx.config.disk_promote:
            return 0
        now = ctx.clock()
        todo = [k for k in keys if (o := bucket.objects.get(k)) is None or o.expired(now)]
        present, _ = ctx.flash.present_many(bucket.name, todo)
        todo = [k for k, p in zip(todo, present) if p]
        if not todo or self._prefetching >= PREFETCH_TASKS:
            return 0
        self._prefetching += 1
        ctx.counters.prefetches += len(todo)
        ctx.spawn(self._prefetch(bucket, todo))
        return len(todo)

    async def _prefetch(self, bucket: Bucket, keys: list[str]) -> None:
        clock = self.context.clock
        try:
            for start in range(0, len(keys), PREFETCH_KEYS):
                now = clock()
                # What a get promoted meanwhile is not read again (and what one is reading is joined: read()).
                chunk = [k for k in keys[start:start + PREFETCH_KEYS]
                         if (o := bucket.objects.get(k)) is None or o.expired(now)]
                for obj in await self.read(bucket, chunk) if chunk else []:
                    if obj is None or not obj.transient or self.promote(bucket, obj):
                        continue
                    current = bucket.objects.get(obj.key)
                    if current is None or current.expired(clock()):
                        return  # RAM is full of what is pinned or being written: stop, the restore reads flash
        except Exception:  # a prefetch is advisory: never let it fail loudly
            log.exception("flash: prefetch of %d blocks of %s failed", len(keys), bucket.name)
        finally:
            self._prefetching -= 1
