"""The S3 protocol layer as one ASGI callable: parse → authenticate → route → handler → response,
with every failure written once as S3 error XML."""

from __future__ import annotations

import hashlib
import logging
import re
import time
from typing import TYPE_CHECKING

from ..asgi import BodyTimeout, ClientDisconnected, Receive, Request, Scope, Send, send_response
from ..engine import errors as storage
from ..engine.store import Engine
from ..metrics import CLIENT_CLOSED, SCOPE_OPERATION, RequestMetrics
from . import bucket_handlers, multipart_handlers, object_handlers
from .auth import CredentialLookup, authenticate
from .call import Call, Response
from .errors import S3Error, from_storage_error
from .router import ROUTES, Route, resolve, split_target
from .xml import escape

if TYPE_CHECKING:
    from ..settings import Settings

log = logging.getLogger("ctxstore.s3")

_HANDLER_MODULES = (bucket_handlers, object_handlers, multipart_handlers)
# An unread body larger than this makes us close the connection after an early error rather than
# let the server swallow it.
_DRAIN_LIMIT = 64 << 10


def _handlers() -> dict[str, object]:
    table: dict[str, object] = {}
    for route in ROUTES:
        for module in _HANDLER_MODULES:
            fn = getattr(module, route.handler, None)
            if fn is not None:
                table[route.operation] = fn
                break
    return table


_XML_INVALID = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff]")


def _text(value: str) -> str:
    """Escaped for XML; characters XML 1.0 cannot carry at all (control characters) become U+FFFD."""
    return escape(_XML_INVALID.sub("\ufffd", value))


class S3Service:
    """Serves S3 requests against an engine, authenticating with a credential lookup."""

    def __init__(self, engine: Engine, lookup: CredentialLookup, settings: Settings) -> None:
        self.engine = engine
        self.lookup = lookup
        self.settings = settings
        self.handlers = _handlers()
        missing = {r.operation for r in ROUTES} - set(self.handlers) - {"UploadPartCopy"}
        if missing:
            raise RuntimeError(f"routes without a handler: {sorted(missing)}")
        self.metrics: RequestMetrics | None = None  # set by the App (server/metrics.py)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        req = Request(scope, receive, self.settings.body_timeout)
        operation = "Unknown"
        started = time.perf_counter()
        try:
            response, operation = await self._handle(req)
        except ClientDisconnected:
            log.info("%s %s: client disconnected during the body; nothing stored", req.method, req.raw_path)
            if self.metrics is not None:
                self.metrics.observe_request("s3", req, CLIENT_CLOSED, started, 0)
            return
        except S3Error as exc:
            response = self.error_response(req, exc)
        except storage.StorageError as exc:
            response = self.error_response(req, from_storage_error(exc))
        except BodyTimeout:
            response = self.error_response(req, S3Error("RequestTimeout"))
        except Exception:
            log.exception("internal error in %s %s", req.method, req.raw_path)
            response = self.error_response(req, S3Error("InternalError"))
        response.headers.append(("x-amz-request-id", req.request_id))
        if not req.body_done and self._has_unread_body(req):
            response.headers.append(("connection", "close"))
        await send_response(send, response.status, response.headers, response.body,
                            head=req.method == "HEAD", content_length=response.content_length)
        if self.metrics is not None:
            self.metrics.observe_request("s3", req, response.status, started,
                                         0 if req.method == "HEAD" else len(response.body))
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s %s %s -> %d in %.2f ms", operation, req.method, req.raw_path, response.status,
                      (time.perf_counter() - started) * 1000)

    async def _handle(self, req: Request) -> tuple[Response, str]:
        if req.method == "OPTIONS":
            raise S3Error("CORSResponse", "CORS is not enabled on ctxstore buckets.")
        target = split_target(req.raw_path, req.headers.get("host"), self.settings.domain)
        auth = authenticate(
            method=req.method, raw_path=req.raw_path, query_string=req.query_string, headers=req.headers,
            lookup=self.lookup, now=time.time(), virtual_bucket=target.bucket if target.virtual else None,
        )
        route: Route = resolve(req.method, target, req.query, req.headers)
        req.scope[SCOPE_OPERATION] = route.operation  # metrics: a failure from here on counts under it
        handler = self.handlers[route.operation]
        call = Call(req=req, auth=auth, service=self, bucket=target.bucket, key=target.key)
        return await handler(call), route.operation  # type: ignore[operator]

    @staticmethod
    def _has_unread_body(req: Request) -> bool:
        headers = req.headers
        if "transfer-encoding" in headers:
            return True
        length = headers.get("content-length", "0")
        if not length.isdigit() or int(length) == 0:
            return False
        return headers.get("expect", "").lower() == "100-continue" or int(length) > _DRAIN_LIMIT

    def error_response(self, req: Request, exc: S3Error) -> Response:
        headers = [(k.lower(), v) for k, v in exc.headers.items()]
        if exc.status in (304,) or req.method == "HEAD":
            return Response(exc.status, headers)
        resource = exc.resource or req.raw_path.split("?", 1)[0]
        parts = [f"<Code>{exc.code}</Code>", f"<Message>{_text(exc.message)}</Message>"]
        parts += [f"<{k}>{_text(v)}</{k}>" for k, v in exc.extra.items()]
        parts += [f"<Resource>{_text(resource)}</Resource>", f"<RequestId>{req.request_id}</RequestId>",
                  f"<HostId>{req.request_id}</HostId>"]
        body = ('<?xml version="1.0" encoding="UTF-8"?>\n<Error>' + "".join(parts) + "</Error>").encode("utf-8")
        headers.append(("content-type", "application/xml"))
        return Response(exc.status, headers, body)

    async def read_xml(self, call: Call) -> bytes:
        """A small XML request body, bounded by ``max_xml_size``."""
        body = await call.req.read_all(self.settings.max_xml_size)
        if body is None:
            raise S3Error("MaxMessageLengthExceeded")
        if call.auth.payload == "sha256":
            if hashlib.sha256(body).hexdigest() != (call.auth.content_sha256 or "").lower():
                raise S3Error("XAmzContentSHA256Mismatch")
        elif call.auth.payload.startswith("streaming"):
            raise S3Error("InvalidRequest", "aws-chunked bodies are accepted for object data only.")
        return body
