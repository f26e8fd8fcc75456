"""The node's HTTP protocol: uvicorn's httptools protocol (reached through :mod:`.uvicorn_seam`) with the limits
uvicorn lacks, the data path below ASGI (:mod:`.direct`) on every request, and answers to a closed connection
dropped and counted instead of raised.

What it adds to uvicorn's protocol:

- a cap on the request line plus headers (uvicorn has none): past it, 400 and the connection closes;
- deadlines: a new connection that sends nothing closes after ``idle_timeout`` (uvicorn only times out idle
  connections after a first response); a request whose line and headers are still incomplete ``header_timeout``
  after its first byte closes (uvicorn cancels its only timer on any byte, so a client dribbling a header would
  hold the connection forever); a response the client stopped reading (the write buffer full and not draining
  for ``write_timeout``) is dropped, freeing what it was sending;
- a :class:`~.direct.DirectChannel` in every request's scope (``scope[SCOPE_KEY]``), which the request shell
  answers through and the body readers read through;
- a 400 for a request the parser refused that lingers instead of closing at once (:func:`~.direct.close_lingering`);
- once the connection's output is closed (by the node after an answer, or by the client's half-close or close),
  any answer still to come is dropped without a write and counted in ``writes_after_close``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Protocol

from .direct import SCOPE_KEY, STATUS_LINES, DirectChannel, close_lingering
from .uvicorn_seam import HttpToolsProtocol, new_parser

__all__ = ["Counters", "HttpOptions", "NodeHttpProtocol", "body_length"]


@dataclass(frozen=True)
class HttpOptions:
    """The limits of the node's HTTP protocol (from the node's settings); a ``None`` deadline is off."""

    max_header_size: int = 64 << 10  # bytes of request line plus headers
    idle_timeout: float | None = None  # seconds a new connection may stay silent
    header_timeout: float | None = None  # seconds from a request's first byte to the end of its headers
    write_timeout: float | None = None  # seconds a paused response may go without the client taking a byte


class Counters(Protocol):
    """Where the protocol counts what it does quietly (the node's request metrics)."""

    writes_after_close: int  # answers dropped: the connection's output was closed


class NodeHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with :class:`HttpOptions`. uvicorn makes one per connection, calling what
    it is configured with by keyword only, so the node configures it as
    ``functools.partial(NodeHttpProtocol, options=..., counters=...)``."""

    def __init__(self, *args: Any, options: HttpOptions, counters: Counters, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.options = options
        self.counters = counters
        self._header_bytes = 0
        self._header_timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None
        self._write_seen = 0
        self._tls = False
        self._output_ended = False

    # ------------------------------------------------------------------ the connection's output

    def output_open(self) -> bool:
        """Whether an answer can still be written: the node has not ended the output (a FIN after an answer)
        and the transport is not closing (the client closed or half-closed, a deadline closed it)."""
        return not self._output_ended and not self.transport.is_closing()

    def answer_dropped(self) -> None:
        """An answer found the output closed and was not written."""
        self.counters.writes_after_close += 1

    def end_output(self) -> None:
        """Nothing more is written on this connection: every request not yet answered (the one in progress,
        pipelined ones) is marked disconnected, so that its answer is dropped, its body read ends, and uvicorn's
        own ``send`` and ``receive`` write nothing either (not even a 100 Continue)."""
        self._output_ended = True
        cycles = [self.cycle, *(cycle for cycle, _ in self.pipeline)]
        for cycle in cycles:
            if cycle is not None and not cycle.response_complete:
                cycle.disconnected = True
                cycle.waiting_for_100_continue = False
                cycle.message_event.set()

    # ------------------------------------------------------------------ transport callbacks

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]  # as uvicorn's
        super().connection_made(transport)
        # Behind TLS the body is decrypted in user space anyway: it is read through the parser there.
        self._tls = transport.get_extra_info("sslcontext") is not None
        self._arm(self.options.idle_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._stop_watching_writes()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self.options.write_timeout is not None and self._write_timer is None:
            self._write_seen = self.transport.get_write_buffer_size()
            self._write_timer = self.loop.call_later(self.options.write_timeout, self._check_writes)

    def resume_writing(self) -> None:
        self._stop_watching_writes()
        super().resume_writing()

    def _check_writes(self) -> None:
        """Paused all along: drop the connection unless the client took some bytes meanwhile."""
        self._write_timer = None
        pending = self.transport.get_write_buffer_size()
        if pending and pending >= self._write_seen:
            self.transport.abort()  # uvicorn then unblocks the response's sends; they go nowhere
        elif pending and self.options.write_timeout is not None:
            self._write_seen = pending
            self._write_timer = self.loop.call_later(self.options.write_timeout, self._check_writes)

    def _stop_watching_writes(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    # ------------------------------------------------------------------ parser callbacks

    def on_message_begin(self) -> None:
        self._header_bytes = 0
        self._arm(self.options.header_timeout)
        super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value) + 4)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and cycle.scope is self.scope:  # a request cycle was made (not an upgrade)
            self.scope[SCOPE_KEY] = DirectChannel(  # type: ignore[literal-required]
                self, cycle, length=body_length(self.headers), detachable=not self._tls,
                reattach=self.reattach)

    def _count(self, n: int) -> None:
        self._header_bytes += n
        if self._header_bytes > self.options.max_header_size:
            # Raised inside a parser callback: uvicorn answers 400 and closes the connection.
            raise ValueError("request headers too large")

    # ------------------------------------------------------------------ uvicorn's hooks

    def send_400_response(self, msg: str) -> None:
        # uvicorn's answer to a request its parser refused (or whose headers were too large), as uvicorn
        # writes it; but the connection lingers instead of closing at once: the client may still be sending a
        # body behind the bad head, and closing with its bytes unread made the kernel reset the connection
        # before the client read the 400 (the S3 fuzzer's rare "no answer").
        self._disarm()
        if not self.output_open():
            self.answer_dropped()
            self.transport.close()
            return
        self.transport.write(b"".join([
            STATUS_LINES[400],
            *(name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers),
            b"content-type: text/plain; charset=utf-8\r\n",
            b"content-length: %d\r\n" % len(msg), b"connection: close\r\n\r\n", msg.encode("ascii"),
        ]))
        close_lingering(self)

    def shutdown(self) -> None:
        # On SIGTERM uvicorn closes idle connections and waits until every one is gone. Closing a TLS
        # connection waits for the peer's close_notify (up to 30 s), which an idle pooled client never sends:
        # the drain would last the whole drain_timeout with nothing in flight. A connection with no request in
        # progress and nothing left to write is dropped at once instead.
        idle = self.cycle is None or self.cycle.response_complete
        if idle and not self.transport.get_write_buffer_size():
            self._disarm()
            self.transport.abort()
        else:
            super().shutdown()

    # ------------------------------------------------------------------ the data path and the header timer

    def reattach(self) -> None:
        """After a body read below the parser: this protocol reads the connection again, with a fresh parser
        (the old one never saw the body's bytes)."""
        self.parser = new_parser(self)
        self.transport.set_protocol(self)

    def _arm(self, timeout: float | None) -> None:
        self._disarm()
        if timeout is not None:
            self._header_timer = self.loop.call_later(timeout, self._headers_timed_out)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_timed_out(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.close()


def body_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    """The body's length from the request headers: Content-Length, 0 without one; None when chunked (or a
    length that is not one number)."""
    length = 0
    seen = False
    for name, value in headers:
        if name == b"transfer-encoding":
            return None
        if name == b"content-length":
            text = value.strip()
            if seen or not text.isdigit():
                return None
            length, seen = int(text), True
    return length
