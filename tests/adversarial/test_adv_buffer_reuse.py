"""A node reuses the buffer of a block that died for the next block of its size (engine/buffers.py). Checked
from the outside, on a real node: an answer still being sent when its block is deleted and the same size is
written over and over delivers the old bytes intact, and every new block reads back as written."""

from __future__ import annotations

import os
import random
import secrets
import socket
import time
from collections.abc import Iterator

import pytest
import xxhash
from support.nodes import Node
from support.probes import Admin, MiB, start_probed_node
from support.raw import UNSIGNED, RawClient, sign

SIZE = 1 * MiB


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    node = start_probed_node(tmp_path_factory.mktemp("adv-reuse"), "--memory", "256MiB")
    yield node
    node.stop()


def slow_reader(port: int, request: bytes) -> socket.socket:
    """Sends ``request`` and reads nothing yet: with a tiny receive buffer most of the answer stays with the
    node, referring to the block's buffer."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(10)
    sock.connect(("127.0.0.1", port))
    sock.sendall(request)
    return sock


def read_answer(sock: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, "closed inside the head"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 200"), head[:200]
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    while len(body) < length:
        chunk = sock.recv(1 << 20)
        assert chunk, "closed inside the body"
        body += chunk
    sock.close()
    return body[:length]


@pytest.mark.parametrize("size", [64 << 10, SIZE], ids=["64KiB", "1MiB"])
def test_an_answer_in_flight_keeps_its_bytes_while_its_size_is_rewritten(node: Node, size: int) -> None:
    # S3 PUT bodies of 64 KiB and more land in reused buffers, as bulk blocks do.
    bucket = "reuse-" + secrets.token_hex(4)
    old = os.urandom(size)
    reuses = Admin(node).stats()["buffer_reuses"]
    with RawClient(node.port, timeout=30) as raw:
        assert raw.s3("PUT", f"/{bucket}").status == 200
        assert raw.s3("PUT", f"/{bucket}/obj", old, payload_hash=UNSIGNED).status == 200
        target = f"/{bucket}/obj"
        readers = [slow_reader(node.port, raw.head_bytes("GET", target, sign(raw.endpoint, "GET", target).headers))
                   for _ in range(3)]
        time.sleep(0.2)  # the answers have started: each holds a view of the block's buffer
        assert raw.s3("DELETE", target).status == 204
        written = {}
        for i in range(40):  # the same size, again and again: the freed buffers are reused for these
            data = os.urandom(size)
            written[f"new{i}"] = data
            assert raw.s3("PUT", f"/{bucket}/new{i}", data, payload_hash=UNSIGNED).status == 200
            if i % 2:
                assert raw.s3("DELETE", f"/{bucket}/new{i}").status == 204
                del written[f"new{i}"]
        assert Admin(node).stats()["buffer_reuses"] > reuses  # the new blocks did reuse freed buffers
        for sock in readers:
            assert xxhash.xxh3_128_hexdigest(read_answer(sock)) == xxhash.xxh3_128_hexdigest(old)
        for key, data in written.items():
            reply = raw.s3("GET", f"/{bucket}/{key}")
            assert reply.status == 200 and reply.body == data, key


@pytest.fixture(scope="module")
def full_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    node = start_probed_node(tmp_path_factory.mktemp("adv-reuse-full"), "--memory", "16MiB")
    yield node
    node.stop()


def test_mixed_sizes_on_a_full_node_never_fail_or_mix_up_blocks(full_node: Node) -> None:
    """Regression: on a full node, writes and deletes of many sizes (kept buffers taken, dropped for room)
    answered 500 InternalError once a size's kept buffers had been taken to the last (found by
    benchmarks/rss_mixed_load.py). Every write must succeed (or be refused with 503) and every read give the
    last bytes written to its key, or 404."""
    rng = random.Random(7)
    bucket = "mixed-" + secrets.token_hex(4)
    latest: dict[str, bytes] = {}
    with RawClient(full_node.port, timeout=30) as raw:
        assert raw.s3("PUT", f"/{bucket}").status == 200
        for i in range(600):
            key = f"k{rng.randrange(200)}"  # ~40 MiB of keys: the node evicts all the time
            roll = rng.random()
            if roll < 0.15:  # deletes leave room in the budget: freed buffers are kept, and charged
                assert raw.s3("DELETE", f"/{bucket}/{key}").status == 204
                latest.pop(key, None)
            elif roll < 0.7:
                data = os.urandom(int(2 ** rng.uniform(10, 20.5)))
                status = raw.s3("PUT", f"/{bucket}/{key}", data, payload_hash=UNSIGNED).status
                assert status in (200, 503), (i, status)
                if status == 200:
                    latest[key] = data
            else:
                reply = raw.s3("GET", f"/{bucket}/{key}")
                assert reply.status in (200, 404), (i, reply.status)
                if reply.status == 200:
                    assert reply.body == latest[key], key
