"""The bulk extension API: many blocks of one bucket per round trip, msgpack heads plus raw payloads.

``POST /_ctx/v1/bulk/<bucket>/<op>``, SigV4-signed exactly like S3 and scoped to the signer's tenant. The wire
schema (frames, heads, error codes) lives in :mod:`ctxstore.wire`, shared with the client; docs/bulk-api.md
describes it for other implementers. Every call has the same skeleton as an S3 handler: parse →
authenticate → engine calls → one response, every failure written once as a msgpack error frame.

Data path, like the S3 layer's: a ``get`` sends each stored buffer as its own ASGI body message (no copy, no
join), holding references to the objects so an eviction during the send cannot change what goes out. A ``put``
reads its head, validates it against the limits and reserves budget for every block *before* a payload byte is
read, then reads each block straight into its own buffer and verifies its XXH3-64. Nothing is committed until
the whole body has arrived and parsed; then each block is stored or rejected on its own.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import xxhash

from ctxstore import wire

from .asgi import BodyTimeout, ClientDisconnected, Receive, Request, Scope, Send, send_response
from .engine import errors as storage
from .engine.objects import Payload
from .engine.store import Engine, Reservation
from .metrics import CLIENT_CLOSED, SCOPE_OPERATION, RequestMetrics
from .s3.auth import AuthContext, CredentialLookup, authenticate
from .s3.errors import S3Error

if TYPE_CHECKING:
    from .settings import Settings

log = logging.getLogger("ctxstore.bulk")

CONTENT_TYPE = "application/vnd.msgpack"
_MAX_FRAME = wire.HEAD_LEN.size + wire.MAX_HEAD_BYTES  # a head-only request body can never be longer
_DRAIN_LIMIT = 4 << 20  # an unread body up to this size is discarded after an early error, not reset

# Typed engine errors -> bulk error codes (anything else is an InternalError).
_STORAGE_CODES: dict[type[storage.StorageError], str] = {
    storage.NoSuchBucket: "NoSuchBucket",
    storage.AccessDenied: "AccessDenied",
    storage.InsufficientCapacity: "SlowDown",
    storage.InvalidArgument: "InvalidArgument",
    storage.EntityTooLarge: "TooManyBytes",
}


class BulkError(Exception):
    """A bulk error response: ``code`` is a row of :data:`ctxstore.wire.ERROR_STATUS`."""

    def __init__(self, code: str, message: str, headers: dict[str, str] | None = None) -> None:
        if code not in wire.ERROR_STATUS:
            raise ValueError(f"unknown bulk error code {code!r}")
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.status = wire.ERROR_STATUS[code]
        self.headers = dict(headers or {})


def from_s3_error(exc: S3Error) -> BulkError:
    """An authentication failure as a bulk error (a code the bulk table lacks is named in the message)."""
    code = exc.code
    if code not in wire.ERROR_STATUS:
        code = "AccessDenied" if exc.status == 403 else "InvalidArgument"
    message = exc.message if code == exc.code else f"{exc.code}: {exc.message}"
    if exc.extra:  # e.g. what the server signed, so a client author can diff it against their own
        message += "".join(f"\n{name}: {value}" for name, value in exc.extra.items())
    return BulkError(code, message)


def from_storage_error(exc: storage.StorageError) -> BulkError:
    """A typed engine error as a bulk error (``Retry-After`` on SlowDown)."""
    for cls in type(exc).__mro__:
        code = _STORAGE_CODES.get(cls)  # type: ignore[arg-type]
        if code is not None:
            headers = {}
            if isinstance(exc, storage.InsufficientCapacity):
                headers["retry-after"] = str(max(1, int(exc.retry_after)))
            return BulkError(code, str(exc), headers)
    return BulkError("InternalError", f"unexpected storage error {type(exc).__name__}")


@dataclass
class _Reply:
    """A successful response: the msgpack frame, then (get only) the stored payloads sent as they are."""

    frame: bytes
    payloads: list[Payload] = field(default_factory=list)


@dataclass
class _Call:
    """One authenticated bulk request."""

    req: Request
    auth: AuthContext
    bucket: str

    @property
    def tenant(self) -> str:
        return self.auth.credentials.tenant


class BulkService:
    """Serves the bulk API against an engine, authenticating with a credential lookup."""

    def __init__(self, engine: Engine, lookup: CredentialLookup, settings: Settings) -> None:
        self.engine = engine
        self.lookup = lookup
        self.settings = settings
        self._ops = {
            "lookup": self._lookup, "get": self._get, "put": self._put, "touch": self._touch,
            "pin": self._pin, "unpin": self._unpin, "delete": self._delete,
        }
        if set(self._ops) != set(wire.OPS):
            raise RuntimeError(f"bulk ops without a handler: {sorted(set(wire.OPS) - set(self._ops))}")
        self.metrics: RequestMetrics | None = None  # set by the App (server/metrics.py)

    @property
    def max_keys(self) -> int:
        return int(self.settings.bulk_max_keys)

    @property
    def max_bytes(self) -> int:
        return int(self.settings.bulk_max_bytes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        req = Request(scope, receive, self.settings.body_timeout)
        started = time.perf_counter()
        try:
            reply = await self._handle(req)
        except ClientDisconnected:
            log.info("bulk %s: client disconnected during the body; nothing stored", req.raw_path)
            status, sent = CLIENT_CLOSED, 0
        except BulkError as exc:
            status, sent = await self._send_error(send, req, exc)
        except wire.WireError as exc:
            status, sent = await self._send_error(send, req, BulkError(exc.code, str(exc)))
        except S3Error as exc:
            status, sent = await self._send_error(send, req, from_s3_error(exc))
        except storage.StorageError as exc:
            status, sent = await self._send_error(send, req, from_storage_error(exc))
        except BodyTimeout:
            status, sent = await self._send_error(send, req,
                                                  BulkError("RequestTimeout", "the request body stalled"))
        except Exception:
            log.exception("internal error in bulk %s", req.raw_path)
            status, sent = await self._send_error(send, req, BulkError("InternalError", "see the server log"))
        else:
            status, sent = await self._send_reply(send, req, reply)
        if self.metrics is not None:
            self.metrics.observe_request("bulk", req, status, started, sent)

    # ------------------------------------------------------------------ request → reply

    async def _handle(self, req: Request) -> _Reply:
        if req.method != "POST":
            raise BulkError("MethodNotAllowed", "the bulk API takes POST only")
        parts = req.scope["path"][len(wire.PREFIX) + 1:].split("/")
        if len(parts) != 2 or parts[1] not in self._ops:
            raise BulkError("NoSuchOperation",
                            f"no bulk operation at {req.raw_path}; ops: {', '.join(wire.OPS)}")
        bucket, op = parts
        req.scope[SCOPE_OPERATION] = op  # metrics: a failure from here on counts under it
        auth = authenticate(
            method=req.method, raw_path=req.raw_path, query_string=req.query_string, headers=req.headers,
            lookup=self.lookup, now=time.time(),
        )
        if auth.payload.startswith("streaming"):
            raise BulkError("InvalidArgument", "the bulk API takes no aws-chunked bodies; sign with "
                            "UNSIGNED-PAYLOAD (blocks carry their own XXH3-64) or the body's SHA-256")
        call = _Call(req, auth, bucket)
        self.engine.bucket(call.tenant, bucket)  # tenant isolation before a byte of the body is read
        return await self._ops[op](call)

    async def _read_head(self, call: _Call, op: str) -> dict[str, Any]:
        """The whole body of a head-only request: exactly one frame, no payloads."""
        declared = _declared_length(call.req)
        if declared is not None and declared > _MAX_FRAME:
            raise BulkError("MalformedFrame", f"a {declared}-byte body is larger than any request head")
        body = await call.req.read_all(_MAX_FRAME)
        if body is None:
            raise BulkError("MalformedFrame", "the body is larger than any request head")
        _check_sha256(call.auth, hashlib.sha256(body) if call.auth.payload == "sha256" else None)
        head, end = wire.unpack_head(body)
        if end != len(body):
            raise BulkError("MalformedFrame", f"{len(body) - end} bytes after the head: {op} has no payloads")
        return head

    async def _keys_request(self, call: _Call, op: str) -> wire.KeysRequest:
        return wire.decode_keys_request(op, await self._read_head(call, op), self.max_keys)

    async def _lookup(self, call: _Call) -> _Reply:
        """Per-key sizes and the present prefix; ``pin`` pins every present block, not only the prefix."""
        request = await self._keys_request(call, "lookup")
        objects = self.engine.lookup(call.tenant, call.bucket, request.keys)
        sizes = [wire.ABSENT if obj is None else obj.size for obj in objects]
        self._pin_present(call, request, objects)
        return _Reply(wire.encode_lookup_response(wire.LookupResponse(wire.prefix_length(sizes), sizes)))

    async def _get(self, call: _Call) -> _Reply:
        """Sizes, checksums and expiries, then the present payloads in key order (the stored buffers)."""
        request = await self._keys_request(call, "get")
        objects = self.engine.lookup(call.tenant, call.bucket, request.keys)
        self._pin_present(call, request, objects)
        present = [obj for obj in objects if obj is not None]
        head = wire.GetResponse(
            sizes=[wire.ABSENT if obj is None else obj.size for obj in objects],
            xxh3=[0 if obj is None else obj.xxh3 for obj in objects],
            expires=[0.0 if obj is None else obj.expires_at for obj in objects],
        )
        for obj in present:
            self.engine.record_read(obj, obj.size)
        # obj.data is never mutated once committed; holding it keeps it whole even if the object is evicted.
        return _Reply(wire.encode_get_head(head), [obj.data for obj in present if obj.size])

    def _pin_present(self, call: _Call, request: wire.KeysRequest, objects: list[Any]) -> None:
        if request.pin:
            keys = [key for key, obj in zip(request.keys, objects, strict=True) if obj is not None]
            self.engine.pin(call.tenant, call.bucket, keys, request.pin)

    async def _touch(self, call: _Call) -> _Reply:
        request = await self._keys_request(call, "touch")
        if request.ttl is not None and not request.ttl > 0:
            raise BulkError("InvalidArgument", "'ttl' must be positive (or nil for each object's own TTL)")
        return _count(self.engine.touch(call.tenant, call.bucket, request.keys, request.ttl))

    async def _pin(self, call: _Call) -> _Reply:
        request = await self._keys_request(call, "pin")
        return _count(self.engine.pin(call.tenant, call.bucket, request.keys, request.seconds))

    async def _unpin(self, call: _Call) -> _Reply:
        request = await self._keys_request(call, "unpin")
        return _count(self.engine.unpin(call.tenant, call.bucket, request.keys))

    async def _delete(self, call: _Call) -> _Reply:
        request = await self._keys_request(call, "delete")
        return _count(sum(self.engine.delete(call.tenant, call.bucket, key) for key in request.keys))

    async def _put(self, call: _Call) -> _Reply:
        body = _BodyReader(call.req, hashlib.sha256() if call.auth.payload == "sha256" else None)
        blocks: list[_Block] = []
        declared = _declared_length(call.req)
        if declared is not None and declared > _MAX_FRAME + self.max_bytes:
            raise BulkError("TooManyBytes", f"a {declared}-byte body exceeds any put under the limit of "
                            f"{self.max_bytes} payload bytes per call")
        try:
            prefix = await body.read(wire.HEAD_LEN.size)
            head_end = wire.head_length(prefix)
            if declared is not None and declared < head_end:
                raise BulkError("IncompleteBody", f"Content-Length {declared} ends inside the {head_end}-byte head")
            head, _ = wire.unpack_head(prefix + await body.read(head_end - len(prefix)))
            request = wire.decode_put_request(head, self.max_keys, self.max_bytes)
            _check_length(call.req, head_end + request.payload_bytes)
            blocks = self._plan(call, request)
            for block in blocks:  # straight into each block's own buffer, verified as it completes
                if block.result == "exists":
                    await body.skip(block.size)
                else:
                    await block.receive(body)
            if not await body.at_end():
                raise BulkError("MalformedFrame", "bytes after the last payload the head announced")
            _check_sha256(call.auth, body.sha256)
            return _Reply(wire.encode_put_response(self._commit(call, request, blocks)))
        finally:
            for block in blocks:
                block.release()
            await body.close()

    def _plan(self, call: _Call, request: wire.PutRequest) -> list[_Block]:
        """One block per key; with if_absent, live keys are 'exists' (bytes skipped). Reserves budget for
        the rest before any payload is read: if the budget cannot make room, nothing is read or stored."""
        blocks = [_Block(key, size, xxh3) for key, size, xxh3 in
                  zip(request.keys, request.sizes, request.xxh3, strict=True)]
        try:
            for block in blocks:
                if request.if_absent and self._live(call, block.key):
                    block.result = "exists"
                    continue
                # Payload plus key: exactly what the committed object will be charged.
                block.reservation = self.engine.reserve(block.size + len(block.key.encode()))
        except BaseException:
            for block in blocks:
                block.release()
            raise
        return blocks

    def _live(self, call: _Call, key: str) -> bool:
        try:
            self.engine.get(call.tenant, call.bucket, key, record=False)
        except storage.NoSuchKey:
            return False
        return True

    def _commit(self, call: _Call, request: wire.PutRequest, blocks: list[_Block]) -> wire.PutResponse:
        """Store every verified block (no await: atomic with respect to other requests)."""
        results: list[str] = []
        errors: dict[int, str] = {}
        for i, block in enumerate(blocks):
            if block.result is None and block.data is not None:
                try:
                    self.engine.put(
                        call.tenant, call.bucket, block.key, block.data, etag=block.etag, ttl=request.ttl,
                        if_none_match=request.if_absent, reservation=block.reservation, xxh3=block.xxh3,
                    )
                    block.result = "stored"
                except storage.PreconditionFailed:  # stored by someone else while this body was arriving
                    block.result = "exists"
                except (storage.InsufficientCapacity, storage.EntityTooLarge) as exc:
                    block.result, block.error = "rejected", f"no room for the block: {exc}"
            results.append(block.result or "rejected")
            if block.error:
                errors[i] = block.error
        return wire.PutResponse(results, errors)

    # ------------------------------------------------------------------ responses

    @staticmethod
    def _base_headers(req: Request) -> list[tuple[str, str]]:
        headers = [("content-type", CONTENT_TYPE), ("x-amz-request-id", req.request_id)]
        if not req.body_done and _close_unread(req):
            headers.append(("connection", "close"))
        return headers

    async def _send_reply(self, send: Send, req: Request, reply: _Reply) -> tuple[int, int]:
        """Returns the status and the body bytes sent (for metrics), as _send_error does."""
        headers = self._base_headers(req)
        if not reply.payloads:
            await send_response(send, 200, headers, reply.frame)
            return 200, len(reply.frame)
        length = len(reply.frame) + sum(len(p) for p in reply.payloads)
        raw = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers]
        raw.append((b"content-length", str(length).encode()))
        await send({"type": "http.response.start", "status": 200, "headers": raw})
        await send({"type": "http.response.body", "body": reply.frame, "more_body": True})
        last = len(reply.payloads) - 1
        for i, payload in enumerate(reply.payloads):  # the stored buffers themselves: no copy, no join
            await send({"type": "http.response.body", "body": payload, "more_body": i < last})
        return 200, length

    async def _send_error(self, send: Send, req: Request, exc: BulkError) -> tuple[int, int]:
        log.debug("bulk %s %s -> %s: %s", req.method, req.raw_path, exc.code, exc.message)
        headers = self._base_headers(req) + list(exc.headers.items())
        if exc.code == "MethodNotAllowed":
            headers.append(("allow", "POST"))
        frame = wire.encode_error(exc.code, exc.message)
        await send_response(send, exc.status, headers, frame, head=req.method == "HEAD")
        return exc.status, 0 if req.method == "HEAD" else len(frame)


def _count(n: int) -> _Reply:
    return _Reply(wire.encode_count_response(wire.CountResponse(n)))


def _close_unread(req: Request) -> bool:
    """Whether to close the connection after answering a request whose body was not read to its end.

    A declared body of at most ``_DRAIN_LIMIT`` bytes is left for the server to discard (a client that sends
    its whole body before reading the answer then gets the error frame, not a reset); anything bigger, of
    unknown length, or still held back by ``Expect: 100-continue`` closes the connection instead."""
    headers = req.headers
    if "transfer-encoding" in headers or headers.get("expect", "").lower() == "100-continue":
        return True
    length = headers.get("content-length", "0")
    return not length.isdigit() or int(length) > _DRAIN_LIMIT


def _declared_length(req: Request) -> int | None:
    """The Content-Length, if the request has a usable one."""
    declared = req.headers.get("content-length")
    return int(declared) if declared is not None and declared.isdigit() else None


def _check_length(req: Request, expected: int) -> None:
    """A declared Content-Length that disagrees with the head fails before the payloads are read."""
    declared = _declared_length(req)
    if declared is None or declared == expected:
        return
    if declared < expected:
        raise BulkError("IncompleteBody", f"Content-Length {declared} is less than the {expected}-byte frame")
    raise BulkError("MalformedFrame", f"Content-Length {declared} is longer than the {expected}-byte frame")


def _check_sha256(auth: AuthContext, sha256: Any) -> None:
    """``x-amz-content-sha256: <hex>``: the body must hash to it (nothing is committed otherwise)."""
    if sha256 is not None and sha256.hexdigest() != (auth.content_sha256 or "").lower():
        raise BulkError("InvalidArgument", "the body's SHA-256 does not match x-amz-content-sha256")


@dataclass
class _Block:
    """One block of a put: its declared size and checksum, its reserved budget, its buffer once read."""

    key: str
    size: int
    xxh3: int
    reservation: Reservation | None = None
    data: bytearray | None = None
    etag: str = ""
    result: str | None = None  # None until decided: "exists" (skipped) or "rejected" (checksum)
    error: str = ""

    async def receive(self, body: _BodyReader) -> None:
        data = bytearray(self.size)
        await body.read_into(memoryview(data))
        actual = xxhash.xxh3_64_intdigest(data)
        if actual != self.xxh3:  # all-or-nothing per block: drop it now, the others go on
            self.result = "rejected"
            self.error = f"XXH3-64 mismatch: the head says {self.xxh3:016x}, the payload has {actual:016x}"
            self.release()
            return
        self.data = data
        # Bulk-written blocks get a cheap, non-MD5 ETag (docs/bulk-api.md): 32 hex digits of the XXH3-128.
        self.etag = f'"{xxhash.xxh3_128_hexdigest(data)}"'

    def release(self) -> None:
        if self.reservation is not None:
            self.reservation.release()


class _BodyReader:
    """Exact byte counts out of a request body that arrives in chunks of any size."""

    def __init__(self, req: Request, sha256: Any = None) -> None:
        self._chunks: AsyncIterator[bytes] = req.chunks()
        self._view = memoryview(b"")
        self.sha256 = sha256  # hashes every byte received (x-amz-content-sha256 with a digest)

    async def _next(self) -> bool:
        try:
            chunk = await self._chunks.__anext__()
        except StopAsyncIteration:
            return False
        except TimeoutError:
            raise BodyTimeout() from None
        if self.sha256 is not None:
            self.sha256.update(chunk)
        self._view = memoryview(chunk)
        return True

    async def read_into(self, dest: memoryview) -> None:
        """Fill ``dest``; IncompleteBody if the body ends first."""
        pos = 0
        while pos < len(dest):
            if not self._view and not await self._next():
                raise wire.WireError("the body ended inside the frame", "IncompleteBody")
            take = min(len(dest) - pos, len(self._view))
            dest[pos:pos + take] = self._view[:take]
            self._view = self._view[take:]
            pos += take

    async def read(self, n: int) -> bytearray:
        buf = bytearray(n)
        await self.read_into(memoryview(buf))
        return buf

    async def skip(self, n: int) -> None:
        while n:
            if not self._view and not await self._next():
                raise wire.WireError("the body ended inside the frame", "IncompleteBody")
            take = min(n, len(self._view))
            self._view = self._view[take:]
            n -= take

    async def at_end(self) -> bool:
        """Whether the body ends here (reads on to its end to find out)."""
        while not self._view:
            if not await self._next():
                return True
        return False

    async def close(self) -> None:
        """Close the chunk generator so its body timeout cannot fire later."""
        await self._chunks.aclose()  # type: ignore[attr-defined]
