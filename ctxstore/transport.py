"""A small HTTP/1.1 client on asyncio's BufferedProtocol: the socket reads straight into the caller's buffers.

Why our own (measured in docs/benchmarks.md, "Client HTTP transport"): a restore moves hundreds of MiB of KV
blocks. aiohttp and urllib3 hand the body over in pieces that must be copied into the destination (aiohttp's
``read()`` then a copy took 4.9x as long as this transport); with ``BufferedProtocol`` the event loop calls
:meth:`Connection.get_buffer` and ``recv_into`` writes each payload into the block's final buffer. The stdlib
``http.client`` with ``readinto`` is as fast but blocking, and the client must be asyncio-native: one
coroutine per node, all nodes concurrently, for both the async and the sync facade.

Scope: exactly what the bulk API needs — one request per connection at a time, ``Content-Length`` bodies
(the server always sends one), keep-alive pooling per node, connect and read (inactivity) timeouts, plain TCP
or TLS (the event loop's TLS transport reads the decrypted bytes into the buffers ``get_buffer`` hands it, so
blocks still land in place).
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable, Coroutine, Iterator, Sequence
from typing import Any, Protocol

from . import wire
from .errors import ContextStoreError, NodeTimeout, NodeUnavailable, ProtocolError
from .tls import describe_failure

MAX_HEADER_BYTES = 64 << 10
SINK_BYTES = 64 << 10  # where bytes go that nobody can take (a broken answer being dropped)
MAX_SMALL_BODY = wire.HEAD_LEN.size + wire.MAX_HEAD_BYTES  # the longest frame-only answer
Buffer = bytes | bytearray | memoryview


class BodyReader(Protocol):
    """Where a response body goes: ``begin(length)`` once its Content-Length is known, then ``get_buffer``
    returns a non-empty writable view while bytes remain (or raises: the answer is malformed)."""

    def begin(self, length: int) -> None: ...

    def get_buffer(self) -> memoryview: ...

    def written(self, n: int) -> None: ...


class BytesReader:
    """Collects a small body (a frame-only answer, an error) into one buffer."""

    def __init__(self, length: int) -> None:
        if length > MAX_SMALL_BODY:  # no frame-only answer is this long: do not allocate what a bad length says
            raise ProtocolError("", 0, "MalformedFrame", f"a {length}-byte answer where a frame was expected")
        self.data = bytearray(length)
        self._view = memoryview(self.data)
        self._pos = 0

    def begin(self, length: int) -> None:
        pass  # sized at construction

    def get_buffer(self) -> memoryview:
        return self._view[self._pos:]

    def written(self, n: int) -> None:
        self._pos += n


ReaderFactory = Callable[[int, int], BodyReader]  # (status, content_length) -> reader


class BodyStream(Protocol):
    """A request body made while it is sent, ``length`` bytes in all: ``groups()`` yields groups of buffers,
    each handed to the transport at once; the next group is made while the kernel sends the previous ones.
    Each call of ``groups()`` starts the body again (a request retried on a fresh connection)."""

    length: int

    def groups(self) -> Iterator[Sequence[Buffer]]: ...


# A streamed body waits for the transport once this much of it is still queued in user space (the kernel's
# socket buffers hold more): the next group is made while that drains.
STREAM_QUEUE = 1 << 20


class Response:
    __slots__ = ("status", "headers", "reader")

    def __init__(self, status: int, headers: dict[str, str], reader: BodyReader) -> None:
        self.status = status
        self.headers = headers
        self.reader = reader


class Connection(asyncio.BufferedProtocol):
    """One keep-alive connection to a node."""

    def __init__(self, node: str, read_timeout: float) -> None:
        self.node = node
        self.read_timeout = read_timeout
        self.transport: asyncio.Transport | None = None
        self.reusable = False
        self.used = False  # has carried a request before (a failure may just be a stale keep-alive)
        self._loop = asyncio.get_running_loop()
        self._scratch = bytearray(MAX_HEADER_BYTES)
        self._scratch_len = 0
        self._in_body = False
        self._remaining = 0
        self._factory: ReaderFactory | None = None
        self._response: Response | None = None
        self._waiter: asyncio.Future[Response] | None = None
        self.received_any = False
        self._progress = 0
        self._timer: asyncio.TimerHandle | None = None
        # Set when a get_buffer call cannot place what arrives: the bytes go to the sink until buffer_updated
        # fails the request and drops the connection. Aborting inside get_buffer instead hands the event loop a
        # buffer whose transport is gone: uvloop then writes into freed memory and the process dies.
        self._broken: Exception | None = None
        self._failing = False
        self._sink = memoryview(bytearray(SINK_BYTES))
        self._drained: asyncio.Future[None] | None = None  # while a streamed body waits for the transport

    # -------------------------------------------------------------- asyncio protocol callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.reusable = True

    def connection_lost(self, exc: Exception | None) -> None:
        self.reusable = False
        self.transport = None
        self._cancel_timer()
        self._fail(NodeUnavailable(self.node, f"connection closed{': ' + str(exc) if exc else ''}"))
        self._wake_writer()

    def pause_writing(self) -> None:
        pass  # flow control is asked for by a streamed body only (it looks at the transport's queue)

    def resume_writing(self) -> None:
        self._wake_writer()

    def _wake_writer(self) -> None:
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    def get_buffer(self, sizehint: int) -> memoryview:
        """Where the next bytes go. Never fails and never closes anything (see ``_broken``)."""
        if self._broken is not None or self.transport is None:
            return self._sink
        if self._in_body and self._response is not None:
            try:
                view = self._response.reader.get_buffer()
                if len(view):
                    return view
                raise ProtocolError(self.node, self._response.status, "ExtraBytes", "bytes beyond the frame")
            except Exception as exc:  # a body the reader cannot place (e.g. more bytes than its head said)
                self._broken = exc
                return self._sink
        view = memoryview(self._scratch)[self._scratch_len:]
        if not view:
            self._broken = ProtocolError(self.node, 0, "HeadersTooLarge", "response headers exceed 64 KiB")
            return self._sink
        return view

    def buffer_updated(self, nbytes: int) -> None:
        self.received_any = True
        self._progress += 1
        if self._broken is not None:  # what arrived went to the sink: fail the request, drop the connection
            if not self._failing:  # once, and outside the loop's buffer protocol (bytes may still be in flight)
                self._failing = True
                self._loop.call_soon(self._reader_failed, self._broken)
            return
        if self._waiter is None:  # bytes nobody asked for: the stream is out of sync
            self._abort(None)
            return
        if self._in_body:
            assert self._response is not None
            try:
                self._response.reader.written(nbytes)
            except Exception as exc:
                self._reader_failed(exc)
                return
            self._remaining -= nbytes
            if self._remaining <= 0:
                self._finish()
            return
        self._scratch_len += nbytes
        self._parse_head()

    # -------------------------------------------------------------- request/response

    async def request(self, head: bytes, body: Sequence[Buffer] | BodyStream, factory: ReaderFactory) -> Response:
        """Send ``head`` (request line + headers) and ``body`` (its parts, or a :class:`BodyStream`); return the
        response once its body is in."""
        if self.transport is None or not self.reusable:
            raise NodeUnavailable(self.node, "connection closed")
        self.used = True
        self._factory = factory
        self._waiter = self._loop.create_future()
        self.received_any = False
        self._arm_timer()
        waiter = self._waiter
        transport = self.transport
        # Head and every payload at once: the event loop sends them with as few writev calls as the socket takes
        # and keeps the rest referenced, not copied (one write per block made 2,048 system calls per 128 MiB
        # save). Flow control is the transport's. A node that answers early (e.g. "over the limit") and closes
        # before taking the whole body: that answer is the outcome, not a dead node.
        try:
            if isinstance(body, Sequence):
                transport.writelines([head, *body])
            else:
                transport.write(head)
                await self._stream(transport, body, waiter)
            return await waiter
        finally:
            self._cancel_timer()

    async def _stream(self, transport: asyncio.Transport, body: BodyStream, waiter: asyncio.Future[Response]) -> None:
        """Write ``body`` group by group, waiting whenever more than :data:`STREAM_QUEUE` is still queued; stops
        early if the node has answered (an early error) or the connection is gone."""
        transport.set_write_buffer_limits(high=STREAM_QUEUE)  # resume_writing comes below a quarter of it
        for group in body.groups():
            if waiter.done() or transport.is_closing():
                return
            transport.writelines(group)
            if transport.get_write_buffer_size() > STREAM_QUEUE:
                self._drained = self._loop.create_future()
                try:
                    await asyncio.wait((self._drained, waiter), return_when=asyncio.FIRST_COMPLETED)
                finally:
                    self._drained = None

    def _parse_head(self) -> None:
        end = self._scratch.find(b"\r\n\r\n", 0, self._scratch_len)
        if end < 0:
            return
        lines = bytes(self._scratch[:end]).decode("latin-1").split("\r\n")
        try:
            _, status_text, *_ = lines[0].split(" ", 2)
            status = int(status_text)
        except (ValueError, IndexError):
            self._abort(ProtocolError(self.node, 0, "BadStatusLine", lines[0][:80]))
            return
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        length_text = headers.get("content-length")
        if length_text is None or not (length_text.isascii() and length_text.isdigit()):
            self._abort(ProtocolError(self.node, status, "NoContentLength", "response without Content-Length"))
            return
        if status == 100:  # interim response: drop it and keep parsing
            rest = self._scratch[end + 4:self._scratch_len]
            self._scratch[:len(rest)] = rest
            self._scratch_len = len(rest)
            self._parse_head()
            return
        length = int(length_text)
        if self._factory is None:
            self._abort(ProtocolError(self.node, status, "Unexpected", "an answer nobody asked for"))
            return
        try:
            reader = self._factory(status, length)
            reader.begin(length)
        except Exception as exc:
            self._response = None
            self._reader_failed(exc)
            return
        self._response = Response(status, headers, reader)
        if headers.get("connection", "").lower() == "close":
            self.reusable = False
        self._in_body = True
        self._remaining = length
        # Body bytes that arrived with the headers: copy them to where they belong (at most 64 KiB).
        leftover = memoryview(self._scratch)[end + 4:self._scratch_len]
        self._scratch_len = 0
        while leftover and self._remaining > 0:
            try:
                target = self._response.reader.get_buffer()
                k = min(len(target), len(leftover), self._remaining)
                if not k:
                    raise ProtocolError(self.node, status, "ExtraBytes", "bytes the body reader cannot take")
                target[:k] = leftover[:k]
                self._response.reader.written(k)
            except Exception as exc:
                self._reader_failed(exc)
                return
            leftover = leftover[k:]
            self._remaining -= k
        if len(leftover):
            self._abort(ProtocolError(self.node, status, "ExtraBytes", "bytes beyond Content-Length"))
            return
        if self._remaining <= 0:
            self._finish()

    def _finish(self) -> None:
        self._in_body = False
        waiter, response = self._waiter, self._response
        self._waiter = self._response = None
        self._factory = None
        if waiter is not None and not waiter.done() and response is not None:
            waiter.set_result(response)

    def _fail(self, exc: Exception) -> None:
        waiter = self._waiter
        self._waiter = None
        self._in_body = False
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)

    def _reader_failed(self, exc: Exception) -> None:
        """The body reader rejected what arrived (a malformed frame): fail the request, drop the connection.
        Raising out of a protocol callback instead would make asyncio log a fatal error and report the node
        as unreachable."""
        status = self._response.status if self._response is not None else 0
        if isinstance(exc, ProtocolError) and not exc.node:
            exc = ProtocolError(self.node, exc.status or status, exc.code, exc.message)
        elif not isinstance(exc, ContextStoreError):
            exc = ProtocolError(self.node, status, getattr(exc, "code", "MalformedFrame"), str(exc))
        self._abort(exc)

    def _abort(self, exc: Exception | None) -> None:
        self.reusable = False
        if exc is not None:
            self._fail(exc)
        if self.transport is not None:
            self.transport.abort()

    # -------------------------------------------------------------- read inactivity timeout

    def _arm_timer(self) -> None:
        seen = self._progress
        self._timer = self._loop.call_later(self.read_timeout, self._check_progress, seen)

    def _check_progress(self, seen: int) -> None:
        if self._waiter is None:
            return
        if self._progress == seen:
            self._abort(NodeTimeout(self.node, f"no data for {self.read_timeout:g} s"))
        else:
            self._arm_timer()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def close(self) -> None:
        self.reusable = False
        if self.transport is None:
            return
        if self.transport.get_extra_info("ssl_object") is not None:
            # A TLS close() first trades close_notify with the node: a round trip that a loop being stopped (the
            # client's close()) never gives it, and the socket would leak. Every answer is framed by its
            # Content-Length, never by the end of the stream, so the connection is simply dropped.
            self.transport.abort()
        else:
            self.transport.close()


class Pool:
    """Keep-alive connections to one node (``host:port``), at most ``limit`` at a time. With ``tls`` they are TLS
    connections whose certificate is checked for ``server_hostname`` (default: ``host``); the connect timeout
    covers the handshake."""

    def __init__(self, host: str, port: int, *, limit: int, connect_timeout: float, read_timeout: float,
                 tls: ssl.SSLContext | None = None, server_hostname: str | None = None) -> None:
        self.host = host
        self.port = port
        self.name = f"{host}:{port}"
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.tls = tls
        self.server_hostname = server_hostname or host
        self._idle: list[Connection] = []
        self._slots = asyncio.Semaphore(limit)
        # close() drops every connection, those in use included: one that comes back from a request begun
        # before it is closed, not kept (nothing may hold a transport the owner believes gone, e.g. a lane's
        # loop that is about to close). The pool stays usable: later requests open new connections.
        self._generation = 0

    async def _connect(self) -> Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(
                    lambda: Connection(self.name, self.read_timeout), self.host, self.port, ssl=self.tls,
                    server_hostname=None if self.tls is None else self.server_hostname)
        except TimeoutError:
            raise NodeTimeout(self.name, f"connect timed out after {self.connect_timeout:g} s") from None
        except ssl.SSLError as exc:  # before OSError, its base: a certificate the client does not trust
            raise NodeUnavailable(self.name, describe_failure(exc, self.server_hostname)) from None
        except OSError as exc:
            raise NodeUnavailable(self.name, f"connect failed: {exc.strerror or exc}") from None
        return conn

    def request(self, head: bytes, body: Sequence[Buffer] | BodyStream, factory: ReaderFactory,
                *, idempotent: bool = True) -> Coroutine[Any, Any, Response]:
        """One request on a pooled connection. A stale keep-alive connection that fails before answering is
        retried once on a fresh connection when the request is idempotent. The pool's generation is taken when
        the request is made, not when its coroutine first runs: a close() in between (a lane's pool closed while
        the task that will use it waits for its first turn) must count for it too."""
        return self._request(head, body, factory, idempotent, self._generation)

    async def _request(self, head: bytes, body: Sequence[Buffer] | BodyStream, factory: ReaderFactory,
                       idempotent: bool, generation: int) -> Response:
        async with self._slots:
            while self._idle:
                conn = self._idle.pop()
                if conn.reusable:
                    break
            else:
                conn = await self._connect()
            reused = conn.used
            try:
                response = await conn.request(head, body, factory)
            except NodeTimeout:
                conn.close()
                raise
            except NodeUnavailable:
                conn.close()
                if not (idempotent and reused and not conn.received_any):
                    raise
                conn = await self._connect()
                try:
                    response = await conn.request(head, body, factory)
                except BaseException:
                    conn.close()
                    raise
            except BaseException:  # cancelled (a caller's deadline) or a protocol error: never reuse or leak
                conn.close()
                raise
            if conn.reusable and generation == self._generation:
                self._idle.append(conn)
            else:
                conn.close()
            return response

    def close(self) -> None:
        """Close every connection: the idle ones now, those in use when their request ends."""
        self._generation += 1
        for conn in self._idle:
            conn.close()
        self._idle.clear()


def request_head(method: str, host: str, path: str, headers: list[tuple[str, str]], length: int, *,
                 content_type: str | None = wire.CONTENT_TYPE) -> bytes:
    """The request line and headers of every request the client sends (``path`` percent-encoded, with its query);
    ``content_type`` None sends none (a plain S3 request)."""
    lines = [f"{method} {path} HTTP/1.1", f"host: {host}", f"content-length: {length}"]
    if content_type is not None:
        lines.append(f"content-type: {content_type}")
    lines += [f"{k}: {v}" for k, v in headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
