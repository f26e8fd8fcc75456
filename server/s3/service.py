"""The S3 service over the request shell: find the target, authenticate, route to the row's handler; every
failure is written once as S3 error XML (headers only for HEAD, ``Retry-After`` on 503)."""

from __future__ import annotations

import re
import time

from ..engine import Engine, StorageError
from ..metrics import SCOPE_OPERATION
from ..protocol.asgi import Request
from ..protocol.auth import CredentialLookup, authenticate
from ..protocol.errors import RequestError
from ..protocol.shell import Reply
from ..settings import Settings
from .call import Call
from .errors import S3Error, as_s3_error
from .router import resolve
from .target import split_target
from .xml import escape

_XML_INVALID = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff]")


def _text(value: str) -> str:
    """Escaped for XML; characters XML 1.0 cannot carry at all (control characters) become U+FFFD."""
    return escape(_XML_INVALID.sub("\ufffd", value))


class S3Service:
    """Serves S3 requests against an engine, authenticating with a credential lookup."""

    api = "s3"
    answerable: tuple[type[Exception], ...] = (S3Error, RequestError, StorageError)

    def __init__(self, engine: Engine, lookup: CredentialLookup, settings: Settings) -> None:
        self.engine = engine
        self.lookup = lookup
        self.settings = settings

    async def handle(self, req: Request) -> Reply:
        if req.method == "OPTIONS":
            raise S3Error("CORSResponse", "CORS is not enabled on ctxstore buckets.")
        target = split_target(req.raw_path, req.headers.get("host"), self.settings.domain)
        auth = authenticate(
            method=req.method, raw_path=req.raw_path, query_string=req.query_string, headers=req.headers,
            lookup=self.lookup, now=time.time(), virtual_bucket=target.bucket if target.virtual else None,
        )
        route = resolve(req.method, target, req.query, req.headers)
        req.scope[SCOPE_OPERATION] = route.operation  # metrics: a failure from here on counts under it
        assert route.handler is not None  # resolve() answers NotImplemented for rows without one
        call = Call(req=req, auth=auth, engine=self.engine, settings=self.settings, bucket=target.bucket,
                    key=target.key)
        return await route.handler(call)

    def error_reply(self, req: Request, exc: Exception) -> Reply:
        error = as_s3_error(exc)
        headers = [(k.lower(), v) for k, v in error.headers.items()]
        if error.status == 304 or req.method == "HEAD":
            return Reply(error.status, headers)
        resource = error.resource or req.raw_path.split("?", 1)[0]
        parts = [f"<Code>{error.code}</Code>", f"<Message>{_text(error.message)}</Message>"]
        parts += [f"<{k}>{_text(v)}</{k}>" for k, v in error.extra.items()]
        parts += [f"<Resource>{_text(resource)}</Resource>", f"<RequestId>{req.request_id}</RequestId>",
                  f"<HostId>{req.request_id}</HostId>"]
        body = ('<?xml version="1.0" encoding="UTF-8"?>\n<Error>' + "".join(parts) + "</Error>").encode("utf-8")
        headers.append(("content-type", "application/xml"))
        return Reply(error.status, headers, body)
