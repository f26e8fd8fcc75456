"""The client's plain S3 requests (:mod:`ctxstore.s3`: the one signed head and error reading that the bulk calls,
CreateBucket and ``ctxstore bench`` share) against a real node: a key with slashes, spaces and ``@`` is encoded a
segment at a time and signed as sent, and an error answer becomes its S3 code."""

from __future__ import annotations

import asyncio

from support.nodes import ACCESS_KEY, SECRET_KEY, Node

from ctxstore import AsyncContextStore, NoSuchBucket, s3, wire

BUCKET = "s3-requests"
KEY = "run 1/chunk@0001/part"


def test_object_paths_are_encoded_a_segment_at_a_time() -> None:
    assert s3.object_path(BUCKET) == "/s3-requests"
    assert s3.object_path(BUCKET, KEY) == "/s3-requests/run%201/chunk%400001/part"


def test_only_bulk_calls_name_the_bulk_content_type() -> None:
    store = AsyncContextStore("127.0.0.1:1", access_key=ACCESS_KEY, secret_key=SECRET_KEY)
    plain = s3.signed_head(store.signer, "GET", "h:1", "/b/k", 0, query="location=").decode()
    bulk = s3.signed_head(store.signer, "POST", "h:1", wire.path("b", "get"), 7,
                          content_type=wire.CONTENT_TYPE).decode()
    assert plain.startswith("GET /b/k?location= HTTP/1.1\r\nhost: h:1\r\ncontent-length: 0\r\n")
    assert "content-type" not in plain and f"content-type: {wire.CONTENT_TYPE}" in bulk
    assert plain.endswith("\r\n\r\n") and "authorization: AWS4-HMAC-SHA256 Credential=" in plain


def test_a_put_get_and_the_errors_of_a_real_node(pod: list[Node]) -> None:
    async def run() -> tuple[int, bytes, str, str, type]:
        async with AsyncContextStore([n.endpoint for n in pod], access_key=ACCESS_KEY,
                                     secret_key=SECRET_KEY) as store:
            await store.create_bucket(BUCKET)
            node = store.pod.owner(KEY)
            put = await s3.request(store.signer, node, "PUT", BUCKET, KEY, body=memoryview(b"kv bytes"))
            got = await s3.request(store.signer, node, "GET", BUCKET, KEY)
            missing = await s3.request(store.signer, node, "GET", BUCKET, KEY + "-not-there")
            no_bucket = await s3.request(store.signer, node, "GET", "s3-requests-none", KEY)
            await s3.request(store.signer, node, "DELETE", BUCKET, KEY)
            return (put.status, s3.body_of(got), s3.error_of(node.name, missing).code,
                    s3.error_of(node.name, no_bucket).code, type(s3.error_of(node.name, no_bucket)))

    status, body, missing, no_bucket, kind = asyncio.run(run())
    assert (status, body) == (200, b"kv bytes")
    assert (missing, no_bucket, kind) == ("NoSuchKey", "NoSuchBucket", NoSuchBucket)
