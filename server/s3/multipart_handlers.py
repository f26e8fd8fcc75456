"""Multipart uploads: CreateMultipartUpload, UploadPart, CompleteMultipartUpload, AbortMultipartUpload,
ListParts. Parts count against the budget; an upload left unfinished is dropped after ``upload_ttl``."""

from __future__ import annotations

import base64

from ..protocol.shell import Reply
from ..protocol.asgi import ascii_int
from .body import declared_length, read_upload, read_xml
from .call import Call, xml_response
from .checksums import ALGORITHMS, Checksum
from .errors import S3Error
from .object_handlers import needs_etag, write_conditions
from .objectmeta import expires_at_header, metadata_from_headers, requested_ttl
from .xml import Node, child_text, document, iso8601, parse


def _part_number(call: Call) -> int:
    raw = call.req.query.get("partNumber", "")
    number = ascii_int(raw)
    if number is None:
        raise S3Error("InvalidArgument", "Part number must be an integer between 1 and 10000, inclusive",
                      extra={"ArgumentName": "partNumber", "ArgumentValue": raw})
    return number


async def create_multipart_upload(call: Call) -> Reply:
    req = call.req
    ttl = requested_ttl(req.headers)
    content_type, stored, user_meta = metadata_from_headers(req.headers)
    algorithm = (req.headers.get("x-amz-checksum-algorithm") or "").lower() or None
    if algorithm is not None and algorithm not in ALGORITHMS:
        raise S3Error("InvalidRequest", f"Checksum algorithm {algorithm} is not supported.")
    upload = call.engine.multipart.create(
        call.tenant, call.bucket_name, call.object_key, ttl=ttl, content_type=content_type, headers=stored,
        user_meta=user_meta, checksum_algorithm=algorithm,
    )
    headers = [("x-amz-checksum-algorithm", algorithm.upper())] if algorithm else []
    body = document("InitiateMultipartUploadResult", [
        ("Bucket", call.bucket), ("Key", call.key), ("UploadId", upload.upload_id),
    ])
    return xml_response(body, headers=headers)


async def upload_part(call: Call) -> Reply:
    number = _part_number(call)
    upload_id = call.req.query["uploadId"]
    engine = call.engine
    length = declared_length(call.req, call.auth, call.settings.max_object_size)
    # Fail before reading the body: no such upload, or one this part would make too large ever to complete.
    engine.multipart.check_part(call.tenant, call.bucket_name, call.object_key, upload_id, number, length or 0)
    body = await read_upload(call, call.engine.config.part_overhead)
    part = engine.multipart.put_part(
        call.tenant, call.bucket_name, call.object_key, upload_id, number, body.data, md5=body.md5,
        checksums=body.checksums, reservation=body.reservation,
    )
    headers = [("etag", part.etag)] + [(f"x-amz-checksum-{a}", v) for a, v in part.checksums.items()]
    return Reply(200, headers)


def _composite_checksums(call: Call, upload_id: str, numbers: list[int]) -> dict[str, str]:
    """S3's composite checksum of a multipart object: the checksum of the parts' checksums, plus ``-N``."""
    upload = call.engine.multipart.get(call.tenant, call.bucket_name, call.object_key, upload_id)
    algorithm = upload.checksum_algorithm
    parts = [upload.parts.get(n) for n in numbers]
    if algorithm is None or any(p is None or algorithm not in p.checksums for p in parts):
        return {}
    combined = Checksum(algorithm)
    for part in parts:
        assert part is not None
        combined.update(base64.b64decode(part.checksums[algorithm]))
    return {algorithm: f"{combined.b64digest()}-{len(parts)}"}


async def complete_multipart_upload(call: Call) -> Reply:
    upload_id = call.req.query["uploadId"]
    done = call.engine.multipart.completion(call.tenant, call.bucket_name, call.object_key, upload_id)
    if done is None:
        call.engine.multipart.get(call.tenant, call.bucket_name, call.object_key, upload_id)  # NoSuchUpload early
    root = parse(await read_xml(call))
    if root.tag != "CompleteMultipartUpload":
        raise S3Error("MalformedXML")
    parts: list[tuple[int, str]] = []
    for element in root.findall("Part"):
        number, etag = ascii_int(child_text(element, "PartNumber")), child_text(element, "ETag")
        if number is None or etag is None:
            raise S3Error("MalformedXML")
        parts.append((number, etag))
    if not parts:
        raise S3Error("MalformedXML", "You must specify at least one part.")
    if_none_match, if_match = write_conditions(call.req.headers)
    if done is None and needs_etag(if_none_match, if_match):
        await call.engine.resident(call.tenant, call.bucket_name, call.object_key)
    checksums = {} if done is not None else _composite_checksums(call, upload_id, [n for n, _ in parts])
    obj = call.engine.complete_upload(
        call.tenant, call.bucket_name, call.object_key, upload_id, parts,
        if_none_match=if_none_match, if_match=if_match, checksums=checksums,
    )
    children: list[Node] = [
        ("Location", f"/{call.bucket}/{call.key}"), ("Bucket", call.bucket), ("Key", call.key), ("ETag", obj.etag),
    ]
    children += [(f"Checksum{alg.upper()}", v) for alg, v in obj.checksums.items()]
    return xml_response(document("CompleteMultipartUploadResult", children),
                        headers=[("x-ctx-expires-at", expires_at_header(obj))])


async def abort_multipart_upload(call: Call) -> Reply:
    call.engine.multipart.abort(call.tenant, call.bucket_name, call.object_key, call.req.query["uploadId"])
    return Reply(204)


async def list_parts(call: Call) -> Reply:
    upload_id = call.req.query["uploadId"]
    upload = call.engine.multipart.get(call.tenant, call.bucket_name, call.object_key, upload_id)
    marker = ascii_int(call.req.query.get("part-number-marker", "0") or "0")
    max_raw = ascii_int(call.req.query.get("max-parts", "1000") or "1000")
    if marker is None or max_raw is None:
        raise S3Error("InvalidArgument", "part-number-marker and max-parts must be non-negative integers")
    max_parts = min(max_raw, 1000)
    numbers = sorted(n for n in upload.parts if n > marker)
    page, truncated = numbers[:max_parts], len(numbers) > max_parts
    children: list[Node] = [
        ("Bucket", call.bucket), ("Key", call.key), ("UploadId", upload_id),
        ("PartNumberMarker", marker), ("NextPartNumberMarker", page[-1] if page else marker),
        ("MaxParts", max_parts), ("IsTruncated", truncated), ("StorageClass", "STANDARD"),
    ]
    if upload.checksum_algorithm:
        children.append(("ChecksumAlgorithm", upload.checksum_algorithm.upper()))
    for n in page:
        part = upload.parts[n]
        nodes: list[Node] = [("PartNumber", n), ("LastModified", iso8601(part.last_modified)),
                             ("ETag", part.etag), ("Size", part.size)]
        nodes += [(f"Checksum{a.upper()}", v) for a, v in part.checksums.items()]
        children.append(("Part", nodes))
    return xml_response(document("ListPartsResult", children))
