"""ListObjects (V1), ListObjectsV2 and ListObjectVersions: paging, prefixes, delimiters and their XML.

Keys are kept sorted by code point, which is the same order as their UTF-8 bytes. A page skips whole
common-prefix groups in O(log n) instead of walking every key under them.
"""

from __future__ import annotations

import base64
import hashlib
import binascii
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from urllib.parse import quote

from ..engine import StoredObject
from ..protocol.asgi import ascii_int
from .errors import S3Error
from .xml import Node, document, iso8601

MAX_KEYS = 1000

ObjectIterator = Callable[[str, bool], AsyncGenerator[StoredObject, None]]  # (start, inclusive) -> live objects


@dataclass
class Page:
    contents: list[StoredObject] = field(default_factory=list)
    prefixes: list[str] = field(default_factory=list)
    truncated: bool = False
    last: str = ""  # the last key or common prefix returned: the next page starts after it


def _successor(prefix: str) -> str | None:
    """The smallest string greater than every string starting with ``prefix`` (None if there is none)."""
    last = ord(prefix[-1])
    if last >= 0x10FFFF:
        return None
    return prefix[:-1] + chr(last + 1)


async def collect(iterate: ObjectIterator, *, prefix: str, delimiter: str, after: str, max_keys: int) -> Page:
    """One page of keys under ``prefix`` strictly after ``after``, grouped by ``delimiter``."""
    page = Page()
    if max_keys <= 0:
        return page
    if after >= prefix:
        start, inclusive = after, False
    else:
        start, inclusive = prefix, True
    count = 0
    restart = True
    while restart:
        restart = False
        async with aclosing(iterate(start, inclusive)) as objects:
            async for obj in objects:
                key = obj.key
                if not key.startswith(prefix):
                    if key > prefix:
                        return page
                    continue
                if delimiter:
                    cut = key.find(delimiter, len(prefix))
                    if cut >= 0:
                        group = key[: cut + len(delimiter)]
                        if group > after:
                            if count == max_keys:
                                page.truncated = True
                                return page
                            page.prefixes.append(group)
                            page.last = group
                            count += 1
                        nxt = _successor(group)
                        if nxt is not None:  # jump over the whole group
                            start, inclusive, restart = nxt, True, True
                            break
                        continue
                if count == max_keys:
                    page.truncated = True
                    return page
                page.contents.append(obj)
                page.last = key
                count += 1
    return page


def parse_max_keys(value: str | None) -> int:
    if value is None:
        return MAX_KEYS
    text = value.strip()
    n = ascii_int(text[1:] if text.startswith("-") else text)
    if n is None:
        raise S3Error("InvalidArgument", "Provided max-keys not an integer or within integer range")
    if text.startswith("-") and n:
        raise S3Error("InvalidArgument", "Argument maxKeys must be an integer between 0 and 2147483647")
    return min(n, MAX_KEYS)


def _encoder(encoding_type: str | None) -> Callable[[str], str]:
    if encoding_type is None:
        return lambda s: s
    if encoding_type.lower() != "url":
        raise S3Error("InvalidArgument", "Invalid Encoding Method specified in Request")
    return lambda s: quote(s, safe="/")


def _owner(tenant: str) -> Node:
    return ("Owner", [("ID", tenant_id(tenant)), ("DisplayName", tenant)])


def tenant_id(tenant: str) -> str:
    """A stable canonical-user-style ID for a tenant (64 hex chars)."""
    return hashlib.sha256(b"ctxstore-tenant:" + tenant.encode()).hexdigest()


def _object_nodes(obj: StoredObject, enc: Callable[[str], str], owner: Node | None) -> list[Node]:
    nodes: list[Node] = [
        ("Key", enc(obj.key)),
        ("LastModified", iso8601(obj.created)),
        ("ETag", obj.etag),
        ("Size", obj.size),
    ]
    if owner is not None:
        nodes.append(owner)
    nodes.append(("StorageClass", "STANDARD"))
    return nodes


async def list_v1(iterate: ObjectIterator, bucket: str, tenant: str, query: dict[str, str]) -> bytes:
    prefix = query.get("prefix", "")
    delimiter = query.get("delimiter", "")
    marker = query.get("marker", "")
    max_keys = parse_max_keys(query.get("max-keys"))
    enc = _encoder(query.get("encoding-type"))
    page = await collect(iterate, prefix=prefix, delimiter=delimiter, after=marker, max_keys=max_keys)
    owner = _owner(tenant)
    children: list[Node] = [
        ("Name", bucket),
        ("Prefix", prefix),  # as sent, even with encoding-type=url: V1 clients (boto3) read it back undecoded
        ("Marker", enc(marker)),
        ("MaxKeys", max_keys),
        ("Delimiter", enc(delimiter) if delimiter else None),
        ("IsTruncated", page.truncated),
        ("NextMarker", enc(page.last) if page.truncated else None),
        ("EncodingType", "url" if "encoding-type" in query else None),
    ]
    children += [("Contents", _object_nodes(o, enc, owner)) for o in page.contents]
    children += [("CommonPrefixes", [("Prefix", enc(p))]) for p in page.prefixes]
    return document("ListBucketResult", children)


def _encode_token(last: str) -> str:
    return base64.urlsafe_b64encode(last.encode("utf-8")).decode("ascii")


def _decode_token(token: str) -> str:
    try:
        # validate=True: urlsafe_b64decode would silently drop characters outside the alphabet.
        return base64.b64decode(token.encode("ascii"), altchars=b"-_", validate=True).decode("utf-8")
    except (binascii.Error, UnicodeError, ValueError):
        raise S3Error("InvalidArgument", "The continuation token provided is incorrect") from None


async def list_v2(iterate: ObjectIterator, bucket: str, tenant: str, query: dict[str, str]) -> bytes:
    prefix = query.get("prefix", "")
    delimiter = query.get("delimiter", "")
    start_after = query.get("start-after", "")
    token = query.get("continuation-token")
    max_keys = parse_max_keys(query.get("max-keys"))
    enc = _encoder(query.get("encoding-type"))
    after = _decode_token(token) if token else start_after  # an empty token lists from the start
    page = await collect(iterate, prefix=prefix, delimiter=delimiter, after=after, max_keys=max_keys)
    owner = _owner(tenant) if query.get("fetch-owner", "").lower() == "true" else None
    children: list[Node] = [
        ("Name", bucket),
        ("Prefix", enc(prefix)),
        ("Delimiter", enc(delimiter) if delimiter else None),
        ("MaxKeys", max_keys),
        ("KeyCount", len(page.contents) + len(page.prefixes)),
        ("IsTruncated", page.truncated),
        ("ContinuationToken", token),
        ("NextContinuationToken", _encode_token(page.last) if page.truncated else None),
        ("StartAfter", enc(start_after) if "start-after" in query else None),
        ("EncodingType", "url" if "encoding-type" in query else None),
    ]
    children += [("Contents", _object_nodes(o, enc, owner)) for o in page.contents]
    children += [("CommonPrefixes", [("Prefix", enc(p))]) for p in page.prefixes]
    return document("ListBucketResult", children)


async def list_versions(iterate: ObjectIterator, bucket: str, tenant: str, query: dict[str, str]) -> bytes:
    """Without versioning every object is listed once, as version ``null``, and is the latest."""
    prefix = query.get("prefix", "")
    delimiter = query.get("delimiter", "")
    key_marker = query.get("key-marker", "")
    max_keys = parse_max_keys(query.get("max-keys"))
    enc = _encoder(query.get("encoding-type"))
    page = await collect(iterate, prefix=prefix, delimiter=delimiter, after=key_marker, max_keys=max_keys)
    owner = _owner(tenant)
    children: list[Node] = [
        ("Name", bucket),
        ("Prefix", enc(prefix)),
        ("KeyMarker", enc(key_marker)),
        ("VersionIdMarker", query.get("version-id-marker", "")),
        ("MaxKeys", max_keys),
        ("Delimiter", enc(delimiter) if delimiter else None),
        ("IsTruncated", page.truncated),
        ("NextKeyMarker", enc(page.last) if page.truncated else None),
        ("NextVersionIdMarker", "null" if page.truncated else None),
        ("EncodingType", "url" if "encoding-type" in query else None),
    ]
    for obj in page.contents:
        nodes = _object_nodes(obj, enc, owner)
        nodes[1:1] = [("VersionId", "null"), ("IsLatest", True)]
        children.append(("Version", nodes))
    children += [("CommonPrefixes", [("Prefix", enc(p))]) for p in page.prefixes]
    return document("ListVersionsResult", children)
