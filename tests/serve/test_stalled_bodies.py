"""The body deadline on a real node, on both body paths: a stalled body fails with RequestTimeout one
``--body-timeout`` after its last byte, whether it is read below ASGI (a plain Content-Length body, straight
into its buffer) or over ASGI (an aws-chunked body, through the decoder). Before, the ASGI path failed a stall
after 3/4 to 1 timeout and the other after 1 to 1 1/4 (server/protocol/deadline.py)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest
from support.nodes import Node, make_client
from support.probes import log_size, start_probed_node, tracebacks
from support.raw import UNSIGNED, UNSIGNED_TRAILER, RawConn, aws_chunked, chunked_headers, crc32_b64, sign

BUCKET = "deadline"
TIMEOUT = 1.0


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    started = start_probed_node(tmp_path_factory.mktemp("deadline"), "--memory", "64MiB",
                                "--body-timeout", str(TIMEOUT))
    try:
        make_client(started.endpoint).create_bucket(Bucket=BUCKET)
        yield started
    finally:
        started.stop()


def stall_after(node: Node, target: str, headers: dict[str, str], wire: bytes) -> float:
    """Send a third of ``wire``, then (within a quarter timeout) a second third, then nothing: the seconds from
    the last byte to the node's RequestTimeout."""
    with RawConn(node, timeout=10) as conn:
        conn.send_head("PUT", target, headers)
        third = len(wire) // 3
        conn.send(wire[:third])
        time.sleep(TIMEOUT / 8)
        conn.send(wire[third:2 * third])
        last = time.monotonic()
        reply = conn.read_response()
        waited = time.monotonic() - last
        assert reply.status == 400 and reply.code == "RequestTimeout", (reply.status, reply.body[:300])  # as S3
    return waited


def test_a_stalled_plain_body_fails_one_timeout_after_its_last_byte(node: Node) -> None:
    start = log_size(node)
    data = os.urandom(3 << 20)
    signed = sign(node, "PUT", f"/{BUCKET}/plain", payload_hash=UNSIGNED, headers={"Content-Length": str(len(data))})
    waited = stall_after(node, f"/{BUCKET}/plain", signed.headers, data)
    assert TIMEOUT * 0.95 <= waited < TIMEOUT * 1.5
    assert tracebacks(node, start) == []


def test_a_stalled_aws_chunked_body_fails_one_timeout_after_its_last_byte(node: Node) -> None:
    start = log_size(node)
    data = os.urandom(3 << 20)
    body = aws_chunked(data, trailer=("x-amz-checksum-crc32", crc32_b64(data)))
    headers = chunked_headers(UNSIGNED_TRAILER, len(data), len(body))
    signed = sign(node, "PUT", f"/{BUCKET}/chunked", payload_hash=UNSIGNED_TRAILER, headers=headers)
    waited = stall_after(node, f"/{BUCKET}/chunked", signed.headers, body)
    assert TIMEOUT * 0.95 <= waited < TIMEOUT * 1.5
    assert tracebacks(node, start) == []
