"""The bulk data path below ASGI (server/protocol/direct.py) on a real node, over raw sockets: a put's body read
by the kernel into the block buffers then the connection handed back to the HTTP parser (keep-alive and
pipelined requests right after a body), an answer given in the middle of a detached body (the rest read away,
or the connection closed), Expect: 100-continue, a stalled or abandoned body (nothing stored, nothing left
reserved), and a get's head and payloads written at once, to a client that reads slowly."""

from __future__ import annotations

import os
import secrets
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import xxhash
from support.nodes import Node, make_client
from support.probes import Admin, start_probed_node, tracebacks, wait_until
from support.raw import UNSIGNED, RawConn, RawResponse, sign

from ctxstore import wire

KiB, MiB = 1 << 10, 1 << 20


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    started = start_probed_node(tmp_path_factory.mktemp("direct"), "--memory", "64MiB", "--body-timeout", "1")
    yield started
    started.stop()


@pytest.fixture
def bucket(node: Node) -> str:
    name = "direct-" + secrets.token_hex(5)
    make_client(node.endpoint).create_bucket(Bucket=name)
    return name


def put_body(blocks: dict[str, bytes], *, ttl: float | None = None) -> bytes:
    sums = [xxhash.xxh3_64_intdigest(d) for d in blocks.values()]
    head = wire.encode_put_head(wire.PutRequest(list(blocks), [len(d) for d in blocks.values()], sums, ttl))
    return head + b"".join(blocks.values())


def request_bytes(node: Node, bucket: str, op: str, body: bytes, extra: dict[str, str] | None = None) -> bytes:
    """One whole signed bulk request, as it goes on the wire."""
    path = wire.path(bucket, op)
    headers = sign(node, "POST", path, payload_hash=UNSIGNED,
                   headers={"Content-Length": str(len(body)), **(extra or {})}).headers
    lines = [f"POST {path} HTTP/1.1", f"Host: 127.0.0.1:{node.port}", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def keys_body(op: str, keys: list[str]) -> bytes:
    return wire.encode_keys_request(op, wire.KeysRequest(keys))


def get_payloads(reply: RawResponse, n: int) -> list[bytes | None]:
    head, end = wire.unpack_head(reply.body, wire.ANY_HEAD)
    sizes = wire.decode_get_head(head, n).sizes
    out: list[bytes | None] = []
    for size in sizes:
        out.append(None if size == wire.ABSENT else reply.body[end:end + size])
        end += 0 if size == wire.ABSENT else size
    assert end == len(reply.body)
    return out


def blocks_of(sizes: list[int]) -> dict[str, bytes]:
    return {f"k/{i:03d}-{secrets.token_hex(3)}": os.urandom(size) for i, size in enumerate(sizes)}


def test_many_puts_and_gets_on_one_keep_alive_connection(node: Node, bucket: str) -> None:
    # Each put's body is read below the parser; the next request on the connection must parse as before.
    with RawConn(node) as conn:
        for sizes in ([0, 1, 7], [64 * KiB] * 20, [MiB + 1, 3, 300 * KiB], [2 * MiB]):
            blocks = blocks_of(sizes)
            conn.send(request_bytes(node, bucket, "put", put_body(blocks)))
            reply = conn.read_response()
            assert reply.status == 200 and reply.headers.get("connection") != "close"
            assert wire.decode_put_response(wire.unpack_head(reply.body, wire.ANY_HEAD)[0],
                                            len(blocks)).results == ["stored"] * len(blocks)
            conn.send(request_bytes(node, bucket, "get", keys_body("get", list(blocks))))
            assert get_payloads(conn.read_response(), len(blocks)) == list(blocks.values())


def test_pipelined_requests_behind_a_put_body_are_answered_in_order(node: Node, bucket: str) -> None:
    first, second = blocks_of([200 * KiB, 5, 64 * KiB]), blocks_of([MiB, 1])
    wire_bytes = (request_bytes(node, bucket, "put", put_body(first))
                  + request_bytes(node, bucket, "put", put_body(second))
                  + request_bytes(node, bucket, "get", keys_body("get", [*first, *second])))
    with RawConn(node) as conn:
        conn.send(wire_bytes)  # all three before reading any answer
        answers = [conn.read_response() for _ in range(3)]
    assert [a.status for a in answers] == [200, 200, 200]
    assert get_payloads(answers[2], 5) == [*first.values(), *second.values()]


def test_expect_100_continue_then_a_detached_body(node: Node, bucket: str) -> None:
    blocks = blocks_of([512 * KiB, 64 * KiB])
    body = put_body(blocks)
    path = wire.path(bucket, "put")
    headers = sign(node, "POST", path, payload_hash=UNSIGNED,
                   headers={"Content-Length": str(len(body)), "Expect": "100-continue"}).headers
    with RawConn(node) as conn:
        reply = conn.request("POST", path, headers, body)
        assert conn.interim == [100]
        assert reply.status == 200
        conn.send(request_bytes(node, bucket, "get", keys_body("get", list(blocks))))
        assert get_payloads(conn.read_response(), 2) == list(blocks.values())


def test_an_answer_in_the_middle_of_a_detached_body_keeps_a_small_remainder_connection(
        tmp_path: Path) -> None:
    # Pins leave room for one 200 KiB block, not two: the second block's reservation fails while its bytes
    # are still owed. The rest (under 1 MiB) is read away and the connection serves the next request.
    small = start_probed_node(tmp_path, "--memory", "1MiB")
    try:
        name = "mid-" + secrets.token_hex(4)
        make_client(small.endpoint).create_bucket(Bucket=name)
        with RawConn(small) as conn:
            pinned = blocks_of([64 * KiB] * 11)
            conn.send(request_bytes(small, name, "put", put_body(pinned)))
            assert conn.read_response().status == 200
            pin = wire.encode_keys_request("pin", wire.KeysRequest(list(pinned), seconds=60))
            conn.send(request_bytes(small, name, "pin", pin))
            assert conn.read_response().status == 200
            refused = blocks_of([200 * KiB, 200 * KiB])
            conn.send(request_bytes(small, name, "put", put_body(refused)))
            reply = conn.read_response()
            assert reply.status == 503 and reply.headers.get("connection") != "close"
            conn.send(request_bytes(small, name, "lookup", keys_body("lookup", [*pinned, *refused])))
            answer = conn.read_response()
            assert answer.status == 200
            sizes = wire.decode_lookup_response(wire.unpack_head(answer.body, wire.ANY_HEAD)[0], 13).sizes
            assert sizes == [64 * KiB] * 11 + [wire.ABSENT] * 2
        assert wait_until(lambda: Admin(small).stats()["reserved"] == 0)
        assert tracebacks(small) == []
    finally:
        small.stop()


def test_a_stalled_detached_body_times_out_and_releases_its_reservation(node: Node, bucket: str) -> None:
    blocks = blocks_of([4 * MiB])
    raw = request_bytes(node, bucket, "put", put_body(blocks))
    with RawConn(node, timeout=10) as conn:
        conn.send(raw[:len(raw) - MiB])  # 3 MiB of the block, then nothing: --body-timeout is 1 s
        started = time.monotonic()  # the last byte
        reply = conn.read_response()
        waited = time.monotonic() - started
        assert reply.status == 408 and reply.headers.get("connection") == "close"
        assert wire.decode_error(wire.unpack_head(reply.body, wire.ANY_HEAD)[0]).error == "RequestTimeout"
        assert conn.closed_by_peer()
    assert 0.9 <= waited < 3, "a stall fails one body timeout after the last byte"
    admin = Admin(node)
    assert wait_until(lambda: admin.stats()["reserved"] == 0)
    assert bucket not in admin.stats()["buckets"] or admin.bucket(bucket)["objects"] == 0


def test_a_trickling_detached_body_is_cut_by_the_minimum_rate(node: Node, bucket: str) -> None:
    # 1 KiB every 0.1 s never stalls for a whole body timeout but stays far below 64 KiB/s.
    raw = request_bytes(node, bucket, "put", put_body(blocks_of([2 * MiB])))
    with RawConn(node, timeout=10) as conn:
        conn.send(raw[:64 * KiB])
        sent = 0
        try:
            while sent < 100:
                conn.send(b"\0" * KiB)
                sent += 1
                time.sleep(0.1)
        except OSError:  # the node closed the connection while we were still sending
            pass
    assert sent < 60, "the node still took a trickling body after 6 body timeouts"
    assert wait_until(lambda: Admin(node).stats()["reserved"] == 0)


def test_a_client_gone_in_the_middle_of_a_detached_body_leaves_nothing(node: Node, bucket: str) -> None:
    blocks = blocks_of([MiB, MiB])
    raw = request_bytes(node, bucket, "put", put_body(blocks))
    with RawConn(node) as conn:
        conn.send(raw[:len(raw) - MiB // 2])
        time.sleep(0.2)
    admin = Admin(node)
    assert wait_until(lambda: admin.stats()["reserved"] == 0)
    with RawConn(node) as conn:
        conn.send(request_bytes(node, bucket, "lookup", keys_body("lookup", list(blocks))))
        reply = conn.read_response()
    assert wire.decode_lookup_response(wire.unpack_head(reply.body, wire.ANY_HEAD)[0], 2).sizes == [wire.ABSENT] * 2
    assert tracebacks(node) == []


def test_a_get_answer_reaches_a_client_that_reads_slowly_intact(node: Node, bucket: str) -> None:
    # Head and 24 MiB of payloads are handed to the transport at once; the transport paces them.
    blocks = blocks_of([MiB] * 24)
    with RawConn(node) as conn:
        conn.send(request_bytes(node, bucket, "put", put_body(blocks)))
        assert conn.read_response().status == 200
    sock = socket.create_connection(("127.0.0.1", node.port), timeout=10)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * KiB)
    try:
        sock.sendall(request_bytes(node, bucket, "get", keys_body("get", list(blocks))))
        received = bytearray()
        while b"\r\n\r\n" not in received:
            received += sock.recv(64 * KiB)
        head, _, rest = bytes(received).partition(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
        body = bytearray(rest)
        while len(body) < length:
            time.sleep(0.001)
            chunk = sock.recv(256 * KiB)
            assert chunk
            body += chunk
    finally:
        sock.close()
    got = get_payloads(RawResponse(200, {}, bytes(body)), len(blocks))
    assert got == list(blocks.values())
