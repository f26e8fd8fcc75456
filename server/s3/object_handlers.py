"""Object operations: PutObject, GetObject, HeadObject, DeleteObject, CopyObject.

Each handler: parse → one engine call → response. Writes are committed by a single engine call after the
whole body arrived and verified, so a failed upload never leaves or replaces anything."""

from __future__ import annotations

from urllib.parse import unquote

from ..engine import OBJECT_OVERHEAD, StoredObject
from ..protocol.shell import Reply
from .body import md5_etag, read_upload
from .call import Call, xml_response
from .errors import S3Error
from .objectmeta import (
    check_read_conditions,
    expires_at_header,
    metadata_from_headers,
    object_headers,
    parse_range,
    requested_ttl,
)
from .target import MAX_KEY_BYTES
from .xml import document, iso8601


def write_conditions(headers: dict[str, str]) -> tuple[str | bool, str | None]:
    """Conditional write headers: ``If-None-Match`` (``*``: no live object may exist; ETags: the live object
    must have none of them) and ``If-Match`` (the live object must have one of these ETags)."""
    return headers.get("if-none-match") or False, headers.get("if-match")


def _checksum_mode(call: Call) -> bool:
    return call.req.headers.get("x-amz-checksum-mode", "").upper() == "ENABLED"


async def put_object(call: Call) -> Reply:
    req = call.req
    ttl = requested_ttl(req.headers)
    content_type, stored, user_meta = metadata_from_headers(req.headers)
    if_none_match, if_match = write_conditions(req.headers)
    engine = call.engine
    engine.store.bucket(call.tenant, call.bucket_name)  # fail before reading the body
    body = await read_upload(call, OBJECT_OVERHEAD, replaces=call.object_key)
    if needs_etag(if_none_match, if_match):
        await engine.resident(call.tenant, call.bucket_name, call.object_key)
    obj = engine.put(
        call.tenant, call.bucket_name, call.object_key, body.data, etag=md5_etag(body.md5), ttl=ttl,
        content_type=content_type, headers=stored, user_meta=user_meta, checksums=body.checksums,
        if_none_match=if_none_match, if_match=if_match, reservation=body.reservation,
    )
    headers = [("etag", obj.etag), ("x-ctx-expires-at", expires_at_header(obj)), ("x-ctx-xxh3", f"{obj.xxh3:016x}")]
    headers += [(f"x-amz-checksum-{alg}", v) for alg, v in obj.checksums.items()]
    return Reply(200, headers)


def needs_etag(if_none_match: str | bool, if_match: str | None) -> bool:
    """A conditional write that compares ETags (not just presence): a flash-only object is read into RAM first."""
    return if_match is not None or (bool(if_none_match) and if_none_match != "*")


async def get_object(call: Call) -> Reply:
    return await _read(call, head=False)


async def head_object(call: Call) -> Reply:
    return await _read(call, head=True)


async def _read(call: Call, *, head: bool) -> Reply:
    req = call.req
    if "partNumber" in req.query:
        raise S3Error("NotImplemented", "GET/HEAD with partNumber is not implemented by ctxstore.")
    engine = call.engine
    obj = await engine.fetch(call.tenant, call.bucket_name, call.object_key, record=not head, meta_only=head)
    check_read_conditions(obj, req.headers)
    span = parse_range(req.headers.get("range"), obj.size)
    # A ranged response carries no whole-object checksum (as in S3): clients would check the part against it.
    headers = object_headers(obj, req.query, checksum_mode=_checksum_mode(call) and span is None)
    status = 200
    start, end = 0, obj.size
    if span is not None:
        start, end = span
        status = 206
        headers.append(("content-range", f"bytes {start}-{end - 1}/{obj.size}"))
    if head:
        return Reply(status, headers, content_length=end - start)
    engine.store.record_read(obj, end - start)
    body = memoryview(obj.data)[start:end] if (start, end) != (0, obj.size) else obj.data
    # Until the send ends the payload stays in memory, replaced or not: it stays counted against the budget.
    return Reply(status, headers, body, after=[engine.store.lease(obj)])


async def delete_object(call: Call) -> Reply:
    call.engine.store.delete(call.tenant, call.bucket_name, call.object_key)
    return Reply(204)


def _copy_source(call: Call) -> tuple[str, str]:
    raw = call.req.headers.get("x-amz-copy-source", "")
    path, _, version = raw.partition("?")
    if version and version not in ("versionId=null",):
        raise S3Error("InvalidArgument", "ctxstore keeps no versions: only versionId=null can be copied.")
    try:
        path = unquote(path, errors="strict").lstrip("/")
    except UnicodeDecodeError:
        raise S3Error("InvalidArgument", "The copy source is not valid UTF-8 once percent-decoded.",
                      extra={"ArgumentName": "x-amz-copy-source", "ArgumentValue": raw}) from None
    bucket, slash, key = path.partition("/")
    if not bucket or not slash or not key:
        raise S3Error("InvalidArgument", "Copy Source must mention the source bucket and key: sourcebucket/sourcekey",
                      extra={"ArgumentName": "x-amz-copy-source", "ArgumentValue": raw})
    if len(key.encode()) > MAX_KEY_BYTES:
        raise S3Error("KeyTooLongError")
    return bucket, key


async def copy_object(call: Call) -> Reply:
    req = call.req
    src_bucket, src_key = _copy_source(call)
    engine = call.engine
    engine.store.bucket(call.tenant, call.bucket_name)
    src: StoredObject = await engine.fetch(call.tenant, src_bucket, src_key, record=True)
    check_read_conditions(src, req.headers, prefix="x-amz-copy-source-")
    directive = req.headers.get("x-amz-metadata-directive", "COPY").upper()
    if directive not in ("COPY", "REPLACE"):
        raise S3Error("InvalidArgument", "Unknown metadata directive.")
    ttl = requested_ttl(req.headers)
    if directive == "REPLACE":
        content_type, stored, user_meta = metadata_from_headers(req.headers)
    else:
        content_type, stored, user_meta = src.content_type, dict(src.headers), dict(src.user_meta)
        if (src_bucket, src_key) == (call.bucket, call.key) and ttl is None:
            raise S3Error("InvalidRequest", "This copy request is illegal because it is trying to copy an object "
                          "to itself without changing the object's metadata, storage class, website redirect "
                          "location or encryption attributes.")
    if ttl is None:
        ttl = src.ttl
    if_none_match, if_match = write_conditions(req.headers)
    if needs_etag(if_none_match, if_match):
        await engine.resident(call.tenant, call.bucket_name, call.object_key)
    # The payload is immutable, so the copy shares it; it is still charged in full to keep accounting simple.
    # A block read from flash is a view of its read buffer: copied, so that buffer is not kept alive.
    data = bytes(src.data) if isinstance(src.data, memoryview) else src.data
    obj = engine.put(
        call.tenant, call.bucket_name, call.object_key, data, etag=src.etag, ttl=ttl,
        content_type=content_type, headers=stored, user_meta=user_meta, checksums=dict(src.checksums),
        parts_count=src.parts_count, if_none_match=if_none_match, if_match=if_match, xxh3=src.xxh3,
    )
    body = document("CopyObjectResult", [("LastModified", iso8601(obj.created)), ("ETag", obj.etag)])
    return xml_response(body, headers=[("x-ctx-expires-at", expires_at_header(obj))])
