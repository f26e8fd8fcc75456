"""Store events (docs/events.md): the authenticated HTTP stream and snapshot on real nodes, the vLLM-format
ZMQ publisher and its replay socket with a real pyzmq subscriber, and the byte layout of the ZMQ payloads."""

from __future__ import annotations

import asyncio
import http.client
import json
import secrets
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Self
from urllib.parse import urlencode

import msgpack
import pytest
import xxhash
import zmq
from support.nodes import Node, free_port, make_client, start_node

from ctxstore_server import events
from ctxstore_server.engine import Engine
from ctxstore_server.node import NodeState
from ctxstore_server.tenants import TenantRegistry
from ctxstore_server.settings import Settings, resolve

TOKEN = "events-test-token-0001"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
TOPIC = b"kv-events"


# ---------------------------------------------------------------------- helpers


class Stream:
    """A consumer of ``GET /_ctx/v1/events``: reads ``u32 BE length ‖ msgpack`` frames, each read bounded."""

    def __init__(self, port: int, timeout: float = 5.0, **params: Any) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        query = urlencode({k: v for k, v in params.items() if v is not None})
        self.conn.request("GET", f"/_ctx/v1/events?{query}", headers=AUTH)
        self.resp = self.conn.getresponse()
        assert self.resp.status == 200, self.resp.read()
        assert self.resp.getheader("content-type") == events.STREAM_CONTENT_TYPE
        self.hello = self.frame()
        assert self.hello["type"] == "hello"

    def frame(self) -> dict[str, Any]:
        head = self.resp.read(4)
        assert len(head) == 4, "stream ended"
        body = self.resp.read(int.from_bytes(head, "big"))
        return msgpack.unpackb(body)

    def events(self, count: int, timeout: float = 5.0) -> list[dict[str, Any]]:
        """The next ``count`` stored/removed frames (heartbeats skipped)."""
        deadline = time.monotonic() + timeout
        out: list[dict[str, Any]] = []
        while len(out) < count:
            assert time.monotonic() < deadline, f"only {len(out)} of {count} events arrived: {out}"
            frame = self.frame()
            if frame["type"] in ("stored", "removed"):
                out.append(frame)
            else:
                assert frame["type"] == "heartbeat", frame
        return out

    def close(self) -> None:
        self.resp.close()
        self.conn.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def get(node: Node, path: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(node.endpoint + path, headers=AUTH if headers is None else headers)
    try:
        with urllib.request.urlopen(request, timeout=5) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.read()


def snapshot(node: Node, bucket: str | None = None) -> dict[str, Any]:
    status, body = get(node, "/_ctx/v1/events/snapshot" + (f"?bucket={bucket}" if bucket else ""))
    assert status == 200, body
    return msgpack.unpackb(body)


def admin_flush(node: Node, bucket: str) -> dict[str, Any]:
    request = urllib.request.Request(
        node.endpoint + "/_ctx/v1/admin/flush", method="POST", data=json.dumps({"bucket": bucket}).encode(),
        headers={**AUTH, "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=5) as resp:
        return json.loads(resp.read())


def new_bucket(s3: Any) -> str:
    name = "ev-" + secrets.token_hex(6)
    s3.create_bucket(Bucket=name)
    return name


def assert_consecutive(seqs: list[int]) -> None:
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), seqs


# ---------------------------------------------------------------------- nodes


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    """A node with the event stream and the ZMQ publisher + replay socket on."""
    pub, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    n = start_node(tmp_path_factory.mktemp("events"), env={
        "CTXSTORE_ADMIN_TOKEN": TOKEN, "CTXSTORE_EVENTS_ZMQ_PUB": pub, "CTXSTORE_EVENTS_ZMQ_REPLAY": replay})
    yield SimpleNamespace(node=n, s3=make_client(n.endpoint), pub=pub, replay=replay)
    n.stop()


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    """A node with a 48 KiB budget (writes evict) and a ring of 4 events (replay falls behind fast)."""
    n = start_node(tmp_path_factory.mktemp("events-small"), "--memory", "48KiB",
                   env={"CTXSTORE_ADMIN_TOKEN": TOKEN, "CTXSTORE_EVENTS_BUFFER": "4"})
    yield SimpleNamespace(node=n, s3=make_client(n.endpoint))
    n.stop()


# ---------------------------------------------------------------------- HTTP stream


def test_events_need_the_admin_token(node: SimpleNamespace) -> None:
    n = node.node
    for path in ("/_ctx/v1/events", "/_ctx/v1/events?since=0", "/_ctx/v1/events/snapshot"):
        assert get(n, path, headers={})[0] == 401
        assert get(n, path, headers={"Authorization": "Bearer wrong-token"})[0] == 401
        assert get(n, path, headers={"Authorization": TOKEN})[0] == 401  # no scheme
    assert get(n, "/_ctx/v1/events?since=abc")[0] == 400
    assert get(n, "/_ctx/v1/events?since=-1")[0] == 400
    assert get(n, "/_ctx/v1/events/nope")[0] == 404
    assert get(n, "/_ctx/v1/events/snapshot?bucket=no-such-bucket")[0] == 404
    request = urllib.request.Request(n.endpoint + "/_ctx/v1/events", method="POST", data=b"", headers=AUTH)
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=5)
    with info.value:
        assert info.value.code == 405


def test_puts_deletes_and_flush_arrive_in_order_with_consecutive_seqs(node: SimpleNamespace) -> None:
    s3, bucket = node.s3, new_bucket(node.s3)
    with Stream(node.node.port, bucket=bucket) as stream:
        before = time.time()
        s3.put_object(Bucket=bucket, Key="k1", Body=b"a" * 10)
        s3.put_object(Bucket=bucket, Key="k2", Body=b"b" * 20)
        s3.put_object(Bucket=bucket, Key="k1", Body=b"c" * 30)  # replaces k1: one `stored`, no `removed`
        s3.delete_object(Bucket=bucket, Key="k2")
        s3.delete_object(Bucket=bucket, Key="never-there")  # nothing was removed: no event
        assert admin_flush(node.node, bucket) == {"flushed": 1}
        got = stream.events(5)
    summary = [(e["type"], e["key"], e.get("size"), e.get("reason")) for e in got]
    assert summary == [("stored", "k1", 10, None), ("stored", "k2", 20, None), ("stored", "k1", 30, None),
                       ("removed", "k2", 20, "deleted"), ("removed", "k1", 30, "flushed")]
    seqs = [e["seq"] for e in got]
    assert_consecutive(seqs)
    assert seqs[0] == stream.hello["seq"] + 1
    for e in got:
        assert e["epoch"] == stream.hello["epoch"] and e["node"] == stream.hello["node"]
        assert e["bucket"] == bucket and e["tenant"] == "default"
        assert e["seq_hashes"] == [e["key"]] and e["tenant_id"] == "default" and e["medium"] == "CPU"
    assert before + 3600 - 5 < got[0]["expires_at"] < time.time() + 3600 + 5


def test_replay_since_then_heartbeats(node: SimpleNamespace) -> None:
    s3, bucket = node.s3, new_bucket(node.s3)
    with Stream(node.node.port, bucket=bucket) as live:
        for i in range(3):
            s3.put_object(Bucket=bucket, Key=f"r{i}", Body=b"x")
        original = live.events(3)
    first = original[0]["seq"]
    with Stream(node.node.port, since=first - 1, bucket=bucket) as replay:
        assert replay.hello["since"] == first - 1 and replay.hello["seq"] >= original[-1]["seq"]
        assert replay.events(3) == original
        started = time.monotonic()
        beat = replay.frame()  # nothing else happens: a heartbeat within a second or so
        assert beat["type"] == "heartbeat" and beat["seq"] >= original[-1]["seq"]
        assert time.monotonic() - started < 2.5
    with Stream(node.node.port, since=original[-1]["seq"], bucket=bucket) as caught_up:
        assert caught_up.frame()["type"] == "heartbeat"  # nothing to replay, no gap


def test_expiry_removals_arrive(node: SimpleNamespace) -> None:
    s3, bucket = node.s3, new_bucket(node.s3)
    with Stream(node.node.port, bucket=bucket) as stream:
        started = time.monotonic()
        s3.put_object(Bucket=bucket, Key="short", Body=b"x", Metadata={"ctx-ttl": "1"})
        stored, removed = stream.events(2, timeout=4)
        assert time.monotonic() - started < 3.5
    assert (stored["type"], removed["type"], removed["key"], removed["reason"]) == (
        "stored", "removed", "short", "expired")
    assert removed["seq"] == stored["seq"] + 1
    assert stored["expires_at"] - stored["ts"] < 1.5


def test_snapshot_is_consistent_with_its_seq(node: SimpleNamespace) -> None:
    s3, n, bucket = node.s3, node.node, new_bucket(node.s3)
    for key in ("a", "b", "c"):
        s3.put_object(Bucket=bucket, Key=key, Body=b"x")
    s3.delete_object(Bucket=bucket, Key="b")
    snap = snapshot(n, bucket)
    assert snap["keys"] == ["a", "c"] and snap["bucket"] == bucket and snap["tenant"] == "default"
    whole = snapshot(n)
    assert whole["buckets"][bucket] == {"tenant": "default", "keys": ["a", "c"], "disk_keys": []}
    assert whole["seq"] >= snap["seq"]
    # Resume right after the snapshot: nothing to replay, the next change is seq + 1.
    with Stream(n.port, since=snap["seq"], epoch=snap["epoch"], bucket=bucket) as stream:
        assert stream.hello["seq"] == snap["seq"] and stream.hello["epoch"] == snap["epoch"]
        s3.put_object(Bucket=bucket, Key="d", Body=b"x")
        (event,) = stream.events(1)
    assert (event["key"], event["seq"]) == ("d", snap["seq"] + 1)


# ---------------------------------------------------------------------- evictions and gaps (small node)


def test_evictions_on_a_small_budget(small: SimpleNamespace) -> None:
    s3, bucket = small.s3, new_bucket(small.s3)
    with Stream(small.node.port, bucket=bucket) as stream:
        for i in range(8):  # ~10.7 KB charged each: 4 fit in 48 KiB
            s3.put_object(Bucket=bucket, Key=f"e{i}", Body=bytes(10_000))
        got = stream.events(8 + 4)
    evicted = [e["key"] for e in got if e["type"] == "removed"]
    assert all(e["reason"] == "evicted" for e in got if e["type"] == "removed")
    assert evicted == ["e0", "e1", "e2", "e3"]  # least recently used first
    assert_consecutive([e["seq"] for e in got])
    assert set(snapshot(small.node, bucket)["keys"]) == {"e4", "e5", "e6", "e7"}


def test_gap_when_since_is_older_than_the_ring_then_resync(small: SimpleNamespace) -> None:
    s3, n, bucket = small.s3, small.node, new_bucket(small.s3)
    for i in range(3):
        s3.put_object(Bucket=bucket, Key=f"g{i}", Body=b"x")
    s3.delete_object(Bucket=bucket, Key="g0")
    s3.delete_object(Bucket=bucket, Key="g1")
    s3.put_object(Bucket=bucket, Key="g3", Body=b"x")
    with Stream(n.port, since=0) as stream:
        latest, oldest = stream.hello["seq"], stream.hello["oldest"]
        assert latest >= 6 and oldest == latest - 3  # the ring holds 4 events
        gap = stream.frame()
        assert gap["type"] == "gap" and gap["reason"] == "buffer"
        assert (gap["since"], gap["oldest"], gap["seq"]) == (0, oldest, latest)
        replayed = stream.events(4)  # the stream goes on with what the ring still holds
        assert [e["seq"] for e in replayed] == list(range(oldest, latest + 1))
        # Resync: the snapshot is the state at its seq; events after it apply on top.
        snap = snapshot(n, bucket)
        assert snap["seq"] == latest and snap["epoch"] == stream.hello["epoch"]
        assert snap["keys"] == ["g2", "g3"]
        s3.put_object(Bucket=bucket, Key="g4", Body=b"x")
        (after,) = stream.events(1)
        assert (after["key"], after["seq"]) == ("g4", snap["seq"] + 1)
    # Numbers from another process (other epoch, or ahead of this node): a gap, then whatever is buffered.
    for params in ({"since": 2, "epoch": 1}, {"since": latest + 1000}):
        with Stream(n.port, **params) as other:
            gap = other.frame()
            assert gap["type"] == "gap" and gap["reason"] == "epoch"


# ---------------------------------------------------------------------- ZMQ (vLLM format)


def decode_batch(payload: bytes) -> tuple[float, list[list[Any]], int]:
    ts, batch_events, dp_rank = msgpack.unpackb(payload)
    return ts, batch_events, dp_rank


def test_zmq_subscriber_and_replay(node: SimpleNamespace) -> None:
    s3, bucket = node.s3, new_bucket(node.s3)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    dealer = ctx.socket(zmq.DEALER)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
        sub.connect(node.pub)
        dealer.connect(node.replay)
        # PUB drops what it sends before the subscription has arrived: probe until a message comes through.
        deadline = time.monotonic() + 5
        first_seq = None
        probe = 0
        while first_seq is None:
            assert time.monotonic() < deadline, "no ZMQ message arrived"
            s3.put_object(Bucket=bucket, Key=f"probe{probe}", Body=b"x")
            probe += 1
            if sub.poll(200):
                topic, seq8, _ = sub.recv_multipart()
                assert topic == TOPIC and len(seq8) == 8
                first_seq = int.from_bytes(seq8, "big")
        k1, k2 = secrets.token_hex(8), secrets.token_hex(8)
        s3.put_object(Bucket=bucket, Key=k1, Body=b"x")
        s3.put_object(Bucket=bucket, Key=k2, Body=b"x")
        s3.delete_object(Bucket=bucket, Key=k1)
        messages: list[tuple[int, bytes]] = []
        seen: list[list[Any]] = []
        deadline = time.monotonic() + 5
        while not any(e[0] == "BlockRemoved" and e[1] == [int(k1, 16)] for e in seen):
            assert time.monotonic() < deadline, f"missing events: {seen}"
            if sub.poll(200):
                topic, seq8, payload = sub.recv_multipart()
                messages.append((int.from_bytes(seq8, "big"), payload))
                ts, batch_events, dp_rank = decode_batch(payload)
                assert abs(ts - time.time()) < 60 and dp_rank == 0
                seen.extend(batch_events)
        assert_consecutive([first_seq] + [seq for seq, _ in messages])
        # The defaults: integer hashes (a hex key's low 64 bits) and RAM as Dynamo's host tier.
        h1, h2 = int(k1, 16), int(k2, 16)
        ours = [e for e in seen if e[1] in ([h1], [h2])]
        assert ours == [
            ["BlockStored", [h1], None, [], 0, None, "CPU", None, None, None, None, None],
            ["BlockStored", [h2], None, [], 0, None, "CPU", None, None, None, None, None],
            ["BlockRemoved", [h1], "CPU", None],
        ]

        def replay(start: int) -> list[tuple[int, bytes]]:
            dealer.send_multipart([b"", start.to_bytes(8, "big")])  # what a REQ socket sends
            out = []
            limit = time.monotonic() + 5
            while True:
                assert time.monotonic() < limit and dealer.poll(2000), "replay did not end"
                empty, seq8, payload = dealer.recv_multipart()
                assert empty == b""
                if seq8 == events.END_SEQ:
                    assert payload == b""
                    return out
                out.append((int.from_bytes(seq8, "big"), payload))

        missed = replay(messages[0][0])
        assert missed[:len(messages)] == messages  # the same bytes, from the requested seq on
        everything = replay(0)
        assert everything[0][0] == 0
        assert decode_batch(everything[0][1])[1] == [["AllBlocksCleared"]]  # a new process holds nothing
        assert_consecutive([seq for seq, _ in everything])
    finally:
        sub.close(linger=0)
        dealer.close(linger=0)
        ctx.term()


# The bytes msgspec 0.23 writes for vLLM's structs declared as in vllm/distributed/kv_events.py, in the last
# schema before PR 42892: BlockStored(block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
# lora_name, extra_keys=None, group_idx=None, kv_cache_spec_kind=None, kv_cache_spec_sliding_window=None),
# BlockRemoved(block_hashes, medium, group_idx=None), AllBlocksCleared(); tag=True, omit_defaults=True.
# Encoded: KVEventBatch(ts=1712345678.125, events=[BlockStored([h], None, [], 0, None, "CTXSTORE", None),
# BlockRemoved([h], "CTXSTORE"), AllBlocksCleared()], data_parallel_rank=0) with EventBatch array_like;
# `array`: KVCacheEvent array_like=True, `map`: without it.
VLLM_GOLDEN = {
    ("array", "ab/00ff", "key"): (
        "93cb41d9841493880000939cab426c6f636b53746f72656491a761622f30306666c09000c0a843545853544f5245c0c0"
        "c0c0c094ac426c6f636b52656d6f76656491a761622f30306666a843545853544f5245c091b0416c6c426c6f636b7343"
        "6c656172656400"
    ),
    ("array", "x/deadbeefcafebabe", "int"): (
        "93cb41d9841493880000939cab426c6f636b53746f72656491cfdeadbeefcafebabec09000c0a843545853544f5245c0"
        "c0c0c0c094ac426c6f636b52656d6f76656491cfdeadbeefcafebabea843545853544f5245c091b0416c6c426c6f636b"
        "73436c656172656400"
    ),
    ("array", "ab/00ff", "bytes"): (
        "93cb41d9841493880000939cab426c6f636b53746f72656491c40200ffc09000c0a843545853544f5245c0c0c0c0c094"
        "ac426c6f636b52656d6f76656491c40200ffa843545853544f5245c091b0416c6c426c6f636b73436c656172656400"
    ),
    ("map", "ab/00ff", "key"): (
        "93cb41d98414938800009388a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657391a761622f30"
        "306666b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f69647390aa626c6f636b5f73697a6500a76c6f"
        "72615f6964c0a66d656469756da843545853544f5245a96c6f72615f6e616d65c083a474797065ac426c6f636b52656d"
        "6f766564ac626c6f636b5f68617368657391a761622f30306666a66d656469756da843545853544f524581a474797065"
        "b0416c6c426c6f636b73436c656172656400"
    ),
    ("map", "x/deadbeefcafebabe", "int"): (
        "93cb41d98414938800009388a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657391cfdeadbeef"
        "cafebabeb1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f69647390aa626c6f636b5f73697a6500a76c"
        "6f72615f6964c0a66d656469756da843545853544f5245a96c6f72615f6e616d65c083a474797065ac426c6f636b5265"
        "6d6f766564ac626c6f636b5f68617368657391cfdeadbeefcafebabea66d656469756da843545853544f524581a47479"
        "7065b0416c6c426c6f636b73436c656172656400"
    ),
    ("map", "ab/00ff", "bytes"): (
        "93cb41d98414938800009388a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657391c40200ffb1"
        "706172656e745f626c6f636b5f68617368c0a9746f6b656e5f69647390aa626c6f636b5f73697a6500a76c6f72615f69"
        "64c0a66d656469756da843545853544f5245a96c6f72615f6e616d65c083a474797065ac426c6f636b52656d6f766564"
        "ac626c6f636b5f68617368657391c40200ffa66d656469756da843545853544f524581a474797065b0416c6c426c6f63"
        "6b73436c656172656400"
    ),
}


@pytest.mark.parametrize(("fmt", "key", "mode"), sorted(VLLM_GOLDEN))
def test_zmq_payload_bytes_match_vllm_msgspec_encoding(fmt: str, key: str, mode: str) -> None:
    h = events.block_hash(key, mode)
    batch = [events.vllm_event("BlockStored", [h], "CTXSTORE", fmt),
             events.vllm_event("BlockRemoved", [h], "CTXSTORE", fmt),
             events.vllm_event("AllBlocksCleared", [], None, fmt)]
    assert events.vllm_batch(1712345678.125, batch).hex() == VLLM_GOLDEN[(fmt, key, mode)]


def test_block_hash_modes() -> None:
    dynamo_key = "rank0/" + format(12583592247330656132, "016x")  # a Dynamo sequence hash (docs/hashing.md)
    assert events.block_hash(dynamo_key, "int") == 12583592247330656132
    vllm_key = "ab" * 32  # a 32-byte sha256 block hash: vLLM's int form is its low 64 bits
    assert events.block_hash(vllm_key, "int") == int.from_bytes(bytes.fromhex(vllm_key), "big") & (2**64 - 1)
    assert events.block_hash(vllm_key, "bytes") == bytes.fromhex(vllm_key)
    assert events.block_hash("not/hex-key", "int") == xxhash.xxh3_64_intdigest(b"not/hex-key")
    assert events.block_hash("not/hex-key", "bytes") == b"not/hex-key"
    assert events.block_hash("odd/abc", "bytes") == b"odd/abc"
    assert events.block_hash("any/thing", "key") == "any/thing"


def test_zmq_settings_are_validated() -> None:
    assert resolve(env={"CTXSTORE_EVENTS_ZMQ_FORMAT": "MAP"}).events_zmq_format == "map"
    with pytest.raises(ValueError, match="CTXSTORE_EVENTS_ZMQ_FORMAT"):
        resolve(env={"CTXSTORE_EVENTS_ZMQ_FORMAT": "json"})
    with pytest.raises(ValueError, match="CTXSTORE_EVENTS_ZMQ_HASHES"):
        resolve(env={"CTXSTORE_EVENTS_ZMQ_HASHES": "hex"})


# ---------------------------------------------------------------------- a slow consumer (in process)


def test_a_slow_consumer_gets_a_gap_frame_and_is_disconnected(tmp_path: Path) -> None:
    """Its queue is bounded: falling further behind clears it, sends a `gap` (reason slow) and ends."""
    engine = Engine()
    settings = Settings(events_consumer_queue=5, admin_token="t")
    hub = events.EventHub(engine, settings, "n1")
    stream = events.EventStream(hub, NodeState(settings, TenantRegistry(), engine, "n1"))
    engine.create_bucket("tenant", "bkt")

    def put(key: str) -> None:
        engine.put("tenant", "bkt", key, b"x", etag='"x"')

    async def scenario() -> list[dict[str, Any]]:
        await hub.start()
        sent: list[Any] = []
        body_sends = 0
        unblock = asyncio.Event()
        blocked = asyncio.Event()

        async def send(message: dict[str, Any]) -> None:
            nonlocal body_sends
            if message["type"] == "http.response.body":
                body_sends += 1
                if body_sends == 2:  # the first live events: the socket "stops draining"
                    blocked.set()
                    await unblock.wait()
            sent.append(message)

        async def receive() -> dict[str, Any]:
            await asyncio.Event().wait()  # the client never disconnects
            raise AssertionError

        scope = {"type": "http", "method": "GET", "path": events.EVENTS_PATH, "query_string": b"",
                 "headers": [(b"authorization", b"Bearer t")]}
        task = asyncio.create_task(stream.serve(scope, receive, send))
        await asyncio.sleep(0.05)
        put("k0")
        hub.flush_now()
        await asyncio.wait_for(blocked.wait(), 2)
        for i in range(1, 12):  # 11 more while the consumer is stuck: more than its queue of 5
            put(f"k{i}")
        hub.flush_now()
        assert hub.counters["events"] == 12
        unblock.set()
        await asyncio.wait_for(task, 5)
        assert not hub._consumers
        await hub.stop()
        assert sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
        frames, rest = events.decode_frames(b"".join(m.get("body", b"") for m in sent[1:]))
        assert rest == b""
        return frames

    frames = asyncio.run(scenario())
    assert [f["type"] for f in frames] == ["hello", "stored", "gap"]
    assert frames[1]["key"] == "k0"
    assert frames[2]["reason"] == "slow" and frames[2]["since"] == frames[1]["seq"] == 1
    assert frames[2]["seq"] == 12


def test_replaced_objects_fold_into_their_new_stored_event() -> None:
    engine = Engine()
    hub = events.EventHub(engine, Settings(), "n1")
    engine.create_bucket("tenant", "bkt")
    engine.put("tenant", "bkt", "k", b"1", etag='"1"')
    engine.put("tenant", "bkt", "k", b"22", etag='"2"')
    engine.store.delete("tenant", "bkt", "k")
    hub.flush_now()
    assert [(e.seq, e.type, e.size, e.reason) for e in hub.ring] == [
        (1, "stored", 1, None), (2, "stored", 2, None), (3, "removed", 2, "deleted")]
    assert all(e.tenant == "tenant" for e in hub.ring)
