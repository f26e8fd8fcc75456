"""Signatures under attack: headers added after signing (issue #6), presigned URLs out of their bounds (#11,
and the S3 behaviour that such URLs answer 403 AccessDenied), and the clock-skew rule that already holds.

As AWS does it, every ``x-amz-*`` and ``x-ctx-*`` header a request carries must be covered by its signature:
a presigned URL signs only ``host``, so a header added to it (``x-amz-copy-source`` turns a PUT into a
CopyObject of any object of the signer's tenant) must be refused, and so must metadata, a TTL or a copy
source added to a header-signed request. A refused request stores nothing and changes nothing.
"""

from __future__ import annotations

import datetime
import secrets
import time
from collections.abc import Iterator

import pytest
from botocore.exceptions import ClientError
from support.nodes import Node, make_client
from support.probes import alive, start_probed_node
from support.raw import UNSIGNED, RawClient, bulk_frame, presign_v2, presign_v4, sign

WEEK = 7 * 24 * 3600


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    started = start_probed_node(tmp_path_factory.mktemp("adv-auth"), "--memory", "64MiB")
    yield started
    assert alive(started)
    started.stop()


@pytest.fixture(scope="module")
def s3(node: Node):
    return make_client(node.endpoint, retries={"mode": "standard", "total_max_attempts": 1})


@pytest.fixture
def raw(node: Node) -> Iterator[RawClient]:
    with RawClient(node.port) as client:
        yield client


@pytest.fixture
def bucket(s3) -> str:
    name = "adv-auth-" + secrets.token_hex(5)
    s3.create_bucket(Bucket=name)
    s3.put_object(Bucket=name, Key="secret", Body=b"the signer's private block")
    return name


def absent(s3, bucket: str, key: str) -> bool:
    try:
        s3.head_object(Bucket=bucket, Key=key)
    except ClientError as exc:
        return exc.response["ResponseMetadata"]["HTTPStatusCode"] == 404
    return False


# ---------------------------------------------------------------------------- #6: unsigned x-amz-* / x-ctx-*

ADDED = [
    ("x-amz-copy-source", "{bucket}/secret"),
    ("x-amz-meta-injected", "1"),
    ("x-ctx-ttl", "1"),
    ("x-amz-meta-ctx-ttl", "1"),
    ("x-amz-checksum-crc32", "AAAAAA=="),
]


@pytest.mark.parametrize("name, value", ADDED, ids=[n for n, _ in ADDED])
def test_header_added_to_a_presigned_put_is_access_denied(s3, raw: RawClient, bucket: str, name: str,
                                                          value: str) -> None:
    """A presigned PUT signs only ``host``: with ``x-amz-copy-source`` added it became a CopyObject of any
    object of the signer's tenant."""
    target = presign_v4(raw.endpoint, "PUT", f"/{bucket}/upload")
    reply = raw.exchange("PUT", target, {"Content-Length": "4", name: value.format(bucket=bucket)}, b"data")
    assert (reply.status, reply.code) == (403, "AccessDenied")
    assert absent(s3, bucket, "upload")


def test_presigned_put_without_added_headers_still_works(s3, raw: RawClient, bucket: str) -> None:
    target = presign_v4(raw.endpoint, "PUT", f"/{bucket}/upload")
    assert raw.exchange("PUT", target, {"Content-Length": "4"}, b"data").status == 200
    assert s3.get_object(Bucket=bucket, Key="upload")["Body"].read() == b"data"


@pytest.mark.parametrize("name, value", ADDED, ids=[n for n, _ in ADDED])
def test_header_added_after_header_signing_is_access_denied(s3, raw: RawClient, bucket: str, name: str,
                                                            value: str) -> None:
    s3.put_object(Bucket=bucket, Key="k", Body=b"before")
    target = f"/{bucket}/k"
    headers = sign(raw.endpoint, "PUT", target, payload_hash=UNSIGNED, headers={"Content-Length": "5"}).headers
    headers[name] = value.format(bucket=bucket)
    reply = raw.exchange("PUT", target, headers, b"after")
    assert (reply.status, reply.code) == (403, "AccessDenied")
    got = s3.get_object(Bucket=bucket, Key="k")
    assert got["Body"].read() == b"before" and "injected" not in got["Metadata"]


def test_signed_metadata_and_ttl_are_accepted(s3, raw: RawClient, bucket: str) -> None:
    target = f"/{bucket}/k"
    headers = sign(raw.endpoint, "PUT", target, payload_hash=UNSIGNED, headers={
        "Content-Length": "4", "x-amz-meta-colour": "blue", "x-ctx-ttl": "600"}).headers
    assert raw.exchange("PUT", target, headers, b"data").status == 200
    assert s3.head_object(Bucket=bucket, Key="k")["Metadata"] == {"colour": "blue"}


def test_header_added_to_a_signed_get_is_access_denied(s3, raw: RawClient, bucket: str) -> None:
    target = f"/{bucket}/secret"
    headers = sign(raw.endpoint, "GET", target, payload_hash=UNSIGNED).headers
    headers["x-amz-checksum-mode"] = "ENABLED"
    reply = raw.exchange("GET", target, headers)
    assert (reply.status, reply.code) == (403, "AccessDenied")
    assert b"private block" not in reply.body


def test_header_added_to_a_bulk_call_is_access_denied(s3, raw: RawClient, bucket: str) -> None:
    target = f"/_ctx/v1/bulk/{bucket}/delete"
    body = bulk_frame({"v": 1, "keys": ["secret"]})
    headers = sign(raw.endpoint, "POST", target, payload_hash=UNSIGNED,
                   headers={"Content-Length": str(len(body))}).headers
    headers["x-ctx-ttl"] = "1"
    reply = raw.exchange("POST", target, headers, body)
    assert (reply.status, reply.code) == (403, "AccessDenied")
    assert s3.get_object(Bucket=bucket, Key="secret")["Body"].read() == b"the signer's private block"


# ---------------------------------------------------------------------------- presigned URL bounds


def test_sigv2_presigned_url_beyond_seven_days_is_access_denied(s3, raw: RawClient, bucket: str) -> None:
    """SigV4 caps presigned URLs at 7 days; SigV2 had no cap at all."""
    target = presign_v2(raw.endpoint, "GET", f"/{bucket}/secret", expires_at=int(time.time()) + WEEK + 3600)
    reply = raw.exchange("GET", target, {})
    assert (reply.status, reply.code) == (403, "AccessDenied")
    assert b"private block" not in reply.body


def test_sigv2_presigned_url_within_seven_days_works(raw: RawClient, bucket: str) -> None:
    target = presign_v2(raw.endpoint, "GET", f"/{bucket}/secret", expires_at=int(time.time()) + WEEK - 3600)
    reply = raw.exchange("GET", target, {})
    assert reply.status == 200 and reply.body == b"the signer's private block"


@pytest.mark.parametrize("expires", [WEEK + 1, 10 * WEEK, 0])
def test_sigv4_presigned_expires_out_of_range_is_access_denied(raw: RawClient, bucket: str, expires: int) -> None:
    target = presign_v4(raw.endpoint, "GET", f"/{bucket}/secret", expires=expires)
    reply = raw.exchange("GET", target, {})
    assert (reply.status, reply.code) == (403, "AccessDenied")


def test_expired_presigned_put_is_access_denied(s3, raw: RawClient, bucket: str) -> None:
    signed_at = datetime.datetime.now(datetime.UTC) - datetime.timedelta(hours=1)
    target = presign_v4(raw.endpoint, "PUT", f"/{bucket}/late", expires=60, when=signed_at)
    reply = raw.exchange("PUT", target, {"Content-Length": "4"}, b"data")
    assert (reply.status, reply.code) == (403, "AccessDenied")
    assert absent(s3, bucket, "late")


def test_request_signed_twenty_minutes_ago_is_too_skewed(s3, raw: RawClient, bucket: str) -> None:
    target = f"/{bucket}/old"
    when = datetime.datetime.now(datetime.UTC) - datetime.timedelta(minutes=20)
    headers = sign(raw.endpoint, "PUT", target, payload_hash=UNSIGNED, headers={"Content-Length": "4"},
                   when=when).headers
    reply = raw.exchange("PUT", target, headers, b"data")
    assert (reply.status, reply.code) == (403, "RequestTimeTooSkewed")
    assert absent(s3, bucket, "old")
