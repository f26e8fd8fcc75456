"""Signed requests by hand: the one place the client builds an authenticated request head and sends a plain S3
request (CreateBucket here; the bench's PutObject, GetObject, DeleteObject, GetBucketLocation, DeleteBucket).

The bulk calls (:mod:`.core`) sign their heads with :func:`signed_head` too; their error answers, when not a bulk
error frame, and every S3 error answer become a client error through :func:`error_of`
(:func:`ctxstore.errors.s3_error`: the one S3 error parser). Paths are percent-encoded a segment at a time
(:func:`object_path`): what is sent is what SigV4 signs.
"""

from __future__ import annotations

from .buckets import path_segment
from .errors import ServerError, s3_error
from .pod import Node
from .sigv4 import Signer
from .transport import Buffer, BytesReader, ReaderFactory, Response, request_head


def object_path(bucket: str, key: str | None = None) -> str:
    """``/bucket`` or ``/bucket/key``, each segment of the key encoded on its own (its slashes stay separators)."""
    path = "/" + path_segment(bucket)
    if key is not None:
        path += "/" + "/".join(path_segment(part) for part in key.split("/"))
    return path


def signed_head(signer: Signer, method: str, host: str, path: str, length: int, *, query: str = "",
                content_type: str | None = None) -> bytes:
    """The request line and headers of ``method path?query`` to ``host`` (``path`` percent-encoded), signed."""
    target = path + (f"?{query}" if query else "")
    return request_head(method, host, target, signer.headers(method, host, path, query), length,
                        content_type=content_type)


def _collected(status: int, n: int) -> BytesReader:
    return BytesReader(n)


async def request(signer: Signer, node: Node, method: str, bucket: str, key: str | None = None, *,
                  query: str = "", body: Buffer | None = None, reader: ReaderFactory | None = None,
                  content_type: str | None = None) -> Response:
    """One signed S3 request to ``node`` on its pooled connections; ``reader(status, length)`` takes the answer's
    body (default: collected whole, for :func:`error_of`)."""
    length = len(body) if body is not None else 0
    head = signed_head(signer, method, node.host_header, object_path(bucket, key), length, query=query,
                       content_type=content_type)
    return await node.pool.request(head, (body,) if body is not None else (), reader or _collected)


def body_of(response: Response) -> bytes:
    """A response's body when it was collected whole (an error's); else nothing."""
    return bytes(response.reader.data) if isinstance(response.reader, BytesReader) else b""


def error_of(node: str, response: Response) -> ServerError:
    """The client error of a non-2xx S3 answer (its ``<Error>`` document's code and message, else ``HTTP``)."""
    return s3_error(node, response.status, body_of(response))
