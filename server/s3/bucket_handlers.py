"""Service and bucket operations: ListBuckets, CreateBucket, HeadBucket, DeleteBucket, GetBucketLocation,
ListObjects(V2), ListObjectVersions, ListMultipartUploads, DeleteObjects."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import AsyncGenerator

from ctxstore.buckets import valid_bucket_name  # one table of S3's rules: the client checks the same

from ..engine import StoredObject
from ..protocol.shell import Reply
from . import listing
from .body import read_xml
from .call import Call, xml_response
from .checksums import Checksum, parse_content_md5, requested_checksums, verify
from .errors import S3Error
from .xml import Node, child_text, document, iso8601, parse

MAX_DELETE_KEYS = 1000


async def list_buckets(call: Call) -> Reply:
    buckets = call.engine.store.list_buckets(call.tenant)
    children: list[Node] = [
        ("Owner", [("ID", listing.tenant_id(call.tenant)), ("DisplayName", call.tenant)]),
        ("Buckets", [("Bucket", [("Name", b.name), ("CreationDate", iso8601(b.created))]) for b in buckets]),
    ]
    return xml_response(document("ListAllMyBucketsResult", children))


async def create_bucket(call: Call) -> Reply:
    name = call.bucket_name
    if not valid_bucket_name(name):
        raise S3Error("InvalidBucketName", extra={"BucketName": name})
    body = await read_xml(call)
    if body:
        root = parse(body)
        if root.tag != "CreateBucketConfiguration":
            raise S3Error("MalformedXML")
    call.engine.create_bucket(call.tenant, name)
    return Reply(200, [("location", f"/{name}")])


async def head_bucket(call: Call) -> Reply:
    call.engine.store.bucket(call.tenant, call.bucket_name)
    return Reply(200, [("x-amz-bucket-region", call.settings.region)])


async def delete_bucket(call: Call) -> Reply:
    call.engine.delete_bucket(call.tenant, call.bucket_name)
    return Reply(204)


async def get_bucket_location(call: Call) -> Reply:
    call.engine.store.bucket(call.tenant, call.bucket_name)
    region = call.settings.region
    # us-east-1 is reported as an empty LocationConstraint, as S3 does.
    body = ('<?xml version="1.0" encoding="UTF-8"?>\n<LocationConstraint '
            f'xmlns="http://s3.amazonaws.com/doc/2006-03-01/">{"" if region == "us-east-1" else region}'
            "</LocationConstraint>").encode()
    return xml_response(body)


def _iterator(call: Call) -> listing.ObjectIterator:
    engine, tenant, bucket = call.engine, call.tenant, call.bucket_name
    engine.store.bucket(tenant, bucket)  # raise NoSuchBucket/AccessDenied before any paging

    def iterate(start: str, inclusive: bool) -> AsyncGenerator[StoredObject, None]:
        return engine.list_objects(tenant, bucket, start, inclusive)

    return iterate


async def list_objects(call: Call) -> Reply:
    return xml_response(await listing.list_v1(_iterator(call), call.bucket_name, call.tenant, call.req.query))


async def list_objects_v2(call: Call) -> Reply:
    return xml_response(await listing.list_v2(_iterator(call), call.bucket_name, call.tenant, call.req.query))


async def list_object_versions(call: Call) -> Reply:
    return xml_response(await listing.list_versions(_iterator(call), call.bucket_name, call.tenant, call.req.query))


async def list_multipart_uploads(call: Call) -> Reply:
    bucket = call.bucket_name
    prefix = call.req.query.get("prefix", "")
    uploads = call.engine.uploads_in(call.tenant, bucket, prefix)[: listing.MAX_KEYS]
    children: list[Node] = [
        ("Bucket", bucket), ("KeyMarker", ""), ("UploadIdMarker", ""), ("Prefix", prefix),
        ("MaxUploads", listing.MAX_KEYS), ("IsTruncated", False),
    ]
    children += [
        ("Upload", [("Key", u.key), ("UploadId", u.upload_id), ("Initiated", iso8601(u.created)),
                    ("StorageClass", "STANDARD")])
        for u in uploads
    ]
    return xml_response(document("ListMultipartUploadsResult", children))


async def delete_objects(call: Call) -> Reply:
    body = await read_xml(call)
    content_md5 = call.req.headers.get("content-md5")
    if content_md5 is not None:
        expected = parse_content_md5(content_md5)
        if not hmac.compare_digest(expected, hashlib.md5(body).digest()):
            raise S3Error("BadDigest")
    for algorithm, value in requested_checksums(call.req.headers).items():  # what botocore sends since 1.36
        checksum = Checksum(algorithm)
        checksum.update(body)
        verify(checksum, value)
    root = parse(body)
    if root.tag != "Delete":
        raise S3Error("MalformedXML")
    quiet = (child_text(root, "Quiet") or "").strip().lower() == "true"
    objects = root.findall("Object")
    if not objects or len(objects) > MAX_DELETE_KEYS:
        raise S3Error("MalformedXML", f"Delete takes between 1 and {MAX_DELETE_KEYS} keys.")
    keys: list[str] = []
    for obj in objects:
        key = child_text(obj, "Key")
        if key is None:
            raise S3Error("MalformedXML")
        keys.append(key)
    engine = call.engine
    engine.store.bucket(call.tenant, call.bucket_name)
    results: list[Node] = []
    for key in keys:
        if len(key.encode()) > 1024 or not key:
            results.append(("Error", [("Key", key), ("Code", "KeyTooLongError" if key else "InvalidArgument"),
                                      ("Message", "invalid key")]))
            continue
        engine.store.delete(call.tenant, call.bucket_name, key)
        if not quiet:
            results.append(("Deleted", [("Key", key)]))
    return xml_response(document("DeleteResult", results))
