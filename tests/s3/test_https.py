"""HTTPS (--tls-cert/--tls-key) with boto3's defaults: aws-chunked bodies with unsigned payloads and a
trailing CRC32, single and multipart; and signed-chunk uploads (STREAMING-AWS4-HMAC-SHA256-PAYLOAD)."""

from __future__ import annotations

import base64
import hashlib
import io
import os
import secrets
import zlib
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from support.nodes import ACCESS_KEY, SECRET_KEY, Node, start_node
from support.raw import (
    SIGNED_CHUNKS,
    SIGNED_CHUNKS_TRAILER,
    aws_chunked,
    raw_request,
    sign,
)
from support.tls import make_self_signed

MiB = 1 << 20


@pytest.fixture(scope="module")
def tls_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Node, Path]]:
    tmp = tmp_path_factory.mktemp("tls")
    cert, key = make_self_signed(tmp)
    node = start_node(tmp, "--tls-cert", str(cert), "--tls-key", str(key), "--memory", "256MiB",
                      scheme="https")
    yield node, cert
    assert node.stop() == 0


class Recorder:
    """Remembers the headers of every request a client sends, by operation."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, dict[str, str]]] = []

    def __call__(self, request, event_name: str, **kwargs: object) -> None:  # noqa: ANN001
        headers = {k.lower(): v.decode("latin-1") if isinstance(v, bytes) else v
                   for k, v in request.headers.items()}
        self.sent.append((event_name.rsplit(".", 1)[-1], headers))

    def headers(self, operation: str) -> list[dict[str, str]]:
        return [h for op, h in self.sent if op == operation]


@pytest.fixture
def tls_client(tls_node: tuple[Node, Path]) -> Iterator[tuple[object, Recorder]]:
    node, cert = tls_node
    client = boto3.client("s3", endpoint_url=node.endpoint, region_name="us-east-1",
                          aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY, verify=str(cert),
                          config=Config(retries={"max_attempts": 1}))
    recorder = Recorder()
    client.meta.events.register("before-send.s3", recorder)
    yield client, recorder
    client.close()


@pytest.fixture
def tls_bucket(tls_client) -> Iterator[str]:  # noqa: ANN001
    client, _ = tls_client
    name = "tls-" + secrets.token_hex(5)
    client.create_bucket(Bucket=name)
    yield name
    for obj in client.list_objects_v2(Bucket=name).get("Contents", []):
        client.delete_object(Bucket=name, Key=obj["Key"])
    client.delete_bucket(Bucket=name)


def crc32_b64(data: bytes) -> str:
    return base64.b64encode(zlib.crc32(data).to_bytes(4, "big")).decode()


def _streaming_unsigned(headers: dict[str, str]) -> bool:
    return (headers.get("x-amz-content-sha256") == "STREAMING-UNSIGNED-PAYLOAD-TRAILER"
            and "aws-chunked" in headers.get("content-encoding", "")
            and headers.get("x-amz-trailer") == "x-amz-checksum-crc32")


def test_certificate_is_verified(tls_node: tuple[Node, Path], tmp_path: Path) -> None:
    """The client really verifies: a different self-signed certificate is refused."""
    node, cert = tls_node
    other_cert, _ = make_self_signed(tmp_path)
    from botocore.exceptions import SSLError

    client = boto3.client("s3", endpoint_url=node.endpoint, region_name="us-east-1",
                          aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY,
                          verify=str(other_cert),
                          config=Config(retries={"max_attempts": 1}))
    with pytest.raises(SSLError):
        client.list_buckets()
    client.close()


@pytest.mark.parametrize("size", [0, 1, 70 * 1024, 3 * MiB], ids=["0B", "1B", "70KiB", "3MiB"])
def test_put_get_default_trailer_checksum(tls_client, tls_bucket: str, size: int) -> None:  # noqa: ANN001
    client, recorder = tls_client
    data = os.urandom(size)
    key = f"blk/{size}"
    put = client.put_object(Bucket=tls_bucket, Key=key, Body=data)
    sent = recorder.headers("PutObject")[-1]
    assert _streaming_unsigned(sent), sent
    assert int(sent["x-amz-decoded-content-length"]) == size
    assert put["ETag"] == f'"{hashlib.md5(data).hexdigest()}"'
    assert put.get("ChecksumCRC32") == crc32_b64(data)

    got = client.get_object(Bucket=tls_bucket, Key=key, ChecksumMode="ENABLED")
    assert got["Body"].read() == data
    assert got["ContentLength"] == size
    assert got["ChecksumCRC32"] == crc32_b64(data)
    head = client.head_object(Bucket=tls_bucket, Key=key, ChecksumMode="ENABLED")
    assert head["ChecksumCRC32"] == crc32_b64(data)


def test_upload_fileobj_multipart_with_trailers(tls_client, tls_bucket: str) -> None:  # noqa: ANN001
    client, recorder = tls_client
    data = os.urandom(12 * MiB)
    config = TransferConfig(multipart_threshold=8 * MiB, multipart_chunksize=5 * MiB, max_concurrency=3)
    client.upload_fileobj(io.BytesIO(data), tls_bucket, "stream/12MiB", Config=config)
    parts = recorder.headers("UploadPart")
    assert len(parts) == 3
    assert all(_streaming_unsigned(h) for h in parts), parts
    head = client.head_object(Bucket=tls_bucket, Key="stream/12MiB", ChecksumMode="ENABLED")
    assert head["ContentLength"] == len(data)
    assert head["ETag"].strip('"').endswith("-3")
    # Composite checksum: CRC32 of the parts' CRC32s, "-3".
    part_crcs = b"".join(zlib.crc32(data[i:i + 5 * MiB]).to_bytes(4, "big")
                         for i in range(0, len(data), 5 * MiB))
    assert head.get("ChecksumCRC32") == f"{crc32_b64(part_crcs)}-3"
    out = io.BytesIO()
    client.download_fileobj(tls_bucket, "stream/12MiB", out)
    assert hashlib.sha256(out.getvalue()).digest() == hashlib.sha256(data).digest()


def test_streaming_put_into_missing_bucket_then_success(tls_client, tls_bucket: str) -> None:  # noqa: ANN001
    """aws-chunked + Transfer-Encoding: chunked + Expect: 100-continue refused early; the client goes on."""
    from botocore.exceptions import ClientError

    client, recorder = tls_client
    body = os.urandom(2 * MiB)
    with pytest.raises(ClientError) as info:
        client.put_object(Bucket="no-such-bucket-" + secrets.token_hex(4), Key="k", Body=body)
    assert info.value.response["Error"]["Code"] == "NoSuchBucket"
    assert recorder.headers("PutObject")[-1].get("expect") == "100-continue"
    client.put_object(Bucket=tls_bucket, Key="after", Body=body)
    assert client.get_object(Bucket=tls_bucket, Key="after")["Body"].read() == body


# -------------------- signed chunks (plain HTTP is enough)


@pytest.mark.parametrize("size", [0, 1, 64 * 1024, 200_000], ids=["0B", "1B", "one-chunk", "4-chunks"])
def test_signed_chunk_upload(server: Node, s3, bucket: str, size: int) -> None:  # noqa: ANN001
    data = os.urandom(size)
    target = f"/{bucket}/signed/{size}"
    # The encoded length does not depend on the signatures: measure it with any.
    body_len = len(aws_chunked(data, seed=sign(server, "PUT", target)))
    headers = {"Content-Encoding": "aws-chunked", "x-amz-decoded-content-length": str(size),
               "Content-Length": str(body_len)}
    signed = sign(server, "PUT", target, payload_hash=SIGNED_CHUNKS, headers=headers)
    body = aws_chunked(data, seed=signed)
    assert len(body) == body_len
    resp = raw_request(server, "PUT", target, signed.headers, body)
    assert resp.status == 200, resp.body
    assert resp.headers["etag"] == f'"{hashlib.md5(data).hexdigest()}"'
    got = s3.get_object(Bucket=bucket, Key=f"signed/{size}")
    assert got["Body"].read() == data
    assert got.get("ContentEncoding") in (None, "")  # aws-chunked is a transfer detail, never stored


def test_signed_chunk_upload_with_signed_trailer(server: Node, s3, bucket: str) -> None:  # noqa: ANN001
    data = os.urandom(150_000)
    target = f"/{bucket}/signed-trailer"
    trailer = ("x-amz-checksum-crc32", crc32_b64(data))
    probe = aws_chunked(data, seed=sign(server, "PUT", target), trailer=trailer)
    headers = {"Content-Encoding": "aws-chunked", "x-amz-decoded-content-length": str(len(data)),
               "x-amz-trailer": "x-amz-checksum-crc32", "Content-Length": str(len(probe))}
    signed = sign(server, "PUT", target, payload_hash=SIGNED_CHUNKS_TRAILER, headers=headers)
    body = aws_chunked(data, seed=signed, trailer=trailer)
    resp = raw_request(server, "PUT", target, signed.headers, body)
    assert resp.status == 200, resp.body
    assert resp.headers.get("x-amz-checksum-crc32") == crc32_b64(data)
    got = s3.get_object(Bucket=bucket, Key="signed-trailer", ChecksumMode="ENABLED")
    assert got["Body"].read() == data
    assert got["ChecksumCRC32"] == crc32_b64(data)
