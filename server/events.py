"""Store events for routers and indexers: which blocks a node holds, as a stream (docs/events.md).

Every commit and every removal the engine makes becomes an event: ``stored`` (bucket, tenant, key, size,
expires_at) or ``removed`` (bucket, tenant, key, size, reason: evicted, expired, deleted, flushed). A replaced
object is not announced as removed: its new version's ``stored`` event says the key is (still) present.

The engine's hot path only appends a small tuple to a deque. A timer a few milliseconds later (or a full
batch) numbers the pending events with the node's sequence (1, 2, 3... from process start; ``epoch`` tells
processes apart), keeps them in a bounded ring for replay and hands the batch to

- the HTTP stream, ``GET /_ctx/v1/events?since=&bucket=&epoch=`` (admin bearer token): frames of
  ``u32 big-endian length ‖ msgpack map``; replay from the ring, then live events, heartbeats, gap frames,
  and a bounded queue per consumer (one that falls behind gets a gap frame and is disconnected);
- ``GET /_ctx/v1/events/snapshot?bucket=``: the live keys and the sequence number they are current at;
- optionally a ZMQ PUB socket publishing vLLM-shaped KV event batches (``[topic, seq u64 BE, msgpack]``) with
  vLLM's ROUTER replay protocol beside it.

Everything runs on the node's event loop: the engine calls the listeners synchronously, so numbering, the
ring, the snapshot and the consumers' queues need no locks, and a snapshot taken between two engine calls is
exactly consistent with the sequence number it reports.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import json
import logging
import re
import struct
import time
from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import msgpack
import xxhash

from .asgi import Receive, Scope, Send, parse_query, send_response

if TYPE_CHECKING:
    from .app import App
    from .engine.objects import StoredObject

log = logging.getLogger("ctxstore.events")

EVENTS_PATH = "/_ctx/v1/events"
SNAPSHOT_PATH = EVENTS_PATH + "/snapshot"

FLUSH_INTERVAL = 0.005  # seconds from the first pending event to its batch
BATCH_MAX = 1024  # events per batch at most; a full batch is flushed at once
HEARTBEAT_INTERVAL = 1.0  # a stream with nothing to send sends a heartbeat frame this often
WAKE_INTERVAL = 0.25  # a stream re-checks draining and disconnection at least this often
SEND_CHUNK = 256 << 10  # frames coalesced into one body message up to about this many bytes
SEND_STALL = 10.0  # a consumer that takes no bytes for this long is dropped

STREAM_CONTENT_TYPE = "application/vnd.ctxstore.events"
SNAPSHOT_CONTENT_TYPE = "application/msgpack"

STORED = "stored"
REMOVED = "removed"

# An event as kept in the ring: (seq, ts, type, bucket, tenant, key, size, expires_at, reason).
Event = tuple[int, float, str, str, str, str, int, float, "str | None"]
SEQ, TS, TYPE, BUCKET, TENANT, KEY, SIZE, EXPIRES_AT, REASON = range(9)

_LEN = struct.Struct(">I")
_pack = msgpack.Packer().pack  # one packer: str as str, bytes as bin, floats as float64


def _frame(fields: dict[str, Any]) -> bytes:
    body = _pack(fields)
    return _LEN.pack(len(body)) + body


def encode_event(ev: Event, epoch: int, node: str, medium: str) -> bytes:
    """One HTTP stream frame for an event. ``seq_hashes``/``tenant_id``/``medium`` are the names of Mooncake's
    KV-event RFC (kvcache-ai/Mooncake#1527) for the same facts."""
    fields: dict[str, Any] = {
        "seq": ev[SEQ], "epoch": epoch, "node": node, "type": ev[TYPE], "ts": ev[TS],
        "bucket": ev[BUCKET], "tenant": ev[TENANT], "key": ev[KEY], "size": ev[SIZE],
    }
    if ev[TYPE] == STORED:
        fields["expires_at"] = ev[EXPIRES_AT]
    else:
        fields["reason"] = ev[REASON]
    fields["seq_hashes"] = [ev[KEY]]
    fields["tenant_id"] = ev[TENANT]
    fields["medium"] = medium
    return _frame(fields)


def decode_frames(data: bytes) -> tuple[list[dict[str, Any]], bytes]:
    """Split a byte buffer into decoded frames; returns them and the incomplete rest."""
    out = []
    pos = 0
    while len(data) - pos >= 4:
        (n,) = _LEN.unpack_from(data, pos)
        if len(data) - pos - 4 < n:
            break
        out.append(msgpack.unpackb(data[pos + 4:pos + 4 + n]))
        pos += 4 + n
    return out, data[pos:]


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

    def __init__(self, node: App) -> None:
        settings = node.settings
        self.node = node
        self.engine = node.engine
        self.node_id: str = node.node_id
        self.epoch = time.time_ns() // 1000  # microseconds since the Unix epoch at process start
        self.seq = 0  # last sequence number given out
        self.medium: str = settings.events_medium
        self.ring: deque[Event] = deque(maxlen=settings.events_buffer)
        self.consumer_limit: int = settings.events_consumer_queue
        self.counters = {"events": 0, "batches": 0, "streams": 0, "gaps": 0, "slow_consumers": 0}
        self._pending: deque[tuple[str, str, str, str, int, float, str | None]] = deque()
        self._consumers: set[Consumer] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._soon = False
        self.zmq: ZmqPublisher | None = None
        if settings.events_zmq_pub:
            buckets = {b.strip() for b in settings.events_zmq_buckets.split(",") if b.strip()}
            self.zmq = ZmqPublisher(
                settings.events_zmq_pub, settings.events_zmq_replay, topic=settings.events_zmq_topic,
                fmt=settings.events_zmq_format, hashes=settings.events_zmq_hashes, medium=self.medium,
                buckets=buckets or None, buffer_events=settings.events_buffer,
            )
        elif settings.events_zmq_replay:
            raise ValueError("events_zmq_replay needs events_zmq_pub: the replay socket serves what PUB sent")
        self.engine.on_store.append(self._on_store)
        self.engine.on_remove.append(self._on_remove)

    # ------------------------------------------------------------------ the engine's hot path

    def _on_store(self, obj: StoredObject) -> None:
        bucket = self.engine.buckets.get(obj.bucket)
        tenant = bucket.owner if bucket is not None else ""
        self._pending.append((STORED, obj.bucket, tenant, obj.key, obj.size, obj.expires_at, None))
        self._schedule()

    def _on_remove(self, obj: StoredObject, reason: str) -> None:
        if reason == "replaced":  # folded: the new version's `stored` event follows at once
            return
        bucket = self.engine.buckets.get(obj.bucket)
        tenant = bucket.owner if bucket is not None else ""
        self._pending.append((REMOVED, obj.bucket, tenant, obj.key, obj.size, obj.expires_at, reason))
        self._schedule()

    def _schedule(self) -> None:
        if self._timer is None:
            if self._loop is not None:
                self._timer = self._loop.call_later(FLUSH_INTERVAL, self._run)
            elif len(self._pending) >= BATCH_MAX:
                self.flush_now()  # no loop to batch on (not started yet, or stopped): memory stays bounded
        elif not self._soon and len(self._pending) >= BATCH_MAX:
            self._soon = True
            self._loop.call_soon(self._run)  # type: ignore[union-attr]

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
            self._timer = self._loop.call_soon(self._run)  # type: ignore[assignment]

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
            batch.append((seq, ts, *popleft()))  # type: ignore[arg-type]
        self.seq = seq
        self.ring.extend(batch)
        self.counters["events"] += n
        self.counters["batches"] += 1
        if self._consumers:
            epoch, node, medium = self.epoch, self.node_id, self.medium
            frames = [(ev[BUCKET], ev[SEQ], encode_event(ev, epoch, node, medium)) for ev in batch]
            for consumer in list(self._consumers):
                consumer.offer(frames)
        if self.zmq is not None:
            self.zmq.publish(batch, ts)

    def flush_now(self) -> None:
        """Number and deliver every pending event now (before a snapshot or a stream's replay point)."""
        while self._pending:
            self._flush_batch()

    def oldest(self) -> int:
        """The oldest sequence number still in the ring (``seq + 1`` when it is empty)."""
        return self.ring[0][SEQ] if self.ring else self.seq + 1

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

    # ------------------------------------------------------------------ HTTP

    async def serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``GET /_ctx/v1/events`` and ``GET /_ctx/v1/events/snapshot``."""
        path = scope["path"]
        if path not in (EVENTS_PATH, SNAPSHOT_PATH):
            await _json(send, 404, {"detail": "no such endpoint"})
            return
        if scope["method"] != "GET":
            await _json(send, 405, {"detail": "method not allowed"}, [("allow", "GET")])
            return
        token = self.node.admin_token
        if not token:
            await _json(send, 403, {"detail": "events API disabled: set CTXSTORE_ADMIN_TOKEN"})
            return
        if not _bearer_ok(scope, token):
            await _json(send, 401, {"detail": "admin bearer token required"},
                        [("www-authenticate", "Bearer")])
            return
        query = parse_query(scope.get("query_string", b""))
        try:
            since = _int_param(query, "since")
            epoch = _int_param(query, "epoch")
        except ValueError as exc:
            await _json(send, 400, {"detail": str(exc)})
            return
        bucket = query.get("bucket") or None
        if path == SNAPSHOT_PATH:
            await self._snapshot(bucket, send)
        else:
            await self._stream(since, epoch, bucket, receive, send)

    async def _snapshot(self, bucket: str | None, send: Send) -> None:
        self.flush_now()  # every change made so far has its number: the keys below are exactly as of `seq`
        engine = self.engine
        now = engine.clock()

        def live(b: Any) -> list[str]:
            return [key for key, obj in b.objects.items() if not obj.expired(now)]

        body: dict[str, Any] = {"seq": self.seq, "epoch": self.epoch, "node": self.node_id, "ts": time.time()}
        if bucket is not None:
            b = engine.buckets.get(bucket)
            if b is None:
                await _json(send, 404, {"detail": f"no bucket {bucket}"})
                return
            body.update(bucket=bucket, tenant=b.owner, keys=live(b))
        else:
            body["buckets"] = {name: {"tenant": b.owner, "keys": live(b)}
                               for name, b in engine.buckets.items()}
        headers = [("content-type", SNAPSHOT_CONTENT_TYPE), ("cache-control", "no-store")]
        await send_response(send, 200, headers, _pack(body))

    def _control(self, kind: str, **extra: Any) -> bytes:
        return _frame({"type": kind, "seq": self.seq, "epoch": self.epoch, "node": self.node_id,
                       "ts": time.time(), **extra})

    async def _stream(self, since: int | None, epoch: int | None, bucket: str | None, receive: Receive,
                      send: Send) -> None:
        # Everything up to registering the consumer runs without yielding: no event can fall between the
        # replay taken from the ring and the live events the consumer's queue receives.
        self.flush_now()
        latest, oldest = self.seq, self.oldest()
        gap: str | None = None
        replay: list[Event] = []
        if since is not None:
            start = since
            if (epoch is not None and epoch != self.epoch) or since > latest:
                gap, start = "epoch", 0  # numbers from another process: everything still buffered follows
            elif since + 1 < oldest:
                gap = "buffer"  # events since+1 .. oldest-1 are gone
            replay = list(itertools.islice(self.ring, max(0, start + 1 - oldest), None))
        consumer = Consumer(bucket, self.consumer_limit)
        consumer.last_seq = latest if since is None else max(0, min(since, latest))
        self._consumers.add(consumer)
        self.counters["streams"] += 1
        if gap:
            self.counters["gaps"] += 1
        watcher = asyncio.ensure_future(_watch_disconnect(receive, consumer))
        loop = asyncio.get_running_loop()
        log.info("events stream opened: since=%s bucket=%s gap=%s", since, bucket, gap)
        complete = True
        try:
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", STREAM_CONTENT_TYPE.encode()), (b"cache-control", b"no-store"),
                (b"x-accel-buffering", b"no"), (b"x-ctx-node", self.node_id.encode()),
                (b"x-ctx-epoch", str(self.epoch).encode()),
            ]})
            head = [self._control("hello", seq=latest, oldest=oldest, since=since, bucket=bucket)]
            if gap:
                head.append(self._control("gap", seq=latest, since=since, oldest=oldest, reason=gap,
                                          bucket=bucket))
            await self._send_body(send, head)
            chunk: list[bytes] = []
            size = 0
            for ev in replay:
                if consumer.closed or consumer.overflow:
                    break
                if bucket is None or ev[BUCKET] == bucket:
                    frame = encode_event(ev, self.epoch, self.node_id, self.medium)
                    chunk.append(frame)
                    size += len(frame)
                consumer.last_seq = ev[SEQ]
                if size >= SEND_CHUNK:
                    await self._send_body(send, chunk)
                    chunk, size = [], 0
            if chunk and not consumer.closed:
                await self._send_body(send, chunk)
            last_send = loop.time()
            while True:
                if consumer.closed or self.node.draining:
                    break
                if consumer.overflow:
                    self.counters["slow_consumers"] += 1
                    self.counters["gaps"] += 1
                    log.warning("events consumer fell %d events behind: sent a gap frame, disconnecting",
                                consumer.limit)
                    await self._send_body(send, [self._control(
                        "gap", since=consumer.last_seq, oldest=self.oldest(), reason="slow", bucket=bucket)])
                    break
                queue = consumer.queue
                if queue:
                    frames, size = [], 0
                    while queue and size < SEND_CHUNK:
                        seq, frame = queue.popleft()
                        frames.append(frame)
                        size += len(frame)
                        consumer.last_seq = seq
                    await self._send_body(send, frames)
                    last_send = loop.time()
                    continue
                wait = min(WAKE_INTERVAL, last_send + HEARTBEAT_INTERVAL - loop.time())
                if wait <= 0:
                    await self._send_body(send, [self._control("heartbeat")])
                    last_send = loop.time()
                    continue
                consumer.wake.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wait):
                        await consumer.wake.wait()
        except _Stalled:
            complete = False  # uvicorn closes a connection whose response never completed
            self.counters["slow_consumers"] += 1
            log.warning("events consumer took no bytes for %gs: disconnecting", SEND_STALL)
        finally:
            self._consumers.discard(consumer)
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
            log.info("events stream closed: last_seq=%d", consumer.last_seq)
        if complete:
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _send_body(self, send: Send, frames: list[bytes]) -> None:
        message = {"type": "http.response.body", "body": b"".join(frames), "more_body": True}
        try:
            await asyncio.wait_for(send(message), SEND_STALL)
        except TimeoutError:
            raise _Stalled() from None


class _Stalled(Exception):
    pass


async def _watch_disconnect(receive: Receive, consumer: Consumer) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            consumer.stop()
            return


def _bearer_ok(scope: Scope, token: str) -> bool:
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, given = value.decode("latin-1").partition(" ")
            return (scheme.lower() == "bearer" and bool(given)
                    and hmac.compare_digest(given.encode(), token.encode()))
    return False


def _int_param(query: dict[str, str], name: str) -> int | None:
    raw = query.get(name)
    if raw is None or raw == "":
        return None
    if not raw.isdigit():
        raise ValueError(f"{name} must be a non-negative integer, got {raw!r}")
    return int(raw)


async def _json(send: Send, status: int, body: dict[str, Any],
                headers: Iterable[tuple[str, str]] = ()) -> None:
    await send_response(send, status, [("content-type", "application/json"), *headers],
                        json.dumps(body).encode())


# ---------------------------------------------------------------------- ZMQ: vLLM's KV event wire format

MASK64 = (1 << 64) - 1
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # vLLM's end-of-replay marker
_HEX = re.compile(r"[0-9a-fA-F]+")


def block_hash(key: str, mode: str) -> str | int | bytes:
    """What ``block_hashes`` carries for ``key``.

    ``key``: the key itself. ``int``: the key's last path segment read as hex, low 64 bits (what vLLM sends
    with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES: ``int.from_bytes(hash, "big") & (2**64 - 1)``; a 16-hex Dynamo
    key is its sequence hash as is); a key that is not hex gets XXH3-64 of its UTF-8 bytes. ``bytes``: that
    hex segment as bytes (vLLM's default), a key that is not hex its UTF-8 bytes."""
    if mode == "key":
        return key
    tail = key.rpartition("/")[2]
    hexadecimal = _HEX.fullmatch(tail) is not None
    if mode == "int":
        return int(tail, 16) & MASK64 if hexadecimal else xxhash.xxh3_64_intdigest(key.encode())
    if hexadecimal and len(tail) % 2 == 0:
        return bytes.fromhex(tail)
    return key.encode()


def vllm_event(kind: str, hashes: list[Any], medium: str | None, fmt: str) -> list[Any] | dict[str, Any]:
    """One KVCacheEvent exactly as msgspec encodes vLLM's structs (tag = class name), in the last schema
    before vLLM PR 42892: BlockStored(block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
    lora_name, extra_keys=None, group_idx=None, kv_cache_spec_kind=None, kv_cache_spec_sliding_window=None),
    BlockRemoved(block_hashes, medium, group_idx=None), AllBlocksCleared().

    ``array`` (``array_like=True``, vLLM before PR 42892): every field in order, defaults written as nil:
    ``["BlockStored", hashes, None, [], 0, None, medium, None, None, None, None, None]``,
    ``["BlockRemoved", hashes, medium, None]``, ``["AllBlocksCleared"]``.
    ``map`` (vLLM after PR 42892): ``{"type": "BlockStored", "block_hashes": ..., ..., "lora_name": None}``,
    fields by name in declaration order, the defaulted ones left out (``omit_defaults``)."""
    if kind == "BlockStored":
        fields: list[tuple[str, Any]] = [
            ("block_hashes", hashes), ("parent_block_hash", None), ("token_ids", []), ("block_size", 0),
            ("lora_id", None), ("medium", medium), ("lora_name", None),
        ]
        defaulted = 4  # extra_keys, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window
    elif kind == "BlockRemoved":
        fields = [("block_hashes", hashes), ("medium", medium)]
        defaulted = 1  # group_idx
    elif kind == "AllBlocksCleared":
        fields, defaulted = [], 0
    else:
        raise ValueError(kind)
    if fmt == "array":  # msgspec writes every field of an array_like struct, defaults included
        return [kind, *(value for _, value in fields), *([None] * defaulted)]
    return {"type": kind, **dict(fields)}  # omit_defaults drops the defaulted fields of a map


def vllm_batch(ts: float, events: list[Any], data_parallel_rank: int = 0) -> bytes:
    """An EventBatch: ``[ts, events, data_parallel_rank]`` (array_like, as every consumer decodes it)."""
    return _pack([ts, events, data_parallel_rank])


class ZmqPublisher:
    """PUB socket sending one EventBatch per hub batch, and vLLM's ROUTER replay service.

    Each message is ``[topic, seq (8 bytes big-endian), payload]``; seq counts messages from 0 at process
    start, the first message being ``[AllBlocksCleared]`` (a new process holds nothing). Replay: a client
    sends ``[b"", start_seq (8 bytes BE)]`` (a REQ socket adds the empty frame, a DEALER sends it) and gets
    ``[b"", seq, payload]`` for every buffered message with seq >= start_seq, then ``[b"", END_SEQ, b""]``."""

    def __init__(self, endpoint: str, replay_endpoint: str, *, topic: str, fmt: str, hashes: str, medium: str,
                 buckets: set[str] | None, buffer_events: int) -> None:
        if fmt not in ("array", "map"):
            raise ValueError(f"events_zmq_format must be array or map, got {fmt!r}")
        if hashes not in ("key", "int", "bytes"):
            raise ValueError(f"events_zmq_hashes must be key, int or bytes, got {hashes!r}")
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.fmt = fmt
        self.hashes = hashes
        self.medium = medium
        self.buckets = buckets
        self.buffer_events = buffer_events
        self.seq = 0  # next message's sequence number
        self.buffer: deque[tuple[int, bytes, int]] = deque()  # (seq, payload, events in it)
        self.buffered = 0
        self.sent = 0
        self.dropped = 0
        self.replays = 0
        self._ctx: Any = None
        self._pub: Any = None
        self._router: Any = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        import zmq
        import zmq.asyncio

        self._ctx = zmq.asyncio.Context()
        # PUB never blocks (it drops past the high-water mark): a plain socket sends from the hub's callback.
        self._pub = self._ctx.socket(zmq.PUB, socket_class=zmq.Socket)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        self._pub.setsockopt(zmq.LINGER, 0)
        _attach(self._pub, self.endpoint)
        if self.replay_endpoint:
            self._router = self._ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            _attach(self._router, self.replay_endpoint)
            self._task = asyncio.create_task(self._serve_replay())
        log.info("publishing KV events on %s (replay %s, topic %r)", self.endpoint,
                 self.replay_endpoint or "off", self.topic.decode())
        self._send(time.time(), [vllm_event("AllBlocksCleared", [], None, self.fmt)])

    def publish(self, batch: list[Event], ts: float) -> None:
        if self._pub is None:
            return
        buckets, mode, medium, fmt = self.buckets, self.hashes, self.medium, self.fmt
        events = [
            vllm_event("BlockStored" if ev[TYPE] == STORED else "BlockRemoved", [block_hash(ev[KEY], mode)],
                       medium, fmt)
            for ev in batch if buckets is None or ev[BUCKET] in buckets
        ]
        if events:
            self._send(ts, events)

    def _send(self, ts: float, events: list[Any]) -> None:
        import zmq

        seq = self.seq
        self.seq += 1
        payload = vllm_batch(ts, events)
        try:
            self._pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK)
            self.sent += 1
        except zmq.ZMQError as exc:  # PUB drops rather than blocks; the message stays replayable either way
            self.dropped += 1
            if exc.errno != zmq.EAGAIN:
                log.warning("publishing KV event batch %d failed: %s", seq, exc)
        self.buffer.append((seq, payload, len(events)))
        self.buffered += len(events)
        while self.buffered > self.buffer_events and len(self.buffer) > 1:
            self.buffered -= self.buffer.popleft()[2]

    async def _serve_replay(self) -> None:
        import zmq

        router = self._router
        while True:
            try:
                frames = await router.recv_multipart()
            except zmq.ZMQError:
                if router.closed:
                    return
                log.exception("replay socket failed")
                await asyncio.sleep(0.1)
                continue
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("invalid KV event replay request (%d frames)", len(frames))
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            self.replays += 1
            for seq, payload, _ in list(self.buffer):
                if seq >= start_seq:
                    await router.send_multipart([client, b"", seq.to_bytes(8, "big"), payload])
            await router.send_multipart([client, b"", END_SEQ, b""])

    def stats(self) -> dict[str, int]:
        return {"seq": self.seq, "sent": self.sent, "dropped": self.dropped,
                "buffered_batches": len(self.buffer), "replays": self.replays}

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for sock in (self._pub, self._router):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._router = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None


def _attach(sock: Any, endpoint: str) -> None:
    """Bind, or connect when the endpoint starts with ``>`` (e.g. to an XSUB proxy)."""
    if endpoint.startswith(">"):
        sock.connect(endpoint[1:])
    else:
        sock.bind(endpoint.lstrip("@"))
