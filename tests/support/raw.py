"""Requests built by hand for tests of bad input: signed with botocore's own SigV4 signer (any payload hash,
extra headers), aws-chunked and HTTP-chunked bodies, and a raw HTTP/1.1 connection that can send half a
request, stall, and read what the server answers or whether it closed; the bare socket parts of the scripted
nodes that stand in for a node in client tests."""

from __future__ import annotations

import base64
import datetime
import hashlib
import hmac
import re
import socket
import threading
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from unittest import mock
from urllib.parse import urlsplit
from xml.etree import ElementTree

from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials as BotoCredentials

from .inprocess import InProcessNode
from .nodes import ACCESS_KEY, SECRET_KEY, Node

UNSIGNED = "UNSIGNED-PAYLOAD"
SIGNED_CHUNKS = "STREAMING-AWS4-HMAC-SHA256-PAYLOAD"
SIGNED_CHUNKS_TRAILER = "STREAMING-AWS4-HMAC-SHA256-PAYLOAD-TRAILER"
UNSIGNED_TRAILER = "STREAMING-UNSIGNED-PAYLOAD-TRAILER"
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()




class _FixedPayloadAuth(S3SigV4Auth):
    """botocore's S3 SigV4 header signer, with the x-amz-content-sha256 we choose."""

    def __init__(self, access: str, secret: str, payload_hash: str) -> None:
        super().__init__(BotoCredentials(access, secret), "s3", "us-east-1")
        self._payload_hash = payload_hash

    def payload(self, request: AWSRequest) -> str:
        return self._payload_hash


@dataclass
class Signed:
    headers: dict[str, str]
    signature: str
    amz_date: str


def sign(node: Node | InProcessNode | None, method: str, target: str, *, payload_hash: str = UNSIGNED,
         headers: dict[str, str] | None = None, access: str = ACCESS_KEY, secret: str = SECRET_KEY,
         when: datetime.datetime | None = None, host: str | None = None) -> Signed:
    """SigV4-sign ``method target`` (target = raw path plus optional ``?query``) with botocore, for ``node``'s
    endpoint or, with ``host``, for that Host header (then part of the signed headers returned)."""
    assert node is not None or host is not None
    url = f"http://{host}{target}" if host else f"{node.endpoint}{target}"  # type: ignore[union-attr]
    all_headers = {"Host": host, **(headers or {})} if host else dict(headers or {})
    request = AWSRequest(method=method, url=url, headers=all_headers)
    auth = _FixedPayloadAuth(access, secret, payload_hash)
    if when is None:
        auth.add_auth(request)
    else:
        with mock.patch("botocore.auth.get_current_datetime", return_value=when):
            auth.add_auth(request)
    out = {k: v for k, v in request.headers.items()}
    match = re.search(r"Signature=([0-9a-f]{64})", out["Authorization"])
    assert match is not None
    signature = match.group(1)
    return Signed(out, signature, out["X-Amz-Date"])


def signing_key(secret: str, day: str, region: str = "us-east-1") -> bytes:
    key = hmac.new(("AWS4" + secret).encode(), day.encode(), hashlib.sha256).digest()
    for part in (region, "s3", "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    return key


def signed_chunked_body(payload: bytes, signed: Signed, *, chunk_size: int = 64 * 1024,
                        secret: str = SECRET_KEY, trailer: tuple[str, str] | None = None,
                        corrupt_chunk: int | None = None) -> bytes:
    """An aws-chunked body with chunk signatures chained from the request's seed signature (AWS's
    "Signature Calculations for the Authorization Header: Transferring Payload in Multiple Chunks").

    ``trailer``: (name, value) sent after the final chunk, signed (the -TRAILER mode).
    ``corrupt_chunk``: index of a chunk whose signature is replaced by a wrong one."""
    day = signed.amz_date[:8]
    key = signing_key(secret, day)
    scope = f"{day}/us-east-1/s3/aws4_request"
    previous = signed.signature
    chunks = [payload[i:i + chunk_size] for i in range(0, len(payload), chunk_size)] + [b""]
    out = bytearray()
    for index, chunk in enumerate(chunks):
        to_sign = "\n".join(["AWS4-HMAC-SHA256-PAYLOAD", signed.amz_date, scope, previous, EMPTY_SHA256,
                             hashlib.sha256(chunk).hexdigest()])
        signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
        previous = signature
        if index == corrupt_chunk:
            signature = "0" * 64
        out += f"{len(chunk):x};chunk-signature={signature}\r\n".encode() + chunk + b"\r\n"
    if trailer is not None:
        line = f"{trailer[0]}:{trailer[1]}"
        to_sign = "\n".join(["AWS4-HMAC-SHA256-TRAILER", signed.amz_date, scope, previous,
                             hashlib.sha256((line + "\n").encode()).hexdigest()])
        signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
        # The final chunk above already ended with CRLF; the trailer lines follow, then a blank line.
        out = out[:-2]
        out += f"{line}\r\nx-amz-trailer-signature:{signature}\r\n\r\n".encode()
    return bytes(out)


@dataclass
class RawResponse:
    status: int
    headers: dict[str, str]
    body: bytes

    @property
    def code(self) -> str | None:
        match = re.search(rb"<Code>([^<]*)</Code>", self.body)
        return match.group(1).decode() if match else None

    def xml(self) -> ElementTree.Element:
        return ElementTree.fromstring(self.body)


class RawConn:
    """One TCP connection to the node, speaking HTTP/1.1 by hand."""

    def __init__(self, node: Node, timeout: float = 10) -> None:
        self.node = node
        self.sock = socket.create_connection(("127.0.0.1", node.port), timeout=timeout)
        self.buf = b""
        self.interim: list[int] = []  # 1xx statuses seen (and skipped) by read_response

    def __enter__(self) -> RawConn:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.sock.close()

    def send_head(self, method: str, target: str, headers: dict[str, str]) -> None:
        lines = [f"{method} {target} HTTP/1.1"]
        if not any(k.lower() == "host" for k in headers):
            lines.append(f"Host: 127.0.0.1:{self.node.port}")
        lines += [f"{k}: {v}" for k, v in headers.items()]
        self.sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _fill(self) -> bool:
        data = self.sock.recv(65536)
        if not data:
            return False
        self.buf += data
        return True

    def read_response(self, head_only: bool = False) -> RawResponse:
        """The next final response (1xx interim responses are skipped)."""
        while True:
            while b"\r\n\r\n" not in self.buf:
                if not self._fill():
                    raise ConnectionError(f"connection closed before a response (got {self.buf[:200]!r})")
            head, self.buf = self.buf.split(b"\r\n\r\n", 1)
            status_line, *header_lines = head.decode("latin-1").split("\r\n")
            status = int(status_line.split()[1])
            headers: dict[str, str] = {}
            for line in header_lines:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            if 100 <= status < 200:
                self.interim.append(status)
                continue
            length = 0 if head_only else int(headers.get("content-length", "0"))
            while len(self.buf) < length:
                if not self._fill():
                    raise ConnectionError("connection closed inside a response body")
            body, self.buf = self.buf[:length], self.buf[length:]
            return RawResponse(status, headers, body)

    def closed_by_peer(self, timeout: float = 3) -> bool:
        """True if the server closes (EOF or reset) within ``timeout`` with nothing more to read."""
        self.sock.settimeout(timeout)
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True
        except TimeoutError:
            return False

    def request(self, method: str, target: str, headers: dict[str, str], body: bytes = b"") -> RawResponse:
        """Send a request, its body only after "100 Continue" if it says ``Expect: 100-continue``."""
        self.send_head(method, target, headers)
        expect = any(k.lower() == "expect" and v.lower() == "100-continue" for k, v in headers.items())
        if body and expect:
            while b"\r\n\r\n" not in self.buf:
                if not self._fill():
                    raise ConnectionError("connection closed before a response")
            if not self.buf.startswith(b"HTTP/1.1 100"):
                return self.read_response(head_only=method == "HEAD")  # answered without wanting the body
        if body:
            self.send(body)
        return self.read_response(head_only=method == "HEAD")


def raw_request(node: Node | InProcessNode, method: str, target: str, headers: dict[str, str],
                body: bytes = b"") -> RawResponse:
    """One request as given: on a connection of its own to a real node, through ASGI to an in-process one
    (with the Host header a client would send, unless given)."""
    if isinstance(node, InProcessNode):
        sent = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
        if not any(k == b"host" for k, _ in sent):
            sent.append((b"host", urlsplit(node.endpoint).netloc.encode()))
        status, answer_headers, data = node.request(method, target, sent, body)
        return RawResponse(status, {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in answer_headers},
                           b"" if method == "HEAD" else data)
    with RawConn(node) as conn:
        return conn.request(method, target, headers, body)


def signed_request(node: Node | InProcessNode, method: str, target: str, body: bytes = b"", *,
                   payload_hash: str | None = None, headers: dict[str, str] | None = None,
                   **kwargs: object) -> RawResponse:
    """A correctly signed request with the body's SHA-256 (unless told otherwise) and Content-Length."""
    all_headers = {"Content-Length": str(len(body)), **(headers or {})}
    if payload_hash is None:
        payload_hash = hashlib.sha256(body).hexdigest()
    signed = sign(node, method, target, payload_hash=payload_hash, headers=all_headers,
                  **kwargs)  # type: ignore[arg-type]
    return raw_request(node, method, target, signed.headers, body)


def assert_healthy(node: Node | InProcessNode) -> None:
    resp = raw_request(node, "GET", "/_ctx/health/live", {})
    assert resp.status == 200



def chunked_headers(payload_hash: str, decoded: int, encoded: int | None) -> dict[str, str]:
    headers = {"Content-Encoding": "aws-chunked", "x-amz-decoded-content-length": str(decoded)}
    if encoded is None:
        headers["Transfer-Encoding"] = "chunked"
    else:
        headers["Content-Length"] = str(encoded)
    if payload_hash.endswith("TRAILER"):
        headers["x-amz-trailer"] = "x-amz-checksum-crc32"
    return headers


def http_chunked(data: bytes, piece: int = 8192) -> bytes:
    """Transfer-Encoding: chunked framing (the HTTP layer, under aws-chunked when boto3 streams)."""
    out = bytearray()
    for i in range(0, len(data), piece):
        out += f"{len(data[i:i + piece]):x}\r\n".encode() + data[i:i + piece] + b"\r\n"
    return bytes(out + b"0\r\n\r\n")


def unsigned_trailer_body(data: bytes, crc_b64: str, chunk: int = 64 * 1024) -> bytes:
    out = bytearray()
    for i in range(0, len(data), chunk):
        out += f"{len(data[i:i + chunk]):x}\r\n".encode() + data[i:i + chunk] + b"\r\n"
    return bytes(out + f"0\r\nx-amz-checksum-crc32:{crc_b64}\r\n\r\n".encode())


def crc32_b64(data: bytes) -> str:
    return base64.b64encode(zlib.crc32(data).to_bytes(4, "big")).decode()


# ---------------------------------------------------------------------------- bare sockets, both ends


def loopback_listener() -> tuple[socket.socket, int]:
    """A listening socket on a free loopback port, and the port (for a scripted node)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    return sock, sock.getsockname()[1]


def serve_in_background(sock: socket.socket, handle: Callable[[socket.socket], None], *,
                        concurrent: bool) -> None:
    """Accept connections on ``sock`` in a daemon thread until it is closed, and ``handle`` each (which closes
    it): in a thread of its own when ``concurrent``, else one after the other."""

    def accept() -> None:
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            if concurrent:
                threading.Thread(target=handle, args=(conn,), daemon=True).start()
            else:
                handle(conn)

    threading.Thread(target=accept, daemon=True).start()


def recv_head(sock: socket.socket, data: bytes = b"") -> tuple[bytes, bytes, bool]:
    """Receive until ``data`` holds a whole HTTP head: (the head, what came after it, whether the head is
    whole: False if the peer closed first, the head then holding what arrived)."""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(1 << 20)
        if not chunk:
            return data, b"", False
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    return head, rest, True


def recv_request(sock: socket.socket, data: bytes = b"") -> tuple[list[bytes], bytes, bytes] | None:
    """One HTTP request with a Content-Length body (none without one), ``data`` being what was read past the
    last: (its head's lines, its body, what came after it), or None if the peer closed first."""
    head, rest, whole = recv_head(sock, data)
    if not whole:
        return None
    lines = head.split(b"\r\n")
    length = next((int(v) for k, _, v in (line.partition(b":") for line in lines[1:])
                   if k.strip().lower() == b"content-length"), 0)
    while len(rest) < length:
        chunk = sock.recv(1 << 20)
        if not chunk:
            return None
        rest += chunk
    return lines, rest[:length], rest[length:]
