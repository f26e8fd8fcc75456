"""The request shell every data-path request goes through, S3 and bulk alike.

A service (:class:`Service`) parses, authenticates and handles a request and knows how to encode an error in its
own protocol; the shell does the rest, once: it runs the handler, turns every failure into the service's error
answer (and an unexpected one into an internal error, logged), decides whether the connection can be kept
after an answer given before the body was read, adds the request id, sends the reply's buffers without
copying them (below ASGI, when the server offers it: all of them in one ``writelines``, :mod:`.direct`), and
counts the request in the metrics.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ..metrics import CLIENT_CLOSED, RequestMetrics
from .asgi import BodyTimeout, Buffer, ClientDisconnected, Receive, Request, Scope, Send, ascii_int, send_response
from .direct import SCOPE_KEY
from .errors import Reject, RequestError

log = logging.getLogger("ctxstore.request")

# An answer given before the body was read keeps the connection only if the server can discard what is left
# of a declared body of at most this many bytes; anything bigger, of unknown length, or still held back by
# `Expect: 100-continue` closes it, so the next request on it cannot be mistaken for body bytes.
DRAIN_LIMIT = 1 << 20


@dataclass
class Reply:
    """A response: status, headers and body buffers (sent as they are, in order)."""

    status: int = 200
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: Buffer | Sequence[Buffer] = b""
    content_length: int | None = None  # HEAD: the length of the body a GET would send
    after: list[Callable[[], None]] = field(default_factory=list)  # called once the body was sent (or not)


class Service(Protocol):
    """A protocol over the shell: S3 or bulk."""

    api: str  # the ``api`` label of the request metrics
    answerable: tuple[type[Exception], ...]  # failures error_reply encodes; anything else is an internal error

    async def handle(self, req: Request) -> Reply: ...

    def error_reply(self, req: Request, exc: Exception) -> Reply: ...


@dataclass(frozen=True)
class BodyLimits:
    """How long a request body may stall, and how slowly it may arrive."""

    timeout: float = 30.0
    min_rate: int = 64 << 10  # bytes per second, measured over each timeout


async def serve(service: Service, metrics: RequestMetrics, limits: BodyLimits,
                scope: Scope, receive: Receive, send: Send) -> None:
    """Answer one request with ``service``."""
    req = Request(scope, receive, limits.timeout, limits.min_rate)
    started = time.perf_counter()
    stalled = False
    try:
        reply = await service.handle(req)
    except ClientDisconnected:
        log.info("%s %s: client disconnected during the body; nothing stored", req.method, req.raw_path)
        metrics.observe_request(service.api, req, CLIENT_CLOSED, started, 0)
        req.scope.pop(SCOPE_KEY, None)
        return
    except BodyTimeout:
        stalled = True  # the rest of the body may never come: the connection cannot be kept
        reply = service.error_reply(req, RequestError(Reject.BODY_TIMEOUT))
    except service.answerable as exc:
        reply = service.error_reply(req, exc)
    except Exception:
        log.exception("internal error in %s %s %s", service.api, req.method, req.raw_path)
        reply = service.error_reply(req, RequestError(Reject.INTERNAL))
    finally:
        await req.close_body()
    reply.headers.append(("x-amz-request-id", req.request_id))
    if stalled or must_close(req):
        reply.headers.append(("connection", "close"))
    head = req.method == "HEAD"
    status = reply.status
    try:
        if req.direct is not None:
            body = reply.body
            parts: Sequence[Buffer] = (body,) if isinstance(body, (bytes, bytearray, memoryview)) else body
            length = sum(len(p) for p in parts) if reply.content_length is None else reply.content_length
            written = await req.direct.respond(reply.status, reply.headers, parts, head=head, length=length)
            sent = 0 if head or not written else length
            if not written:  # the client closed or half-closed the connection first: nothing was sent
                status = CLIENT_CLOSED
        else:
            sent = await send_response(send, reply.status, reply.headers, reply.body, head=head,
                                       content_length=reply.content_length)
    finally:
        for done in reply.after:  # e.g. the leases of the payloads being sent: they may be freed now
            done()
        # The channel refers to uvicorn's cycle, whose scope refers to the channel: break that cycle now rather
        # than leave the request's objects (and any read-ahead buffer) to the garbage collector.
        req.scope.pop(SCOPE_KEY, None)
    metrics.observe_request(service.api, req, status, started, sent)
    if log.isEnabledFor(logging.DEBUG):
        log.debug("%s %s %s -> %d in %.2f ms", service.api, req.method, req.raw_path, status,
                  (time.perf_counter() - started) * 1000)


def must_close(req: Request) -> bool:
    """Whether the connection must close after this answer because part of the request body was not read."""
    if req.body_done:
        return False
    headers = req.headers
    if "transfer-encoding" in headers:
        return True
    length = ascii_int(headers.get("content-length", "0"))
    if length is None:
        return True
    if length == 0:
        return False
    return headers.get("expect", "").lower() == "100-continue" or length > DRAIN_LIMIT
