"""Puts whose checksums follow the payloads (``trailer``): the client sends them only to a node whose bulk answers
announced the feature (``x-ctx-bulk-features: put-trailer``), and a node that then refuses such a frame (it was
replaced by an older version) gets the call again with the checksums in the head, without a failure.

Nodes of this version are driven in every other client and bulk test (the client switches to the trailer after
its first answer); here a scripted node in this process plays nodes of other versions, which cannot be run here:
one that announces the feature and checks every trailer it gets, one that never heard of it and refuses the
field as an older node does, and one that is rolled back between two saves.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import xxhash
from support.raw import loopback_listener, recv_request, serve_in_background

from ctxstore import ContextStore, Timeouts, wire

BS = 16


@dataclass
class Put:
    """What the scripted node saw of one put."""

    trailer: bool
    sizes: list[int]
    sums: list[int]  # from the head or the trailer
    verified: bool  # every payload hashed to its checksum


@dataclass
class VersionedNode:
    """A bulk node of another version: ``announces`` the trailer feature in its answers, ``accepts`` puts with a
    trailer (an older node refuses the unknown field with MalformedFrame, as the real ones do)."""

    announces: bool
    accepts: bool
    puts: list[Put] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.sock, self.port = loopback_listener()
        serve_in_background(self.sock, self._connection, concurrent=True)

    def _connection(self, conn: socket.socket) -> None:
        with conn:
            pending = b""
            try:
                while (request := recv_request(conn, pending)) is not None:
                    lines, body, pending = request
                    conn.sendall(self._answer(lines[0], body))
            except OSError:
                return

    def _answer(self, request_line: bytes, body: bytes) -> bytes:
        path = request_line.split(b" ")[1].decode()
        if not path.endswith("/put"):
            return self._http(400, wire.encode_error("NoSuchOperation", "only puts here"))
        head, end = wire.unpack_head(body, wire.ANY_HEAD)
        if "trailer" in head and not self.accepts:
            return self._http(400, wire.encode_error("MalformedFrame", "unknown field 'trailer' in the head"))
        sizes = head["sizes"]
        payloads, pos = [], end
        for size in sizes:
            payloads.append(body[pos:pos + size])
            pos += size
        sums = wire.decode_trailer(body[pos:], len(sizes)) if "trailer" in head else head["xxh3"]
        verified = all(xxhash.xxh3_64_intdigest(p) == s for p, s in zip(payloads, sums, strict=True))
        self.puts.append(Put("trailer" in head, sizes, sums, verified))
        return self._http(200, wire.encode_put_response(wire.PutResponse(["stored"] * len(sizes))))

    def _http(self, status: int, frame: bytes) -> bytes:
        features = f"{wire.FEATURES_HEADER}: {wire.FEATURES}\r\n" if self.announces else ""
        return (f"HTTP/1.1 {status} X\r\ncontent-length: {len(frame)}\r\n{features}\r\n").encode() + frame

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def nodes() -> Iterator[list[VersionedNode]]:
    made: list[VersionedNode] = []
    yield made
    for node in made:
        node.close()


def save_twice(node: VersionedNode, *, strict: bool = False, between: object = None) -> tuple[list[int], int]:
    """Two saves of 4 blocks of 64 KiB, one put call each (one thread); what each stored, and the client's
    error count."""
    store = ContextStore(f"127.0.0.1:{node.port}", access_key="AKIDEXAMPLE", secret_key="secret-0000",
                         timeouts=Timeouts(connect=1.0, read=2.0, total=5.0), strict=strict, threads=1)
    try:
        ns = store.namespace("bkt", model="m", block_size=BS, create=False)
        blocks = [os.urandom(64 << 10) for _ in range(4)]
        stored = [ns.save(list(range(4 * BS)), blocks).stored]
        if callable(between):
            between()
        stored.append(ns.save(list(range(100, 100 + 4 * BS)), blocks).stored)
        return stored, int(store.metrics_snapshot()["errors"])  # type: ignore[call-overload]
    finally:
        store.close()


def test_a_node_that_announces_it_gets_the_checksums_after_the_payloads(nodes: list[VersionedNode]) -> None:
    nodes.append(node := VersionedNode(announces=True, accepts=True))
    assert save_twice(node) == ([4, 4], 0)
    # Both use the trailer: before its first save the client asked the node (an empty lookup), whose answer, a
    # refusal here, said what it takes.
    assert [p.trailer for p in node.puts] == [True, True]
    assert all(p.verified and p.sizes == [64 << 10] * 4 for p in node.puts)


def test_a_node_that_never_announced_it_never_gets_a_trailer(nodes: list[VersionedNode]) -> None:
    nodes.append(node := VersionedNode(announces=False, accepts=False))
    assert save_twice(node) == ([4, 4], 0)
    assert [p.trailer for p in node.puts] == [False, False] and all(p.verified for p in node.puts)


@pytest.mark.parametrize("strict", [False, True], ids=["lenient", "strict"])
def test_a_node_rolled_back_to_an_older_version_gets_the_call_again_without_a_failure(
        nodes: list[VersionedNode], strict: bool) -> None:
    nodes.append(node := VersionedNode(announces=True, accepts=True))

    def roll_back() -> None:
        node.announces = node.accepts = False

    assert save_twice(node, strict=strict, between=roll_back) == ([4, 4], 0)
    # The second save's trailer was refused (not recorded) and sent again with the checksums in the head.
    assert [p.trailer for p in node.puts] == [True, False] and all(p.verified for p in node.puts)
