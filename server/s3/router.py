"""The S3 routing table: method + target (service, bucket or object) + query keys + headers → operation.

Each row names the S3 operation (used in logs, metrics and docs/s3-compatibility.md). Sub-resources
ctxstore does not implement are a table of their own, answered with NotImplemented.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import unquote

from .errors import S3Error

if TYPE_CHECKING:
    from .handlers import Call, Response

Handler = Callable[["Call"], Awaitable["Response"]]

SERVICE, BUCKET, OBJECT = "service", "bucket", "object"


@dataclass(frozen=True)
class Route:
    operation: str
    method: str
    target: str
    query: tuple[str, ...] = ()  # query keys that must be present
    header: str | None = None  # a header that must be present
    query_value: tuple[str, str] | None = None  # a query key with a required value
    handler_name: str = ""  # function in handlers; defaults to the snake_case operation

    @property
    def handler(self) -> str:
        return self.handler_name or re.sub(r"(?<!^)(?=[A-Z])", "_", self.operation).lower()

    def matches(self, method: str, target: str, query: Mapping[str, str], headers: Mapping[str, str]) -> bool:
        if method != self.method or target != self.target:
            return False
        if any(q not in query for q in self.query):
            return False
        if self.header is not None and self.header not in headers:
            return False
        if self.query_value is not None and query.get(self.query_value[0]) != self.query_value[1]:
            return False
        return True


# Order matters: the first matching row wins, so specific rows precede general ones.
ROUTES: tuple[Route, ...] = (
    Route("ListBuckets", "GET", SERVICE),
    Route("GetBucketLocation", "GET", BUCKET, ("location",)),
    Route("ListObjectVersions", "GET", BUCKET, ("versions",)),
    Route("ListMultipartUploads", "GET", BUCKET, ("uploads",)),
    Route("ListObjectsV2", "GET", BUCKET, query_value=("list-type", "2")),
    Route("ListObjects", "GET", BUCKET),
    Route("HeadBucket", "HEAD", BUCKET),
    Route("CreateBucket", "PUT", BUCKET),
    Route("DeleteBucket", "DELETE", BUCKET),
    Route("DeleteObjects", "POST", BUCKET, ("delete",)),
    Route("CreateMultipartUpload", "POST", OBJECT, ("uploads",)),
    Route("CompleteMultipartUpload", "POST", OBJECT, ("uploadId",)),
    Route("UploadPartCopy", "PUT", OBJECT, ("partNumber", "uploadId"), header="x-amz-copy-source"),
    Route("UploadPart", "PUT", OBJECT, ("partNumber", "uploadId")),
    Route("AbortMultipartUpload", "DELETE", OBJECT, ("uploadId",)),
    Route("ListParts", "GET", OBJECT, ("uploadId",)),
    Route("CopyObject", "PUT", OBJECT, header="x-amz-copy-source"),
    Route("PutObject", "PUT", OBJECT),
    Route("GetObject", "GET", OBJECT),
    Route("HeadObject", "HEAD", OBJECT),
    Route("DeleteObject", "DELETE", OBJECT),
)

# Sub-resources that name S3 features ctxstore does not have: any request naming one gets NotImplemented.
UNSUPPORTED_SUBRESOURCES: tuple[str, ...] = (
    "accelerate", "acl", "analytics", "attributes", "cors", "encryption", "intelligent-tiering", "inventory",
    "legal-hold", "lifecycle", "logging", "metadataConfiguration", "metrics", "notification", "object-lock",
    "ownershipControls", "policy", "policyStatus", "publicAccessBlock", "replication", "requestPayment",
    "restore", "retention", "select", "tagging", "torrent", "versioning", "website",
)

# Operations routed but answered NotImplemented (listed in docs/s3-compatibility.md as rejected).
NOT_IMPLEMENTED_OPERATIONS = ("UploadPartCopy",)

_BUCKET_NAME = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")
_IP_LIKE = re.compile(r"^\d+\.\d+\.\d+\.\d+$")
MAX_KEY_BYTES = 1024


def valid_bucket_name(name: str) -> bool:
    """S3's general-purpose bucket naming rules."""
    return bool(
        _BUCKET_NAME.match(name)
        and ".." not in name
        and ".-" not in name
        and "-." not in name
        and not _IP_LIKE.match(name)
        and not name.startswith(("xn--", "sthree-"))
        and not name.endswith(("-s3alias", "--ol-s3", ".mrap", "--x-s3"))
    )


@dataclass(frozen=True)
class Target:
    bucket: str | None
    key: str | None
    virtual: bool = False  # the bucket came from the Host header (virtual-hosted style)

    @property
    def kind(self) -> str:
        if self.bucket is None:
            return SERVICE
        return BUCKET if self.key is None else OBJECT


def split_target(raw_path: str, host: str | None, domain: str) -> Target:
    """Bucket and key from the raw path (path-style) or the Host header (virtual-hosted-style).

    The key is percent-decoded exactly once; ``+`` is a literal plus."""
    path = raw_path.split("?", 1)[0]
    bucket: str | None = None
    if domain and host:
        hostname = host.rsplit(":", 1)[0] if not host.endswith("]") else host
        hostname = hostname.lower().rstrip(".")
        if hostname.endswith("." + domain):
            bucket = hostname[: -len(domain) - 1]
    if bucket is None:
        stripped = path[1:] if path.startswith("/") else path
        if not stripped:
            return Target(None, None)
        first, slash, rest = stripped.partition("/")
        bucket = _decode(first)
        return Target(bucket, _decode_key(rest) if slash and rest else None)
    rest = path[1:] if path.startswith("/") else path
    return Target(bucket, _decode_key(rest) if rest else None, virtual=True)


def _decode(text: str) -> str:
    try:
        return unquote(text, encoding="utf-8", errors="strict")
    except UnicodeDecodeError:
        raise S3Error("InvalidArgument", "The path is not valid UTF-8.") from None


def _decode_key(text: str) -> str:
    key = _decode(text)
    if len(key.encode("utf-8")) > MAX_KEY_BYTES:
        raise S3Error("KeyTooLongError", extra={"MaxSizeAllowed": str(MAX_KEY_BYTES)})
    return key


def resolve(method: str, target: Target, query: Mapping[str, str], headers: Mapping[str, str]) -> Route:
    """The route for a request, or S3Error (NotImplemented / MethodNotAllowed)."""
    for sub in UNSUPPORTED_SUBRESOURCES:
        if sub in query:
            raise S3Error("NotImplemented", f"The {sub} sub-resource is not implemented by ctxstore.")
    kind = target.kind
    for route in ROUTES:
        if route.matches(method, kind, query, headers):
            if route.operation in NOT_IMPLEMENTED_OPERATIONS:
                raise S3Error("NotImplemented", f"{route.operation} is not implemented by ctxstore.")
            return route
    raise S3Error("MethodNotAllowed", extra={"Method": method, "ResourceType": kind.upper()})


def markdown() -> str:
    """docs/s3-compatibility.md, generated from the routing table."""
    target_words = {SERVICE: "service (`/`)", BUCKET: "bucket", OBJECT: "object"}
    lines = [
        "# S3 compatibility",
        "",
        "Generated from the routing table in `server/s3/router.py` by "
        "`python -m ctxstore_server.s3.router > docs/s3-compatibility.md`; a test keeps it in sync.",
        "",
        "Addressing: path-style (`/bucket/key`) always; virtual-hosted-style (`Host: bucket.<domain>`) when "
        "`--domain` / `CTXSTORE_DOMAIN` is set. Authentication: SigV4 (header, presigned query, aws-chunked "
        "signed and unsigned-with-trailer bodies) and SigV2 (presigned query and header). "
        "ctxstore's own APIs live under `/_ctx/`, which no bucket name can reach (`_` is not allowed in bucket names).",
        "",
        "## Supported operations",
        "",
        "| operation | method | target | selected by |",
        "|---|---|---|---|",
    ]
    for route in ROUTES:
        if route.operation in NOT_IMPLEMENTED_OPERATIONS:
            continue
        selectors = [f"`?{q}`" for q in route.query]
        if route.query_value:
            selectors.append(f"`?{route.query_value[0]}={route.query_value[1]}`")
        if route.header:
            selectors.append(f"header `{route.header}`")
        lines.append(f"| {route.operation} | {route.method} | {target_words[route.target]} | "
                     f"{', '.join(selectors) or '-'} |")
    lines += [
        "",
        "## Rejected",
        "",
        "Answered `501 NotImplemented`:",
        "",
        *[f"- {op}" for op in NOT_IMPLEMENTED_OPERATIONS],
        "- GetObject / HeadObject with `partNumber`",
        "- any request naming one of these sub-resources: "
        + ", ".join(f"`{s}`" for s in UNSUPPORTED_SUBRESOURCES),
        "",
        "`OPTIONS` (CORS preflight) answers `400 CORSResponse`: CORS is not enabled. Any other method/target "
        "combination answers `405 MethodNotAllowed`.",
        "",
        "## Differences from AWS S3",
        "",
        "- Every object expires: `x-ctx-ttl: <seconds>` (or metadata `x-amz-meta-ctx-ttl`) on PUT, else the "
        "bucket's default, else the server's, capped by `--max-ttl`. Responses carry `x-ctx-expires-at` "
        "(Unix seconds) and `x-ctx-xxh3` (the server's XXH3-64 of the payload, hex).",
        "- No versioning: ListObjectVersions lists each object once as version `null`.",
        "- Conditional writes: `If-None-Match` only takes `*`; `If-Match` compares ETags; both are evaluated "
        "atomically with the write (PutObject, CopyObject, CompleteMultipartUpload).",
        "- When the byte budget is full of pinned blocks or uploads in flight, writes answer `503 SlowDown` with "
        "`Retry-After`.",
        "- ListMultipartUploads returns at most 1000 uploads, without paging.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    sys.stdout.write(markdown())
