"""The fault proxy itself (``support.faultproxy``): each action does exactly what it says, at the position it
says, on the connections and messages it says, and the proxy stays bounded. Driven through a real node."""

from __future__ import annotations

import base64
import hashlib
import os
import socket
from collections.abc import Iterator

import pytest
from support.faultproxy import FaultProxy, Rule, extra, flip, garbage, hang, truncate
from support.nodes import Node
from support.probes import start_probed_node, wait_until
from support.raw import RawClient, sign

PAYLOAD = os.urandom(100_000)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    started = start_probed_node(tmp_path_factory.mktemp("adv-proxy"), "--memory", "64MiB")
    with RawClient(started.port) as raw:
        assert raw.s3("PUT", "/proxy").status == 200
        assert raw.s3("PUT", "/proxy/obj", PAYLOAD).status == 200
    yield started
    started.stop()


def get_through(proxy: FaultProxy, *, timeout: float = 5.0) -> tuple[bytes, bytes, bool]:
    """GET /proxy/obj through the proxy on a fresh connection: (head, body bytes received, closed by peer)."""
    sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=timeout)
    raw = RawClient(proxy.port)
    headers = sign(raw.endpoint, "GET", "/proxy/obj").headers
    sock.sendall(raw.head_bytes("GET", "/proxy/obj", headers))
    data = b""
    closed = False
    try:
        while True:
            chunk = sock.recv(1 << 20)
            if not chunk:
                closed = True
                break
            data += chunk
            head, _, body = data.partition(b"\r\n\r\n")
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), None)
            if length is not None and len(body) >= length:
                sock.settimeout(0.2)
    except TimeoutError:
        pass
    finally:
        sock.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return head, body, closed


def test_passes_answers_through_untouched(node: Node) -> None:
    with FaultProxy(("127.0.0.1", node.port)) as proxy:
        head, body, _ = get_through(proxy)
    assert head.startswith(b"HTTP/1.1 200") and body == PAYLOAD


def test_flip_changes_exactly_the_chosen_bit(node: Node) -> None:
    with FaultProxy(("127.0.0.1", node.port), [flip("body", offset=1234, bit=3)]) as proxy:
        _, body, _ = get_through(proxy)
        faults = proxy.faults_applied("flip")
    assert len(body) == len(PAYLOAD)
    diff = [i for i in range(len(body)) if body[i] != PAYLOAD[i]]
    assert diff == [1234] and body[1234] ^ PAYLOAD[1234] == 0x08
    assert len(faults) == 1 and faults[0].bit == 3


def test_seeded_flips_replay_exactly(node: Node) -> None:
    bodies = []
    for _ in range(2):
        with FaultProxy(("127.0.0.1", node.port), [flip("body", count=5)], seed=42) as proxy:
            bodies.append(get_through(proxy)[1])
    assert bodies[0] == bodies[1] != PAYLOAD
    assert sum(a != b for a, b in zip(bodies[0], PAYLOAD)) in range(1, 6)


def test_extra_bytes_counted_in_content_length(node: Node) -> None:
    with FaultProxy(("127.0.0.1", node.port), [extra(b"XYZ")]) as proxy:
        head, body, _ = get_through(proxy)
    assert f"content-length: {len(PAYLOAD) + 3}".encode() in head.lower()
    assert body == PAYLOAD + b"XYZ"


def test_truncate_forwards_up_to_the_offset_then_closes(node: Node) -> None:
    with FaultProxy(("127.0.0.1", node.port), [truncate("body", offset=5000)]) as proxy:
        _, body, closed = get_through(proxy)
    assert body == PAYLOAD[:5000] and closed


def test_hang_forwards_up_to_the_offset_then_nothing(node: Node) -> None:
    with FaultProxy(("127.0.0.1", node.port), [hang("body", offset=777)], hang_timeout=2) as proxy:
        _, body, closed = get_through(proxy, timeout=1.0)
    assert body == PAYLOAD[:777] and not closed


def test_garbage_replaces_the_answer(node: Node) -> None:
    with FaultProxy(("127.0.0.1", node.port), [garbage(b"NOT HTTP AT ALL")]) as proxy:
        sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
        raw = RawClient(proxy.port)
        sock.sendall(raw.head_bytes("GET", "/proxy/obj", sign(raw.endpoint, "GET", "/proxy/obj").headers))
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
        sock.close()
    assert data == b"NOT HTTP AT ALL"


def test_rules_select_connections_and_messages(node: Node) -> None:
    rules = [Rule("flip", "body", offset=0, bit=0, connections={1}, messages={1})]
    with FaultProxy(("127.0.0.1", node.port), rules) as proxy:
        assert get_through(proxy)[1] == PAYLOAD  # connection 0: untouched
        with RawClient(proxy.port) as raw:  # connection 1: its second answer only
            assert raw.s3("GET", "/proxy/obj").body == PAYLOAD
            second = raw.s3("GET", "/proxy/obj").body
            assert second != PAYLOAD and second[1:] == PAYLOAD[1:]
            assert raw.s3("GET", "/proxy/obj").body == PAYLOAD


def test_request_direction_faults_reach_the_node(node: Node) -> None:
    """A flipped bit in an upload's body: the node's MD5 check sees it (BadDigest), nothing is stored."""
    data = os.urandom(10_000)
    md5 = base64.b64encode(hashlib.md5(data).digest()).decode()
    rule = flip("body", offset=10, direction="request", path="/proxy/up")
    with FaultProxy(("127.0.0.1", node.port), [rule]) as proxy, RawClient(proxy.port) as raw:
        reply = raw.s3("PUT", "/proxy/up", data, headers={"Content-MD5": md5}, payload_hash="UNSIGNED-PAYLOAD")
    assert (reply.status, reply.code) == (400, "BadDigest")
    with RawClient(node.port) as raw:
        assert raw.s3("HEAD", "/proxy/up").status == 404


def test_connections_are_bounded(node: Node) -> None:
    with FaultProxy(("127.0.0.1", node.port), max_connections=2) as proxy:
        held = [socket.create_connection(("127.0.0.1", proxy.port), timeout=5) for _ in range(2)]
        try:
            assert wait_until(lambda: proxy.open_connections == 2, timeout=5)
            extra_sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
            try:
                assert extra_sock.recv(1) == b""  # closed at once: over the bound
            finally:
                extra_sock.close()
            assert proxy.refused >= 1
        finally:
            for sock in held:
                sock.close()
