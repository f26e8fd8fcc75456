"""Hand-made S3 and bulk requests for adversarial tests: signed by botocore (an independent signer, not the
client under test), sent on raw sockets so a test controls every byte, header and pause.

``RawClient`` keeps one keep-alive connection to a node and reconnects when the node closes it; ``signed``
signs a request exactly as given (SigV4 header auth with the payload hash we choose), ``presign_v4`` and
``presign_v2`` make presigned targets; ``aws_chunked`` builds aws-chunked bodies (signed chunks or unsigned
with a trailer); ``bulk_frame`` builds bulk API frames.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import hmac
import re
import select
import socket
import struct
import zlib
from dataclasses import dataclass
from typing import Any, Self
from unittest import mock
from urllib.parse import urlsplit

import msgpack
from botocore.auth import HmacV1QueryAuth, S3SigV4Auth, S3SigV4QueryAuth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

from .nodes import ACCESS_KEY, SECRET_KEY

UNSIGNED = "UNSIGNED-PAYLOAD"
SIGNED_CHUNKS = "STREAMING-AWS4-HMAC-SHA256-PAYLOAD"
SIGNED_CHUNKS_TRAILER = "STREAMING-AWS4-HMAC-SHA256-PAYLOAD-TRAILER"
UNSIGNED_TRAILER = "STREAMING-UNSIGNED-PAYLOAD-TRAILER"
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
BULK_PREFIX = "/_ctx/v1/bulk"


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes
    closed: bool = False  # the server closed the connection after this answer

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


class _PayloadAuth(S3SigV4Auth):
    """botocore's S3 SigV4 header signer with the x-amz-content-sha256 we choose."""

    def __init__(self, access: str, secret: str, payload_hash: str) -> None:
        super().__init__(Credentials(access, secret), "s3", "us-east-1")
        self._payload_hash = payload_hash

    def payload(self, request: AWSRequest) -> str:
        return self._payload_hash


@dataclass
class Signed:
    headers: dict[str, str]
    signature: str
    amz_date: str


def signed(endpoint: str, method: str, target: str, *, payload_hash: str = UNSIGNED,
           headers: dict[str, str] | None = None, access: str = ACCESS_KEY, secret: str = SECRET_KEY,
           when: datetime.datetime | None = None) -> Signed:
    """SigV4 header auth for ``method target`` (target = raw path plus optional ``?query``), signing every
    header given (botocore's rules), with ``payload_hash`` as x-amz-content-sha256."""
    request = AWSRequest(method=method, url=f"{endpoint}{target}", headers=dict(headers or {}))
    auth = _PayloadAuth(access, secret, payload_hash)
    if when is None:
        auth.add_auth(request)
    else:
        with mock.patch("botocore.auth.get_current_datetime", return_value=when):
            auth.add_auth(request)
    out = dict(request.headers.items())
    match = re.search(r"Signature=([0-9a-f]{64})", out["Authorization"])
    assert match is not None
    return Signed(out, match.group(1), out["X-Amz-Date"])


def presign_v4(endpoint: str, method: str, target: str, *, expires: int = 300, access: str = ACCESS_KEY,
               secret: str = SECRET_KEY, when: datetime.datetime | None = None,
               headers: dict[str, str] | None = None) -> str:
    """A SigV4 presigned target (path?query) signing only the headers given (host at least)."""
    request = AWSRequest(method=method, url=f"{endpoint}{target}", headers=dict(headers or {}))
    auth = S3SigV4QueryAuth(Credentials(access, secret), "s3", "us-east-1", expires=expires)
    if when is None:
        auth.add_auth(request)
    else:
        with mock.patch("botocore.auth.get_current_datetime", return_value=when):
            auth.add_auth(request)
    parts = urlsplit(request.url)
    return f"{parts.path}?{parts.query}"


def presign_v2(endpoint: str, method: str, target: str, *, expires_at: int, access: str = ACCESS_KEY,
               secret: str = SECRET_KEY) -> str:
    """A SigV2 presigned target expiring at the Unix time ``expires_at``."""
    request = AWSRequest(method=method, url=f"{endpoint}{target}", headers={})
    auth = HmacV1QueryAuth(Credentials(access, secret), expires=0)
    with mock.patch.object(HmacV1QueryAuth, "_get_date", return_value=str(expires_at)):
        auth.add_auth(request)
    parts = urlsplit(request.url)
    return f"{parts.path}?{parts.query}"


class RawClient:
    """HTTP/1.1 by hand on one keep-alive connection to ``127.0.0.1:port`` (reconnects when closed)."""

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

    def read_reply(self, *, head_only: bool = False) -> Reply:
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
            return Reply(status, headers, body, closed)

    def exchange(self, method: str, target: str, headers: dict[str, str], body: bytes = b"", *,
                 retry: bool = True) -> Reply:
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
               pause: float = 0.0) -> Reply:
        """Send the head, then ``pieces`` one by one (``pause`` seconds apart), stopping as soon as the server
        answers early. A server that closes before answering gives ``Reply(0, ..., closed=True)``.
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
                return Reply(0, {}, b"", closed=True)

    def pipeline(self, requests: list[tuple[str, str, bytes]], *, batch: int = 64) -> list[Reply]:
        """Many signed requests (method, target, body; UNSIGNED-PAYLOAD) sent back to back, ``batch`` at a time,
        before their answers are read: fast setup of thousands of objects or buckets."""
        replies: list[Reply] = []
        for start in range(0, len(requests), batch):
            out = bytearray()
            group = requests[start:start + batch]
            for method, target, body in group:
                headers = signed(self.endpoint, method, target, payload_hash=UNSIGNED,
                                 headers={"Content-Length": str(len(body))}, access=self.access,
                                 secret=self.secret).headers
                out += self.head_bytes(method, target, headers) + body
            self.send_raw(bytes(out))
            replies += [self.read_reply(head_only=method == "HEAD") for method, _, _ in group]
        return replies

    def s3(self, method: str, target: str, body: bytes = b"", *, headers: dict[str, str] | None = None,
           payload_hash: str | None = None, sign: bool = True, content_length: bool = True) -> Reply:
        """A SigV4-signed S3 request (payload hash: the body's SHA-256 unless given), with a Content-Length
        unless ``content_length=False`` (then the body is sent as given, e.g. already chunk-encoded)."""
        all_headers = {"Content-Length": str(len(body)), **(headers or {})} if content_length else dict(headers or {})
        if sign:
            digest = hashlib.sha256(body).hexdigest() if payload_hash is None else payload_hash
            all_headers = signed(self.endpoint, method, target, payload_hash=digest, headers=all_headers,
                                 access=self.access, secret=self.secret).headers
        return self.exchange(method, target, all_headers, body)

    def bulk(self, bucket: str, op: str, body: bytes, *, headers: dict[str, str] | None = None) -> Reply:
        """A bulk API call (``UNSIGNED-PAYLOAD``)."""
        target = f"{BULK_PREFIX}/{bucket}/{op}"
        all_headers = {"Content-Length": str(len(body)), **(headers or {})}
        all_headers = signed(self.endpoint, "POST", target, payload_hash=UNSIGNED, headers=all_headers,
                             access=self.access, secret=self.secret).headers
        return self.exchange("POST", target, all_headers, body)


def bulk_frame(head: dict[str, Any] | bytes, payloads: bytes = b"") -> bytes:
    """``u32 length ‖ msgpack head ‖ payloads`` (``head`` may be pre-packed bytes)."""
    packed = head if isinstance(head, bytes) else msgpack.packb(head, use_bin_type=True)
    return struct.pack(">I", len(packed)) + packed + payloads


def signing_key(secret: str, day: str, region: str = "us-east-1") -> bytes:
    key = hmac.new(("AWS4" + secret).encode(), day.encode(), hashlib.sha256).digest()
    for part in (region, "s3", "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    return key


def aws_chunked(payload: bytes, *, chunk_size: int = 64 << 10, seed: Signed | None = None,
                secret: str = SECRET_KEY, trailer: tuple[str, str] | None = None) -> bytes:
    """An aws-chunked body. With ``seed`` (the request's signature) chunks are signed and chained from it
    (STREAMING-AWS4-HMAC-SHA256-PAYLOAD[-TRAILER]); without, chunks carry no signature (the unsigned-with-
    trailer mode). ``trailer``: (name, value) after the final chunk, signed when the chunks are."""
    chunks = [payload[i:i + chunk_size] for i in range(0, len(payload), chunk_size)] + [b""]
    out = bytearray()
    previous = seed.signature if seed is not None else ""
    key = b""
    scope = ""
    if seed is not None:
        day = seed.amz_date[:8]
        key = signing_key(secret, day)
        scope = f"{day}/us-east-1/s3/aws4_request"
    for chunk in chunks:
        if seed is not None:
            to_sign = "\n".join(["AWS4-HMAC-SHA256-PAYLOAD", seed.amz_date, scope, previous, EMPTY_SHA256,
                                 hashlib.sha256(chunk).hexdigest()])
            previous = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
            out += f"{len(chunk):x};chunk-signature={previous}\r\n".encode()
        else:
            out += f"{len(chunk):x}\r\n".encode()
        out += chunk
        if chunk or trailer is None:
            out += b"\r\n"
    if trailer is not None:
        line = f"{trailer[0]}:{trailer[1]}"
        out += f"{line}\r\n".encode()
        if seed is not None:
            to_sign = "\n".join(["AWS4-HMAC-SHA256-TRAILER", seed.amz_date, scope, previous,
                                 hashlib.sha256((line + "\n").encode()).hexdigest()])
            signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
            out += f"x-amz-trailer-signature:{signature}\r\n".encode()
        out += b"\r\n"
    return bytes(out)


def crc32_b64(data: bytes) -> str:
    return base64.b64encode(zlib.crc32(data).to_bytes(4, "big")).decode()


def md5_b64(data: bytes) -> str:
    return base64.b64encode(hashlib.md5(data).digest()).decode()
