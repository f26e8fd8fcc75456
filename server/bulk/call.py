"""What every bulk operation receives: the request, who signed it, the bucket, the engine and the limits."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ctxstore import wire

from ..engine import Engine
from ..protocol.asgi import Request, ascii_int
from ..protocol.auth import AuthContext
from ..protocol.payload import PayloadHash
from .errors import BulkError

MAX_FRAME = wire.HEAD_LEN.size + wire.MAX_HEAD_BYTES  # a head-only request body can never be longer


@dataclass
class BulkCall:
    """One authenticated bulk request on one bucket."""

    req: Request
    auth: AuthContext
    bucket: str
    engine: Engine
    max_keys: int
    max_bytes: int
    # Where a put's block routes go (bucket, keys, route, indices of the stored keys): the event hub's, on a
    # node whose events feed a router; None elsewhere (the node does not ask for them).
    routes: Callable[[str, list[str], wire.PutRoute, list[int]], None] | None = None

    @property
    def tenant(self) -> str:
        return self.auth.credentials.tenant

    def declared_length(self) -> int | None:
        """The Content-Length, if the request has a usable one."""
        return ascii_int(self.req.headers.get("content-length"))

    async def read_head(self, op: str) -> dict[str, object]:
        """The whole body of a head-only request: exactly one frame, no payloads."""
        declared = self.declared_length()
        if declared is not None and declared > MAX_FRAME:
            raise BulkError("MalformedFrame", f"a {declared}-byte body is larger than any request head")
        body = await self.req.read_all(MAX_FRAME)
        if body is None:
            raise BulkError("MalformedFrame", "the body is larger than any request head")
        payload_hash = PayloadHash(self.auth)
        payload_hash.update(body)
        payload_hash.verify()
        head, end = wire.unpack_head(body, wire.request_schema(op, self.max_keys))
        if end != len(body):
            raise BulkError("MalformedFrame", f"{len(body) - end} bytes after the head: {op} has no payloads")
        return head

    async def keys_request(self, op: str) -> wire.KeysRequest:
        return wire.decode_keys_request(op, await self.read_head(op), self.max_keys)
