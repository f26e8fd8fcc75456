"""llm-d's storage events (``events_zmq_style=llm-d``): the topic, framing and event shape of llm-d's own
``StorageEventPublisher`` (llm-d/llm-d-kv-cache, ``kv_connectors/llmd_fs_backend/llmd_fs_backend/
event_publisher.py``), pinned with the vectors of its test (``tests/test_storage_events.py``)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import msgpack
import zmq
from support.nodes import free_port, make_client, start_node

from ctxstore_server import events

# test_storage_event_publisher_emits_go_compatible_three_frame_message / test_publish_blocks_removed_emits_...:
# publish_blocks_stored([0xABCDEF0123456789, (1 << 72) + 7, b"\x01\x02"]) with model "test-model".
LLMD_TOPIC = b"kv@SHARED_STORAGE@test-model"
LLMD_STORED = ["BlockStored", [0xABCDEF0123456789, 7, 0x0102], 0, [], 0, None, "SHARED_STORAGE"]
LLMD_REMOVED = ["BlockRemoved", [0xABCDEF0123456789, 0x1234], "SHARED_STORAGE"]


def test_llmd_events_match_llmds_own_publisher() -> None:
    assert events.llmd_topic("SHARED_STORAGE", "test-model") == LLMD_TOPIC
    # Its hashes: the low 64 bits, a bytes hash read big-endian; a hex key's last segment read as hex is the same.
    hashes = [events.block_hash(k, "int") for k in ("abcdef0123456789", "01" + "00" * 8 + "07", "ns/0102")]
    assert hashes == LLMD_STORED[1]
    stored = events.llmd_event("BlockStored", [0xABCDEF0123456789, 7, 0x0102], "SHARED_STORAGE")
    removed = events.llmd_event("BlockRemoved", [0xABCDEF0123456789, 0x1234], "SHARED_STORAGE")
    # Byte for byte what its msgpack.packb(event, use_bin_type=True) writes.
    assert stored == msgpack.packb(LLMD_STORED, use_bin_type=True)
    assert removed == msgpack.packb(LLMD_REMOVED, use_bin_type=True)
    ts, raw = msgpack.unpackb(events.llmd_batch(1712345678.125, [stored, removed]), raw=False)
    assert isinstance(ts, float) and [msgpack.unpackb(r, raw=False) for r in raw] == [LLMD_STORED, LLMD_REMOVED]


def test_a_node_in_the_llmd_style(tmp_path: Path) -> None:
    pub = f"tcp://127.0.0.1:{free_port()}"
    node = start_node(tmp_path, env={"CTXSTORE_EVENTS_ZMQ_PUB": pub, "CTXSTORE_EVENTS_ZMQ_STYLE": "llm-d",
                                     "CTXSTORE_EVENTS_MEDIUM": "SHARED_STORAGE"})
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@SHARED_STORAGE@llama")
    sub.connect(pub)
    try:
        s3 = make_client(node.endpoint)
        s3.create_bucket(Bucket="llama")
        got: list[tuple[bytes, int, list[Any]]] = []
        deadline = time.monotonic() + 5
        k = 0
        while not any(e[0] == "BlockRemoved" for _, _, evs in got for e in evs):
            assert time.monotonic() < deadline, f"no events: {got}"
            if not got:  # PUB drops what comes before the subscription: store until one arrives
                s3.put_object(Bucket="llama", Key=f"{k:016x}", Body=b"x")
                k += 1
            elif k >= 0:
                s3.delete_object(Bucket="llama", Key=f"{0:016x}")
                k = -1
            if sub.poll(200):
                topic, seq8, payload = sub.recv_multipart()
                ts, raw = msgpack.unpackb(payload, raw=False)
                got.append((topic, int.from_bytes(seq8, "big"), [msgpack.unpackb(r, raw=False) for r in raw]))
        assert {topic for topic, _, _ in got} == {b"kv@SHARED_STORAGE@llama"}
        seqs = [seq for _, seq, _ in got]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))) and seqs[0] >= 1  # from 1, no clear message
        flat = [e for _, _, evs in got for e in evs]
        assert all(e[0] == "BlockStored" and e[2:] == [0, [], 0, None, "SHARED_STORAGE"] for e in flat[:-1])
        assert flat[-1] == ["BlockRemoved", [0], "SHARED_STORAGE"]
    finally:
        sub.close(linger=0)
        ctx.term()
        node.stop()
