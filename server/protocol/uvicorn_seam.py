"""Every uvicorn internal the node relies on, named and typed in one place.

The node's HTTP protocol (:mod:`.http`) subclasses uvicorn's httptools protocol, and the data path below ASGI
(:mod:`.direct`) drives uvicorn's request cycle and flow control by hand. None of that is uvicorn's public API:
an upgrade may rename or drop any of it. So the rest of the node reaches uvicorn only through the types here —
:class:`Connection`, :class:`Cycle` and :class:`Flow` describe exactly the attributes and methods used, and
:data:`HttpToolsProtocol` is the one class subclassed — and ``tests/protocol/test_uvicorn_seam.py`` checks each
name against the installed uvicorn, so an upgrade that breaks the node fails there, naming what went missing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as _HttpToolsProtocol

__all__ = ["Connection", "Cycle", "Flow", "HttpToolsProtocol", "ServerState", "new_parser"]

HttpToolsProtocol = _HttpToolsProtocol  # the base class of the node's HTTP protocol


class Flow(Protocol):
    """uvicorn's ``FlowControl``: read pausing, and the write pause the transport signals."""

    write_paused: bool

    async def drain(self) -> None: ...  # until the transport is below its low-water mark again
    def pause_reading(self) -> None: ...
    def resume_reading(self) -> None: ...


class Cycle(Protocol):
    """uvicorn's ``RequestResponseCycle``: one request's body as the parser delivers it, and its response state."""

    @property
    def scope(self) -> object: ...  # the request's ASGI scope

    body: bytearray  # body bytes the parser delivered and nobody took yet
    more_body: bool  # the parser has not seen the body's end
    disconnected: bool  # the connection went before the response was complete
    keep_alive: bool
    waiting_for_100_continue: bool
    response_started: bool
    response_complete: bool
    default_headers: list[tuple[bytes, bytes]]  # the ``date`` (and ``server``) headers, renewed each second
    message_event: asyncio.Event  # set on more body, the body's end, a disconnect or the response's completion

    def on_response(self) -> None: ...  # the response is complete: start a pipelined request or the keep-alive


class ServerState(Protocol):
    """uvicorn's ``ServerState``, shared by every connection."""

    default_headers: list[tuple[bytes, bytes]]


class Connection(Protocol):
    """An instance of uvicorn's httptools protocol: its per-connection state, the parser callbacks the node
    extends and the transport callbacks the data path forwards."""

    transport: asyncio.Transport
    loop: asyncio.AbstractEventLoop
    parser: httptools.HttpRequestParser
    headers: list[tuple[bytes, bytes]]  # its headers so far

    @property
    def flow(self) -> Flow: ...

    @property
    def server_state(self) -> ServerState: ...

    @property
    def scope(self) -> object: ...  # the ASGI scope of the request being parsed

    @property
    def cycle(self) -> Cycle | None: ...  # the request being answered (None before the first)

    @property
    def pipeline(self) -> Any: ...  # requests parsed behind the one being answered: (cycle, app) pairs

    # transport callbacks
    def connection_made(self, transport: asyncio.Transport) -> None: ...
    def connection_lost(self, exc: Exception | None) -> None: ...
    def eof_received(self) -> None: ...
    def pause_writing(self) -> None: ...
    def resume_writing(self) -> None: ...
    # parser callbacks
    def on_message_begin(self) -> None: ...
    def on_url(self, url: bytes) -> None: ...
    def on_header(self, name: bytes, value: bytes) -> None: ...
    def on_headers_complete(self) -> None: ...
    # uvicorn's own hooks
    def send_400_response(self, msg: str) -> None: ...  # answers a request the parser refused
    def shutdown(self) -> None: ...  # the server's graceful shutdown, per connection


def new_parser(connection: Connection) -> httptools.HttpRequestParser:
    """A fresh request parser calling back into ``connection``, set up as uvicorn sets up its own."""
    parser = httptools.HttpRequestParser(connection)
    set_leniencies: Callable[..., None] | None = getattr(parser, "set_dangerous_leniencies", None)
    if set_leniencies is not None:  # httptools >= 0.6.3
        set_leniencies(lenient_data_after_close=True)
    return parser


def as_connection(protocol: _HttpToolsProtocol) -> Connection:
    """uvicorn's protocol seen through :class:`Connection` (checked by mypy: uvicorn's own annotations must
    agree with the ones above)."""
    connection: Connection = protocol
    return connection
