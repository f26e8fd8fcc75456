"""The Mooncake-style envelope (``events_zmq_style=mooncake``, Mooncake's KV-event RFC kvcache-ai/Mooncake#1527):
``[b"", seq u64 BE, msgpack (ts_ms, [{event_type, object_key, tenant_id, group_id}], dp_rank)]``, as Dynamo's
shared KV cache subscriber parses it (``parse_mooncake_event_frames`` and ``apply_batch`` in Dynamo's
lib/llm/src/kv_router SGLang HiCache client), pinned with the vector of its test
``test_parse_mooncake_event_frames``."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import msgpack
import zmq
from support.nodes import free_port, make_client, start_node

from ctxstore_server import events

# test_parse_mooncake_event_frames: frames [b"", 7 as u64 BE, rmp_serde((0_i64, [MooncakeObjectEvent{
# event_type: "stored", object_key: "key-0", tenant_id: "default", group_id: "group-0"}], 0_u32))] parse to
# sequence 7 and that event. rmp_serde writes the struct positionally and reads it from an array or a map by
# field name; the RFC names the fields, so ctxstore writes the map.
FIELDS = ("event_type", "object_key", "tenant_id", "group_id")


def parse_mooncake_event_frames(frames: list[bytes]) -> tuple[int, list[dict[str, Any]]]:
    """What Dynamo's parser takes from the frames (a struct from an array or a map, as rmp_serde reads it)."""
    _, sequence, payload = frames
    assert len(sequence) == 8
    ts_ms, raw, rank = msgpack.unpackb(payload, raw=False)
    assert isinstance(ts_ms, int) and isinstance(rank, int) and 0 <= rank < 1 << 32
    objects = [e if isinstance(e, dict) else dict(zip(FIELDS, e, strict=True)) for e in raw]
    return int.from_bytes(sequence, "big"), objects


def test_the_envelope_parses_as_dynamos_vector() -> None:
    upstream = [b"", (7).to_bytes(8, "big"), msgpack.packb([0, [["stored", "key-0", "default", "group-0"]], 0])]
    ours = [b"", (7).to_bytes(8, "big"),
            events.mooncake_batch(0.0, [{**events.mooncake_event("stored", "key-0", "default"),
                                         "group_id": "group-0"}])]
    assert parse_mooncake_event_frames(ours) == parse_mooncake_event_frames(upstream) == (
        7, [{"event_type": "stored", "object_key": "key-0", "tenant_id": "default", "group_id": "group-0"}])
    assert events.mooncake_event("removed", "k", "default") == {
        "event_type": "removed", "object_key": "k", "tenant_id": "default", "group_id": None}
    ts_ms, _, rank = msgpack.unpackb(events.mooncake_batch(1712345678.125, []))
    assert (ts_ms, rank) == (1712345678125, 0)


def test_a_node_in_the_mooncake_style(tmp_path: Path) -> None:
    pub = f"tcp://127.0.0.1:{free_port()}"
    node = start_node(tmp_path, env={"CTXSTORE_EVENTS_ZMQ_PUB": pub, "CTXSTORE_EVENTS_ZMQ_STYLE": "mooncake"})
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub)
    try:
        s3 = make_client(node.endpoint)
        s3.create_bucket(Bucket="pod")
        got: list[tuple[int, list[dict[str, Any]]]] = []
        deadline = time.monotonic() + 5
        k = 0
        while not any(e["event_type"] == "removed" for _, evs in got for e in evs):
            assert time.monotonic() < deadline, f"no events: {got}"
            if not got:  # PUB drops what comes before the subscription: store until one arrives
                s3.put_object(Bucket="pod", Key=f"k{k}", Body=b"x")
                k += 1
            elif k >= 0:
                s3.delete_object(Bucket="pod", Key="k0")
                k = -1
            if sub.poll(200):
                frames = sub.recv_multipart()
                assert frames[0] == b""
                got.append(parse_mooncake_event_frames(frames))
        seqs = [seq for seq, _ in got]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # consecutive: Dynamo clears on a gap
        flat = [e for _, evs in got for e in evs]
        assert flat[-1] == {"event_type": "removed", "object_key": "k0", "tenant_id": "default", "group_id": None}
        assert all(e["event_type"] == "stored" and e["tenant_id"] == "default" for e in flat[:-1])
    finally:
        sub.close(linger=0)
        ctx.term()
        node.stop()
