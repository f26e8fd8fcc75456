"""Object metadata on the wire: request headers → what is stored, stored object → response headers,
conditional requests and byte ranges."""

from __future__ import annotations

import email.utils
import functools
import re
import time
from collections.abc import Mapping

from ..engine import Completion, StoredObject, etag_matches
from ..protocol.asgi import ascii_int
from ..settings import parse_duration
from .errors import S3Error

# Standard headers stored with an object and returned on GET/HEAD.
STORED_HEADERS = ("cache-control", "content-disposition", "content-encoding", "content-language", "expires")
# GET query parameters that override response headers (signed requests only, which all of ours are).
RESPONSE_OVERRIDES = {
    "response-content-type": "content-type",
    "response-content-language": "content-language",
    "response-expires": "expires",
    "response-cache-control": "cache-control",
    "response-content-disposition": "content-disposition",
    "response-content-encoding": "content-encoding",
}
MAX_USER_METADATA = 2048  # bytes of x-amz-meta-* names and values, as S3 limits them
DEFAULT_CONTENT_TYPE = "binary/octet-stream"
TTL_HEADER = "x-ctx-ttl"
TTL_META_HEADER = "x-amz-meta-ctx-ttl"


def requested_ttl(headers: Mapping[str, str]) -> float | None:
    """The TTL a request asks for (``x-ctx-ttl``, else ``x-amz-meta-ctx-ttl``), in seconds."""
    raw = headers.get(TTL_HEADER)
    name = TTL_HEADER
    if raw is None:
        raw, name = headers.get(TTL_META_HEADER), TTL_META_HEADER
    if raw is None:
        return None
    try:
        ttl = parse_duration(raw)
    except ValueError:
        ttl = 0.0
    if not ttl > 0:
        raise S3Error("InvalidArgument", f"{name} must be a positive number of seconds (or 5m, 2h, 7d)",
                      extra={"ArgumentName": name, "ArgumentValue": raw})
    return ttl


def metadata_from_headers(headers: Mapping[str, str]) -> tuple[str, dict[str, str], dict[str, str]]:
    """(content type, stored standard headers, user metadata) from a PUT/POST/COPY request."""
    content_type = headers.get("content-type") or DEFAULT_CONTENT_TYPE
    stored: dict[str, str] = {}
    for name in STORED_HEADERS:
        value = headers.get(name)
        if value is None:
            continue
        if name == "content-encoding":
            # aws-chunked describes the transfer, not the object: S3 strips it and keeps the rest as sent.
            value = ",".join(p for p in value.split(",") if p.strip() != "aws-chunked").strip()
            if not value:
                continue
        stored[name] = value
    user_meta: dict[str, str] = {}
    size = 0
    for name, value in headers.items():
        if name.startswith("x-amz-meta-"):
            short = name[len("x-amz-meta-"):]
            user_meta[short] = value
            size += len(short) + len(value)
    if size > MAX_USER_METADATA:
        raise S3Error("MetadataTooLarge", extra={"MaxSizeAllowed": str(MAX_USER_METADATA), "Size": str(size)})
    return content_type, stored, user_meta


def http_date(ts: float) -> str:
    """RFC 1123 date of a Unix time (Last-Modified): formatted once per second and kept (an object's date is
    asked for on every GET and HEAD of it; email.utils.formatdate alone was 6 % of a 64 KiB GET)."""
    return _http_date(int(ts))


_DAYS = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")
_MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")


@functools.lru_cache(maxsize=4096)
def _http_date(seconds: int) -> str:
    t = time.gmtime(seconds)
    return (f"{_DAYS[t.tm_wday]}, {t.tm_mday:02d} {_MONTHS[t.tm_mon - 1]} {t.tm_year:04d} "
            f"{t.tm_hour:02d}:{t.tm_min:02d}:{t.tm_sec:02d} GMT")


def expires_at_header(obj: StoredObject | Completion) -> str:
    return f"{obj.expires_at:.3f}"


def object_headers(obj: StoredObject, query: Mapping[str, str], *, checksum_mode: bool) -> list[tuple[str, str]]:
    """Response headers describing ``obj`` (everything but Content-Length and Content-Range)."""
    values: dict[str, str] = {"content-type": obj.content_type, **obj.headers}
    for param, header in RESPONSE_OVERRIDES.items():
        if param in query:
            values[header] = _header_value(param, query[param])
    out = [
        ("etag", obj.etag),
        ("last-modified", http_date(obj.created)),
        ("accept-ranges", "bytes"),
        ("x-ctx-expires-at", expires_at_header(obj)),
        ("x-ctx-xxh3", f"{obj.xxh3:016x}"),
    ]
    out += list(values.items())
    out += [("x-amz-meta-" + k, v) for k, v in obj.user_meta.items()]
    if obj.parts_count:
        out.append(("x-amz-mp-parts-count", str(obj.parts_count)))
    if checksum_mode:
        out += [(f"x-amz-checksum-{alg}", value) for alg, value in obj.checksums.items()]
        if obj.checksums:
            composite = any(v.rsplit("-", 1)[-1].isdigit() and "-" in v for v in obj.checksums.values())
            out.append(("x-amz-checksum-type", "COMPOSITE" if composite else "FULL_OBJECT"))
    return out


_UNSAFE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


def _header_value(param: str, value: str) -> str:
    """A ``response-*`` override as a header value: no control characters (CR/LF would split the response)
    and nothing Latin-1 cannot carry."""
    if _UNSAFE.search(value) or not all(ord(c) < 256 for c in value):
        raise S3Error("InvalidArgument", f"{param} contains characters a header value cannot carry",
                      extra={"ArgumentName": param})
    return value


def _parse_http_date(value: str) -> float | None:
    try:
        parsed = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    return parsed.timestamp() if parsed is not None else None


def check_read_conditions(obj: StoredObject, headers: Mapping[str, str], prefix: str = "") -> None:
    """RFC 7232 as S3 applies it to GET/HEAD (``prefix`` = ``x-amz-copy-source-`` for copy sources).

    Raises PreconditionFailed (412) or NotModified (304; copy sources answer 412 instead)."""
    modified = int(obj.created)
    if_match = headers.get(prefix + "if-match")
    if_unmodified = headers.get(prefix + "if-unmodified-since")
    if_none_match = headers.get(prefix + "if-none-match")
    if_modified = headers.get(prefix + "if-modified-since")
    if if_match is not None:
        if not etag_matches(if_match, obj.etag):
            raise S3Error("PreconditionFailed", extra={"Condition": prefix + "If-Match"})
    elif if_unmodified is not None:
        since = _parse_http_date(if_unmodified)
        if since is not None and modified > since:
            raise S3Error("PreconditionFailed", extra={"Condition": prefix + "If-Unmodified-Since"})
    not_modified = "PreconditionFailed" if prefix else "NotModified"
    if if_none_match is not None:
        if etag_matches(if_none_match, obj.etag):
            raise S3Error(not_modified, headers={"ETag": obj.etag, "Last-Modified": http_date(obj.created)})
    elif if_modified is not None:
        since = _parse_http_date(if_modified)
        if since is not None and modified <= since and since <= time.time():
            raise S3Error(not_modified, headers={"ETag": obj.etag, "Last-Modified": http_date(obj.created)})


def parse_range(value: str | None, size: int) -> tuple[int, int] | None:
    """``bytes=a-b`` → (start, end exclusive); None means the whole object (absent or ignorable header).

    Unsatisfiable → InvalidRange (416). Malformed or multi-range headers are ignored, as HTTP allows."""
    if value is None:
        return None
    unit, _, spec = value.strip().partition("=")
    if unit.strip().lower() != "bytes" or "," in spec:
        return None
    first, dash, last = spec.strip().partition("-")
    if not dash:
        return None
    if first == "":
        suffix = ascii_int(last)
        if suffix is None:
            return None
        if suffix == 0 or size == 0:
            raise _unsatisfiable(size)
        return max(0, size - suffix), size
    start = ascii_int(first)
    last_byte = ascii_int(last) if last else None
    if start is None or (last and last_byte is None):
        return None
    end = last_byte + 1 if last_byte is not None else None
    if end is not None and end <= start:  # e.g. bytes=5-3: syntactically invalid, so ignored
        return None
    if end is None:
        end = size
    if start >= size:
        raise _unsatisfiable(size)
    return start, min(end, size)


def _unsatisfiable(size: int) -> S3Error:
    return S3Error("InvalidRange", headers={"Content-Range": f"bytes */{size}"},
                   extra={"ActualObjectSize": str(size)})
