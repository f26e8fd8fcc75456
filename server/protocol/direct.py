"""The data path below ASGI: a request body read straight into the caller's buffers (``recv_into``) and a
whole response handed to the transport in one ``writelines``.

Why (docs/benchmarks.md, "Restore, save and lookup"): through ASGI a bulk get awaited one ``send`` per block
and the transport paused above 64 KiB buffered, so a restore of 2048 blocks made 2,054 ``write()`` calls (87 %
of the node's CPU); a put's body was copied three times in user space (the HTTP layer's bytearray, a new
``bytes`` per ASGI message, the body reader's copy into the block's buffer) before its checksums ran.

The node's HTTP protocol (uvicorn's httptools protocol, subclassed in :mod:`.http`) puts a
:class:`DirectChannel` into the scope of every request (``scope[SCOPE_KEY]``). The request shell
(:mod:`.shell`) answers through it and :meth:`.asgi.Request.readinto` reads through it when it is there; plain
ASGI is the fallback (in-process tests, another server). What the ASGI path does, it keeps: the body deadline
(:mod:`.deadline`, the same rule), ``Expect: 100-continue``, the protocol's write watchdog (its own
``pause_writing``), the default headers (``date``), keep-alive and pipelining (uvicorn's request cycle is
completed exactly as its own ``send`` completes it).

Reading. Bytes the HTTP parser already took (at most one read of the socket, and up to 64 KiB more while the
handler has not asked) are copied out of the cycle's buffer. Then, for a body with a ``Content-Length`` on a
plain TCP connection, the channel *detaches* the body: the transport's protocol becomes a
:class:`asyncio.BufferedProtocol` whose ``get_buffer`` is the destination itself, so the kernel copies each
payload into its final buffer and nothing in user space touches it. The sink never asks for more than the body
has left, so the next request stays in the kernel; when the body ends, the HTTP protocol is put back with a
fresh parser. Behind TLS the bytes are decrypted in user space anyway, and there the channel keeps reading what
the parser delivers.

Writing. The head (status line, default headers, the reply's headers, Content-Length) and every body buffer go
to ``transport.writelines`` at once; the event loop sends them with as few ``writev`` calls as the socket takes
and keeps the rest referenced, not copied. :meth:`DirectChannel.respond` returns once the transport is below its
low-water mark again (when the ASGI path's last ``send`` would have returned), so a reply's ``after`` hooks
(leases) still run after the send. An answer that finds the connection's output closed (the client closed or
half-closed it, or the node ended it after an earlier answer) is dropped and counted, never written.

uvicorn's protocol and request cycle are reached through :mod:`.uvicorn_seam` only.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Sequence
from http import HTTPStatus
from typing import Protocol

from .deadline import BodyDeadline, BodyTimeout
from .uvicorn_seam import Connection, Cycle

SCOPE_KEY = "ctxstore.direct"  # where the HTTP protocol puts a request's channel

Buffer = bytes | bytearray | memoryview

_SCRATCH = 64 << 10  # bytes read ahead when no destination is waiting, and the discard buffer's size
_HEADER_VALUE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")  # what uvicorn refuses in a header value
_HEADER_NAME = re.compile(r'[\x00-\x1f\x7f()<>@,;:\\[\]={} \t\\"]')


def _status_line(status: int) -> bytes:
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = ""
    return f"HTTP/1.1 {status} {phrase}\r\n".encode("latin-1")


STATUS_LINES = {status: _status_line(status) for status in range(100, 600)}
_defaults: tuple[object, bytes] = (None, b"")


def _default_headers(headers: list[tuple[bytes, bytes]]) -> bytes:
    """uvicorn's default headers (the ``date``), as bytes: joined once per list (uvicorn makes a new one each
    second)."""
    global _defaults
    if _defaults[0] is not headers:
        _defaults = (headers, b"".join(name + b": " + value + b"\r\n" for name, value in headers))
    return _defaults[1]


class ClientDisconnected(Exception):
    """The client went away before its request body was complete: nothing to answer, nothing stored."""


class HttpConnection(Connection, Protocol):
    """The node's HTTP protocol (:class:`.http.NodeHttpProtocol`) as the data path uses it: uvicorn's
    protocol, plus the state of the connection's output."""

    def output_open(self) -> bool: ...  # whether an answer can still be written
    def answer_dropped(self) -> None: ...  # count an answer that found the output closed
    def end_output(self) -> None: ...  # nothing more may be written: requests not yet answered are dropped


LINGER_SECONDS = 2.0  # how long a closing connection reads away a body still arriving (then it closes)
LINGER_BYTES = 64 << 20  # and at most this much of it


class _Linger(asyncio.BufferedProtocol):
    """The transport's protocol after an answer that closes the connection while the client may still be
    sending its body. The answer went out with a FIN after it (``write_eof``); what still arrives is read
    and dropped, because closing a socket with unread bytes makes the kernel send a reset, and a reset can
    destroy the answer before the client has read it (the client then sees a dropped connection instead of
    its 4xx). Closes at the client's EOF, past :data:`LINGER_BYTES` or after :data:`LINGER_SECONDS`."""

    def __init__(self, transport: asyncio.Transport, http: HttpConnection) -> None:
        self._transport = transport
        self._http = http
        self._left = LINGER_BYTES
        self._buf = memoryview(bytearray(_SCRATCH))
        self._timer = http.loop.call_later(LINGER_SECONDS, self._close)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._buf

    def buffer_updated(self, nbytes: int) -> None:
        self._left -= nbytes
        if self._left <= 0:
            self._close()

    def eof_received(self) -> bool | None:
        self._close()
        return False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # pragma: no cover - never the first
        pass

    def connection_lost(self, exc: Exception | None) -> None:
        self._timer.cancel()
        self._http.connection_lost(exc)

    def pause_writing(self) -> None:
        self._http.pause_writing()

    def resume_writing(self) -> None:
        self._http.resume_writing()

    def _close(self) -> None:
        self._timer.cancel()
        self._transport.close()


def close_lingering(http: HttpConnection) -> None:
    """Close a connection after its answer was written, when the client may still be sending a body behind
    it: a FIN after the answer, then what still arrives is read away (:class:`_Linger`). Where the transport
    cannot half-close, it closes at once. Either way nothing more is written on it (``http.end_output``)."""
    transport = http.transport
    http.end_output()
    if not transport.can_write_eof():
        transport.close()
        return
    transport.write_eof()
    transport.set_protocol(_Linger(transport, http))
    http.flow.resume_reading()


class _BodySink(asyncio.BufferedProtocol):
    """The transport's protocol while a detached body is read: the kernel writes into the channel's
    destination. Everything else (connection lost, EOF, write flow control) goes on to the HTTP protocol."""

    def __init__(self, channel: DirectChannel, http: HttpConnection) -> None:
        self.channel = channel
        self.http = http

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.channel._buffer()

    def buffer_updated(self, nbytes: int) -> None:
        self.channel._received(nbytes)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # pragma: no cover - never the first
        pass

    def connection_lost(self, exc: Exception | None) -> None:
        self.channel._lost()
        self.http.connection_lost(exc)

    def eof_received(self) -> bool | None:
        self.http.eof_received()
        return None

    def pause_writing(self) -> None:
        self.http.pause_writing()

    def resume_writing(self) -> None:
        self.http.resume_writing()


class DirectChannel:
    """One request's body and response below ASGI, on uvicorn's httptools protocol ``http`` and its request
    cycle. ``reattach`` puts the HTTP protocol back on the transport with a fresh parser."""

    def __init__(self, http: HttpConnection, cycle: Cycle, *, length: int | None, detachable: bool,
                 reattach: Callable[[], None]) -> None:
        self._http = http
        self._cycle = cycle
        self._transport = http.transport
        self._flow = http.flow
        self._loop = http.loop
        self._length = length  # Content-Length; None: chunked (read through the parser only)
        self._detachable = detachable and length is not None
        self._reattach = reattach
        self.timeout = 30.0  # the body timeout and minimum rate: set by the request (the node's settings)
        self.min_rate = 64 << 10
        self._taken = 0  # body bytes handed to the caller (or discarded)
        self._offset = 0  # bytes of cycle.body already taken
        self._sink: _BodySink | None = None
        self._remaining = 0  # while detached: body bytes still in the socket
        self._dests: list[memoryview] | None = None  # while a read waits: the buffers the kernel fills in turn
        self._current = 0  # the one being filled
        self._filled = 0  # bytes of it filled
        self._pending = bytearray()  # bytes the sink read while nobody waited (at most _SCRATCH)
        self._scratch: memoryview | None = None
        self._discard = False
        self._waiter: asyncio.Future[None] | None = None
        self._watch: BodyDeadline | None = None
        self._lost_connection = False
        self.body_done = length == 0

    # ------------------------------------------------------------------ reading

    async def readinto(self, view: memoryview) -> int:
        """Fill ``view`` with body bytes; fewer only where the body ends. Raises :class:`ClientDisconnected` and
        :class:`BodyTimeout`."""
        cycle = self._cycle
        if cycle.waiting_for_100_continue and self._http.output_open():
            self._transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            cycle.waiting_for_100_continue = False
        want = len(view)
        filled = 0
        while filled < want and not self.body_done:
            if self._watch is not None and self._watch.expired:
                raise BodyTimeout()
            if self._sink is not None:
                filled += await self._read_detached(view[filled:])
                continue
            body = cycle.body
            available = len(body) - self._offset
            if available:
                take = min(available, want - filled)
                with memoryview(body) as source:
                    view[filled:filled + take] = source[self._offset:self._offset + take]
                self._offset += take
                filled += take
                self._count(take)
                if self._offset == len(body):
                    cycle.body = bytearray()  # what uvicorn's receive() does once it handed the bytes on
                    self._offset = 0
                continue
            if not cycle.more_body:
                self.body_done = True
                break
            if cycle.disconnected or self._lost_connection:
                raise ClientDisconnected()
            if self._detachable:
                self._detach()
                continue
            await self._wait_parser()
        if self._length is not None and self._taken >= self._length:
            self.body_done = True
        return filled

    async def readinto_many(self, views: list[memoryview]) -> int:
        """Fill each of ``views`` in turn (fewer bytes only where the body ends). Detached, the kernel fills
        them one after another and the caller wakes once: one wait for a run of small blocks, not one each."""
        views = [view for view in views if len(view)]  # an empty buffer would stop the transport
        total = 0
        left = sum(len(view) for view in views)
        for i, view in enumerate(views):
            if self._sink is not None and not self._pending and not self.body_done and left <= self._remaining:
                return total + await self._wait_detached(views[i:])
            n = await self.readinto(view)
            total += n
            left -= len(view)
            if n < len(view):
                break
        return total

    def _count(self, n: int) -> None:
        self._taken += n
        if self._watch is not None:
            self._watch.arrived(n)
        if self._length is not None and self._taken >= self._length:
            self.body_done = True
            self._stop_watch()

    def _start_watch(self) -> None:
        if self._watch is None and not self.body_done:
            self._watch = BodyDeadline(self._loop, self.timeout, self.min_rate, self._expired)

    def _stop_watch(self) -> None:
        if self._watch is not None:
            self._watch.stop()

    def _expired(self) -> None:
        self._wake(BodyTimeout())
        self._cycle.message_event.set()

    async def _wait_parser(self) -> None:
        """Until the parser delivers more of the body, the connection goes or the body's deadline passes
        (each sets the cycle's message event)."""
        self._start_watch()
        self._flow.resume_reading()
        event: asyncio.Event = self._cycle.message_event
        await event.wait()
        event.clear()

    def _detach(self) -> None:
        """Move the rest of the body off the parser: the transport reads it into the caller's buffers."""
        assert self._length is not None
        self._remaining = self._length - self._taken
        self._sink = _BodySink(self, self._http)
        self._start_watch()
        self._transport.set_protocol(self._sink)

    async def _read_detached(self, view: memoryview) -> int:
        """Fill ``view`` (or what the body has left of it) straight from the socket."""
        n = min(len(view), len(self._pending) + self._remaining)
        if not n:
            self.body_done = True
            return 0
        view = view[:n]
        pos = 0
        if self._pending:
            take = min(n, len(self._pending))
            view[:take] = self._pending[:take]
            del self._pending[:take]
            pos = take
            self._count(take)
        if pos < n:
            await self._wait_detached([view[pos:]])
        return n

    async def _wait_detached(self, views: list[memoryview]) -> int:
        """Let the kernel fill ``views`` (all within what the body has left) in turn; returns their bytes."""
        if self._lost_connection:
            raise ClientDisconnected()
        self._dests, self._current, self._filled = views, 0, 0
        self._waiter = self._loop.create_future()
        self._flow.resume_reading()
        try:
            await self._waiter
        finally:
            self._waiter = None
            self._dests = None
        return sum(len(v) for v in views)

    def _buffer(self) -> memoryview:
        """The sink's ``get_buffer``: the waiting destination, else a scratch buffer (never more than the body
        has left, so the next request's bytes stay in the kernel)."""
        if self._dests is not None and not self._discard:
            return self._dests[self._current][self._filled:]
        if self._scratch is None:
            self._scratch = memoryview(bytearray(_SCRATCH))
        return self._scratch[:min(_SCRATCH, self._remaining)]

    def _received(self, n: int) -> None:
        """The sink's ``buffer_updated``."""
        self._remaining -= n
        if self._discard:
            self._taken += n
        elif self._dests is not None:
            self._filled += n
            self._count(n)
            if self._filled == len(self._dests[self._current]):
                self._current += 1
                self._filled = 0
                if self._current == len(self._dests):
                    self._dests = None
                    if self._remaining:
                        self._flow.pause_reading()  # until the caller hands over its next buffers
                    self._wake(None)
        else:
            assert self._scratch is not None
            self._pending += self._scratch[:n]
            self._flow.pause_reading()
        if not self._remaining:
            self._end_detached()

    def _end_detached(self) -> None:
        """The whole body is in: the HTTP protocol reads what comes next (e.g. a pipelined request)."""
        if self._sink is not None and not self._lost_connection:
            self._sink = None
            self._stop_watch()
            self._reattach()

    def _wake(self, exc: BaseException | None) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            if exc is None:
                waiter.set_result(None)
            else:
                waiter.set_exception(exc)

    def _lost(self) -> None:
        self._lost_connection = True
        self._stop_watch()
        self._wake(ClientDisconnected())

    def close_body(self) -> None:
        """The handler is done with the body: no deadline may fire later, no buffer of its is written to."""
        self._stop_watch()
        self._dests = None

    # ------------------------------------------------------------------ writing

    def _close_after_answer(self) -> None:
        """Close once the answer is out; if the client may still be sending its body, linger (:class:`_Linger`)
        so that its bytes left unread do not reset the connection before it has read the answer."""
        transport = self._transport
        unread = self._sink is not None or self._cycle.more_body
        if self.body_done or not unread or self._lost_connection:
            transport.close()
            return
        self._stop_watch()
        self._sink = None
        close_lingering(self._http)

    async def respond(self, status: int, headers: Sequence[tuple[str, str]], parts: Sequence[Buffer], *,
                      head: bool, length: int) -> bool:
        """Write a whole response: head and every body buffer in one ``writelines``; completes uvicorn's cycle
        (keep-alive, pipelined requests) as its own ``send`` does, then waits until the transport is below its
        low-water mark. Returns False when the connection's output was closed and nothing was written. Raises
        RuntimeError (before writing anything) for a header uvicorn would refuse."""
        cycle = self._cycle
        flow = self._flow
        if flow.write_paused and not cycle.disconnected:
            await flow.drain()
        if cycle.disconnected or not self._http.output_open():
            # The client closed or half-closed the connection (or the node ended it): not a byte is written, and
            # uvicorn is told the cycle is over without an answer (it would log one missing).
            cycle.disconnected = True
            self._http.answer_dropped()
            return False
        names = [name.lower() for name, _ in headers]
        values = [value for _, value in headers]
        if _HEADER_NAME.search("".join(names)):
            raise RuntimeError("Invalid HTTP header name.")
        if _HEADER_VALUE.search("".join(values)):
            raise RuntimeError("Invalid HTTP header value.")
        if "connection" in names and any(n == "connection" and "close" in v.lower() for n, v in zip(names, values)):
            cycle.keep_alive = False
            close = ""
        else:
            close = "" if cycle.keep_alive else "connection: close\r\n"
        text = "".join([f"{name}: {value}\r\n" for name, value in zip(names, values)])
        start = b"".join((STATUS_LINES.get(status) or _status_line(status), _default_headers(cycle.default_headers),
                         f"{text}content-length: {length}\r\n{close}\r\n".encode("latin-1")))
        cycle.response_started = True
        cycle.waiting_for_100_continue = False
        out: list[Buffer] = [start]
        if not head:
            out += [part for part in parts if len(part)]
        if len(out) == 1:
            self._transport.write(out[0])
        else:
            self._transport.writelines(out)
        cycle.response_complete = True
        cycle.message_event.set()
        if not cycle.keep_alive:
            self._close_after_answer()
        elif self._sink is not None and not self._lost_connection:
            # Answered before the detached body was read: read the rest of it away (the shell closes the
            # connection instead when more than a small remainder is owed), then parse the next request.
            self._discard = True
            self._stop_watch()
            self._pending.clear()
            flow.resume_reading()
        cycle.on_response()
        while flow.write_paused and not cycle.disconnected:
            await flow.drain()
        return True
