"""Raw ASGI for the data paths: the request (method, raw path, query, headers, body as it arrives) and a
response sender that hands stored buffers to the server without copying them.

Framework routing costs a large share of small-request throughput, so the S3 and bulk services read the
ASGI scope directly (docs/architecture.md). Where the node's HTTP protocol offers the path below ASGI
(:mod:`.direct`), :meth:`Request.readinto` reads the body through it straight into the caller's buffers.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable, MutableMapping, Sequence
from typing import Any
from urllib.parse import unquote

from .deadline import BodyDeadline, BodyTimeout
from .direct import SCOPE_KEY, ClientDisconnected, DirectChannel

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Buffer = bytes | bytearray | memoryview

# Large payloads go out in slices so the server's write flow control can pause us between them.
SEND_SLICE = 1 << 20

_REQUEST_IDS = itertools.count(1)
_NODE_TAG = os.urandom(3).hex().upper()

__all__ = ["BodyTimeout", "ClientDisconnected", "DirectChannel", "Request", "send_response"]


class Request:
    """One HTTP request: method, raw and decoded path, query pairs, lowercase headers, body receive."""

    __slots__ = (
        "scope", "receive", "method", "raw_path", "query_string", "query", "headers", "request_id",
        "body_started", "body_done", "body_timeout", "min_body_rate", "direct", "_chunks", "_rest",
    )

    def __init__(self, scope: Scope, receive: Receive, body_timeout: float = 30.0,
                 min_body_rate: int = 64 << 10) -> None:
        self.scope = scope
        self.receive = receive
        self.method: str = scope["method"]
        raw = scope.get("raw_path")
        self.raw_path: str = raw.decode("latin-1") if raw else scope["path"]
        self.query_string: bytes = scope.get("query_string", b"")
        self.query: dict[str, str] = parse_query(self.query_string)
        headers: dict[str, str] = {}
        for name, value in scope["headers"]:
            key = name.decode("latin-1")
            text = value.decode("latin-1")
            headers[key] = f"{headers[key]},{text}" if key in headers else text
        self.headers = headers
        self.request_id = f"{_NODE_TAG}{next(_REQUEST_IDS):013X}"
        self.body_started = False
        self.body_done = False
        self.body_timeout = body_timeout
        self.min_body_rate = min_body_rate  # bytes per second, measured over each body_timeout
        # The path below ASGI, when the server offers it (the node's own HTTP protocol does).
        self.direct: DirectChannel | None = scope.get(SCOPE_KEY)
        if self.direct is not None:
            self.direct.timeout, self.direct.min_rate = body_timeout, min_body_rate
        self._chunks: AsyncIterator[bytes] | None = None  # readinto over ASGI: the chunks, and what is left
        self._rest = memoryview(b"")

    def header(self, name: str, default: str | None = None) -> str | None:
        return self.headers.get(name, default)

    async def chunks(self) -> AsyncGenerator[bytes, None]:
        """Yield the body as it arrives. Raises ClientDisconnected, or BodyTimeout when the body's deadline
        (:mod:`.deadline`: no byte for body_timeout, or less than min_body_rate over a body_timeout) fails it.
        The deadline interrupts only a wait for the body, never the caller's own work between chunks."""
        self.body_started = True
        task = asyncio.current_task()
        assert task is not None
        waiting = [False]  # whether this task is waiting for the next message (the deadline may cancel that)

        def expire() -> None:
            if waiting[0]:
                task.cancel()

        deadline = BodyDeadline(asyncio.get_running_loop(), self.body_timeout, self.min_body_rate, expire)
        try:
            while True:
                if deadline.expired:
                    raise BodyTimeout()
                waiting[0] = True
                try:
                    message = await self.receive()
                except asyncio.CancelledError:
                    if deadline.expired and task.uncancel() == 0:  # our cancel, nobody else's
                        raise BodyTimeout() from None
                    raise
                finally:
                    waiting[0] = False
                if message["type"] == "http.disconnect":
                    raise ClientDisconnected()
                body = message.get("body", b"")
                more = message.get("more_body", False)
                if not more:
                    self.body_done = True
                    deadline.stop()
                deadline.arrived(len(body))
                if body:
                    yield body
                if not more:
                    return
        finally:
            deadline.stop()

    async def readinto(self, view: memoryview) -> int:
        """Fill ``view`` from the body; fewer bytes only where the body ends (0: it has ended). Below ASGI the
        kernel writes straight into ``view``; over ASGI each chunk is copied once. Raises ClientDisconnected,
        or BodyTimeout as :meth:`chunks` does."""
        self.body_started = True
        if self.direct is not None:
            n = await self.direct.readinto(view)
            if self.direct.body_done:
                self.body_done = True
            return n
        pos = 0
        while pos < len(view):
            if not self._rest:
                if self._chunks is None:
                    self._chunks = self.chunks()
                try:
                    self._rest = memoryview(await self._chunks.__anext__())
                except StopAsyncIteration:
                    break
            take = min(len(view) - pos, len(self._rest))
            view[pos:pos + take] = self._rest[:take]
            self._rest = self._rest[take:]
            pos += take
        return pos

    async def readinto_many(self, views: list[memoryview]) -> int:
        """Fill each of ``views`` in turn, as :meth:`readinto` would one by one (below ASGI with one wait)."""
        self.body_started = True
        if self.direct is not None:
            n = await self.direct.readinto_many(views)
            if self.direct.body_done:
                self.body_done = True
            return n
        total = 0
        for view in views:
            n = await self.readinto(view)
            total += n
            if n < len(view):
                break
        return total

    async def close_body(self) -> None:
        """Done with the body: its deadline cannot fire later and no buffer of the handler's is written to."""
        if self.direct is not None:
            self.direct.close_body()
        if self._chunks is not None:
            aclose = getattr(self._chunks, "aclose", None)
            self._chunks = None
            if aclose is not None:
                await aclose()

    async def read_all(self, limit: int) -> bytes | None:
        """The whole (small) body, or None if it exceeds ``limit`` bytes (the rest is left unread)."""
        length = ascii_int(self.headers.get("content-length")) if "transfer-encoding" not in self.headers else None
        if self.direct is not None and length is not None:
            if length > limit:
                return None
            data = bytearray(length)
            if await self.readinto(memoryview(data)) != length:
                raise ClientDisconnected()  # a Content-Length body ends only where the connection does
            return bytes(data)
        parts: list[bytes] = []
        size = 0
        chunks = self.chunks()
        try:
            async for chunk in chunks:
                size += len(chunk)
                if size > limit:
                    return None
                parts.append(chunk)
        finally:
            await chunks.aclose()  # its deadline stops now, not when the generator is collected
        return b"".join(parts)


def ascii_int(text: str | None) -> int | None:
    """A non-negative integer written in ASCII digits (HTTP and S3 numbers), else None.

    ``str.isdigit`` and ``int`` accept other scripts' digits and superscripts ("²", "١"): never for input."""
    if text is None:
        return None
    text = text.strip()
    if not text or not text.isascii() or not text.isdigit():
        return None
    return int(text)


def raw_header(scope: Scope, name: bytes) -> bytes | None:
    """The first value of header ``name`` (lowercase) in an ASGI scope, as sent."""
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return None


def parse_query(raw: bytes) -> dict[str, str]:
    """Query parameters, percent-decoded; ``+`` stays a plus sign (S3 clients encode spaces as %20)."""
    out: dict[str, str] = {}
    if not raw:
        return out
    for pair in raw.decode("latin-1").split("&"):
        if not pair:
            continue
        name, _, value = pair.partition("=")
        name = unquote(name, encoding="utf-8", errors="replace")
        out.setdefault(name, unquote(value, encoding="utf-8", errors="replace"))
    return out


async def send_response(
    send: Send,
    status: int,
    headers: Iterable[tuple[str, str]],
    body: Buffer | Sequence[Buffer] = b"",
    *,
    head: bool = False,
    content_length: int | None = None,
) -> int:
    """Send a complete response; ``body`` is one buffer or several sent back to back (each stored buffer as
    it is: no copy, no join). ``head``: headers only (Content-Length still describes the body). Returns the
    body bytes sent."""
    parts: Sequence[Buffer] = (body,) if isinstance(body, (bytes, bytearray, memoryview)) else body
    length = sum(len(p) for p in parts) if content_length is None else content_length
    raw_headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers]
    raw_headers.append((b"content-length", str(length).encode()))
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    pieces = [] if head else [piece for part in parts if len(part) for piece in _slices(part)]
    if not pieces:
        await send({"type": "http.response.body", "body": b""})
        return 0
    last = len(pieces) - 1
    for i, piece in enumerate(pieces):
        await send({"type": "http.response.body", "body": piece, "more_body": i < last})
    return length


def _slices(part: Buffer) -> list[Buffer]:
    """A large buffer in SEND_SLICE pieces, so the server's write flow control can pause us between them."""
    if len(part) <= SEND_SLICE:
        return [part]
    view = memoryview(part)
    return [view[start:start + SEND_SLICE] for start in range(0, len(view), SEND_SLICE)]
