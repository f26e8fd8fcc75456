"""The event hub: numbers one node's store events, keeps them in a bounded ring for replay and fans batches
out to the HTTP stream's consumers and the optional ZMQ publisher.

Every commit and every removal the engine makes becomes an event: ``stored`` (bucket, tenant, key, size,
expires_at) or ``removed`` (bucket, tenant, key, size, reason: evicted, expired, deleted, flushed). A replaced
object is not announced as removed: its new version's ``stored`` event says the key is (still) present. Each
event names its medium: RAM's (``events_medium``) or the flash tier's (``events_disk_medium``); a demotion is
``removed`` (reason ``demoted``, RAM's medium) followed at once by ``stored`` (the disk medium).

A node with a ZMQ publisher asks clients for each saved block's tokens, block size and parent
(``wire.FEATURE_PUT_ROUTE``); the bulk put hands them to :attr:`EventHub.routes` and the publisher puts them into
the block's ``BlockStored`` events, so a router's index (Dynamo's) credits the block (docs/events.md).

The engine's hot path only appends a small tuple to a deque. A timer a few milliseconds later (or a full
batch) numbers the pending events with the node's sequence (1, 2, 3... from process start; ``epoch`` tells
processes apart). Everything runs on the node's event loop: the engine calls the listeners synchronously, so
numbering, the ring, the snapshot and the consumers' queues need no locks, and a snapshot taken between two
engine calls is exactly consistent with the sequence number it reports.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import deque
from typing import Any

from ..engine import BlockRef, Engine, StoredObject
from ..settings import Settings
from .model import REMOVED, STORED, Event, encode_event
from .routes import LOG_NAME, RouteBook
from .zmq import ZmqPublisher

log = logging.getLogger("ctxstore.events")

FLUSH_INTERVAL = 0.005  # seconds from the first pending event to its batch
BATCH_MAX = 1024  # events per batch at most; a full batch is flushed at once


class Consumer:
    """One HTTP stream: frames waiting to be sent (bounded), and why it must stop."""

    __slots__ = ("bucket", "closed", "last_seq", "limit", "overflow", "queue", "wake")

    def __init__(self, bucket: str | None, limit: int) -> None:
        self.bucket = bucket
        self.limit = limit
        self.queue: deque[tuple[int, bytes]] = deque()
        self.wake = asyncio.Event()
        self.overflow = False
        self.closed = False
        self.last_seq = 0  # last event seq sent (or skipped over by replay)

    def offer(self, frames: list[tuple[str, int, bytes]]) -> None:
        if self.overflow or self.closed:
            return
        queue = self.queue
        before = len(queue)
        bucket = self.bucket
        for ev_bucket, seq, frame in frames:
            if bucket is None or ev_bucket == bucket:
                queue.append((seq, frame))
        if len(queue) > self.limit:
            self.overflow = True
            queue.clear()  # the memory goes now; the consumer gets a gap frame
            self.wake.set()
        elif len(queue) != before:
            self.wake.set()

    def stop(self) -> None:
        self.closed = True
        self.wake.set()



class EventHub:
    """Numbers, buffers and fans out one node's store events."""

    def __init__(self, engine: Engine, settings: Settings, node_id: str) -> None:
        self.engine = engine
        self.node_id = node_id
        self.epoch = time.time_ns() // 1000  # microseconds since the Unix epoch at process start
        self.seq = 0  # last sequence number given out
        self.medium: str = settings.events_medium
        self.disk_medium: str = settings.events_disk_medium
        self.ring: deque[Event] = deque(maxlen=settings.events_buffer)
        self.consumer_limit: int = settings.events_consumer_queue
        self.counters = {"events": 0, "batches": 0, "streams": 0, "gaps": 0, "slow_consumers": 0}
        self._pending: deque[tuple[str, str, str, str, int, float, str | None, str]] = deque()
        self._consumers: set[Consumer] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.Handle | None = None  # the pending run: a flush timer, or a call_soon
        self._soon = False
        self.zmq: ZmqPublisher | None = None
        # The blocks' routes (tokens, parent, block size, salt), asked of clients only for the ZMQ publisher's
        # vLLM-style events (llm-d's storage events carry none).
        self.routes: RouteBook | None = None
        if settings.events_zmq_pub:
            buckets = {b.strip() for b in settings.events_zmq_buckets.split(",") if b.strip()}
            if settings.events_zmq_style == "vllm":
                log_path = ""
                if settings.disk:  # the blocks a restart recovers are announced with their routes again
                    os.makedirs(settings.disk, exist_ok=True)
                    log_path = os.path.join(settings.disk, LOG_NAME)
                self.routes = RouteBook(log_path, reset=settings.disk_reset, buckets=frozenset(buckets) or None)
            self.zmq = ZmqPublisher(
                settings.events_zmq_pub, settings.events_zmq_replay, topic=settings.events_zmq_topic,
                fmt=settings.events_zmq_format, hashes=settings.events_zmq_hashes, medium=self.medium,
                buckets=buckets or None, buffer_events=settings.events_buffer, routes=self.routes,
                style=settings.events_zmq_style,
            )
        elif settings.events_zmq_replay:
            raise ValueError("events_zmq_replay needs events_zmq_pub: the replay socket serves what PUB sent")
        engine.subscribe(on_store=self._on_store, on_remove=self._on_remove, on_disk=self._on_disk)

    # ------------------------------------------------------------------ the engine's hot path

    def _on_store(self, obj: StoredObject) -> None:
        self._pending.append((STORED, obj.bucket, obj.tenant, obj.key, obj.size, obj.expires_at, None, self.medium))
        self._schedule()

    def _on_remove(self, obj: StoredObject, reason: str) -> None:
        # replaced: folded, the new version's `stored` event follows at once; demoted: the flash tier announces
        # the move (removed + stored) once the block is on flash.
        if reason in ("replaced", "demoted"):
            return
        self._pending.append((REMOVED, obj.bucket, obj.tenant, obj.key, obj.size, obj.expires_at, reason,
                              self.medium))
        self._schedule()

    def _on_disk(self, kind: str, block: BlockRef, reason: str | None) -> None:
        # A demotion's `removed` names the medium the block left (RAM's); everything else is the disk's.
        medium = self.medium if reason == "demoted" else self.disk_medium
        self._pending.append((STORED if kind == "stored" else REMOVED, block.bucket, block.tenant, block.key,
                              block.size, block.expires_at, reason, medium))
        self._schedule()

    def _schedule(self) -> None:
        if self._timer is None:
            if self._loop is not None:
                self._timer = self._loop.call_later(FLUSH_INTERVAL, self._run)
            elif len(self._pending) >= BATCH_MAX:
                self.flush_now()  # no loop to batch on (not started yet, or stopped): memory stays bounded
        elif not self._soon and len(self._pending) >= BATCH_MAX and self._loop is not None:
            self._soon = True
            self._loop.call_soon(self._run)

    # ------------------------------------------------------------------ batching

    def _run(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._soon = False
        try:
            self._flush_batch()
        except Exception:  # a failing consumer or socket must not stop the numbering
            log.exception("publishing an event batch failed")
        if self._pending and self._loop is not None:  # the rest after the loop had a turn
            self._soon = True
            self._timer = self._loop.call_soon(self._run)

    def _flush_batch(self) -> None:
        pending = self._pending
        n = min(len(pending), BATCH_MAX)
        if not n:
            return
        ts = time.time()
        seq = self.seq
        popleft = pending.popleft
        batch: list[Event] = []
        for _ in range(n):
            seq += 1
            batch.append(Event(seq, ts, *popleft()))
        self.seq = seq
        self.ring.extend(batch)
        self.counters["events"] += n
        self.counters["batches"] += 1
        if self._consumers:
            epoch, node = self.epoch, self.node_id
            frames = [(ev.bucket, ev.seq, encode_event(ev, epoch, node)) for ev in batch]
            for consumer in list(self._consumers):
                consumer.offer(frames)
        if self.zmq is not None:
            self.zmq.publish(batch, ts)
        if self.routes is not None:  # after the publisher: a block stored and removed in one batch had its route
            self._forget_routes(batch)

    def _forget_routes(self, batch: list[Event]) -> None:
        """Drop the routes of blocks this batch leaves gone: their last event is a removal that is not a move
        (``demoted``) nor a superseded flash copy (``replaced``: the new version's route stays)."""
        assert self.routes is not None
        last: dict[tuple[str, str], Event] = {}
        for ev in batch:
            last[(ev.bucket, ev.key)] = ev
        for (bucket, key), ev in last.items():
            if ev.type == REMOVED and ev.reason not in ("demoted", "replaced"):
                self.routes.forget(bucket, key)

    def flush_now(self) -> None:
        """Number and deliver every pending event now (before a snapshot or a stream's replay point)."""
        while self._pending:
            self._flush_batch()

    def oldest(self) -> int:
        """The oldest sequence number still in the ring (``seq + 1`` when it is empty)."""
        return self.ring[0].seq if self.ring else self.seq + 1

    def add_consumer(self, bucket: str | None, last_seq: int, gap: str | None) -> Consumer:
        """A new stream consumer that has seen events up to ``last_seq``; ``gap``: it missed some."""
        consumer = Consumer(bucket, self.consumer_limit)
        consumer.last_seq = last_seq
        self._consumers.add(consumer)
        self.counters["streams"] += 1
        if gap:
            self.counters["gaps"] += 1
        return consumer

    def remove_consumer(self, consumer: Consumer) -> None:
        self._consumers.discard(consumer)

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"seq": self.seq, "epoch": self.epoch, "oldest": self.oldest(),
                               "buffered": len(self.ring), "consumers": len(self._consumers), **self.counters}
        if self.zmq is not None:
            out["zmq"] = self.zmq.stats()
        return out

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if self.zmq is not None:
            await self.zmq.start()
        if self._pending:
            self._schedule()

    async def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.flush_now()
        self._loop = None
        for consumer in list(self._consumers):
            consumer.stop()
        if self.zmq is not None:
            await self.zmq.close()
        if self.routes is not None:
            self.routes.close()
