"""Real S3 tools against a real node: the minio client, the aws CLI, s3cmd, and presigned URLs from boto3."""

from __future__ import annotations

import hashlib
import http.client
import io
import os
import secrets
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from support.nodes import ACCESS_KEY, SECRET_KEY, Node, make_client

minio = pytest.importorskip("minio")
from minio.commonconfig import CopySource  # noqa: E402
from minio.deleteobjects import DeleteObject  # noqa: E402

BIN = Path(sys.executable).parent
MiB = 1 << 20


def _random(n: int) -> bytes:
    return secrets.token_bytes(n) if n < 4 * MiB else os.urandom(n)


# -------------------- minio


@pytest.fixture
def mc(server: Node):
    return minio.Minio(f"127.0.0.1:{server.port}", access_key=ACCESS_KEY, secret_key=SECRET_KEY, secure=False,
                       region="us-east-1")


@pytest.fixture
def mbucket(mc, s3) -> Iterator[str]:
    name = "minio-" + secrets.token_hex(5)
    mc.make_bucket(name)
    yield name
    for obj in mc.list_objects(name, recursive=True):
        mc.remove_object(name, obj.object_name)
    mc.remove_bucket(name)


def test_minio_bucket_lifecycle(mc) -> None:
    name = "minio-life-" + secrets.token_hex(4)
    assert not mc.bucket_exists(name)
    mc.make_bucket(name)
    try:
        assert mc.bucket_exists(name)
        assert name in [b.name for b in mc.list_buckets()]
    finally:
        mc.remove_bucket(name)
    assert not mc.bucket_exists(name)


def test_minio_small_objects(mc, mbucket: str) -> None:
    data = b"kv-block" * 100
    result = mc.put_object(mbucket, "a/b/one", io.BytesIO(data), len(data), content_type="application/x-kv",
                           metadata={"x-amz-meta-model": "llama"})
    assert result.etag == hashlib.md5(data).hexdigest()
    resp = mc.get_object(mbucket, "a/b/one")
    try:
        assert resp.read() == data
    finally:
        resp.close()
        resp.release_conn()
    st = mc.stat_object(mbucket, "a/b/one")
    assert st.size == len(data)
    assert st.etag == hashlib.md5(data).hexdigest()
    assert st.content_type == "application/x-kv"
    assert st.metadata.get("x-amz-meta-model") == "llama"

    for key in ("a/b/two", "a/c", "top", "weird key+@%&=.bin"):
        mc.put_object(mbucket, key, io.BytesIO(key.encode()), len(key.encode()))
    flat = sorted(o.object_name for o in mc.list_objects(mbucket, prefix="a/"))
    assert flat == ["a/b/", "a/c"]
    deep = sorted(o.object_name for o in mc.list_objects(mbucket, recursive=True))
    assert deep == sorted(["a/b/one", "a/b/two", "a/c", "top", "weird key+@%&=.bin"])
    resp = mc.get_object(mbucket, "weird key+@%&=.bin")
    try:
        assert resp.read() == b"weird key+@%&=.bin"
    finally:
        resp.close()
        resp.release_conn()

    mc.copy_object(mbucket, "copied", CopySource(mbucket, "a/b/one"))
    resp = mc.get_object(mbucket, "copied")
    try:
        assert resp.read() == data
    finally:
        resp.close()
        resp.release_conn()

    mc.remove_object(mbucket, "top")
    doomed = [DeleteObject("a/b/two"), DeleteObject("a/c"), DeleteObject("nope")]
    errors = list(mc.remove_objects(mbucket, doomed))
    assert errors == []
    left = sorted(o.object_name for o in mc.list_objects(mbucket, recursive=True))
    assert left == ["a/b/one", "copied", "weird key+@%&=.bin"]
    with pytest.raises(minio.error.S3Error) as info:
        mc.stat_object(mbucket, "top")
    assert info.value.code in ("NoSuchKey", "ResponseHeadersNotFound", "NoSuchObject")


def test_minio_multipart_stream(mc, mbucket: str, s3) -> None:
    data = _random(12 * MiB)
    # Unknown length: minio buffers part_size bytes at a time and goes multipart.
    result = mc.put_object(mbucket, "big", io.BytesIO(data), length=-1, part_size=5 * MiB)
    assert result.etag.endswith("-3")
    head = s3.head_object(Bucket=mbucket, Key="big")
    assert head["ContentLength"] == len(data)
    assert head["ETag"].strip('"').endswith("-3")
    resp = mc.get_object(mbucket, "big")
    try:
        assert hashlib.sha256(resp.read()).digest() == hashlib.sha256(data).digest()
    finally:
        resp.close()
        resp.release_conn()
    # A range read through minio.
    resp = mc.get_object(mbucket, "big", offset=5 * MiB - 10, length=20)
    try:
        assert resp.read() == data[5 * MiB - 10:5 * MiB + 10]
    finally:
        resp.close()
        resp.release_conn()


def test_minio_presigned_and_files(mc, mbucket: str, tmp_path: Path) -> None:
    data = _random(300_000)
    src = tmp_path / "src.bin"
    src.write_bytes(data)
    mc.fput_object(mbucket, "file", str(src))
    dst = tmp_path / "dst.bin"
    mc.fget_object(mbucket, "file", str(dst))
    assert dst.read_bytes() == data
    url = mc.presigned_get_object(mbucket, "file")
    with urllib.request.urlopen(url, timeout=10) as resp:
        assert resp.read() == data


# -------------------- aws CLI


def _aws(server: Node, tmp: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {
        "PATH": os.environ.get("PATH", ""),
        "HOME": str(tmp),
        "AWS_ACCESS_KEY_ID": ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_CONFIG_FILE": str(tmp / "no-such-aws-config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp / "no-such-aws-credentials"),
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_PAGER": "",
    }
    proc = subprocess.run([str(BIN / "aws"), "--endpoint-url", server.endpoint, *args], env=env,
                          capture_output=True, text=True, timeout=60)
    if check and proc.returncode != 0:
        raise AssertionError(f"aws {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n"
                             f"{proc.stderr}")
    return proc


def test_aws_cli_cp_multipart_roundtrip(server: Node, bucket: str, s3, tmp_path: Path) -> None:
    data = _random(20 * MiB)
    src = tmp_path / "big.bin"
    src.write_bytes(data)
    _aws(server, tmp_path, "s3", "cp", str(src), f"s3://{bucket}/dir/big.bin")
    head = s3.head_object(Bucket=bucket, Key="dir/big.bin")
    assert head["ContentLength"] == len(data)
    etag = head["ETag"].strip('"')
    assert "-" in etag and int(etag.rsplit("-", 1)[1]) >= 2, etag  # multipart: "<md5 of md5s>-N"
    dst = tmp_path / "down.bin"
    _aws(server, tmp_path, "s3", "cp", f"s3://{bucket}/dir/big.bin", str(dst))
    assert dst.stat().st_size == len(data)
    assert hashlib.sha256(dst.read_bytes()).digest() == hashlib.sha256(data).digest()

    listing = _aws(server, tmp_path, "s3", "ls", f"s3://{bucket}/dir/").stdout
    assert "big.bin" in listing and str(len(data)) in listing
    buckets = _aws(server, tmp_path, "s3", "ls").stdout
    assert bucket in buckets
    _aws(server, tmp_path, "s3", "rm", f"s3://{bucket}/dir/big.bin")
    assert "Contents" not in s3.list_objects_v2(Bucket=bucket)


def test_aws_cli_s3api(server: Node, bucket: str, tmp_path: Path) -> None:
    src = tmp_path / "small.bin"
    src.write_bytes(b"hello ctxstore\n" * 50)
    out = _aws(server, tmp_path, "s3api", "put-object", "--bucket", bucket, "--key", "k/1",
               "--body", str(src), "--metadata", "ctx-ttl=600").stdout
    assert hashlib.md5(src.read_bytes()).hexdigest() in out
    dst = tmp_path / "small.out"
    out = _aws(server, tmp_path, "s3api", "get-object", "--bucket", bucket, "--key", "k/1", str(dst)).stdout
    assert dst.read_bytes() == src.read_bytes()
    assert '"ContentLength": 750' in out
    missing = _aws(server, tmp_path, "s3api", "get-object", "--bucket", bucket, "--key", "nope", str(dst),
                   check=False)
    assert missing.returncode != 0 and "NoSuchKey" in missing.stderr


# -------------------- s3cmd


def test_s3cmd(server: Node, s3, tmp_path: Path) -> None:
    cfg = tmp_path / "s3cfg"
    cfg.write_text(
        "[default]\n"
        f"access_key = {ACCESS_KEY}\n"
        f"secret_key = {SECRET_KEY}\n"
        f"host_base = 127.0.0.1:{server.port}\n"
        f"host_bucket = 127.0.0.1:{server.port}\n"
        "use_https = False\n"
        "signature_v2 = False\n"
        "bucket_location = us-east-1\n"
        "check_ssl_certificate = False\n"
        "progress_meter = False\n"
        "multipart_chunk_size_mb = 5\n"
    )
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path)}

    def run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run([str(BIN / "python"), str(BIN / "s3cmd"), "-c", str(cfg), *args], env=env,
                              capture_output=True, text=True, timeout=60)
        if check and proc.returncode != 0:
            raise AssertionError(f"s3cmd {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n"
                                 f"{proc.stderr}")
        return proc

    name = "s3cmd-" + secrets.token_hex(4)
    run("mb", f"s3://{name}")
    try:
        small = tmp_path / "small.bin"
        small.write_bytes(_random(1000))
        big = tmp_path / "big.bin"
        big.write_bytes(_random(11 * MiB))  # 5 MiB chunks: multipart
        run("put", str(small), f"s3://{name}/blocks/small.bin")
        run("put", str(big), f"s3://{name}/blocks/big.bin")
        assert s3.head_object(Bucket=name, Key="blocks/big.bin")["ETag"].strip('"').endswith("-3")
        listing = run("ls", f"s3://{name}/blocks/").stdout
        assert "small.bin" in listing and "big.bin" in listing
        assert name in run("ls").stdout
        for src in (small, big):
            dst = tmp_path / (src.name + ".down")
            run("get", f"s3://{name}/blocks/{src.name}", str(dst))
            assert dst.read_bytes() == src.read_bytes()
        run("del", f"s3://{name}/blocks/small.bin", f"s3://{name}/blocks/big.bin")
        assert "Contents" not in s3.list_objects_v2(Bucket=name)
    finally:
        for obj in s3.list_objects_v2(Bucket=name).get("Contents", []):
            s3.delete_object(Bucket=name, Key=obj["Key"])
        run("rb", f"s3://{name}")
    assert name not in [b["Name"] for b in s3.list_buckets()["Buckets"]]


# -------------------- presigned URLs


def _fetch(url: str, method: str = "GET", data: bytes | None = None) -> tuple[int, bytes]:
    """Fetch a presigned URL sending no header of our own (urllib would add a Content-Type to a PUT, which
    SigV2 signs)."""
    if method == "GET":
        try:
            with urllib.request.urlopen(url, timeout=10) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            with exc:
                return exc.code, exc.read()
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    try:
        conn.request(method, f"{parts.path}?{parts.query}", body=data)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


@pytest.mark.parametrize("signature_version", [None, "s3v4"], ids=["default", "s3v4"])
def test_presigned_urls(server: Node, bucket: str, s3, signature_version: str | None) -> None:
    config = {"signature_version": signature_version} if signature_version else {}
    client = make_client(server.endpoint, **config)
    data = _random(5000)
    s3.put_object(Bucket=bucket, Key="pre/signed key+1", Body=data)
    url = client.generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": "pre/signed key+1"},
                                        ExpiresIn=300)
    if signature_version is None:
        assert "X-Amz-Signature=" in url or "AWSAccessKeyId=" in url  # SigV2 query auth in us-east-1 today
    else:
        assert "X-Amz-Signature=" in url
    assert _fetch(url) == (200, data)
    # Tampering with the URL breaks the signature.
    status, body = _fetch(url.replace("pre/signed", "pre/signex"))
    assert status == 403 and b"SignatureDoesNotMatch" in body

    # A presigned PUT.
    put_url = client.generate_presigned_url("put_object", Params={"Bucket": bucket, "Key": "pre/put"},
                                            ExpiresIn=300)
    status, _ = _fetch(put_url, "PUT", b"presigned body")
    assert status == 200
    assert s3.get_object(Bucket=bucket, Key="pre/put")["Body"].read() == b"presigned body"

    # Expired.
    short = client.generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": "pre/signed key+1"},
                                          ExpiresIn=1)
    time.sleep(2.1)
    status, body = _fetch(short)
    assert status == 403
    assert b"<Code>AccessDenied</Code>" in body and b"expired" in body.lower()


def test_presigned_sigv2_query_explicit(server: Node, bucket: str, s3) -> None:
    """The legacy SigV2 query form (AWSAccessKeyId/Expires/Signature) that old tools still produce."""
    client = make_client(server.endpoint, signature_version="s3")
    s3.put_object(Bucket=bucket, Key="v2", Body=b"v2 body")
    url = client.generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": "v2"}, ExpiresIn=60)
    assert "AWSAccessKeyId=" in url
    assert _fetch(url) == (200, b"v2 body")


def test_virtual_hosted_style(server: Node, bucket: str, s3) -> None:
    """The shared node serves CTXSTORE_DOMAIN=s3.ctx.test: Host <bucket>.s3.ctx.test addresses the bucket
    (for header SigV4 and both presigned forms). Sent to 127.0.0.1 with that Host header: no DNS needed."""
    import boto3
    from botocore.config import Config

    s3.put_object(Bucket=bucket, Key="v/h k", Body=b"virtual")
    for signature_version in ("s3", "s3v4"):
        client = boto3.client("s3", endpoint_url=f"http://s3.ctx.test:{server.port}", region_name="us-east-1",
                              aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY,
                              config=Config(signature_version=signature_version,
                                            s3={"addressing_style": "virtual"}))
        url = client.generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": "v/h k"},
                                            ExpiresIn=60)
        parts = urllib.parse.urlsplit(url)
        assert parts.hostname == f"{bucket}.s3.ctx.test"
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        try:
            conn.request("GET", f"{parts.path}?{parts.query}", headers={"Host": parts.netloc})
            resp = conn.getresponse()
            assert (resp.status, resp.read()) == (200, b"virtual"), signature_version
        finally:
            conn.close()
