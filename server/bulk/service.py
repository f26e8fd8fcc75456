"""The bulk service over the request shell: ``POST /_ctx/v1/bulk/<bucket>/<op>``, SigV4-signed exactly like S3
and scoped to the signer's tenant; every failure is written once as a msgpack error frame."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

from ctxstore import wire

from ..engine import Engine, StorageError
from ..metrics import SCOPE_OPERATION
from ..protocol.asgi import Request
from ..protocol.auth import CredentialLookup, authenticate
from ..protocol.errors import RequestError
from ..protocol.shell import Reply
from ..settings import Settings
from . import ops
from .call import BulkCall
from .errors import BulkError, as_bulk_error
from .put import put
from .query import query

log = logging.getLogger("ctxstore.bulk")

Operation = Callable[[BulkCall], Awaitable[Reply]]
OPERATIONS: dict[str, Operation] = {
    "lookup": ops.lookup, "get": ops.get, "put": put, "touch": ops.touch, "pin": ops.pin, "unpin": ops.unpin,
    "prefetch": ops.prefetch,
    "delete": ops.delete,
    "query": query,
}
if set(OPERATIONS) != set(wire.OPS):
    raise RuntimeError(f"bulk ops without a handler: {sorted(set(wire.OPS) - set(OPERATIONS))}")


class BulkService:
    """Serves the bulk API against an engine, authenticating with a credential lookup."""

    api = "bulk"
    answerable: tuple[type[Exception], ...] = (BulkError, wire.WireError, RequestError, StorageError)

    def __init__(self, engine: Engine, lookup: CredentialLookup, settings: Settings,
                 routes: Callable[[str, list[str], wire.PutRoute, list[int]], None] | None = None) -> None:
        self.engine = engine
        self.lookup = lookup
        self.settings = settings  # limits are read per call: the admin API may change settings at run time
        self.routes = routes  # a node whose events feed a router asks puts for their blocks' routes
        # Every answer says what this node takes beyond the first bulk API (a client uses it from then on).
        self.features = wire.FEATURES if routes is None else f"{wire.FEATURES},{wire.FEATURE_PUT_ROUTE}"

    async def handle(self, req: Request) -> Reply:
        if req.method != "POST":
            raise BulkError("MethodNotAllowed", "the bulk API takes POST only")
        parts = req.scope["path"][len(wire.PREFIX) + 1:].split("/")
        if len(parts) != 2 or parts[1] not in OPERATIONS:
            raise BulkError("NoSuchOperation", f"no bulk operation at {req.raw_path}; ops: {', '.join(wire.OPS)}")
        bucket, op = parts
        req.scope[SCOPE_OPERATION] = op  # metrics: a failure from here on counts under it
        auth = authenticate(
            method=req.method, raw_path=req.raw_path, query_string=req.query_string, headers=req.headers,
            lookup=self.lookup, now=time.time(),
        )
        if auth.payload.startswith("streaming"):
            raise BulkError("InvalidArgument", "the bulk API takes no aws-chunked bodies; sign with "
                            "UNSIGNED-PAYLOAD (blocks carry their own XXH3-64) or the body's SHA-256")
        call = BulkCall(req, auth, bucket, self.engine, self.settings.bulk_max_keys, self.settings.bulk_max_bytes,
                        self.routes)
        self.engine.store.bucket(call.tenant, bucket)  # tenant isolation before a byte of the body is read
        reply = await OPERATIONS[op](call)
        reply.headers.append((wire.FEATURES_HEADER, self.features))
        return reply

    def error_reply(self, req: Request, exc: Exception) -> Reply:
        error = as_bulk_error(exc)
        log.debug("bulk %s %s -> %s: %s", req.method, req.raw_path, error.code, error.message)
        headers = [("content-type", wire.CONTENT_TYPE), *error.headers.items()]
        if error.code == "MethodNotAllowed":
            headers.append(("allow", "POST"))
        headers.append((wire.FEATURES_HEADER, self.features))  # a client learns them from any answer
        return Reply(error.status, headers, wire.encode_error(error.code, error.message))
