"""Router-grade events: a save carries each block's tokens, parent and block size (and the namespace's salt) to a
node whose ZMQ events feed a router, and only to such a node; its ``BlockStored`` events carry them as Dynamo
reads them. (Dynamo's own indexer against a node: tests/integrations/test_dynamo.py.)"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
from support.nodes import ACCESS_KEY, SECRET_KEY, free_port, start_node
from support.probes import metric

from ctxstore import ContextStore, wire
from ctxstore_server import events

ROUTE = wire.PutRoute(2, [[1, 2], [3, 4]], [None, "aa"], "salt")


def test_a_put_route_round_trips_through_the_head() -> None:
    head = wire.encode_put_head(wire.PutRequest(["aa", "bb"], [1, 1], [0, 0], route=ROUTE))
    decoded = wire.decode_put_request(wire.unpack_head(head, wire.request_schema("put", 16))[0], 16, 1 << 20)
    assert decoded.route == ROUTE
    plain = wire.encode_put_head(wire.PutRequest(["aa"], [1], [0]))
    assert wire.decode_put_request(wire.unpack_head(plain, wire.request_schema("put", 16))[0], 16, 1 << 20).route \
        is None
    assert ROUTE.select([1]) == wire.PutRoute(2, [[3, 4]], ["aa"], "salt")


@pytest.mark.parametrize("bad", [
    {"tokens": [[1, 2]], "parents": [None]},  # no block_size
    {"block_size": 2, "tokens": [[1]], "parents": [None]},  # a block of the wrong length
    {"block_size": 2, "tokens": [[1, 1 << 32]], "parents": [None]},  # not a u32 token id
    {"block_size": 2, "tokens": [[1, 2]], "parents": [7]},  # a parent that is not a key
    {"block_size": 2, "tokens": [[1, 2]], "parents": [None], "salt": 3},
    {"block_size": 0, "tokens": [[]], "parents": [None]},
])
def test_a_malformed_route_is_refused(bad: dict[str, Any]) -> None:
    head = {"v": 1, "keys": ["aa"], "sizes": [1], "xxh3": [0], **bad}
    with pytest.raises(wire.WireError):
        wire.decode_put_request(head, 16, 1 << 20)


def test_routed_stored_events_as_dynamo_reads_them() -> None:
    plain = events.Route("aa", events.RouteBook.pack_tokens([1, 2]), 2, None)
    assert events.routed_stored([7], 5, plain.token_ids(), plain, "CPU", "array") == \
        ["BlockStored", [7], 5, [1, 2], 2, None, "CPU", None, None, None, None, None]
    salted = plain._replace(salt="s")
    # Dynamo reads a salt only from a map event's `cache_salt`: a salted block is a map whatever the format.
    assert events.routed_stored([7], None, [1, 2], salted, "DISK", "array") == {
        "type": "BlockStored", "block_hashes": [7], "parent_block_hash": None, "token_ids": [1, 2], "block_size": 2,
        "lora_id": None, "medium": "DISK", "lora_name": None, "cache_salt": "s"}


def test_the_route_log_survives_a_restart_and_drops_what_is_gone(tmp_path: Path) -> None:
    path = str(tmp_path / "routes.log")
    book = events.RouteBook(path)
    book.remember("b", ["aa", "bb", "cc"], wire.PutRoute(2, [[1, 2], [3, 4], [5, 6]], [None, "aa", "bb"], "s"),
                  [0, 1])
    assert book.get("b", "cc") is None  # not stored by the put
    book.forget("b", "aa")
    book.close()
    again = events.RouteBook(path)
    assert again.get("b", "aa") is None  # gone before the restart
    entry = again.get("b", "bb")
    assert entry is not None and (entry.parent, entry.token_ids(), entry.block_size, entry.salt) == (
        "aa", [3, 4], 2, "s")
    again.close()
    reset = events.RouteBook(path, reset=True)  # the flash tier starts empty: so do the routes
    assert len(reset) == 0
    reset.close()


LOOKUPS = 'ctxstore_requests_total{api="bulk",operation="lookup",status="200"}'


def _subscriber(ctx: zmq.Context[Any], endpoint: str) -> zmq.Socket[Any]:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    return sub


def test_a_save_carries_its_route_only_to_a_node_that_asks(tmp_path: Path) -> None:
    pub = f"tcp://127.0.0.1:{free_port()}"
    token = "routes-admin-token"
    routed = start_node(tmp_path, env={"CTXSTORE_EVENTS_ZMQ_PUB": pub, "CTXSTORE_ADMIN_TOKEN": token})
    plain = start_node(tmp_path, env={"CTXSTORE_ADMIN_TOKEN": token})
    ctx = zmq.Context()
    sub = _subscriber(ctx, pub)
    try:
        for node, asks in ((routed, True), (plain, False)):
            with ContextStore(node.endpoint, access_key=ACCESS_KEY, secret_key=SECRET_KEY) as store:
                ns = store.namespace("routes", model="m", block_size=4, scheme="dynamo")
                tokens = list(range(12))
                # The client's first call to the node is this save: it learns what the node asks for first.
                assert ns.save(tokens, [b"x" * 10] * 3).stored == 3
                assert store._async.pod.nodes[0].put_route is asks
                assert ns.save(tokens, [b"x" * 10] * 3).existed == 3  # (no new event)
                assert metric(node, LOOKUPS, token) == 1  # asked before the first save only
            with ContextStore(node.endpoint, access_key=ACCESS_KEY, secret_key=SECRET_KEY) as store:
                # A refusal tells as much: the node's answer for a bucket it does not have.
                store._loop.run(store._async._learn_features("no-such-bucket"))
                assert store._async.pod.nodes[0].features_known and store._async.pod.nodes[0].put_route is asks
        keys = [int(k, 16) for k in ns.block_hashes(tokens)]
        stored: list[Any] = []
        deadline = time.monotonic() + 5
        while not stored:  # the routed node's save (PUB may drop what came before the subscription)
            assert time.monotonic() < deadline, "no routed events"
            if sub.poll(200):
                _, _, payload = sub.recv_multipart()
                stored += [e for e in msgpack.unpackb(payload)[1] if isinstance(e, dict)]
        # The save's three chained blocks in one event, as Dynamo takes a run: the first one's parent, the
        # tokens back to back, the namespace's salt.
        salt = ns.fingerprint.hexdigest()
        assert [(e["block_hashes"], e["parent_block_hash"], e["token_ids"], e["block_size"], e["medium"],
                 e["cache_salt"]) for e in stored] == [(keys, None, list(range(12)), 4, "CPU", salt)]
    finally:
        sub.close(linger=0)
        ctx.term()
        routed.stop()
        plain.stop()


class _Socket:
    def __init__(self) -> None:
        self.sent: list[list[bytes]] = []

    def send_multipart(self, frames: list[bytes], flags: int = 0) -> None:
        self.sent.append(frames)


def test_a_run_of_chained_blocks_is_one_event_and_a_break_starts_another() -> None:
    book = events.RouteBook()
    book.remember("b", ["01", "02", "03", "09"], wire.PutRoute(1, [[1], [2], [3], [9]], [None, "01", "02", "07"]),
                  [0, 1, 2, 3])
    publisher = events.ZmqPublisher("", "", topic="t", fmt="array", hashes="int", medium="CPU", buckets=None,
                                    buffer_events=100, routes=book)
    publisher._pub = _Socket()
    batch = [events.Event(i + 1, 0.0, events.STORED, "b", "", key, 1, 0.0, None, medium)
             for i, (key, medium) in enumerate([("01", "CPU"), ("02", "CPU"), ("03", "DISK"), ("09", "DISK"),
                                                ("05", "CPU")])]
    publisher.publish(batch, 1.0)
    (frames,) = publisher._pub.sent
    assert msgpack.unpackb(frames[2])[1] == [
        ["BlockStored", [1, 2], None, [1, 2], 1, None, "CPU", None, None, None, None, None],
        ["BlockStored", [3], 2, [3], 1, None, "DISK", None, None, None, None, None],  # another medium
        ["BlockStored", [9], 7, [9], 1, None, "DISK", None, None, None, None, None],  # not 03's child
        ["BlockStored", [5], None, [], 0, None, "CPU", None, None, None, None, None],  # no route
    ]


def test_a_staged_save_carries_its_route_chunk_by_chunk(tmp_path: Path) -> None:
    # Blocks from (CPU) torch tensors through the staging pool (the host backend: a GPU cache's path), in
    # chunks of two blocks: each chunk's put carries its own blocks' tokens and parents.
    torch = pytest.importorskip("torch")
    pub = f"tcp://127.0.0.1:{free_port()}"
    node = start_node(tmp_path, env={"CTXSTORE_EVENTS_ZMQ_PUB": pub})
    ctx = zmq.Context()
    sub = _subscriber(ctx, pub)
    try:
        with ContextStore(node.endpoint, access_key=ACCESS_KEY, secret_key=SECRET_KEY, staging="host",
                          staging_bytes=4 * 2 * 16) as store:
            ns = store.namespace("staged-routes", model="m", block_size=4, scheme="dynamo")
            tokens = list(range(20))  # 5 blocks: chunks of 2, 2 and 1
            blocks = torch.arange(5 * 16, dtype=torch.uint8).reshape(5, 16)
            assert ns.save(tokens, blocks).stored == 5
            keys = [int(k, 16) for k in ns.block_hashes(tokens)]
        seen: dict[int, tuple[Any, list[int]]] = {}
        deadline = time.monotonic() + 5
        while len(seen) < 5:
            assert time.monotonic() < deadline, f"routed events for {len(seen)} of 5 blocks"
            if sub.poll(200):
                for e in msgpack.unpackb(sub.recv_multipart()[2])[1]:
                    if isinstance(e, dict) and e.get("type") == "BlockStored":
                        parent = e["parent_block_hash"]
                        for i, h in enumerate(e["block_hashes"]):
                            seen[h] = (parent, e["token_ids"][i * 4:(i + 1) * 4])
                            parent = h
        assert [seen[k] for k in keys] == [(None if i == 0 else keys[i - 1], tokens[i * 4:(i + 1) * 4])
                                           for i in range(5)]
    finally:
        sub.close(linger=0)
        ctx.term()
        node.stop()


def test_only_the_routes_of_the_buckets_the_publisher_reports_are_kept() -> None:
    book = events.RouteBook(buckets=frozenset({"reported"}))
    for bucket in ("reported", "ignored"):
        book.remember(bucket, ["aa"], wire.PutRoute(1, [[1]], [None]), [0])
    assert book.get("reported", "aa") is not None and book.get("ignored", "aa") is None and len(book) == 1


def test_the_routes_of_blocks_a_restart_did_not_bring_back_are_dropped(tmp_path: Path) -> None:
    # Blocks lost with RAM at a SIGKILL, expired while the node was down or of a bucket it forgot leave no
    # removal behind: at start the node keeps only the routes of what it holds, in memory and in the log.
    path = str(tmp_path / "events-routes.log")
    book = events.RouteBook(path)
    book.remember("b", ["aa", "bb", "cc"], wire.PutRoute(1, [[1], [2], [3]], [None, "aa", "bb"]), [0, 1, 2])
    book.remember("gone", ["dd"], wire.PutRoute(1, [[4]], [None]), [0])
    book.close()
    again = events.RouteBook(path)
    asked: list[tuple[str, list[str]]] = []

    def holds(bucket: str, keys: list[str]) -> list[bool]:
        asked.append((bucket, sorted(keys)))
        return [bucket == "b" and key == "bb" for key in keys]

    assert again.retain(holds) == 3
    assert sorted(asked) == [("b", ["aa", "bb", "cc"]), ("gone", ["dd"])]  # one question per bucket
    assert [again.get("b", k) is not None for k in ("aa", "bb", "cc")] == [False, True, False]
    again.close()
    reread = events.RouteBook(path)
    assert len(reread) == 1 and reread.get("b", "bb") is not None
    reread.close()
