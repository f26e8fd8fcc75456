"""The KV events as vLLM publishes them: a ZMQ PUB socket sending msgpack EventBatches
(``[topic, seq u64 BE, payload]``) and vLLM's ROUTER replay protocol beside it; or, in the ``llm-d`` style, as
llm-d's storage tier publishes them (``llmd_fs_backend.event_publisher.StorageEventPublisher``); or, in the
``mooncake`` style, in the envelope of Mooncake's KV-event RFC (kvcache-ai/Mooncake#1527) that Dynamo's shared
KV cache subscriber reads for a pod-level store."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections import deque
from typing import Any

import xxhash

from .model import STORED, Event, pack
from .routes import Route, RouteBook

log = logging.getLogger("ctxstore.events")

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


def vllm_event(kind: str, hashes: list[Any], medium: str | None, fmt: str, *, parent: Any = None,
               tokens: list[int] | None = None, block_size: int = 0) -> list[Any] | dict[str, Any]:
    """One KVCacheEvent exactly as msgspec encodes vLLM's structs (tag = class name), in the last schema
    before vLLM PR 42892: BlockStored(block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
    lora_name, extra_keys=None, group_idx=None, kv_cache_spec_kind=None, kv_cache_spec_sliding_window=None),
    BlockRemoved(block_hashes, medium, group_idx=None), AllBlocksCleared().

    ``array`` (``array_like=True``, vLLM before PR 42892): every field in order, defaults written as nil:
    ``["BlockStored", hashes, None, [], 0, None, medium, None, None, None, None, None]``,
    ``["BlockRemoved", hashes, medium, None]``, ``["AllBlocksCleared"]``.
    ``map`` (vLLM after PR 42892): ``{"type": "BlockStored", "block_hashes": ..., ..., "lora_name": None}``,
    fields by name in declaration order, the defaulted ones left out (``omit_defaults``). ``parent``, ``tokens``
    and ``block_size``: a routed ``BlockStored``'s (:func:`routed_stored`)."""
    if kind == "BlockStored":
        fields: list[tuple[str, Any]] = [
            ("block_hashes", hashes), ("parent_block_hash", parent), ("token_ids", tokens or []),
            ("block_size", block_size),
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


def routed_stored(hashes: list[Any], parent: Any, tokens: list[int], route: Route, medium: str | None,
                  fmt: str) -> Any:
    """A ``BlockStored`` a router's index credits: the hashes of a run of chained blocks, the first one's
    parent's, their tokens back to back and the block size (what Dynamo hashes into its radix tree), and, for a
    salted namespace, the salt as Dynamo's ``cache_salt``. vLLM's struct has no field for the salt, so a
    salted block is always a map (Dynamo reads ``cache_salt`` only from a map; its positional decoder takes no
    salt there); unsalted ones follow ``fmt``."""
    event = vllm_event("BlockStored", hashes, medium, "array" if route.salt is None and fmt == "array" else "map",
                       parent=parent, tokens=tokens, block_size=route.block_size)
    if route.salt is not None:
        assert isinstance(event, dict)
        event["cache_salt"] = route.salt
    return event


def llmd_event(kind: str, hashes: list[int], medium: str) -> bytes:
    """One event as llm-d's ``StorageEventPublisher`` packs it: a positional array, itself packed (the batch holds
    it as msgpack bin): ``["BlockStored", hashes, 0, [], 0, None, medium]`` or ``["BlockRemoved", hashes,
    medium]`` (llm-d/llm-d-kv-cache ``kv_connectors/llmd_fs_backend``; the storage tier knows no parent, tokens
    or block size)."""
    if kind == "BlockStored":
        return pack(["BlockStored", hashes, 0, [], 0, None, medium])
    if kind == "BlockRemoved":
        return pack(["BlockRemoved", hashes, medium])
    raise ValueError(kind)


def llmd_topic(medium: str, model: str) -> bytes:
    """llm-d's per-model topic, ``kv@<medium>@<model>`` (its indexer reads the model from the third part)."""
    return f"kv@{medium}@{model}".encode()


def llmd_batch(ts: float, events: list[bytes]) -> bytes:
    """llm-d's storage batch: ``[ts, [event bytes, ...]]`` (no data-parallel rank)."""
    return pack([ts, events])


def mooncake_event(kind: str, key: str, tenant: str) -> dict[str, Any]:
    """One object event of the Mooncake envelope, by the names of Dynamo's ``MooncakeObjectEvent``
    (lib/llm/src/kv_router, the SGLang HiCache shared cache): ``stored`` or ``removed``, the object key, the
    tenant, no group."""
    return {"event_type": kind, "object_key": key, "tenant_id": tenant, "group_id": None}


def mooncake_batch(ts: float, events: list[dict[str, Any]], data_parallel_rank: int = 0) -> bytes:
    """The Mooncake envelope's payload: ``(timestamp_ms, events, dp_rank)`` (i64, list, u32)."""
    return pack([int(ts * 1000), events, data_parallel_rank])


def vllm_batch(ts: float, events: list[Any], data_parallel_rank: int = 0) -> bytes:
    """An EventBatch: ``[ts, events, data_parallel_rank]`` (array_like, as every consumer decodes it)."""
    return pack([ts, events, data_parallel_rank])


class ZmqPublisher:
    """PUB socket sending one EventBatch per hub batch, and vLLM's ROUTER replay service.

    Each message is ``[topic, seq (8 bytes big-endian), payload]``; seq counts messages from 0 at process
    start, the first message being ``[AllBlocksCleared]`` (a new process holds nothing). Replay: a client
    sends ``[b"", start_seq (8 bytes BE)]`` (a REQ socket adds the empty frame, a DEALER sends it) and gets
    ``[b"", seq, payload]`` for every buffered message with seq >= start_seq, then ``[b"", END_SEQ, b""]``."""

    def __init__(self, endpoint: str, replay_endpoint: str, *, topic: str, fmt: str, hashes: str, medium: str,
                 buckets: set[str] | None, buffer_events: int, routes: RouteBook | None = None,
                 style: str = "vllm") -> None:
        if fmt not in ("array", "map"):
            raise ValueError(f"events_zmq_format must be array or map, got {fmt!r}")
        if hashes not in ("key", "int", "bytes"):
            raise ValueError(f"events_zmq_hashes must be key, int or bytes, got {hashes!r}")
        if style not in ("vllm", "llm-d", "mooncake"):
            raise ValueError(f"events_zmq_style must be vllm, llm-d or mooncake, got {style!r}")
        self.style = style
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.fmt = fmt
        self.hashes = hashes
        self.medium = medium
        self.buckets = buckets
        self.buffer_events = buffer_events
        self.routes = routes
        # next message's sequence number: vLLM's count from 0 (message 0 clears), llm-d's storage tier from 1
        self.seq = 1 if style == "llm-d" else 0
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
        log.info("publishing KV events, %s style, on %s (replay %s%s)", self.style, self.endpoint,
                 self.replay_endpoint or "off", f", topic {self.topic.decode()!r}" if self.style == "vllm" else "")
        if self.style == "vllm":  # llm-d's and Mooncake's have no clear: a consumer sees the new process by its seq
            self._send(self.topic, vllm_batch(time.time(), [vllm_event("AllBlocksCleared", [], None, self.fmt)]), 1)

    def publish(self, batch: list[Event], ts: float) -> None:
        if self._pub is None:
            return
        if self.style == "llm-d":
            self._publish_llmd(batch, ts)
            return
        if self.style == "mooncake":  # the RFC's envelope: an empty topic, the events by key and tenant
            objects = [mooncake_event("stored" if ev.type == STORED else "removed", ev.key, ev.tenant)
                       for ev in batch if self.buckets is None or ev.bucket in self.buckets]
            if objects:
                self._send(b"", mooncake_batch(ts, objects), len(objects))
            return
        buckets, mode, fmt, routes = self.buckets, self.hashes, self.fmt, self.routes
        events: list[Any] = []
        # The run of chained blocks the last event holds: (bucket, last key, medium, route, hashes, tokens). A
        # block whose parent is the run's last block joins it, so a save's blocks go as one event (as vLLM sends
        # a step's blocks), its tokens back to back.
        run: tuple[str, str, str, Route, list[Any], list[int]] | None = None
        for ev in batch:
            if buckets is not None and ev.bucket not in buckets:
                continue
            route = routes.get(ev.bucket, ev.key) if routes is not None and ev.type == STORED else None
            if route is None:
                run = None
                events.append(vllm_event("BlockStored" if ev.type == STORED else "BlockRemoved",
                                         [block_hash(ev.key, mode)], ev.medium, fmt))
                continue
            h = block_hash(ev.key, mode)
            if run is not None and route.parent == run[1] and (ev.bucket, ev.medium, route.block_size, route.salt) \
                    == (run[0], run[2], run[3].block_size, run[3].salt):
                run[4].append(h)
                run[5].extend(route.token_ids())
                run = (ev.bucket, ev.key, ev.medium, route, run[4], run[5])
                continue
            parent = None if route.parent is None else block_hash(route.parent, mode)
            hashes, tokens = [h], route.token_ids()
            events.append(routed_stored(hashes, parent, tokens, route, ev.medium, fmt))
            run = (ev.bucket, ev.key, ev.medium, route, hashes, tokens)
        if events:
            self._send(self.topic, vllm_batch(ts, events), len(events))

    def _publish_llmd(self, batch: list[Event], ts: float) -> None:
        """One message per (medium, bucket) of the batch on topic ``kv@<medium>@<bucket>`` (the bucket stands for
        the model), consecutive events of one kind merged into one event, as llm-d's storage publisher sends a
        store's blocks."""
        groups: dict[tuple[str, str], list[tuple[str, list[int]]]] = {}
        for ev in batch:
            if self.buckets is not None and ev.bucket not in self.buckets:
                continue
            kind = "BlockStored" if ev.type == STORED else "BlockRemoved"
            h = block_hash(ev.key, "int")
            assert isinstance(h, int)
            runs = groups.setdefault((ev.medium, ev.bucket), [])
            if runs and runs[-1][0] == kind:
                runs[-1][1].append(h)
            else:
                runs.append((kind, [h]))
        for (medium, bucket), runs in groups.items():
            packed = [llmd_event(kind, hashes, medium) for kind, hashes in runs]
            self._send(llmd_topic(medium, bucket), llmd_batch(ts, packed), sum(len(h) for _, h in runs))

    def _send(self, topic: bytes, payload: bytes, n_events: int) -> None:
        import zmq

        seq = self.seq
        self.seq += 1
        try:
            self._pub.send_multipart([topic, seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK)
            self.sent += 1
        except zmq.ZMQError as exc:  # PUB drops rather than blocks; the message stays replayable either way
            self.dropped += 1
            if exc.errno != zmq.EAGAIN:
                log.warning("publishing KV event batch %d failed: %s", seq, exc)
        self.buffer.append((seq, payload, n_events))
        self.buffered += n_events
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
