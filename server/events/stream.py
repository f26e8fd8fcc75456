"""The HTTP face of the event hub (admin bearer token):

- ``GET /_ctx/v1/events?since=&bucket=&epoch=``: frames (``u32 big-endian length ‖ msgpack map``), first a
  replay from the ring, then live events, heartbeats and gap frames; each consumer has a bounded queue, and
  one that falls behind gets a gap frame and is disconnected;
- ``GET /_ctx/v1/events/snapshot?bucket=``: the live keys and the sequence number they are current at.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import time
from collections.abc import Iterable
from typing import Any

from ctxstore import wire
from ctxstore.admin_schema import EVENTS_PATH

from .. import bearer
from ..node import NodeState
from ..protocol.asgi import Receive, Scope, Send, ascii_int, parse_query, raw_header, send_response
from .hub import Consumer, EventHub
from .model import STREAM_CONTENT_TYPE, Event, encode_event, frame, pack

log = logging.getLogger("ctxstore.events")

SNAPSHOT_PATH = EVENTS_PATH + "/snapshot"
HEARTBEAT_INTERVAL = 1.0  # a stream with nothing to send sends a heartbeat frame this often
WAKE_INTERVAL = 0.25  # a stream re-checks draining and disconnection at least this often
SEND_CHUNK = 256 << 10  # frames coalesced into one body message up to about this many bytes
SEND_STALL = 10.0  # a consumer that takes no bytes for this long is dropped


class EventStream:
    """Serves the stream and the snapshot of one node's hub."""

    def __init__(self, hub: EventHub, node: NodeState) -> None:
        self.hub = hub
        self.node = node

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
        if not bearer.matches(raw_header(scope, b"authorization"), token):
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
        hub = self.hub
        seq = 0

        def at() -> None:  # every change made so far has its number: the keys are exactly as of `seq`
            nonlocal seq
            hub.flush_now()
            seq = hub.seq

        live = await self.node.engine.live_keys(bucket, at)
        body: dict[str, Any] = {"seq": seq, "epoch": hub.epoch, "node": hub.node_id, "ts": time.time()}
        if bucket is not None:
            if bucket not in live:
                await _json(send, 404, {"detail": f"no bucket {bucket}"})
                return
            owner, keys, disk = live[bucket]
            body.update(bucket=bucket, tenant=owner, keys=keys, disk_keys=disk)
        else:
            body["buckets"] = {name: {"tenant": owner, "keys": keys, "disk_keys": disk}
                               for name, (owner, keys, disk) in live.items()}
        headers = [("content-type", wire.CONTENT_TYPE), ("cache-control", "no-store")]
        await send_response(send, 200, headers, pack(body))

    def _control(self, kind: str, **extra: Any) -> bytes:
        hub = self.hub
        return frame({"type": kind, "seq": hub.seq, "epoch": hub.epoch, "node": hub.node_id, "ts": time.time(),
                      **extra})

    async def _stream(self, since: int | None, epoch: int | None, bucket: str | None, receive: Receive,
                      send: Send) -> None:
        # Everything up to registering the consumer runs without yielding: no event can fall between the
        # replay taken from the ring and the live events the consumer's queue receives.
        hub = self.hub
        hub.flush_now()
        latest, oldest = hub.seq, hub.oldest()
        gap: str | None = None
        replay: list[Event] = []
        if since is not None:
            start = since
            if (epoch is not None and epoch != hub.epoch) or since > latest:
                gap, start = "epoch", 0  # numbers from another process: everything still buffered follows
            elif since + 1 < oldest:
                gap = "buffer"  # events since+1 .. oldest-1 are gone
            replay = list(itertools.islice(hub.ring, max(0, start + 1 - oldest), None))
        consumer = hub.add_consumer(bucket, latest if since is None else max(0, min(since, latest)), gap)
        watcher = asyncio.ensure_future(_watch_disconnect(receive, consumer))
        loop = asyncio.get_running_loop()
        log.info("events stream opened: since=%s bucket=%s gap=%s", since, bucket, gap)
        complete = True
        try:
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", STREAM_CONTENT_TYPE.encode()), (b"cache-control", b"no-store"),
                (b"x-accel-buffering", b"no"), (b"x-ctx-node", hub.node_id.encode()),
                (b"x-ctx-epoch", str(hub.epoch).encode()),
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
                if bucket is None or ev.bucket == bucket:
                    encoded = encode_event(ev, hub.epoch, hub.node_id)
                    chunk.append(encoded)
                    size += len(encoded)
                consumer.last_seq = ev.seq
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
                    hub.counters["slow_consumers"] += 1
                    hub.counters["gaps"] += 1
                    log.warning("events consumer fell %d events behind: sent a gap frame, disconnecting",
                                consumer.limit)
                    await self._send_body(send, [self._control(
                        "gap", since=consumer.last_seq, oldest=hub.oldest(), reason="slow", bucket=bucket)])
                    break
                queue = consumer.queue
                if queue:
                    frames, size = [], 0
                    while queue and size < SEND_CHUNK:
                        seq, encoded = queue.popleft()
                        frames.append(encoded)
                        size += len(encoded)
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
            hub.counters["slow_consumers"] += 1
            log.warning("events consumer took no bytes for %gs: disconnecting", SEND_STALL)
        finally:
            hub.remove_consumer(consumer)
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


def _int_param(query: dict[str, str], name: str) -> int | None:
    raw = query.get(name)
    if raw is None or raw == "":
        return None
    value = ascii_int(raw)
    if value is None:
        raise ValueError(f"{name} must be a non-negative integer, got {raw!r}")
    return value


async def _json(send: Send, status: int, body: dict[str, Any],
                headers: Iterable[tuple[str, str]] = ()) -> None:
    await send_response(send, status, [("content-type", "application/json"), *headers],
                        json.dumps(body).encode())
