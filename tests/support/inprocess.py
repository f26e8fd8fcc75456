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
import time
from collections.abc import Iterator
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

ENDPOINT = "http://inprocess.ctx.test"
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
    """The node's application in this process, with tenants ``default`` and ``other`` and an admin token."""

    def __init__(self, **settings: Any) -> None:
        self.clock = FakeClock()
        tenants = TenantRegistry()
        tenants.add("default", ACCESS_KEY, SECRET_KEY)
        tenants.add("other", OTHER_ACCESS_KEY, OTHER_SECRET_KEY)
        self.settings = Settings(**{"admin_token": ADMIN_TOKEN, **settings})
        engine = Engine(EngineConfig.from_settings(self.settings), clock=self.clock)
        self.app = App(self.settings, tenants, engine)
        self.loop = asyncio.new_event_loop()

    @property
    def engine(self) -> Engine:
        return self.app.engine

    def close(self) -> None:
        self.loop.close()

    def advance(self, seconds: float) -> None:
        """Move the engine's clock (TTLs, pins, upload lifetimes)."""
        self.clock.advance(seconds)

    def housekeep(self) -> int:
        """One housekeeping pass, as the node's background task makes every 250 ms."""
        return self.engine.reap()

    def client(self, access_key: str = ACCESS_KEY, secret_key: str = SECRET_KEY, **config: Any) -> Any:
        """A boto3 S3 client whose requests this node answers."""
        client = boto3.client("s3", endpoint_url=ENDPOINT, region_name="us-east-1", aws_access_key_id=access_key,
                              aws_secret_access_key=secret_key, config=Config(**config) if config else None)
        client.meta.events.register_first("before-send.s3", self._answer)
        return client

    def admin(self, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
        """A call of the admin API (``path`` under /_ctx/v1/admin) with the token: (status, decoded JSON)."""
        data = json.dumps(body).encode() if body is not None else b""
        headers = [(b"authorization", f"Bearer {ADMIN_TOKEN}".encode()), (b"content-type", b"application/json"),
                   (b"host", b"inprocess.ctx.test"), (b"content-length", str(len(data)).encode())]
        status, _, answer = self.request(method, "/_ctx/v1/admin" + path, headers, data)
        return status, json.loads(answer) if answer else None

    def request(self, method: str, raw_path: str, headers: list[tuple[bytes, bytes]], body: bytes = b""
                ) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        """One request through the ASGI application: (status, headers, body)."""
        path, _, query = raw_path.partition("?")
        scope = {"type": "http", "http_version": "1.1", "method": method, "scheme": "http",
                 "path": unquote(path), "raw_path": path.encode(), "query_string": query.encode(),
                 "headers": headers, "client": ("127.0.0.1", 1), "server": ("inprocess.ctx.test", 80)}
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
