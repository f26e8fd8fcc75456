"""Answers for a connection whose output is closed are dropped quietly and counted, against a real node.

A client that half-closes its side (``shutdown(SHUT_WR)``) right after its request, or whose request is followed
by bytes the parser refuses (the node answers 400 and ends its output with a FIN), used to get its answer
written after the connection's output was gone: ``RuntimeError: Cannot call writelines() after write_eof()``,
one traceback in the node's log per request (45 in 3,000 fuzzed S3 requests). Now such an answer is not written,
``ctxstore_writes_after_close_total`` counts it, the log stays clean and the node serves the next request.
"""

from __future__ import annotations

import hashlib
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.nodes import Node, make_client
from support.probes import (
    log_size,
    log_text,
    metric,
    start_probed_node,
    tracebacks,
    wait_until,
)
from support.raw import sign, signed_request

BUCKET = "half-close"
KEY = "k"
TRIES = 20


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    started = start_probed_node(tmp_path_factory.mktemp("half-close"), "--memory", "64MiB")
    try:
        make_client(started.endpoint).create_bucket(Bucket=BUCKET)
        assert signed_request(started, "PUT", f"/{BUCKET}/{KEY}", b"x" * 100_000).status == 200
        yield started
    finally:
        started.stop()


def writes_after_close(node: Node) -> float:
    return metric(node, "ctxstore_writes_after_close_total")


PUTS_DROPPED = 'ctxstore_requests_total{api="s3",operation="PutObject",status="499"}'


def get_request(node: Node) -> bytes:
    signed = sign(node, "GET", f"/{BUCKET}/{KEY}")
    lines = [f"GET /{BUCKET}/{KEY} HTTP/1.1", f"Host: 127.0.0.1:{node.port}"]
    lines += [f"{name}: {value}" for name, value in signed.headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def exchange(node: Node, data: bytes, *, half_close: bool) -> bytes:
    """Send ``data`` (half-closing after it if told), then read until the node closes; returns what came."""
    with socket.create_connection(("127.0.0.1", node.port), timeout=10) as sock:
        sock.sendall(data)
        if half_close:
            sock.shutdown(socket.SHUT_WR)
        received = b""
        try:
            while chunk := sock.recv(1 << 16):
                received += chunk
        except ConnectionResetError:
            pass
        return received


def assert_still_serving(node: Node) -> None:
    reply = signed_request(node, "GET", f"/{BUCKET}/{KEY}")
    assert reply.status == 200 and len(reply.body) == 100_000


def put_in_two_parts(node: Node, key: str, body: bytes) -> bytes:
    """A PUT whose body comes in two parts, the second followed at once by the client's half-close: the node
    cannot answer before it has the whole body, so the answer comes after the FIN."""
    signed = sign(node, "PUT", f"/{BUCKET}/{key}", payload_hash=hashlib.sha256(body).hexdigest(),
                  headers={"Content-Length": str(len(body))})
    lines = [f"PUT /{BUCKET}/{key} HTTP/1.1", f"Host: 127.0.0.1:{node.port}"]
    lines += [f"{name}: {value}" for name, value in signed.headers.items()]
    half = len(body) // 2
    with socket.create_connection(("127.0.0.1", node.port), timeout=10) as sock:
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body[:half])
        time.sleep(0.02)
        sock.sendall(body[half:])
        sock.shutdown(socket.SHUT_WR)
        received = b""
        while chunk := sock.recv(1 << 16):
            received += chunk
        return received


def errors_logged(node: Node, since: int) -> list[str]:
    return [*tracebacks(node, since), *(line for line in log_text(node)[since:].splitlines() if "ERROR" in line)]


def test_an_answer_after_the_clients_half_close_is_dropped_and_counted(node: Node) -> None:
    start, before, unanswered = log_size(node), writes_after_close(node), metric(node, PUTS_DROPPED)
    answered = 0
    for i in range(TRIES):
        received = put_in_two_parts(node, f"half-{i}", b"y" * 200_000)
        assert received == b"" or received.startswith(b"HTTP/1.1 200 "), received[:200]
        answered += bool(received)
    assert answered < TRIES, "every answer came before the half-close: nothing was tested"
    assert wait_until(lambda: writes_after_close(node) == before + TRIES - answered)
    assert metric(node, PUTS_DROPPED) == unanswered + TRIES - answered  # observed as "client went away"
    assert errors_logged(node, start) == []
    assert_still_serving(node)


def test_a_get_half_closed_at_once_is_answered_or_dropped_never_an_error(node: Node) -> None:
    start, before = log_size(node), writes_after_close(node)
    request = get_request(node)
    dropped = 0
    for _ in range(TRIES):
        received = exchange(node, request, half_close=True)
        assert received == b"" or received.startswith(b"HTTP/1.1 200 "), received[:200]
        dropped += not received
    assert wait_until(lambda: writes_after_close(node) == before + dropped)
    assert errors_logged(node, start) == []
    assert_still_serving(node)


@pytest.mark.parametrize("half_close", [False, True], ids=["open", "half-closed"])
def test_an_answer_after_the_node_ended_the_output_is_dropped_and_counted(node: Node, half_close: bool) -> None:
    """A request, then a head the parser refuses: the node answers that 400 and ends its output (a FIN after
    it) while the first request is still being handled; the first request's answer is dropped."""
    start, before = log_size(node), writes_after_close(node)
    data = get_request(node) + b"BAD\x00 / HTTP/1.1\r\n\r\n"
    for _ in range(TRIES):
        received = exchange(node, data, half_close=half_close)
        assert b" 400 " in received.split(b"\r\n", 1)[0] or not received, received[:200]
    assert wait_until(lambda: writes_after_close(node) >= before + TRIES)
    assert errors_logged(node, start) == []
    assert_still_serving(node)


def test_the_counter_is_described_in_the_metrics_doc() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text()
    assert "ctxstore_writes_after_close_total" in doc
