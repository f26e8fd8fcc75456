"""The S3 routing table: method + target (service, bucket or object) + query keys + headers → operation.

Each row names the S3 operation (used in logs, metrics and docs/s3-compatibility.md) and the handler function
that serves it. Sub-resources ctxstore does not implement are a table of their own, answered with
NotImplemented.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

from ..protocol.shell import Reply
from . import bucket_handlers as buckets
from . import multipart_handlers as multipart
from . import object_handlers as objects
from .call import Call
from .errors import S3Error
from .target import BUCKET, OBJECT, SERVICE, Target

Handler = Callable[[Call], Awaitable[Reply]]


@dataclass(frozen=True)
class Route:
    operation: str
    method: str
    target: str
    query: tuple[str, ...] = ()  # query keys that must be present
    header: str | None = None  # a header that must be present
    query_value: tuple[str, str] | None = None  # a query key with a required value
    handler: Handler | None = None  # None: routed, but answered NotImplemented

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
    Route("ListBuckets", "GET", SERVICE, handler=buckets.list_buckets),
    Route("GetBucketLocation", "GET", BUCKET, ("location",), handler=buckets.get_bucket_location),
    Route("ListObjectVersions", "GET", BUCKET, ("versions",), handler=buckets.list_object_versions),
    Route("ListMultipartUploads", "GET", BUCKET, ("uploads",), handler=buckets.list_multipart_uploads),
    Route("ListObjectsV2", "GET", BUCKET, query_value=("list-type", "2"), handler=buckets.list_objects_v2),
    Route("ListObjects", "GET", BUCKET, handler=buckets.list_objects),
    Route("HeadBucket", "HEAD", BUCKET, handler=buckets.head_bucket),
    Route("CreateBucket", "PUT", BUCKET, handler=buckets.create_bucket),
    Route("DeleteBucket", "DELETE", BUCKET, handler=buckets.delete_bucket),
    Route("DeleteObjects", "POST", BUCKET, ("delete",), handler=buckets.delete_objects),
    Route("CreateMultipartUpload", "POST", OBJECT, ("uploads",), handler=multipart.create_multipart_upload),
    Route("CompleteMultipartUpload", "POST", OBJECT, ("uploadId",), handler=multipart.complete_multipart_upload),
    Route("UploadPartCopy", "PUT", OBJECT, ("partNumber", "uploadId"), header="x-amz-copy-source"),
    Route("UploadPart", "PUT", OBJECT, ("partNumber", "uploadId"), handler=multipart.upload_part),
    Route("AbortMultipartUpload", "DELETE", OBJECT, ("uploadId",), handler=multipart.abort_multipart_upload),
    Route("ListParts", "GET", OBJECT, ("uploadId",), handler=multipart.list_parts),
    Route("CopyObject", "PUT", OBJECT, header="x-amz-copy-source", handler=objects.copy_object),
    Route("PutObject", "PUT", OBJECT, handler=objects.put_object),
    Route("GetObject", "GET", OBJECT, handler=objects.get_object),
    Route("HeadObject", "HEAD", OBJECT, handler=objects.head_object),
    Route("DeleteObject", "DELETE", OBJECT, handler=objects.delete_object),
)

# Sub-resources that name S3 features ctxstore does not have: any request naming one gets NotImplemented.
UNSUPPORTED_SUBRESOURCES: tuple[str, ...] = (
    "accelerate", "acl", "analytics", "attributes", "cors", "encryption", "intelligent-tiering", "inventory",
    "legal-hold", "lifecycle", "logging", "metadataConfiguration", "metrics", "notification", "object-lock",
    "ownershipControls", "policy", "policyStatus", "publicAccessBlock", "replication", "requestPayment",
    "restore", "retention", "select", "tagging", "torrent", "versioning", "website",
)

# Operations routed but answered NotImplemented (listed in docs/s3-compatibility.md as rejected).
NOT_IMPLEMENTED_OPERATIONS = tuple(r.operation for r in ROUTES if r.handler is None)

# The rows of each (method, target kind), in table order: a request is matched against those only.
_CANDIDATES: dict[tuple[str, str], tuple[Route, ...]] = {}
for _route in ROUTES:
    _CANDIDATES[(_route.method, _route.target)] = (*_CANDIDATES.get((_route.method, _route.target), ()), _route)


def resolve(method: str, target: Target, query: Mapping[str, str], headers: Mapping[str, str]) -> Route:
    """The route for a request, or S3Error (NotImplemented / MethodNotAllowed)."""
    if query:
        for sub in UNSUPPORTED_SUBRESOURCES:
            if sub in query:
                raise S3Error("NotImplemented", f"The {sub} sub-resource is not implemented by ctxstore.")
    kind = target.kind
    for route in _CANDIDATES.get((method, kind), ()):
        if route.matches(method, kind, query, headers):
            if route.handler is None:
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
        "- Conditional writes: `If-None-Match: *` (no live object) or `If-None-Match: <etag>` (not that version) "
        "and `If-Match: <etag>` answer `412 PreconditionFailed` when they fail; both are evaluated "
        "atomically with the write (PutObject, CopyObject, CompleteMultipartUpload).",
        "- When the byte budget is full of pinned blocks or uploads in flight, writes answer `503 SlowDown` with "
        "`Retry-After`. A part that would make its own upload hold more than the node's budget (or its tenant's "
        "quota) answers `400 EntityTooLarge` at once instead: parts are never evicted, so that upload could never "
        "complete.",
        "- ListMultipartUploads returns at most 1000 uploads, without paging.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    sys.stdout.write(markdown())
