"""Prometheus metrics (docs/metrics.md): the /metrics endpoint and its bearer token, the exposition, request
and store metrics moving with S3 and bulk traffic, and a bucket named "metrics" that still works; against the
node's application in-process (what it counts is above the transport)."""

from __future__ import annotations

import asyncio
import gzip
import os
import secrets
import time
import urllib.parse
from collections.abc import Iterator
from typing import Any

import pytest
import xxhash
from botocore.exceptions import ClientError
from support.inprocess import InProcessNode
from support.nodes import ACCESS_KEY, SECRET_KEY
from support.raw import EMPTY_SHA256, raw_request, sign
from prometheus_client.parser import text_string_to_metric_families

from ctxstore import __version__, wire
from ctxstore_server.app import App
from ctxstore_server.metrics import DURATION_BUCKETS, is_scrape
from ctxstore_server.settings import Settings
from ctxstore_server.tenants import TenantRegistry

TOKEN = "metrics-test-token-" + secrets.token_hex(8)
MiB = 1 << 20


# ============================================================================================ helpers


@pytest.fixture(scope="module")
def node() -> Iterator[InProcessNode]:
    n = InProcessNode(memory=64 * MiB, node_id="metrics-node-1", admin_token=TOKEN, keep_time=True)
    yield n
    n.close()


@pytest.fixture(scope="module")
def s3(node: InProcessNode) -> Any:
    return node.client()


@pytest.fixture
def bucket(s3: Any) -> Iterator[str]:
    name = "m-" + secrets.token_hex(6)
    s3.create_bucket(Bucket=name)
    yield name
    for obj in s3.list_objects_v2(Bucket=name).get("Contents", []):
        s3.delete_object(Bucket=name, Key=obj["Key"])
    s3.delete_bucket(Bucket=name)


def request(node: InProcessNode, method: str, path: str, headers: dict[str, str] | None = None,
            body: bytes = b"") -> tuple[int, dict[str, str], bytes]:
    all_headers = dict(headers or {})
    if body or method in ("POST", "PUT"):
        all_headers.setdefault("Content-Length", str(len(body)))
    reply = raw_request(node, method, path, all_headers, body)
    return reply.status, reply.headers, reply.body


def bearer(token: str = TOKEN) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def scrape(node: InProcessNode, path: str = "/metrics") -> Samples:
    status, headers, body = request(node, "GET", path, bearer())
    assert status == 200, body
    assert headers["content-type"].startswith("text/plain")
    return parse(body.decode())


def value(samples: Samples, name: str, **labels: str) -> float:
    """A sample's value, 0 if the series does not exist (yet)."""
    return samples.get((name, frozenset(labels.items())), 0.0)


def requests_total(samples: Samples, api: str, operation: str, status: int) -> float:
    return value(samples, "ctxstore_requests_total", api=api, operation=operation, status=str(status))


def bulk_call(node: InProcessNode, bucket: str, op: str, body: bytes) -> tuple[int, bytes]:
    path = wire.path(bucket, op)  # UNSIGNED-PAYLOAD: the bulk API's blocks carry their own XXH3-64
    status, _, reply = request(node, "POST", path, sign(node, "POST", path).headers, body)
    return status, reply


def put_frame(blocks: dict[str, bytes]) -> bytes:
    head = wire.PutRequest(list(blocks), [len(d) for d in blocks.values()],
                           [xxhash.xxh3_64_intdigest(d) for d in blocks.values()])
    return wire.encode_put_head(head) + b"".join(blocks.values())


def keys_frame(op: str, keys: list[str], **fields: Any) -> bytes:
    return wire.encode_keys_request(op, wire.KeysRequest(keys, **fields))


# ============================================================================================ the endpoint


def test_the_endpoint_takes_the_admin_token_and_nothing_else(node: InProcessNode) -> None:
    for path in ("/metrics", "/_ctx/metrics"):
        for headers in (bearer("wrong-token"), bearer(""), {"Authorization": f"Bearer {SECRET_KEY}"},
                        {"Authorization": f"bearer {TOKEN}x"}):
            status, head, body = request(node, "GET", path, headers)
            assert status == 401, (path, headers, body)
            assert head["www-authenticate"] == "Bearer"
            assert b"ctxstore_" not in body
    status, _, _ = request(node, "GET", "/_ctx/metrics")  # no Authorization at all
    assert status == 401
    # S3 credentials don't open it: a SigV4-signed request for the reserved path is refused...
    signed = sign(node, "GET", "/_ctx/metrics", payload_hash=EMPTY_SHA256)
    status, _, body = request(node, "GET", "/_ctx/metrics", signed.headers)
    assert status == 401 and b"ctxstore_" not in body
    # ...and on /metrics an unauthenticated or signed request is S3's (the bucket "metrics" does not exist)
    status, _, body = request(node, "GET", "/metrics")
    assert status == 403 and b"<Code>AccessDenied</Code>" in body
    with pytest.raises(ClientError) as info:
        node.client().list_objects_v2(Bucket="metrics")
    assert info.value.response["Error"]["Code"] == "NoSuchBucket"

    # The right token, either path, scheme name in any case.
    for path in ("/metrics", "/_ctx/metrics"):
        status, head, body = request(node, "GET", path, {"Authorization": f"bEaReR {TOKEN}"})
        assert status == 200 and b"ctxstore_up 1.0" in body
    status, head, body = request(node, "HEAD", "/_ctx/metrics", bearer())
    assert status == 200 and body == b"" and int(head["content-length"]) > 0
    status, head, _ = request(node, "POST", "/_ctx/metrics", bearer())
    assert status == 405 and "GET" in head["allow"]


def test_exposition_parses_and_describes_the_node(node: InProcessNode) -> None:
    status, headers, body = request(node, "GET", "/metrics", bearer())
    assert status == 200
    assert headers["content-type"].startswith("text/plain; version=")
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    types = {name: f.type for name, f in families.items()}
    for name in ("ctxstore_budget_bytes", "ctxstore_used_bytes", "ctxstore_reserved_bytes",
                 "ctxstore_pinned_bytes", "ctxstore_parts_bytes", "ctxstore_uploads_in_progress",
                 "ctxstore_up", "ctxstore_draining", "ctxstore_start_time_seconds"):
        assert types[name] == "gauge", name
    for name in ("ctxstore_bucket_objects", "ctxstore_bucket_bytes", "ctxstore_bucket_pinned_bytes"):
        assert types[name] == "gauge", name
    for name in ("ctxstore_bucket_hits", "ctxstore_bucket_misses", "ctxstore_bucket_puts",
                 "ctxstore_bucket_evictions", "ctxstore_bucket_expirations", "ctxstore_bucket_bytes_in",
                 "ctxstore_bucket_bytes_out", "ctxstore_requests", "ctxstore_request_bytes",
                 "ctxstore_response_bytes"):
        assert types[name] == "counter", name
    assert types["ctxstore_request_duration_seconds"] == "histogram"
    assert types["ctxstore_info"] == "gauge"  # an info metric: the text format has no "info" type
    assert "process_resident_memory_bytes" in families

    samples = parse(body.decode())
    assert value(samples, "ctxstore_budget_bytes") == 64 * MiB
    assert value(samples, "ctxstore_up") == 1
    assert value(samples, "ctxstore_draining") == 0
    assert value(samples, "ctxstore_info", version=__version__, node_id="metrics-node-1") == 1
    assert 0 < time.time() - value(samples, "ctxstore_start_time_seconds") < 600

    # gzip when asked for (Prometheus asks)
    status, headers, zipped = request(node, "GET", "/metrics", {**bearer(), "Accept-Encoding": "gzip"})
    assert status == 200 and headers["content-encoding"] == "gzip"
    assert "ctxstore_budget_bytes" in {f.name for f in text_string_to_metric_families(
        gzip.decompress(zipped).decode())}


# ============================================================================================ traffic


def test_s3_traffic_moves_request_and_bucket_metrics(node: InProcessNode, s3: Any, bucket: str) -> None:
    before = scrape(node)
    sizes = {"a": 1000, "b": 70_000, "c": 5}
    for key, size in sizes.items():
        s3.put_object(Bucket=bucket, Key=key, Body=os.urandom(size))
    assert len(s3.get_object(Bucket=bucket, Key="a")["Body"].read()) == 1000
    assert len(s3.get_object(Bucket=bucket, Key="b")["Body"].read()) == 70_000
    with pytest.raises(ClientError) as info:
        s3.get_object(Bucket=bucket, Key="absent")
    assert info.value.response["Error"]["Code"] == "NoSuchKey"
    s3.head_object(Bucket=bucket, Key="c")
    with pytest.raises(ClientError):  # a bad signature fails before routing: operation Unknown
        node.client(ACCESS_KEY, "not-the-secret").get_object(Bucket=bucket, Key="a")
    upload = s3.create_multipart_upload(Bucket=bucket, Key="mpu")["UploadId"]
    during = scrape(node)
    s3.abort_multipart_upload(Bucket=bucket, Key="mpu", UploadId=upload)
    after = scrape(node)

    def delta(api: str, operation: str, status: int) -> float:
        return requests_total(after, api, operation, status) - requests_total(before, api, operation, status)

    assert delta("s3", "PutObject", 200) == 3
    assert delta("s3", "GetObject", 200) == 2
    assert delta("s3", "GetObject", 404) == 1
    assert delta("s3", "HeadObject", 200) == 1
    assert delta("s3", "Unknown", 403) == 1
    assert delta("s3", "CreateMultipartUpload", 200) == 1
    assert delta("s3", "AbortMultipartUpload", 204) == 1
    assert value(during, "ctxstore_uploads_in_progress") >= 1

    def bytes_delta(name: str, operation: str) -> float:
        return (value(after, name, api="s3", operation=operation)
                - value(before, name, api="s3", operation=operation))

    assert bytes_delta("ctxstore_request_bytes_total", "PutObject") == sum(sizes.values())
    assert bytes_delta("ctxstore_response_bytes_total", "GetObject") > 71_000  # both bodies + the 404's XML
    assert bytes_delta("ctxstore_response_bytes_total", "HeadObject") == 0

    labels = {"api": "s3", "operation": "PutObject", "status": "200"}
    count = value(after, "ctxstore_request_duration_seconds_count", **labels)
    assert count == requests_total(after, "s3", "PutObject", 200) >= 3
    assert value(after, "ctxstore_request_duration_seconds_bucket", le="+Inf", **labels) == count
    cumulative = [value(after, "ctxstore_request_duration_seconds_bucket", le=str(b), **labels)
                  for b in DURATION_BUCKETS]
    assert cumulative == sorted(cumulative) and cumulative[-1] <= count
    assert 0 < value(after, "ctxstore_request_duration_seconds_sum", **labels) < 60

    per_bucket = {"bucket": bucket, "tenant": "default"}
    assert value(after, "ctxstore_bucket_objects", **per_bucket) == 3
    assert value(after, "ctxstore_bucket_bytes", **per_bucket) == sum(sizes.values())
    assert value(after, "ctxstore_bucket_puts_total", **per_bucket) == 3
    assert value(after, "ctxstore_bucket_bytes_in_total", **per_bucket) == sum(sizes.values())
    assert value(after, "ctxstore_bucket_hits_total", **per_bucket) == 2  # HEAD counts no hit
    assert value(after, "ctxstore_bucket_misses_total", **per_bucket) == 1
    assert value(after, "ctxstore_bucket_bytes_out_total", **per_bucket) >= 71_000
    assert value(after, "ctxstore_used_bytes") >= sum(sizes.values())


def test_bulk_traffic_moves_request_and_bucket_metrics(node: InProcessNode, s3: Any, bucket: str) -> None:
    before = scrape(node)
    blocks = {"k1": os.urandom(4096), "k2": os.urandom(100)}
    body = put_frame(blocks)
    status, _ = bulk_call(node, bucket, "put", body)
    assert status == 200
    status, reply = bulk_call(node, bucket, "get", keys_frame("get", ["k1", "gone", "k2"]))
    assert status == 200
    status, _ = bulk_call(node, bucket, "lookup", keys_frame("lookup", ["k1", "k2"], pin=60.0))
    assert status == 200
    status, _ = bulk_call(node, "no-such-bucket-" + secrets.token_hex(4), "get", keys_frame("get", ["k1"]))
    assert status == 404
    status, _, _ = request(node, "GET", wire.path(bucket, "get"))  # wrong method: before the op is known
    assert status == 405
    after = scrape(node)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("ctxstore_requests_total", api="bulk", operation="put", status="200") == 1
    assert delta("ctxstore_requests_total", api="bulk", operation="get", status="200") == 1
    assert delta("ctxstore_requests_total", api="bulk", operation="lookup", status="200") == 1
    assert delta("ctxstore_requests_total", api="bulk", operation="get", status="404") == 1
    assert delta("ctxstore_requests_total", api="bulk", operation="Unknown", status="405") == 1
    assert delta("ctxstore_request_bytes_total", api="bulk", operation="put") == len(body)
    assert delta("ctxstore_response_bytes_total", api="bulk", operation="get") > len(reply)  # + the 404
    assert delta("ctxstore_request_duration_seconds_count", api="bulk", operation="get", status="200") == 1

    per_bucket = {"bucket": bucket, "tenant": "default"}
    assert value(after, "ctxstore_bucket_objects", **per_bucket) == 2
    assert value(after, "ctxstore_bucket_puts_total", **per_bucket) == 2
    assert value(after, "ctxstore_bucket_hits_total", **per_bucket) == 4  # get: 2, lookup: 2
    assert value(after, "ctxstore_bucket_misses_total", **per_bucket) == 1
    assert value(after, "ctxstore_bucket_bytes_out_total", **per_bucket) == 4196
    assert value(after, "ctxstore_bucket_pinned_bytes", **per_bucket) >= 4196  # the lookup pinned both
    assert value(after, "ctxstore_pinned_bytes") >= 4196
    status, _ = bulk_call(node, bucket, "unpin", keys_frame("unpin", ["k1", "k2"]))
    assert status == 200


def test_evictions_and_expirations_are_counted() -> None:
    small = InProcessNode(memory=MiB, admin_token=TOKEN)  # on a fake clock
    try:
        s3 = small.client()
        s3.create_bucket(Bucket="small")
        for i in range(8):  # 8 x 200 KiB into a 1 MiB budget: the oldest go
            s3.put_object(Bucket="small", Key=f"big-{i}", Body=os.urandom(200 << 10))
        s3.put_object(Bucket="small", Key="short", Body=b"x" * 10, Metadata={"ctx-ttl": "0.3"})
        labels = {"bucket": "small", "tenant": "default"}
        assert value(scrape(small), "ctxstore_bucket_expirations_total", **labels) == 0
        small.advance(0.5)
        small.housekeep()  # the housekeeper's pass (every 0.25 s on a node) reaps the expired object
        samples = scrape(small)
        assert value(samples, "ctxstore_bucket_expirations_total", **labels) == 1
        assert value(samples, "ctxstore_bucket_evictions_total", **labels) >= 3
        assert value(samples, "ctxstore_bucket_puts_total", **labels) == 9
        assert value(samples, "ctxstore_used_bytes") <= value(samples, "ctxstore_budget_bytes") == MiB
        assert requests_total(samples, "s3", "PutObject", 200) == 9
    finally:
        small.close()


# ============================================================================================ /metrics vs S3


def test_a_bucket_named_metrics_still_works(node: InProcessNode, s3: Any) -> None:
    s3.create_bucket(Bucket="metrics")
    try:
        s3.put_object(Bucket="metrics", Key="a", Body=b"hello")
        s3.put_object(Bucket="metrics", Key="b/c", Body=b"world!")
        assert [o["Key"] for o in s3.list_objects_v2(Bucket="metrics")["Contents"]] == ["a", "b/c"]
        assert [o["Key"] for o in s3.list_objects(Bucket="metrics")["Contents"]] == ["a", "b/c"]
        s3.head_bucket(Bucket="metrics")
        assert s3.get_object(Bucket="metrics", Key="a")["Body"].read() == b"hello"
        # A presigned listing of /metrics carries no Authorization header: S3's.
        presigner = node.client(signature_version="s3v4")
        url = urllib.parse.urlsplit(presigner.generate_presigned_url("list_objects_v2", Params={"Bucket": "metrics"}))
        listing = raw_request(node, "GET", f"{url.path}?{url.query}", {}).body
        assert b"<Key>a</Key>" in listing and b"<Key>b/c</Key>" in listing
        # A Bearer PUT on /metrics is no scrape either: S3 refuses its authorization.
        status, _, body = request(node, "PUT", "/metrics", bearer())
        assert status in (400, 403) and body.startswith(b"<?xml")

        # The same path with the bearer token: the exposition, which counts the requests above.
        samples = scrape(node, "/metrics")
        assert value(samples, "ctxstore_bucket_objects", bucket="metrics", tenant="default") == 2
        assert requests_total(samples, "s3", "ListObjectsV2", 200) >= 2
        assert requests_total(samples, "s3", "CreateBucket", 200) >= 1
    finally:
        for key in ("a", "b/c"):
            s3.delete_object(Bucket="metrics", Key=key)
        s3.delete_bucket(Bucket="metrics")
    assert ("ctxstore_bucket_objects", frozenset({("bucket", "metrics"), ("tenant", "default")})) \
        not in scrape(node)


# ============================================================================================ in process


def _app(**settings: Any) -> App:
    tenants = TenantRegistry()
    tenants.add("default", ACCESS_KEY, SECRET_KEY)
    return App(Settings(**settings), tenants)


async def _call(app: App, method: str, path: str, headers: list[tuple[bytes, bytes]],
                messages: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    scope = {"type": "http", "method": method, "path": path, "raw_path": path.encode(), "query_string": b"",
             "headers": [(b"host", b"testserver"), *headers]}
    pending = list(messages or [{"type": "http.request", "body": b"", "more_body": False}])
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return pending.pop(0) if pending else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    return sent


def test_without_an_admin_token_the_endpoint_is_disabled() -> None:
    app = _app(admin_token="")
    for path in ("/metrics", "/_ctx/metrics"):
        sent = asyncio.run(_call(app, "GET", path, [(b"authorization", b"Bearer anything")]))
        assert sent[0]["status"] == 403 and b"disabled" in sent[1]["body"]


def test_every_app_has_its_own_registry_and_counts_a_client_that_went_away() -> None:
    one, two = _app(admin_token="t1"), _app(admin_token="t2")
    assert one.metrics.registry is not two.metrics.registry
    one.engine.create_bucket("default", "inproc")
    body = put_frame({"k": os.urandom(1000)})
    path = wire.path("inproc", "put")
    signed = sign(None, "POST", path, host="testserver")
    headers = [(b"content-length", str(len(body)).encode()),
               *((k.lower().encode(), v.encode()) for k, v in signed.headers.items() if k.lower() != "host")]
    sent = asyncio.run(_call(one, "POST", path, headers, [
        {"type": "http.request", "body": body[:10], "more_body": True}, {"type": "http.disconnect"}]))
    assert sent == []  # nothing to answer
    samples = parse(one.metrics.exposition().decode())
    assert requests_total(samples, "bulk", "put", 499) == 1
    assert value(samples, "ctxstore_request_bytes_total", api="bulk", operation="put") == 0  # not read whole
    assert requests_total(parse(two.metrics.exposition().decode()), "bulk", "put", 499) == 0
    sent = asyncio.run(_call(two, "GET", "/_ctx/metrics", [(b"authorization", b"Bearer t1")]))
    assert sent[0]["status"] == 401  # one node's token does not open another's


def test_scrape_detection() -> None:
    def scope(method: str, auth: bytes | None) -> dict[str, Any]:
        return {"method": method, "headers": [] if auth is None else [(b"authorization", auth)]}

    assert is_scrape(scope("GET", b"Bearer x"))
    assert is_scrape(scope("HEAD", b"bearer x"))
    assert not is_scrape(scope("PUT", b"Bearer x"))
    assert not is_scrape(scope("GET", None))  # anonymous or presigned S3
    assert not is_scrape(scope("GET", b"AWS4-HMAC-SHA256 Credential=AKIA/20240101/us-east-1/s3/aws4_request"))
    assert not is_scrape(scope("GET", b"AWS AKIA:signature"))
    assert not is_scrape(scope("GET", b"Bearerx"))
