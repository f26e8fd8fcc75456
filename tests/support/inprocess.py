"""A node in the test process, on a fake clock: the handler tier of the suite.

:class:`InProcessNode` builds the real application (:class:`ctxstore_server.app.App`) with an engine whose
clock only moves when the test says so, and hands out real boto3 clients whose requests never reach a
socket: botocore signs and serializes each request as usual, then a ``before-send`` hook passes it to the
application through ASGI and gives botocore the answer to parse. So a TTL test advances the clock instead of
sleeping, and still speaks S3 exactly as a user's client does. What crosses a real socket (uvicorn, limits,
connections) is tested against real processes (:mod:`support.nodes`).
"""

from __future__ import annotations

import asyncio
import io
import json
import secrets
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import unquote, urlsplit

import boto3
from botocore.awsrequest import AWSPreparedRequest, AWSResponse
from botocore.config import Config

from ctxstore_server.app import App
from ctxstore_server.engine import Engine, EngineConfig
from ctxstore_server.settings import Settings
from ctxstore_server.tenants import TenantRegistry

from .nodes import ACCESS_KEY, OTHER_ACCESS_KEY, OTHER_SECRET_KEY, SECRET_KEY

ENDPOINT = "http://inprocess.ctx.test:9000"
ADMIN_TOKEN = "in-process-admin-token"


class FakeClock:
    """A clock that only moves when told to (starts at the wall clock: signatures still carry real times)."""

    def __init__(self, now: float | None = None) -> None:
        self.now = time.time() if now is None else now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        assert seconds >= 0
        self.now += seconds


class _Body(io.BytesIO):
    """A response body as botocore reads it from urllib3 (``stream()`` and ``read()``)."""

    def stream(self, amt: int = 1 << 16, decode_content: bool | None = None) -> Iterator[bytes]:
        while chunk := self.read(amt):
            yield chunk


class InProcessNode:
    """The node's application in this process, with tenants ``default`` and ``other`` and an admin token.

    ``endpoint`` and ``port`` are what its clients put in their Host header and sign; nothing listens there."""

    port = 9000

    def __init__(self, *, keep_time: bool = False, **settings: Any) -> None:
        """``keep_time``: before each request the clock moves up to the wall clock (never back), so a node that
        many tests share ages as a real one does; without it, time passes only when a test says so."""
        self.clock = FakeClock()
        self.keep_time = keep_time
        tenants = TenantRegistry()
        tenants.add("default", ACCESS_KEY, SECRET_KEY)
        tenants.add("other", OTHER_ACCESS_KEY, OTHER_SECRET_KEY)
        # The default tenant's keys are settings too, as on a real node (the admin API shows them masked).
        self.settings = Settings(**{"admin_token": ADMIN_TOKEN, "access_key": ACCESS_KEY, "secret_key": SECRET_KEY,
                                    **settings})
        engine = Engine(EngineConfig.from_settings(self.settings), clock=self.clock)
        self.app = App(self.settings, tenants, engine)
        self.loop = asyncio.new_event_loop()
        self._lock = threading.Lock()  # one request at a time on the loop (clients may be used from threads)

    @property
    def endpoint(self) -> str:
        """The address the clients sign for (never resolved: nothing here opens a socket)."""
        return ENDPOINT

    @property
    def engine(self) -> Engine:
        return self.app.engine

    def close(self) -> None:
        self.loop.close()

    def advance(self, seconds: float) -> None:
        """Move the engine's clock (TTLs, pins, upload lifetimes)."""
        self.clock.advance(seconds)

    def catch_up(self) -> None:
        """Move the clock up to the wall clock, never back: a node that many tests share ages as a real one."""
        self.clock.advance(max(0.0, time.time() - self.clock.now))

    def housekeep(self) -> int:
        """One housekeeping pass, as the node's background task makes every 250 ms."""
        return self.engine.reap()

    def client(self, access_key: str = ACCESS_KEY, secret_key: str = SECRET_KEY, *, endpoint: str = ENDPOINT,
               **config: Any) -> Any:
        """A boto3 S3 client whose requests this node answers (``endpoint``: the address it signs for; e.g.
        the node's virtual-host domain)."""
        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id=access_key,
                              aws_secret_access_key=secret_key, config=Config(**config) if config else None)
        client.meta.events.register_first("before-send.s3", self._answer)
        return client

    def other_client(self, **config: Any) -> Any:
        """A boto3 S3 client of the tenant ``other``."""
        return self.client(OTHER_ACCESS_KEY, OTHER_SECRET_KEY, **config)

    def admin(self, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
        """A call of the admin API (``path`` under /_ctx/v1/admin) with the token: (status, decoded JSON)."""
        data = json.dumps(body).encode() if body is not None else b""
        headers = [(b"authorization", f"Bearer {self.settings.admin_token}".encode()),
                   (b"content-type", b"application/json"), (b"host", urlsplit(ENDPOINT).netloc.encode()),
                   (b"content-length", str(len(data)).encode())]
        status, _, answer = self.request(method, "/_ctx/v1/admin" + path, headers, data)
        return status, json.loads(answer) if answer else None

    def request(self, method: str, raw_path: str, headers: list[tuple[bytes, bytes]], body: bytes = b""
                ) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        """One request through the ASGI application: (status, headers, body)."""
        path, _, query = raw_path.partition("?")
        scope = {"type": "http", "http_version": "1.1", "method": method, "scheme": "http",
                 "path": unquote(path), "raw_path": path.encode(), "query_string": query.encode(),
                 "headers": headers, "client": ("127.0.0.1", 1), "server": ("inprocess.ctx.test", 9000)}
        with self._lock:
            if self.keep_time:
                self.catch_up()
            return self.loop.run_until_complete(self._call(scope, body))

    async def _call(self, scope: dict[str, Any], body: bytes) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        messages = [{"type": "http.request", "body": body, "more_body": False}]
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            if messages:
                return messages.pop(0)
            await asyncio.sleep(3600)  # the client never goes away by itself
            raise AssertionError("unreachable")

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        await self.app(scope, receive, send)
        start = sent[0]
        return start["status"], list(start["headers"]), b"".join(bytes(m.get("body", b"")) for m in sent[1:])

    def _answer(self, request: AWSPreparedRequest, **_: Any) -> AWSResponse:
        url = urlsplit(request.url)
        body = request.body
        if hasattr(body, "read"):
            body = body.read()
        elif isinstance(body, str):
            body = body.encode()
        elif body is not None and not isinstance(body, bytes | bytearray):
            body = b"".join(body)  # an iterator of chunks
        data = bytes(body or b"")
        headers = [(k.lower().encode("latin-1"), (v.encode("latin-1") if isinstance(v, str) else bytes(v)))
                   for k, v in request.headers.items()]
        if not any(name == b"host" for name, _ in headers):
            headers.append((b"host", url.netloc.encode()))
        if not any(name == b"content-length" for name, _ in headers):
            headers.append((b"content-length", str(len(data)).encode()))
        raw_path = url.path + (f"?{url.query}" if url.query else "")
        status, answer_headers, answer = self.request(request.method, raw_path, headers, data)
        decoded = {k.decode("latin-1"): v.decode("latin-1") for k, v in answer_headers}
        return AWSResponse(request.url, status, decoded, _Body(answer))


def like_the_session_node(**settings: Any) -> InProcessNode:
    """An in-process node set up as the session's real node of tests/conftest.py (512 MiB, default TTL 1 h,
    virtual hosts under ``s3.ctx.test``, its clock keeping time), with ``settings`` on top."""
    return InProcessNode(keep_time=True, **{"memory": 512 << 20, "default_ttl": 3600.0, "domain": "s3.ctx.test",
                                            **settings})


@contextmanager
def scratch_bucket(client: Any, prefix: str = "test", *, name: str | None = None) -> Iterator[str]:
    """A fresh bucket of ``client``'s tenant (``name``, or the prefix and a random suffix), emptied and deleted
    afterwards. Any S3 client: an in-process node's or a real node's."""
    name = name or f"{prefix}-{secrets.token_hex(6)}"
    client.create_bucket(Bucket=name)
    try:
        yield name
    finally:
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=name):
            for obj in page.get("Contents", []):
                client.delete_object(Bucket=name, Key=obj["Key"])
        client.delete_bucket(Bucket=name)
