"""Reading S3 request bodies: an object (or part) upload, plain or aws-chunked, into one buffer of the
declared size, verifying every digest the client sent before anything is committed; and small XML bodies."""

from __future__ import annotations

import base64
import hashlib
import hmac
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from ..engine import Reservation
from ..protocol.asgi import BodyTimeout, Request, ascii_int
from ..protocol.auth import AuthContext
from ..protocol.chunked import AwsChunkedDecoder
from ..protocol.payload import PayloadHash
from .call import Call
from .checksums import Checksum, parse_content_md5, requested_checksums, trailer_algorithm, verify
from .errors import S3Error


@dataclass
class UploadBody:
    """A verified body: the buffer, its MD5 and the checksums to store (algorithm → base64)."""

    data: bytearray | memoryview
    md5: bytes
    checksums: dict[str, str] = field(default_factory=dict)
    reservation: Reservation | None = None


def declared_length(req: Request, auth: AuthContext, max_size: int) -> int | None:
    """The decoded body length the client announced, checked before a byte of it is read; None for a plain
    ``Transfer-Encoding: chunked`` body without one (accepted within the object size limit, as RGW and MinIO
    do)."""
    streaming = auth.payload.startswith("streaming")
    name = "x-amz-decoded-content-length" if streaming else "content-length"
    raw = req.headers.get(name)
    if raw is None:
        if not streaming and "chunked" in req.headers.get("transfer-encoding", "").lower():
            return None
        raise S3Error("MissingContentLength", f"You must provide the {name} HTTP header.")
    length = ascii_int(raw)
    if length is None:
        raise S3Error("InvalidArgument", f"{name} must be a non-negative integer",
                      extra={"ArgumentName": name, "ArgumentValue": raw})
    if length > max_size:
        raise S3Error("EntityTooLarge", extra={"ProposedSize": str(length), "MaxSizeAllowed": str(max_size)})
    return length


async def read_upload(call: Call, fixed: int, *, replaces: str | None = None) -> UploadBody:
    """Open a reservation, read the whole body into one buffer (the reservation growing as it arrives),
    verify it. ``fixed``: the bytes the stored object or part is charged beyond its payload; ``replaces``: the
    key of the object it will replace. Raises S3Error; stores nothing."""
    req, auth = call.req, call.auth
    max_size = call.settings.max_object_size
    length = declared_length(req, auth, max_size)
    content_md5 = req.headers.get("content-md5")
    expected_md5 = parse_content_md5(content_md5) if content_md5 is not None else None
    expected = requested_checksums(req.headers)
    trailer = trailer_algorithm(req.headers)
    streaming = auth.payload.startswith("streaming")
    if trailer is not None and not auth.payload.endswith("trailer"):
        raise S3Error("InvalidRequest", "x-amz-trailer requires a STREAMING-*-TRAILER payload")
    hashers = {alg: Checksum(alg) for alg in [*expected, *([trailer] if trailer else [])]}
    payload_hash = PayloadHash(auth)
    md5 = hashlib.md5()
    decoder = (AwsChunkedDecoder(signer=auth.chunk_signer, expect_trailer=auth.payload.endswith("trailer"))
               if streaming else None)

    reservation = call.engine.store.capacity.reserve(call.tenant, call.bucket_name, length, fixed, key=replaces)
    try:
        # A known length: one buffer of that size, filled in place. Unknown: a buffer that grows (its size
        # bounded by the reservation, which refuses what passes the object size limit).
        growing = bytearray()  # the buffer of a body of unknown length
        data: bytearray | memoryview
        if length is None:
            data = growing
        else:  # a reused buffer from 64 KiB up, as for a bulk block: no page faults, nothing long-lived on the heap
            data = call.engine.store.buffers.take(length)
        view = memoryview(data) if length is not None else None
        pos = 0
        try:
            if view is not None and decoder is None and req.direct is not None:
                # Below ASGI: the body lands in its buffer as it arrives, each slice hashed where it lies.
                await _read_direct(call, req, view, reservation, [md5, payload_hash, *hashers.values()])
                pos = len(view)
                chunks: AsyncIterator[bytes] = _no_chunks()
            else:
                chunks = req.chunks()
            async for chunk in chunks:
                pieces = decoder.feed(chunk) if decoder is not None else (chunk,)
                for piece in pieces:
                    end = pos + len(piece)
                    if length is not None and end > length:
                        raise S3Error("IncompleteBody", "The body is longer than the declared length.")
                    await call.engine.tier.with_write_room(lambda: reservation.grow(end))  # noqa: B023 (awaited here)
                    if view is not None:
                        view[pos:end] = piece
                    else:
                        growing += piece
                    md5.update(piece)
                    payload_hash.update(piece)
                    for hasher in hashers.values():
                        hasher.update(piece)
                    pos = end
        except TimeoutError:
            raise BodyTimeout() from None
        trailers = decoder.finish() if decoder is not None else {}
        if length is not None and pos != length:
            raise S3Error("IncompleteBody")
        digest = md5.digest()
        if expected_md5 is not None and not hmac.compare_digest(expected_md5, digest):
            raise S3Error("BadDigest", "The Content-MD5 you specified did not match what we received.")
        payload_hash.verify()
        if trailer is not None:
            sent = requested_checksums(trailers)
            if trailer not in sent:
                raise S3Error("InvalidRequest", f"The trailer x-amz-checksum-{trailer} is missing.")
            expected[trailer] = sent[trailer]
        stored: dict[str, str] = {}
        for alg, value in expected.items():
            verify(hashers[alg], value)
            stored[alg] = hashers[alg].b64digest()
        return UploadBody(data=data, md5=digest, checksums=stored, reservation=reservation)
    except BaseException:
        reservation.release()
        raise


READ_SLICE = 1 << 20  # the reservation grows by this much before each slice of a body is read


async def _read_direct(call: Call, req: Request, view: memoryview, reservation: Reservation,
                       hashers: list[Any]) -> None:
    for start in range(0, len(view), READ_SLICE):
        piece = view[start:start + READ_SLICE]
        await call.engine.tier.with_write_room(lambda: reservation.grow(start + len(piece)))  # noqa: B023 (awaited here)
        if await req.readinto(piece) != len(piece):
            raise S3Error("IncompleteBody")
        for hasher in hashers:
            hasher.update(piece)
    if await req.readinto(memoryview(bytearray(1))):  # a Content-Length body cannot go on; chunked can
        raise S3Error("IncompleteBody", "The body is longer than the declared length.")


async def _no_chunks() -> AsyncIterator[bytes]:
    return
    yield b""  # pragma: no cover - makes this an (empty) async generator


def md5_etag(md5: bytes) -> str:
    return f'"{md5.hex()}"'


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


async def read_xml(call: Call) -> bytes:
    """A small XML request body, bounded by ``max_xml_size`` and checked against its signed SHA-256."""
    body = await call.req.read_all(call.settings.max_xml_size)
    if body is None:
        raise S3Error("MaxMessageLengthExceeded")
    if call.auth.payload.startswith("streaming"):
        raise S3Error("InvalidRequest", "aws-chunked bodies are accepted for object data only.")
    payload_hash = PayloadHash(call.auth)
    payload_hash.update(body)
    payload_hash.verify()
    return body
