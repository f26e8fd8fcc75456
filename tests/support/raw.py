"""Requests built by hand for tests of bad input, the one kit of the suite: signed with botocore's own SigV4
signer (an independent signer, not the client under test: any payload hash, any Host, extra headers, presigned
targets v4 and v2), aws-chunked bodies (signed chunks, a trailer), HTTP-chunked framing and bulk API frames;
sent to a real node on a raw HTTP/1.1 connection that can send half a request, stall, and read what the server
answers or whether it closed (``RawConn`` for one request, ``RawClient`` for a keep-alive connection), or
through ASGI to an :class:`~support.inprocess.InProcessNode` (``raw_request``, ``signed_request``); and the
bare socket parts of the scripted nodes that stand in for a node in client tests."""

from __future__ import annotations

import base64
import datetime
import hashlib
import hmac
import re
import select
import socket
import struct
import threading
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Self
from unittest import mock
from urllib.parse import urlsplit
from xml.etree import ElementTree

import msgpack
from botocore.auth import HmacV1QueryAuth, S3SigV4Auth, S3SigV4QueryAuth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials as BotoCredentials

from ctxstore import wire

from .inprocess import InProcessNode
from .nodes import ACCESS_KEY, SECRET_KEY, Node

UNSIGNED = "UNSIGNED-PAYLOAD"
SIGNED_CHUNKS = "STREAMING-AWS4-HMAC-SHA256-PAYLOAD"
SIGNED_CHUNKS_TRAILER = "STREAMING-AWS4-HMAC-SHA256-PAYLOAD-TRAILER"
UNSIGNED_TRAILER = "STREAMING-UNSIGNED-PAYLOAD-TRAILER"
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()

# Where a request goes: a real node, an in-process one, or an endpoint URL (``http://host:port``).
Target = Node | InProcessNode | str


def endpoint_of(to: Target) -> str:
    return to if isinstance(to, str) else to.endpoint


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


def _with_time(auth: Any, request: AWSRequest, when: datetime.datetime | None) -> None:
    if when is None:
        auth.add_auth(request)
    else:
        with mock.patch("botocore.auth.get_current_datetime", return_value=when):
            auth.add_auth(request)


def sign(to: Target | None, method: str, target: str, *, payload_hash: str = UNSIGNED,
         headers: dict[str, str] | None = None, access: str = ACCESS_KEY, secret: str = SECRET_KEY,
         when: datetime.datetime | None = None, host: str | None = None) -> Signed:
    """SigV4 header auth for ``method target`` (target = raw path plus optional ``?query``), signing every header
    given (botocore's rules) with ``payload_hash`` as x-amz-content-sha256: for ``to``'s endpoint or, with
    ``host``, for that Host header (then part of the headers returned)."""
    assert to is not None or host is not None
    url = f"http://{host}{target}" if host else f"{endpoint_of(to)}{target}"  # type: ignore[arg-type]
    all_headers = {"Host": host, **(headers or {})} if host else dict(headers or {})
    request = AWSRequest(method=method, url=url, headers=all_headers)
    _with_time(_FixedPayloadAuth(access, secret, payload_hash), request, when)
    out = dict(request.headers.items())
    match = re.search(r"Signature=([0-9a-f]{64})", out["Authorization"])
    assert match is not None
    return Signed(out, match.group(1), out.get("X-Amz-Date", ""))  # none when a Date header was signed


def presign_v4(to: Target, method: str, target: str, *, expires: int = 300, access: str = ACCESS_KEY,
               secret: str = SECRET_KEY, when: datetime.datetime | None = None,
               headers: dict[str, str] | None = None) -> str:
    """A SigV4 presigned target (path?query) signing only the headers given (host at least)."""
    request = AWSRequest(method=method, url=f"{endpoint_of(to)}{target}", headers=dict(headers or {}))
    _with_time(S3SigV4QueryAuth(BotoCredentials(access, secret), "s3", "us-east-1", expires=expires), request, when)
    parts = urlsplit(request.url)
    return f"{parts.path}?{parts.query}"


def presign_v2(to: Target, method: str, target: str, *, expires_at: int, access: str = ACCESS_KEY,
               secret: str = SECRET_KEY) -> str:
    """A SigV2 presigned target expiring at the Unix time ``expires_at``."""
    request = AWSRequest(method=method, url=f"{endpoint_of(to)}{target}", headers={})
    auth = HmacV1QueryAuth(BotoCredentials(access, secret), expires=0)
    with mock.patch.object(HmacV1QueryAuth, "_get_date", return_value=str(expires_at)):
        auth.add_auth(request)
    parts = urlsplit(request.url)
    return f"{parts.path}?{parts.query}"


def signing_key(secret: str, day: str, region: str = "us-east-1") -> bytes:
    key = hmac.new(("AWS4" + secret).encode(), day.encode(), hashlib.sha256).digest()
    for part in (region, "s3", "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    return key


def aws_chunked(payload: bytes, *, chunk_size: int = 64 << 10, seed: Signed | None = None,
                secret: str = SECRET_KEY, trailer: tuple[str, str] | None = None,
                corrupt_chunk: int | None = None) -> bytes:
    """An aws-chunked body (AWS's "Signature Calculations for the Authorization Header: Transferring Payload in
    Multiple Chunks"). With ``seed`` (the request's signature) chunks are signed and chained from it
    (STREAMING-AWS4-HMAC-SHA256-PAYLOAD[-TRAILER]); without, chunks carry no signature (the unsigned-with-
    trailer mode). ``trailer``: (name, value) after the final chunk, signed when the chunks are.
    ``corrupt_chunk``: index of a chunk whose signature is replaced by a wrong one."""
    chunks = [payload[i:i + chunk_size] for i in range(0, len(payload), chunk_size)] + [b""]
    out = bytearray()
    previous = seed.signature if seed is not None else ""
    key = b""
    scope = ""
    if seed is not None:
        day = seed.amz_date[:8]
        key = signing_key(secret, day)
        scope = f"{day}/us-east-1/s3/aws4_request"
    for index, chunk in enumerate(chunks):
        if seed is not None:
            to_sign = "\n".join(["AWS4-HMAC-SHA256-PAYLOAD", seed.amz_date, scope, previous, EMPTY_SHA256,
                                 hashlib.sha256(chunk).hexdigest()])
            previous = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
            shown = "0" * 64 if index == corrupt_chunk else previous
            out += f"{len(chunk):x};chunk-signature={shown}\r\n".encode()
        else:
            out += f"{len(chunk):x}\r\n".encode()
        out += chunk
        if chunk or trailer is None:
            out += b"\r\n"
    if trailer is not None:  # the final chunk's line, then the trailer lines, then a blank line
        line = f"{trailer[0]}:{trailer[1]}"
        out += f"{line}\r\n".encode()
        if seed is not None:
            to_sign = "\n".join(["AWS4-HMAC-SHA256-TRAILER", seed.amz_date, scope, previous,
                                 hashlib.sha256((line + "\n").encode()).hexdigest()])
            signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
            out += f"x-amz-trailer-signature:{signature}\r\n".encode()
        out += b"\r\n"
    return bytes(out)


def bulk_frame(head: dict[str, Any] | bytes, payloads: bytes = b"") -> bytes:
    """``u32 length ‖ msgpack head ‖ payloads`` (``head`` may be pre-packed bytes)."""
    packed = head if isinstance(head, bytes) else msgpack.packb(head, use_bin_type=True)
    return struct.pack(">I", len(packed)) + packed + payloads


@dataclass
class RawResponse:
    status: int
    headers: dict[str, str]
    body: bytes
    closed: bool = False  # the server closed the connection after this answer (RawClient)

    @property
    def code(self) -> str | None:
        """The S3 error code (XML) or the bulk error code (msgpack frame), if the body carries one."""
        match = re.search(rb"<Code>([^<]*)</Code>", self.body)
        if match:
            return match.group(1).decode()
        head = self.frame
        if isinstance(head, dict) and isinstance(head.get("error"), str):
            return head["error"]
        return None

    @property
    def frame(self) -> Any:
        """The msgpack head of a bulk answer (None if the body is not a frame)."""
        if len(self.body) < 4:
            return None
        (n,) = struct.unpack_from(">I", self.body, 0)
        if 4 + n > len(self.body):
            return None
        try:
            return msgpack.unpackb(self.body[4:4 + n], raw=False, strict_map_key=False)
        except Exception:  # noqa: BLE001 - msgpack raises several types for garbage
            return None

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


class RawClient:
    """HTTP/1.1 by hand on one keep-alive connection to ``127.0.0.1:port`` (reconnects when closed): a signed S3
    or bulk request (``s3``, ``bulk``), a pipeline of them, a body sent in pieces with pauses."""

    def __init__(self, port: int, *, timeout: float = 15.0, access: str = ACCESS_KEY,
                 secret: str = SECRET_KEY) -> None:
        self.port = port
        self.endpoint = f"http://127.0.0.1:{port}"
        self.timeout = timeout
        self.access = access
        self.secret = secret
        self.sock: socket.socket | None = None
        self.buf = b""
        self.pieces_sent = 0

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        self.buf = b""

    def connect(self) -> socket.socket:
        if self.sock is None:
            self.sock = socket.create_connection(("127.0.0.1", self.port), timeout=self.timeout)
            self.buf = b""
        return self.sock

    def send_raw(self, data: bytes) -> None:
        self.connect().sendall(data)

    def head_bytes(self, method: str, target: str, headers: dict[str, str]) -> bytes:
        lines = [f"{method} {target} HTTP/1.1"]
        if not any(k.lower() == "host" for k in headers):
            lines.append(f"Host: 127.0.0.1:{self.port}")
        lines += [f"{k}: {v}" for k, v in headers.items()]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    def _fill(self) -> bool:
        assert self.sock is not None
        data = self.sock.recv(1 << 20)
        if not data:
            return False
        self.buf += data
        return True

    def read_reply(self, *, head_only: bool = False) -> RawResponse:
        """The next final answer (1xx skipped). Raises ConnectionError if the server closes first."""
        self.connect()
        while True:
            while b"\r\n\r\n" not in self.buf:
                if not self._fill():
                    self.close()
                    raise ConnectionError("connection closed before an answer")
            head, self.buf = self.buf.split(b"\r\n\r\n", 1)
            status_line, *lines = head.decode("latin-1").split("\r\n")
            status = int(status_line.split()[1])
            headers: dict[str, str] = {}
            for line in lines:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            if 100 <= status < 200:
                continue
            length = 0 if head_only or status in (204, 304) else int(headers.get("content-length", "0"))
            while len(self.buf) < length:
                if not self._fill():
                    self.close()
                    raise ConnectionError("connection closed inside an answer's body")
            body, self.buf = self.buf[:length], self.buf[length:]
            closed = headers.get("connection", "").lower() == "close"
            if closed:
                self.close()
            return RawResponse(status, headers, body, closed)

    def exchange(self, method: str, target: str, headers: dict[str, str], body: bytes = b"", *,
                 retry: bool = True) -> RawResponse:
        """Send one request and read its answer; a stale keep-alive connection is retried once (``retry``:
        only when the connection had carried requests before)."""
        data = self.head_bytes(method, target, headers) + body
        fresh = self.sock is None
        for attempt in (0, 1):
            try:
                self.send_raw(data)
                return self.read_reply(head_only=method == "HEAD")
            except (ConnectionError, BrokenPipeError, ConnectionResetError):
                self.close()
                if attempt or fresh or not retry:
                    raise
        raise AssertionError("unreachable")

    def stream(self, method: str, target: str, headers: dict[str, str], pieces: list[bytes], *,
               pause: float = 0.0) -> RawResponse:
        """Send the head, then ``pieces`` one by one (``pause`` seconds apart), stopping as soon as the server
        answers early. A server that closes before answering gives ``RawResponse(0, ..., closed=True)``.
        ``self.pieces_sent`` says how many pieces went out before the answer."""
        sock = self.connect()
        self.pieces_sent = 0
        try:
            sock.sendall(self.head_bytes(method, target, headers))
            for piece in pieces:
                ready, _, _ = select.select([sock], [], [], pause)
                if ready:
                    break
                sock.sendall(piece)
                self.pieces_sent += 1
            return self.read_reply(head_only=method == "HEAD")
        except (ConnectionError, OSError):
            try:
                return self.read_reply(head_only=method == "HEAD")
            except (ConnectionError, OSError):
                self.close()
                return RawResponse(0, {}, b"", closed=True)

    def pipeline(self, requests: list[tuple[str, str, bytes]], *, batch: int = 64) -> list[RawResponse]:
        """Many signed requests (method, target, body; UNSIGNED-PAYLOAD) sent back to back, ``batch`` at a time,
        before their answers are read: fast setup of thousands of objects or buckets."""
        replies: list[RawResponse] = []
        for start in range(0, len(requests), batch):
            out = bytearray()
            group = requests[start:start + batch]
            for method, target, body in group:
                headers = sign(self.endpoint, method, target, payload_hash=UNSIGNED,
                               headers={"Content-Length": str(len(body))}, access=self.access,
                               secret=self.secret).headers
                out += self.head_bytes(method, target, headers) + body
            self.send_raw(bytes(out))
            replies += [self.read_reply(head_only=method == "HEAD") for method, _, _ in group]
        return replies

    def s3(self, method: str, target: str, body: bytes = b"", *, headers: dict[str, str] | None = None,
           payload_hash: str | None = None, signed: bool = True, content_length: bool = True) -> RawResponse:
        """A SigV4-signed S3 request (payload hash: the body's SHA-256 unless given; ``signed=False``: none),
        with a Content-Length unless ``content_length=False`` (then the body is sent as given, e.g. already
        chunk-encoded)."""
        all_headers = {"Content-Length": str(len(body)), **(headers or {})} if content_length else dict(headers or {})
        if signed:
            digest = hashlib.sha256(body).hexdigest() if payload_hash is None else payload_hash
            all_headers = sign(self.endpoint, method, target, payload_hash=digest, headers=all_headers,
                               access=self.access, secret=self.secret).headers
        return self.exchange(method, target, all_headers, body)

    def bulk(self, bucket: str, op: str, body: bytes, *, headers: dict[str, str] | None = None) -> RawResponse:
        """A bulk API call (``UNSIGNED-PAYLOAD``)."""
        target = f"{wire.PREFIX}/{bucket}/{op}"
        all_headers = {"Content-Length": str(len(body)), **(headers or {})}
        all_headers = sign(self.endpoint, "POST", target, payload_hash=UNSIGNED, headers=all_headers,
                           access=self.access, secret=self.secret).headers
        return self.exchange("POST", target, all_headers, body)


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


def crc32_b64(data: bytes) -> str:
    return base64.b64encode(zlib.crc32(data).to_bytes(4, "big")).decode()


def md5_b64(data: bytes) -> str:
    return base64.b64encode(hashlib.md5(data).digest()).decode()


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
