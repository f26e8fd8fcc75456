"""The bulk API (server/bulk) against the node's application in-process (a real node where the socket is what
is tested: a client gone mid-body, answers before the body), signed with botocore's SigV4 signer
(:mod:`support.raw`): put/get round trips, if_absent, per-block checksums, truncated and malformed bodies, limits,
lookup prefixes, pins under eviction, touch, delete, tenant isolation, S3 interop and auth errors.
A few in-process tests drive the ASGI app directly to see what a socket cannot: that a get sends the stored
buffers themselves, the engine's counters, and a stalled body."""

from __future__ import annotations

import asyncio
import hashlib
import http.client
import os
import secrets
import socket
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import xxhash
from support.fixtures import wants_real_node
from support.inprocess import InProcessNode
from support.nodes import ACCESS_KEY, OTHER_ACCESS_KEY, OTHER_SECRET_KEY, SECRET_KEY, Node, make_client, start_node
from support.raw import UNSIGNED, raw_request, sign

from ctxstore import wire
from ctxstore_server.app import App
from ctxstore_server.settings import Settings
from ctxstore_server.tenants import TenantRegistry

KiB = 1 << 10


# ============================================================================================ helpers


def signed_headers(host: str, path: str, body: bytes, *, payload_hash: str = UNSIGNED,
                   access: str = ACCESS_KEY, secret: str = SECRET_KEY) -> dict[str, str]:
    """SigV4 headers for ``POST path`` as botocore signs an S3 request (``payload_hash``: UNSIGNED-PAYLOAD,
    a hex SHA-256, or a STREAMING-* constant), without the Host header (the sender adds it)."""
    headers = sign(None, "POST", path, host=host, payload_hash=payload_hash, access=access, secret=secret).headers
    assert headers["X-Amz-Content-SHA256"] == payload_hash
    return {k: v for k, v in headers.items() if k.lower() != "host"}


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    @property
    def head(self) -> dict[str, Any]:
        return wire.unpack_head(self.body, wire.ANY_HEAD)[0]

    @property
    def payload(self) -> bytes:
        return self.body[wire.unpack_head(self.body, wire.ANY_HEAD)[1]:]

    @property
    def error(self) -> str:
        assert self.status != 200, self.head
        return wire.decode_error(self.head).error


class Bulk:
    """A minimal bulk client for tests: one signed request per call, through ASGI to an in-process node or on a
    connection of its own (http.client) to a real one."""

    def __init__(self, node: Node | InProcessNode, access: str = ACCESS_KEY, secret: str = SECRET_KEY) -> None:
        self.node, self.access, self.secret = node, access, secret

    @property
    def host(self) -> str:
        if isinstance(self.node, InProcessNode):
            return urlsplit(self.node.endpoint).netloc
        return f"127.0.0.1:{self.node.port}"

    def raw(self, bucket: str, op: str, body: bytes, *, method: str = "POST", payload_hash: str = UNSIGNED,
            headers: dict[str, str] | None = None, sign: bool = True, chunked: bool = False) -> Reply:
        path = wire.path(bucket, op)
        all_headers = signed_headers(self.host, path, body, payload_hash=payload_hash, access=self.access,
                                     secret=self.secret) if sign else {}
        all_headers.update(headers or {})
        if isinstance(self.node, InProcessNode):  # the body as the HTTP layer hands it over (chunks decoded)
            if chunked:
                all_headers["Transfer-Encoding"] = "chunked"
            else:
                all_headers["Content-Length"] = str(len(body))
            reply = raw_request(self.node, method, path, all_headers, body)
            return Reply(reply.status, reply.headers, reply.body)
        conn = http.client.HTTPConnection("127.0.0.1", self.node.port, timeout=15)
        try:
            if chunked:
                all_headers["Transfer-Encoding"] = "chunked"
            conn.request(method, path, body=body, headers=all_headers, encode_chunked=chunked)
            resp = conn.getresponse()
            return Reply(resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read())
        finally:
            conn.close()

    def keys_op(self, bucket: str, op: str, keys: list[str], **fields: Any) -> Reply:
        return self.raw(bucket, op, wire.encode_keys_request(op, wire.KeysRequest(keys, **fields)))

    def put(self, bucket: str, blocks: dict[str, bytes], *, ttl: float | None = None, if_absent: bool = True,
            xxh3: list[int] | None = None, trailer: bool = False) -> Reply:
        return self.raw(bucket, "put", put_frame(blocks, ttl=ttl, if_absent=if_absent, xxh3=xxh3, trailer=trailer))

    def put_results(self, bucket: str, blocks: dict[str, bytes], **kwargs: Any) -> wire.PutResponse:
        reply = self.put(bucket, blocks, **kwargs)
        assert reply.status == 200, reply.head
        return wire.decode_put_response(reply.head, len(blocks))

    def get(self, bucket: str, keys: list[str], pin: float = 0.0
            ) -> tuple[wire.GetResponse, list[bytes | None]]:
        reply = self.keys_op(bucket, "get", keys, pin=pin)
        assert reply.status == 200, reply.head
        head = wire.decode_get_head(reply.head, len(keys))
        payload, pos, out = reply.payload, 0, []
        for size in head.sizes:
            if size == wire.ABSENT:
                out.append(None)
            else:
                out.append(payload[pos:pos + size])
                pos += size
        assert pos == len(payload)
        return head, out

    def lookup(self, bucket: str, keys: list[str], pin: float = 0.0) -> wire.LookupResponse:
        reply = self.keys_op(bucket, "lookup", keys, pin=pin)
        assert reply.status == 200, reply.head
        return wire.decode_lookup_response(reply.head, len(keys))

    def count(self, bucket: str, op: str, keys: list[str], **fields: Any) -> int:
        reply = self.keys_op(bucket, op, keys, **fields)
        assert reply.status == 200, reply.head
        return wire.decode_count_response(reply.head).count


def put_frame(blocks: dict[str, bytes], *, ttl: float | None = None, if_absent: bool = True,
              xxh3: list[int] | None = None, trailer: bool = False) -> bytes:
    """A whole put body: head, then the blocks (``xxh3`` overrides the true checksums; ``trailer``: they come
    after the blocks instead of in the head)."""
    sums = xxh3 or [xxhash.xxh3_64_intdigest(d) for d in blocks.values()]
    request = wire.PutRequest(list(blocks), [len(d) for d in blocks.values()], None if trailer else sums, ttl,
                              if_absent)
    return wire.encode_put_head(request) + b"".join(blocks.values()) + (wire.encode_trailer(sums) if trailer else b"")


LAYOUTS = pytest.mark.parametrize("trailer", [False, True], ids=["sums-in-head", "sums-in-trailer"])


def blocks_of(n: int, size: int, prefix: str = "blk") -> dict[str, bytes]:
    return {f"{prefix}/{i:04d}-{secrets.token_hex(4)}": os.urandom(size) for i in range(n)}


def quietly_start(tmp: Path, *args: str) -> Node:
    # conftest.start_node leaves its log file to the garbage collector: mute that ResourceWarning.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        return start_node(tmp, *args)


@pytest.fixture
def bulk(request: pytest.FixtureRequest) -> Bulk:
    """A bulk client of the in-process node, or of the session's real node for a test that asks for ``server``."""
    return Bulk(request.getfixturevalue("server" if wants_real_node(request) else "inprocess"))


SMALL = {"memory": 1 << 20, "bulk_max_keys": 8, "bulk_max_bytes": 256 * KiB}  # and as options of a real node
SMALL_OPTIONS = ("--memory", "1MiB", "--bulk-max-keys", "8", "--bulk-max-bytes", "256KiB")


@pytest.fixture(scope="module")
def small() -> Iterator[InProcessNode]:
    """A node with a 1 MiB budget and small bulk limits."""
    node = InProcessNode(keep_time=True, **SMALL)
    yield node
    node.close()


@pytest.fixture
def small_bucket(small: InProcessNode) -> str:
    name = "small-" + secrets.token_hex(6)
    small.client().create_bucket(Bucket=name)
    return name


@pytest.fixture
def small_real(tmp_path: Path) -> Iterator[tuple[Node, str]]:
    """A real node with the small limits, and a bucket of it: for answers given before the body arrives."""
    node = quietly_start(tmp_path, *SMALL_OPTIONS)
    name = "small-" + secrets.token_hex(6)
    make_client(node.endpoint).create_bucket(Bucket=name)
    yield node, name
    node.stop()


# ============================================================================================ data path


@LAYOUTS
def test_put_then_get_returns_the_blocks_byte_identical_in_order(bulk: Bulk, bucket: str, trailer: bool) -> None:
    blocks = {f"chain/{i:03d}": os.urandom(size) for i, size in enumerate([64 * KiB, 1, 0, 300 * KiB, 7] * 8)}
    assert bulk.put_results(bucket, blocks, ttl=600, trailer=trailer).results == ["stored"] * len(blocks)
    keys = list(blocks)
    asked = [keys[5], "chain/missing", *keys[10:20], "other/missing", keys[0]]
    head, payloads = bulk.get(bucket, asked)
    now = time.time()
    for key, size, digest, expires, payload in zip(asked, head.sizes, head.xxh3, head.expires, payloads,
                                                   strict=True):
        if key.endswith("missing"):
            assert (size, digest, expires, payload) == (wire.ABSENT, 0, 0.0, None)
        else:
            assert payload == blocks[key] and size == len(blocks[key])
            assert digest == xxhash.xxh3_64_intdigest(blocks[key])
            assert now + 590 < expires <= now + 601


def test_every_answer_announces_the_put_trailer(bulk: Bulk, bucket: str) -> None:
    # What a client needs to know before it sends a put whose checksums follow the payloads (wire.py).
    for reply in (bulk.keys_op(bucket, "lookup", ["x"]), bulk.put(bucket, {"y": b"1"}, trailer=True)):
        assert reply.status == 200 and wire.has_feature(reply.headers, wire.FEATURE_PUT_TRAILER)
    refused = bulk.keys_op("no-such-bucket-" + secrets.token_hex(3), "lookup", ["x"])  # a refusal says it too
    assert refused.status == 404 and wire.has_feature(refused.headers, wire.FEATURE_PUT_TRAILER)


def test_a_trailer_of_large_blocks_and_one_that_names_a_skipped_block(bulk: Bulk, bucket: str) -> None:
    """Blocks larger than a read slice (read in pieces) and a block that already exists (its payload is read
    away): the trailer still lines up with every key, skipped ones included."""
    blocks = {f"big/{i}-{secrets.token_hex(3)}": os.urandom(size) for i, size in
              enumerate([3 * (1 << 20) + 7, 10, 2 * (1 << 20)])}
    keys = list(blocks)
    assert bulk.put_results(bucket, {keys[1]: blocks[keys[1]]}).results == ["stored"]
    sums = [xxhash.xxh3_64_intdigest(d) for d in blocks.values()]
    sums[2] ^= 1 << 63
    result = bulk.put_results(bucket, blocks, xxh3=sums, trailer=True)
    assert result.results == ["stored", "exists", "rejected"] and set(result.errors) == {2}
    assert bulk.get(bucket, keys)[1] == [blocks[keys[0]], blocks[keys[1]], None]


def test_get_of_only_absent_keys_and_of_no_keys(bulk: Bulk, bucket: str) -> None:
    head, payloads = bulk.get(bucket, ["nope/1", "nope/2"])
    assert head.sizes == [wire.ABSENT, wire.ABSENT] and payloads == [None, None]
    assert bulk.get(bucket, [])[1] == []


@LAYOUTS
def test_if_absent_skips_existing_keys_and_keeps_their_bytes(bulk: Bulk, bucket: str, trailer: bool) -> None:
    assert bulk.put_results(bucket, {"a": b"old-a"}, trailer=trailer).results == ["stored"]
    result = bulk.put_results(bucket, {"a": b"new-a-bytes", "b": b"new-b"}, trailer=trailer)
    assert result.results == ["exists", "stored"]
    assert bulk.get(bucket, ["a", "b"])[1] == [b"old-a", b"new-b"]
    # if_absent=False replaces.
    assert bulk.put_results(bucket, {"a": b"newer-a"}, if_absent=False, trailer=trailer).results == ["stored"]
    assert bulk.get(bucket, ["a"])[1] == [b"newer-a"]


def test_duplicate_keys_in_one_put(bulk: Bulk, bucket: str) -> None:
    request = wire.PutRequest(["d", "d"], [2, 2], [xxhash.xxh3_64_intdigest(b) for b in (b"11", b"22")])
    reply = bulk.raw(bucket, "put", wire.encode_put_head(request) + b"1122")
    assert wire.decode_put_response(reply.head, 2).results == ["stored", "exists"]
    assert bulk.get(bucket, ["d"])[1] == [b"11"]


@LAYOUTS
def test_checksum_mismatch_rejects_only_that_block(bulk: Bulk, bucket: str, trailer: bool) -> None:
    blocks = blocks_of(4, 10 * KiB)
    sums = [xxhash.xxh3_64_intdigest(d) for d in blocks.values()]
    sums[2] ^= 1
    result = bulk.put_results(bucket, blocks, xxh3=sums, trailer=trailer)
    assert result.results == ["stored", "stored", "rejected", "stored"]
    assert set(result.errors) == {2} and "XXH3" in result.errors[2]
    head, payloads = bulk.get(bucket, list(blocks))
    assert head.sizes[2] == wire.ABSENT
    expected = list(blocks.values())
    assert payloads[:2] + payloads[3:] == expected[:2] + expected[3:]


@LAYOUTS
def test_runs_of_small_blocks_with_skipped_empty_and_bad_ones_land_exactly(bulk: Bulk, bucket: str,
                                                                           trailer: bool) -> None:
    """Small blocks are read in runs with one wait each (bulk/put.py): a run that mixes empty blocks, blocks
    that already exist (skipped) and blocks failing their checksum must still put every byte where it
    belongs."""
    sizes = [64 * KiB] * 40 + [0, 64 * KiB, 0, 3000, 1 << 20, 2 * (1 << 20) + 5, 64 * KiB] + [64 * KiB] * 30
    blocks = {f"run/{i:03d}-{secrets.token_hex(3)}": os.urandom(size) for i, size in enumerate(sizes)}
    keys = list(blocks)
    existing = {keys[i]: blocks[keys[i]] for i in (3, 17, 44, 60)}
    assert bulk.put_results(bucket, existing).results == ["stored"] * 4
    sums = [xxhash.xxh3_64_intdigest(d) for d in blocks.values()]
    for bad in (5, 18, 45, 70):
        sums[bad] ^= 1
    result = bulk.put_results(bucket, blocks, xxh3=sums, trailer=trailer)
    expected = ["exists" if k in existing else "rejected" if i in (5, 18, 45, 70) else "stored"
                for i, k in enumerate(keys)]
    assert result.results == expected
    head, payloads = bulk.get(bucket, keys)
    for i, key in enumerate(keys):
        if expected[i] == "rejected":
            assert head.sizes[i] == wire.ABSENT and payloads[i] is None
        else:
            assert payloads[i] == blocks[key], key


@LAYOUTS
def test_truncated_body_stores_nothing(bulk: Bulk, bucket: str, server: Node, trailer: bool) -> None:
    blocks = blocks_of(3, 256 * KiB)
    body = put_frame(blocks, trailer=trailer)
    path = wire.path(bucket, "put")
    headers = signed_headers(bulk.host, path, body)
    lines = [f"POST {path} HTTP/1.1", f"Host: {bulk.host}", f"Content-Length: {len(body)}",
             *(f"{k}: {v}" for k, v in headers.items())]
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + body[: len(body) - 1000])
        time.sleep(0.2)
    # Give the server a moment to see the disconnect; nothing may ever appear.
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        assert bulk.lookup(bucket, list(blocks)).sizes == [wire.ABSENT] * 3
        time.sleep(0.1)


@LAYOUTS
def test_body_shorter_or_longer_than_its_frame(bulk: Bulk, bucket: str, trailer: bool) -> None:
    blocks = blocks_of(2, 1000)
    frame = put_frame(blocks, trailer=trailer)
    short = bulk.raw(bucket, "put", frame[:-10])
    assert (short.status, short.error) == (400, "IncompleteBody")
    long = bulk.raw(bucket, "put", frame + b"extra")
    assert (long.status, long.error) == (400, "MalformedFrame")
    # Chunked transfer encoding (no Content-Length to compare with): found at the end of the body.
    for body, code in [(frame[:-10], "IncompleteBody"), (frame + b"extra", "MalformedFrame")]:
        reply = bulk.raw(bucket, "put", body, chunked=True)
        assert reply.error == code
    assert bulk.lookup(bucket, list(blocks)).sizes == [wire.ABSENT] * 2


@pytest.mark.parametrize("op", wire.OPS)
def test_malformed_frames_get_400_and_change_nothing(bulk: Bulk, bucket: str, op: str) -> None:
    garbage = [b"", b"\x00\x00", b"\x00\x00\x00\x05\xc1\xc1\xc1\xc1\xc1", b"\xff\xff\xff\xff" + b"x" * 10,
               wire.HEAD_LEN.pack(3) + b"\x93\x01\x02\x03", wire.pack_head({"keys": "not-a-list"}),
               os.urandom(64)]
    if op == "put":
        garbage.append(wire.pack_head({"keys": ["a"], "sizes": "x", "xxh3": [0]}))
    for body in garbage:
        reply = bulk.raw(bucket, op, body)
        assert reply.status == 400, (op, body, reply.body)
        assert reply.error in ("MalformedFrame", "IncompleteBody"), (op, body, reply.head)
    reply = bulk.raw(bucket, op, wire.pack_head({"keys": ["k"]}) + b"trailing")
    assert (reply.status, reply.error) == (400, "MalformedFrame")


def test_bad_values_get_invalid_argument(bulk: Bulk, bucket: str) -> None:
    reply = bulk.raw(bucket, "put", wire.pack_head({"keys": [""], "sizes": [0], "xxh3": [0]}))
    assert reply.error == "InvalidArgument"
    reply = bulk.raw(bucket, "touch", wire.pack_head({"keys": ["a"], "ttl": 0}))
    assert reply.error == "InvalidArgument"
    reply = bulk.raw(bucket, "pin", wire.pack_head({"keys": ["a"], "seconds": 0}))
    assert reply.error == "InvalidArgument"


def test_lookup_prefix_stops_at_the_first_hole(bulk: Bulk, bucket: str) -> None:
    chain = [f"chain/{i}" for i in range(8)]
    bulk.put_results(bucket, {k: f"block {k}".encode() for i, k in enumerate(chain) if i != 5})
    result = bulk.lookup(bucket, chain)
    assert result.prefix == 5
    assert result.sizes[5] == wire.ABSENT and all(s > 0 for i, s in enumerate(result.sizes) if i != 5)
    assert bulk.lookup(bucket, ["absent", *chain]).prefix == 0
    assert bulk.lookup(bucket, chain[:5]).prefix == 5
    assert bulk.lookup(bucket, []).prefix == 0
    assert result.tiers is None  # no flash tier: every present block is in RAM, the answer does not say it


def test_touch_extends_expires_and_never_shortens(bulk: Bulk, bucket: str) -> None:
    bulk.put_results(bucket, {"t/1": b"x", "t/2": b"y"}, ttl=60)
    before = bulk.get(bucket, ["t/1"])[0].expires[0]
    assert bulk.count(bucket, "touch", ["t/1", "t/2", "t/absent"], ttl=3600) == 2
    after = bulk.get(bucket, ["t/1", "t/2"])[0].expires
    assert all(e > before + 3000 for e in after)
    assert bulk.count(bucket, "touch", ["t/1"], ttl=None) == 1  # own TTL class (60 s): does not shorten
    assert bulk.get(bucket, ["t/1"])[0].expires[0] == pytest.approx(after[0], abs=1)


def test_delete_counts_live_keys(bulk: Bulk, bucket: str) -> None:
    bulk.put_results(bucket, {"del/1": b"1", "del/2": b"2", "keep": b"3"})
    assert bulk.count(bucket, "delete", ["del/1", "del/2", "del/absent"]) == 2
    assert bulk.lookup(bucket, ["del/1", "del/2", "keep"]).sizes == [wire.ABSENT, wire.ABSENT, 1]
    assert bulk.count(bucket, "delete", ["del/1"]) == 0


def test_pin_and_unpin_count(bulk: Bulk, bucket: str) -> None:
    bulk.put_results(bucket, {"p/1": b"1", "p/2": b"2"})
    assert bulk.count(bucket, "pin", ["p/1", "p/2", "p/absent"], seconds=30) == 2
    assert bulk.count(bucket, "unpin", ["p/1", "p/absent"]) == 1


# ======================================================================================== limits and budget


def test_over_limits_fail_and_store_nothing(small: InProcessNode, small_bucket: str) -> None:
    bulk = Bulk(small)
    too_many = blocks_of(9, 10)
    reply = bulk.put(small_bucket, too_many)
    assert (reply.status, reply.error) == (400, "TooManyKeys")
    reply = bulk.keys_op(small_bucket, "get", list(too_many))
    assert (reply.status, reply.error) == (400, "TooManyKeys")
    too_big = blocks_of(5, 64 * KiB)  # 320 KiB > 256 KiB
    reply = bulk.put(small_bucket, too_big)
    assert (reply.status, reply.error) == (413, "TooManyBytes")
    assert reply.headers.get("connection") != "close"  # a small unread body is drained: keep-alive
    one_huge = {"huge": os.urandom(300 * KiB)}
    assert bulk.put(small_bucket, one_huge).error == "TooManyBytes"
    assert bulk.lookup(small_bucket, list(too_big)).sizes == [wire.ABSENT] * 5
    assert bulk.lookup(small_bucket, list(too_many)[:8]).prefix == 0
    # At the limits exactly: accepted.
    assert bulk.put_results(small_bucket, blocks_of(4, 64 * KiB)).results == ["stored"] * 4
    assert bulk.put_results(small_bucket, blocks_of(8, 10)).results == ["stored"] * 8


def send_partial(node: Node, path: str, content_length: int, data: bytes) -> tuple[int, str | None, str]:
    """Announce ``content_length`` body bytes, send only ``data``, and read the answer while the rest is
    still owed: (status, Connection header, error code)."""
    host = f"127.0.0.1:{node.port}"
    lines = [f"POST {path} HTTP/1.1", f"Host: {host}", f"Content-Length: {content_length}",
             *(f"{k}: {v}" for k, v in signed_headers(host, path, b"").items())]
    with socket.create_connection(("127.0.0.1", node.port), timeout=5) as sock:
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + data)
        resp = http.client.HTTPResponse(sock)
        resp.begin()
        body = resp.read()
    return resp.status, resp.getheader("connection"), wire.decode_error(wire.unpack_head(body, wire.ANY_HEAD)[0]).error


def test_bad_puts_are_answered_before_their_payloads_are_sent(small_real: tuple[Node, str]) -> None:
    small, small_bucket = small_real
    path = wire.path(small_bucket, "put")
    # The head announces 8 MiB of payloads (over the 256 KiB limit) that never come: the answer must not wait.
    head = wire.encode_put_head(wire.PutRequest(["a", "b"], [4 << 20, 4 << 20], [0, 0]))
    assert send_partial(small, path, len(head) + (8 << 20), head) == (413, "close", "TooManyBytes")
    # A Content-Length no put under the limits can have: refused before a byte is read.
    assert send_partial(small, path, 100 << 20, b"") == (413, "close", "TooManyBytes")
    # A Content-Length that ends inside the head it announces.
    assert send_partial(small, path, 6, head[:6])[2] == "IncompleteBody"
    # A Content-Length that disagrees with the head's payload sizes.
    small_head = wire.encode_put_head(wire.PutRequest(["a"], [1000], [0]))
    assert send_partial(small, path, len(small_head) + 10, small_head)[2] == "IncompleteBody"


def test_pinned_blocks_survive_eviction_and_a_full_pinned_budget_says_slow_down(small: InProcessNode,
                                                                                small_bucket: str) -> None:
    bulk = Bulk(small)
    pinned = blocks_of(4, 64 * KiB, "pinned")
    bulk.put_results(small_bucket, pinned)
    assert bulk.lookup(small_bucket, list(pinned), pin=60).prefix == 4  # lookup pins what it found
    early = blocks_of(4, 64 * KiB, "early")
    bulk.put_results(small_bucket, early)
    for _ in range(6):  # 24 × 64 KiB through a 1 MiB budget: everything unpinned is evicted at least once
        assert bulk.put_results(small_bucket, blocks_of(4, 64 * KiB, "fill")).results == ["stored"] * 4
    head, payloads = bulk.get(small_bucket, list(pinned))
    assert payloads == list(pinned.values())
    assert bulk.lookup(small_bucket, list(early)).sizes == [wire.ABSENT] * 4

    # Pin 14 of the ~15 blocks the budget holds: a put that cannot make room gets 503 SlowDown + Retry-After
    # and stores nothing.
    filler = [blocks_of(n, 64 * KiB, "full") for n in (4, 4, 2)]
    for group in filler:
        bulk.put_results(small_bucket, group)
        bulk.count(small_bucket, "pin", list(group), seconds=60)
    refused = blocks_of(4, 64 * KiB, "refused")
    reply = bulk.put(small_bucket, refused)
    assert (reply.status, reply.error) == (503, "SlowDown")
    assert int(reply.headers["retry-after"]) >= 1
    assert bulk.lookup(small_bucket, list(refused)).sizes == [wire.ABSENT] * 4
    # Unpinned, the budget makes room again.
    for group in [pinned, *filler]:
        bulk.count(small_bucket, "unpin", list(group))
    assert bulk.put_results(small_bucket, refused).results == ["stored"] * 4


# ========================================================================================= auth and tenants


def test_tenant_isolation(inprocess: InProcessNode, bucket: str, bulk: Bulk) -> None:
    bulk.put_results(bucket, {"secret": b"mine"})
    other = Bulk(inprocess, OTHER_ACCESS_KEY, OTHER_SECRET_KEY)
    for op in wire.OPS:
        body = (put_frame({"x": b"x"}) if op == "put"
                else wire.encode_keys_request(op, wire.KeysRequest(["secret"], seconds=1)))
        reply = other.raw(bucket, op, body)
        assert (reply.status, reply.error) == (403, "AccessDenied"), op
    reply = other.keys_op("no-such-bucket-" + secrets.token_hex(4), "get", ["secret"])
    assert (reply.status, reply.error) == (404, "NoSuchBucket")
    assert bulk.get(bucket, ["secret", "x"])[1] == [b"mine", None]


def test_sigv4_errors_get_403_error_frames(bulk: Bulk, bucket: str, inprocess: InProcessNode) -> None:
    body = wire.encode_keys_request("lookup", wire.KeysRequest(["k"]))
    bad = Bulk(inprocess, ACCESS_KEY, SECRET_KEY + "x").raw(bucket, "lookup", body)
    assert (bad.status, bad.error) == (403, "SignatureDoesNotMatch")
    assert bad.headers["content-type"] == "application/vnd.msgpack"
    unknown = Bulk(inprocess, "CTXUNKNOWNKEY0000000", SECRET_KEY).raw(bucket, "lookup", body)
    assert (unknown.status, unknown.error) == (403, "InvalidAccessKeyId")
    unsigned = bulk.raw(bucket, "lookup", body, sign=False)
    assert (unsigned.status, unsigned.error) == (403, "AccessDenied")
    # Signed for one body, sent with another: the signature covers the path, so a changed op fails too.
    headers = {**signed_headers(bulk.host, wire.path(bucket, "lookup"), body), "Content-Length": str(len(body))}
    resp = raw_request(inprocess, "POST", wire.path(bucket, "delete"), headers, body)
    error = wire.decode_error(wire.unpack_head(resp.body, wire.ANY_HEAD)[0])
    assert (resp.status, error.error) == (403, "SignatureDoesNotMatch")


def test_payload_modes(bulk: Bulk, bucket: str) -> None:
    data = b"sha256-signed block"
    body = put_frame({"s": data})
    good = bulk.raw(bucket, "put", body, payload_hash=hashlib.sha256(body).hexdigest())
    assert wire.decode_put_response(good.head, 1).results == ["stored"]
    body2 = put_frame({"s2": data})
    tampered = bulk.raw(bucket, "put", body2[:-1] + b"X", payload_hash=hashlib.sha256(body2).hexdigest())
    assert (tampered.status, tampered.error) == (400, "InvalidArgument")
    assert bulk.lookup(bucket, ["s", "s2"]).sizes == [len(data), wire.ABSENT]
    lookup = wire.encode_keys_request("lookup", wire.KeysRequest(["s"]))
    assert bulk.raw(bucket, "lookup", lookup, payload_hash=hashlib.sha256(lookup).hexdigest()).status == 200
    mismatch = bulk.raw(bucket, "lookup", lookup, payload_hash=hashlib.sha256(b"x").hexdigest())
    assert mismatch.error == "InvalidArgument"
    streaming = bulk.raw(bucket, "put", body, payload_hash="STREAMING-UNSIGNED-PAYLOAD-TRAILER")
    assert (streaming.status, streaming.error) == (400, "InvalidArgument")


def test_unknown_op_and_wrong_method(bulk: Bulk, bucket: str) -> None:
    body = wire.encode_keys_request("get", wire.KeysRequest(["k"]))
    reply = bulk.raw(bucket, "frobnicate", body)
    assert (reply.status, reply.error) == (404, "NoSuchOperation")
    reply = bulk.raw(f"{bucket}/extra", "get", body)
    assert (reply.status, reply.error) == (404, "NoSuchOperation")
    reply = bulk.raw(bucket, "get", b"", method="GET")
    assert (reply.status, reply.error) == (405, "MethodNotAllowed")
    assert reply.headers["allow"] == "POST"


# ============================================================================================ S3 interop


def test_bulk_written_blocks_are_s3_objects_and_vice_versa(bulk: Bulk, bucket: str, s3: Any) -> None:
    data = os.urandom(100 * KiB)
    bulk.put_results(bucket, {"from-bulk": data}, ttl=300)
    obj = s3.get_object(Bucket=bucket, Key="from-bulk")
    assert obj["Body"].read() == data
    etag = obj["ETag"].strip('"')
    assert etag == f"{xxhash.xxh3_64_intdigest(data):016x}" and etag != hashlib.md5(data).hexdigest()
    headers = obj["ResponseMetadata"]["HTTPHeaders"]
    assert headers["x-ctx-xxh3"] == f"{xxhash.xxh3_64_intdigest(data):016x}"

    s3_data = os.urandom(70 * KiB)
    s3.put_object(Bucket=bucket, Key="from-s3", Body=s3_data)
    head, payloads = bulk.get(bucket, ["from-s3", "from-bulk"])
    assert payloads == [s3_data, data]
    assert head.xxh3[0] == xxhash.xxh3_64_intdigest(s3_data)
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket)["Contents"]]
    assert keys == ["from-bulk", "from-s3"]


# ============================================================================================ in process


def make_app(**settings: Any) -> tuple[App, str]:
    tenants = TenantRegistry()
    tenants.add("default", ACCESS_KEY, SECRET_KEY)
    app = App(Settings(**settings), tenants)
    app.engine.create_bucket("default", "inproc")
    return app, "inproc"


async def call_app(app: App, op: str, body: bytes, *, split: int = 8, stall: bool = False,
                   disconnect: bool = False) -> list[dict[str, Any]]:
    """One bulk request through the ASGI app, its body in two messages cut at ``split``; returns the messages
    the app sent. ``stall``: the second message never comes; ``disconnect``: the client goes away instead."""
    path = wire.path("inproc", op)
    headers = signed_headers("testserver", path, body)
    scope = {
        "type": "http", "method": "POST", "path": path, "raw_path": path.encode(), "query_string": b"",
        "headers": [(b"host", b"testserver"), (b"content-length", str(len(body)).encode()),
                    *((k.lower().encode(), v.encode()) for k, v in headers.items())],
    }
    pending: list[dict[str, Any]] = [{"type": "http.request", "body": body[:split], "more_body": True}]
    if disconnect:
        pending.append({"type": "http.disconnect"})
    elif not stall:
        pending.append({"type": "http.request", "body": body[split:], "more_body": False})
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if pending:
            return pending.pop(0)
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    return sent


def test_get_sends_the_stored_buffers_without_copying_and_counts_stats() -> None:
    app, bucket = make_app()
    blocks = {f"k{i}": os.urandom(1000 + i) for i in range(3)}
    sent = asyncio.run(call_app(app, "put", put_frame(blocks)))
    assert sent[0]["status"] == 200
    stored = [app.engine.store.get("default", bucket, k, record=False) for k in blocks]
    sent = asyncio.run(call_app(app, "get", wire.encode_keys_request("get", wire.KeysRequest(
        ["k0", "absent", "k1", "k2"]))))
    start, frame, *payloads = sent
    length = int(dict(start["headers"])[b"content-length"])
    assert length == len(frame["body"]) + sum(len(d) for d in blocks.values())
    assert [m["body"] for m in payloads] == [o.data for o in stored]
    assert all(m["body"] is o.data for m, o in zip(payloads, stored, strict=True))  # the stored buffer itself
    assert [m["more_body"] for m in [frame, *payloads]] == [True, True, True, False]
    stats = app.engine.operator.stats()["buckets"][bucket]
    assert (stats["hits"], stats["misses"]) == (3, 1)
    assert stats["bytes_out"] == sum(len(d) for d in blocks.values())
    assert stats["puts"] == 3


def test_a_stalled_put_body_times_out_and_stores_nothing() -> None:
    app, bucket = make_app(body_timeout=0.2)
    sent = asyncio.run(call_app(app, "put", put_frame({"slow": b"x" * 100}), stall=True))
    assert sent[0]["status"] == 408
    assert wire.decode_error(wire.unpack_head(sent[1]["body"], wire.ANY_HEAD)[0]).error == "RequestTimeout"
    assert app.engine.budget.reserved == 0 and app.engine.budget.used == app.engine.budget.state  # the bucket's record


def test_a_client_gone_mid_put_leaves_nothing_reserved_or_stored() -> None:
    app, bucket = make_app()
    body = put_frame({"a": b"x" * 5000, "b": b"y" * 5000})
    for split in (2, 20, 6000, len(body) - 1):  # in the length prefix, the head, a payload, the last byte
        sent = asyncio.run(call_app(app, "put", body, split=split, disconnect=True))
        assert sent == []  # nobody to answer
        assert (app.engine.budget.used - app.engine.budget.state, app.engine.budget.reserved) == (0, 0)
    assert app.engine.store.lookup("default", bucket, ["a", "b"]) == [None, None]


def test_lookup_and_get_pin_every_present_block() -> None:
    app, bucket = make_app()
    asyncio.run(call_app(app, "put", put_frame({"c/0": b"0", "c/2": b"2", "c/3": b"3"})))
    now = time.time()
    sent = asyncio.run(call_app(app, "lookup", wire.encode_keys_request(
        "lookup", wire.KeysRequest(["c/0", "c/1", "c/2"], pin=30))))
    answer = wire.decode_lookup_response(wire.unpack_head(sent[1]["body"], wire.ANY_HEAD)[0], 3)
    assert answer == wire.LookupResponse(1, [1, wire.ABSENT, 1], None)  # no flash tier: no tiers field
    pins = {k: app.engine.store.get("default", bucket, k, record=False).pinned_until for k in ("c/0", "c/2", "c/3")}
    assert now + 29 < pins["c/0"] < now + 31 and now + 29 < pins["c/2"] < now + 31  # beyond the prefix too
    assert pins["c/3"] == 0.0  # not asked for
    asyncio.run(call_app(app, "get", wire.encode_keys_request("get", wire.KeysRequest(["c/3"], pin=1e9))))
    pinned_until = app.engine.store.get("default", bucket, "c/3", record=False).pinned_until
    assert pinned_until == pytest.approx(time.time() + app.node.settings.max_pin, abs=5)  # capped by --max-pin
