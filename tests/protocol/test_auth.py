"""Request authentication: AWS's published vectors, then requests signed by botocore itself."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import quote, urlsplit

import boto3
import pytest
from botocore.awsrequest import AWSResponse
from botocore.config import Config
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.raw import presign_v4, sign

from ctxstore_server.protocol.auth import AuthContext, Credentials, authenticate
from ctxstore_server.protocol.errors import RequestError
from ctxstore_server.s3.errors import S3Error, as_s3_error

# AWS's example credentials, used by every published example.
AWS_KEY = "AKIAIOSFODNN7EXAMPLE"
AWS_SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
AWS_CREDS = Credentials(AWS_KEY, AWS_SECRET, "aws-example")

# Credentials for the botocore-signed requests; the secret has the characters that trip naive code.
KEY = "CTXSTOREKEY1"
SECRET = "s3cr3t/with+slash=and~tilde"
CREDS = Credentials(KEY, SECRET, "tenant-a")
CREDENTIALS = {AWS_KEY: AWS_CREDS, KEY: CREDS}

EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
T_2013_05_24 = 1369353600.0  # 20130524T000000Z, the instant of AWS's SigV4 examples


def lookup(access_key: str) -> Credentials | None:
    return CREDENTIALS.get(access_key)


@dataclass(frozen=True)
class Wire:
    """A request as the server sees it: method, raw path, raw query, lowercase headers."""

    method: str
    raw_path: str
    query: bytes
    headers: dict[str, str]

    def auth(self, **kwargs: Any) -> AuthContext:
        kwargs.setdefault("now", time.time())
        return authenticate(
            method=self.method, raw_path=self.raw_path, query_string=self.query, headers=self.headers,
            lookup=lookup, **kwargs,
        )

    def with_headers(self, **changes: str | None) -> Wire:
        headers = dict(self.headers)
        for name, value in changes.items():
            name = name.replace("_", "-")
            if value is None:
                headers.pop(name, None)
            else:
                headers[name] = value
        return replace(self, headers=headers)


def wire_from_url(method: str, url: str, headers: dict[str, str] | None = None) -> Wire:
    parts = urlsplit(url)
    all_headers = {"host": parts.netloc, **(headers or {})}
    return Wire(method, parts.path, parts.query.encode("ascii"), all_headers)


def assert_fails(code: str, wire: Wire, **kwargs: Any) -> S3Error:
    with pytest.raises(RequestError) as caught:
        wire.auth(**kwargs)
    error = as_s3_error(caught.value)  # the S3 error a client sees
    assert error.code == code, (error.code, error.message)
    # Whatever went wrong, the secret never leaves the server.
    for secret in (SECRET, AWS_SECRET):
        assert secret not in repr((str(error), error.message, error.extra, error.headers))
    return error


# -- AWS published SigV4 vectors ---------------------------------------------------------------------------
# From "Signature Calculations for the Authorization Header: Transferring Payload in a Single Chunk (AWS
# Signature Version 4)", section "Examples: Signature Calculations" (bucket examplebucket, virtual-hosted).


def _v4_header(signed_headers: str, signature: str) -> str:
    return (
        f"AWS4-HMAC-SHA256 Credential={AWS_KEY}/20130524/us-east-1/s3/aws4_request,"
        f"SignedHeaders={signed_headers},Signature={signature}"
    )


_EXAMPLE_HOST = "examplebucket.s3.amazonaws.com"
_WELCOME_SHA256 = hashlib.sha256(b"Welcome to Amazon S3.").hexdigest()

AWS_V4_EXAMPLES = {
    "GET Object": Wire("GET", "/test.txt", b"", {
        "host": _EXAMPLE_HOST, "range": "bytes=0-9", "x-amz-content-sha256": EMPTY_SHA256,
        "x-amz-date": "20130524T000000Z",
        "authorization": _v4_header("host;range;x-amz-content-sha256;x-amz-date",
                                    "f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41"),
    }),
    "PUT Object": Wire("PUT", "/test%24file.text", b"", {
        "host": _EXAMPLE_HOST, "date": "Fri, 24 May 2013 00:00:00 GMT", "x-amz-date": "20130524T000000Z",
        "x-amz-storage-class": "REDUCED_REDUNDANCY", "x-amz-content-sha256": _WELCOME_SHA256,
        "authorization": _v4_header("date;host;x-amz-content-sha256;x-amz-date;x-amz-storage-class",
                                    "98ad721746da40c64f1a55b78f14c238d841ea1380cd77a1b5971af0ece108bd"),
    }),
    "GET Bucket Lifecycle": Wire("GET", "/", b"lifecycle", {
        "host": _EXAMPLE_HOST, "x-amz-content-sha256": EMPTY_SHA256, "x-amz-date": "20130524T000000Z",
        "authorization": _v4_header("host;x-amz-content-sha256;x-amz-date",
                                    "fea454ca298b7da1c68078a5d1bdbfbbe0d65c699e0f91ac7a200a0136783543"),
    }),
    "GET Bucket (List Objects)": Wire("GET", "/", b"max-keys=2&prefix=J", {
        "host": _EXAMPLE_HOST, "x-amz-content-sha256": EMPTY_SHA256, "x-amz-date": "20130524T000000Z",
        "authorization": _v4_header("host;x-amz-content-sha256;x-amz-date",
                                    "34b48302e7b5fa45bde8084f4b7868a86f0a534bc59db6670ed5711ef69dc6f7"),
    }),
}


@pytest.mark.parametrize("name", list(AWS_V4_EXAMPLES))
def test_aws_published_sigv4_header_examples(name: str) -> None:
    ctx = AWS_V4_EXAMPLES[name].auth(now=T_2013_05_24)
    assert ctx.credentials is AWS_CREDS
    assert ctx.scheme == "v4-header"
    assert ctx.payload == "sha256"
    assert ctx.content_sha256 == AWS_V4_EXAMPLES[name].headers["x-amz-content-sha256"]
    assert ctx.chunk_signer is None


def test_aws_put_example_with_the_dollar_sent_unescaped() -> None:
    # A client that leaves '$' raw on the wire still signs it escaped: the re-encoded path is tried too.
    wire = replace(AWS_V4_EXAMPLES["PUT Object"], raw_path="/test$file.text")
    assert wire.auth(now=T_2013_05_24).scheme == "v4-header"


@pytest.mark.parametrize("name", list(AWS_V4_EXAMPLES))
def test_aws_published_sigv4_examples_tampered(name: str) -> None:
    wire = AWS_V4_EXAMPLES[name]
    assert_fails("SignatureDoesNotMatch", replace(wire, method="DELETE"), now=T_2013_05_24)
    assert_fails("SignatureDoesNotMatch", replace(wire, raw_path=wire.raw_path + "x"), now=T_2013_05_24)
    assert_fails("SignatureDoesNotMatch", replace(wire, query=wire.query + b"&x=1"), now=T_2013_05_24)
    assert_fails("SignatureDoesNotMatch", wire.with_headers(host="evil.example"), now=T_2013_05_24)
    assert_fails("SignatureDoesNotMatch", wire.with_headers(x_amz_content_sha256="0" * 64), now=T_2013_05_24)
    error = assert_fails("RequestTimeTooSkewed", wire, now=T_2013_05_24 + 901)
    assert error.extra["MaxAllowedSkewMilliseconds"] == "900000"
    assert_fails("RequestTimeTooSkewed", wire, now=T_2013_05_24 - 901)
    assert wire.auth(now=T_2013_05_24 + 899).scheme == "v4-header"


def test_signature_mismatch_reports_the_canonical_request() -> None:
    wire = replace(AWS_V4_EXAMPLES["GET Object"], raw_path="/other.txt")
    error = assert_fails("SignatureDoesNotMatch", wire, now=T_2013_05_24)
    assert error.extra["CanonicalRequest"].startswith("GET\n/other.txt\n\nhost:examplebucket.s3.")
    assert error.extra["StringToSign"].startswith("AWS4-HMAC-SHA256\n20130524T000000Z\n20130524/us-east-1/")


# "Authenticating Requests: Using Query Parameters (AWS Signature Version 4)", example GET of test.txt, valid
# for 86400 s.
AWS_PRESIGNED = wire_from_url(
    "GET",
    "https://examplebucket.s3.amazonaws.com/test.txt?X-Amz-Algorithm=AWS4-HMAC-SHA256"
    "&X-Amz-Credential=AKIAIOSFODNN7EXAMPLE%2F20130524%2Fus-east-1%2Fs3%2Faws4_request&X-Amz-Date=20130524T000000Z"
    "&X-Amz-Expires=86400&X-Amz-SignedHeaders=host"
    "&X-Amz-Signature=aeeed9bbccd4d02ee5c0109b86d86835f995330da4c265957d157751f604d404",
)


def test_aws_published_presigned_example() -> None:
    ctx = AWS_PRESIGNED.auth(now=T_2013_05_24 + 3600)
    assert (ctx.credentials, ctx.scheme, ctx.payload, ctx.content_sha256) == (
        AWS_CREDS, "v4-presigned", "unsigned", None)
    assert AWS_PRESIGNED.auth(now=T_2013_05_24 + 86400).scheme == "v4-presigned"
    error = assert_fails("AccessDenied", AWS_PRESIGNED, now=T_2013_05_24 + 86401)
    assert error.message == "Request has expired"
    # Signed more than the allowed skew in the future.
    assert_fails("RequestTimeTooSkewed", AWS_PRESIGNED, now=T_2013_05_24 - 901)
    assert_fails("SignatureDoesNotMatch", AWS_PRESIGNED.with_headers(host="examplebucket.s3.example"),
                 now=T_2013_05_24)
    assert_fails("SignatureDoesNotMatch", replace(AWS_PRESIGNED, query=AWS_PRESIGNED.query + b"&versionId=1"),
                 now=T_2013_05_24)


@pytest.mark.parametrize(("expires", "code"), [
    (b"0", "AccessDenied"), (b"604801", "AccessDenied"), (b"-1", "AccessDenied"),  # out of range: grants nothing
    (b"abc", "AuthorizationQueryParametersError"), (b"1.5", "AuthorizationQueryParametersError"),  # malformed
])
def test_presigned_expires_out_of_range(expires: bytes, code: str) -> None:
    query = AWS_PRESIGNED.query.replace(b"X-Amz-Expires=86400", b"X-Amz-Expires=" + expires)
    wire = replace(AWS_PRESIGNED, query=query)
    error = assert_fails(code, wire, now=T_2013_05_24)
    assert error.status == (403 if code == "AccessDenied" else 400)


# -- AWS published SigV2 vectors ---------------------------------------------------------------------------
# From "Signing and Authenticating REST Requests" (Signature Version 2), examples with bucket johnsmith.


def _v2(method: str, path: str, query: bytes, headers: dict[str, str], signature: str) -> Wire:
    return Wire(method, path, query, {**headers, "authorization": f"AWS {AWS_KEY}:{signature}"})


AWS_V2_EXAMPLES: dict[str, tuple[Wire, str | None, str]] = {  # wire, virtual bucket, date
    "Object GET": (_v2("GET", "/photos/puppy.jpg", b"", {
        "host": "johnsmith.s3.amazonaws.com", "date": "Tue, 27 Mar 2007 19:36:42 +0000"},
        "bWq2s1WEIj+Ydj0vQ697zp+IXMU="), "johnsmith", "Tue, 27 Mar 2007 19:36:42 +0000"),
    "Object PUT": (_v2("PUT", "/photos/puppy.jpg", b"", {
        "host": "johnsmith.s3.amazonaws.com", "content-type": "image/jpeg", "content-length": "94328",
        "date": "Tue, 27 Mar 2007 21:15:45 +0000"},
        "MyyxeRY7whkBe+bq8fHCL/2kKUg="), "johnsmith", "Tue, 27 Mar 2007 21:15:45 +0000"),
    "List": (_v2("GET", "/", b"prefix=photos&max-keys=50&marker=puppy", {
        "host": "johnsmith.s3.amazonaws.com", "user-agent": "Mozilla/5.0",
        "date": "Tue, 27 Mar 2007 19:42:41 +0000"},
        "htDYFYduRNen8P9ZfE/s9SuKy0U="), "johnsmith", "Tue, 27 Mar 2007 19:42:41 +0000"),
    "Fetch": (_v2("GET", "/", b"acl", {
        "host": "johnsmith.s3.amazonaws.com", "date": "Tue, 27 Mar 2007 19:44:46 +0000"},
        "c2WLPFtWHVgbEmeEG93a4cG37dM="), "johnsmith", "Tue, 27 Mar 2007 19:44:46 +0000"),
    # The document's own Delete example signs the x-amz-date value on the Date line.
    "Delete": (_v2("DELETE", "/johnsmith/photos/puppy.jpg", b"", {
        "host": "s3.amazonaws.com", "user-agent": "dotnet", "date": "Tue, 27 Mar 2007 21:20:27 +0000",
        "x-amz-date": "Tue, 27 Mar 2007 21:20:26 +0000"},
        "lx3byBScXR6KzyMaifNkardMwNk="), None, "Tue, 27 Mar 2007 21:20:26 +0000"),
    "Upload": (_v2("PUT", "/db-backup.dat.gz", b"", {
        "host": "static.johnsmith.net:8080", "user-agent": "curl/7.15.5",
        "date": "Tue, 27 Mar 2007 21:06:08 +0000",
        "x-amz-acl": "public-read", "content-type": "application/x-download",
        "content-md5": "4gJE4saaMU4BqNR0kLY+lw==",
        "x-amz-meta-reviewedby": "joe@johnsmith.net,jane@johnsmith.net",  # two headers, joined
        "x-amz-meta-filechecksum": "0x02661779", "x-amz-meta-checksumalgorithm": "crc32",
        "content-disposition": "attachment; filename=database.dat", "content-encoding": "gzip",
        "content-length": "5913339"},
        "ilyl83RwaSoYIEdixDQcA4OnAnc="), "static.johnsmith.net", "Tue, 27 Mar 2007 21:06:08 +0000"),
    "List All My Buckets": (_v2("GET", "/", b"", {
        "host": "s3.amazonaws.com", "date": "Wed, 28 Mar 2007 01:29:59 +0000"},
        "qGdzdERIC03wnaRNKh6OqZehG9s="), None, "Wed, 28 Mar 2007 01:29:59 +0000"),
    "Unicode Keys": (_v2("GET", "/dictionary/fran%C3%A7ais/pr%c3%a9f%c3%a8re", b"", {
        "host": "s3.amazonaws.com", "date": "Wed, 28 Mar 2007 01:49:49 +0000"},
        "DNEZGsoieTZ92F3bUfSPQcbGmlM="), None, "Wed, 28 Mar 2007 01:49:49 +0000"),
}


def _http_time(date: str) -> float:
    from email.utils import parsedate_to_datetime

    return parsedate_to_datetime(date).timestamp()


@pytest.mark.parametrize("name", list(AWS_V2_EXAMPLES))
def test_aws_published_sigv2_header_examples(name: str) -> None:
    wire, bucket, date = AWS_V2_EXAMPLES[name]
    now = _http_time(date)
    ctx = wire.auth(now=now, virtual_bucket=bucket)
    assert (ctx.credentials, ctx.scheme, ctx.payload) == (AWS_CREDS, "v2-header", "unsigned")
    assert_fails("SignatureDoesNotMatch", replace(wire, method="POST"), now=now, virtual_bucket=bucket)
    extra_header = wire.with_headers(x_amz_meta_extra="1")
    assert_fails("SignatureDoesNotMatch", extra_header, now=now, virtual_bucket=bucket)
    assert_fails("RequestTimeTooSkewed", wire, now=now + 901, virtual_bucket=bucket)


def test_aws_published_sigv2_query_example() -> None:
    wire = wire_from_url(
        "GET",
        "http://johnsmith.s3.amazonaws.com/photos/puppy.jpg"
        "?AWSAccessKeyId=AKIAIOSFODNN7EXAMPLE&Signature=NpgCjnDzrM%2BWFzoENXmpNDUsSn8%3D&Expires=1175139620",
    )
    ctx = wire.auth(now=1175139620 - 60, virtual_bucket="johnsmith")
    assert (ctx.credentials, ctx.scheme, ctx.payload) == (AWS_CREDS, "v2-presigned", "unsigned")
    error = assert_fails("AccessDenied", wire, now=1175139621, virtual_bucket="johnsmith")
    assert error.message == "Request has expired"
    assert_fails("SignatureDoesNotMatch", wire, now=1175139620 - 60, virtual_bucket="otherbucket")


# -- requests signed by botocore ---------------------------------------------------------------------------


class _EmptyBody:
    def stream(self, **_: Any) -> Iterator[bytes]:
        yield b""


def boto_client(
    signature_version: str = "s3v4", endpoint: str = "http://s3.test:9000", addressing: str = "path",
    secret: str = SECRET, key: str = KEY,
) -> Any:
    return boto3.client(
        "s3", endpoint_url=endpoint, aws_access_key_id=key, aws_secret_access_key=secret,
        region_name="us-east-1",
        config=Config(signature_version=signature_version, s3={"addressing_style": addressing},
                      retries={"max_attempts": 1}),
    )


def capture(client: Any, operation: str, **params: Any) -> tuple[Wire, bytes]:
    """Run a client call, catching the request botocore would send (nothing goes on the network)."""
    sent: dict[str, Any] = {}

    def before_send(request: Any, **_: Any) -> AWSResponse:
        sent["request"] = request
        return AWSResponse(request.url, 200, {}, _EmptyBody())

    client.meta.events.register("before-send.s3", before_send)
    try:
        getattr(client, operation)(**params)
    finally:
        client.meta.events.unregister("before-send.s3", before_send)
    request = sent["request"]
    headers: dict[str, str] = {}
    for name, value in request.headers.items():
        text = value.decode() if isinstance(value, bytes) else str(value)
        headers[name.lower()] = f"{headers[name.lower()]},{text}" if name.lower() in headers else text
    body = request.body
    data = body if isinstance(body, bytes) else (body.read() if body is not None else b"")
    parts = urlsplit(request.url)
    headers.setdefault("host", parts.netloc)
    return Wire(request.method, parts.path, parts.query.encode("ascii"), headers), data


KEYS = [
    "plain.bin",
    "kv/model@rev/layer+0/block%20 1",
    "a@b/c%d+e f",
    "spaces  and\ttabs",
    "unicode/ключ/键/🔑",
    "reserved !$&'()*,;=:~",
    "trailing/",
]


@pytest.mark.parametrize("key", KEYS)
def test_botocore_sigv4_header_put_get_head(key: str) -> None:
    client = boto_client()
    wire, body = capture(client, "put_object", Bucket="bucket", Key=key, Body=b"hello world")
    ctx = wire.auth()
    assert (ctx.credentials, ctx.scheme, ctx.payload) == (CREDS, "v4-header", "sha256")
    assert ctx.content_sha256 == hashlib.sha256(body).hexdigest()
    for operation in ("get_object", "head_object", "delete_object"):
        wire, _ = capture(client, operation, Bucket="bucket", Key=key)
        assert wire.auth().credentials is CREDS


def test_botocore_list_with_query() -> None:
    wire, _ = capture(boto_client(), "list_objects_v2", Bucket="bucket", Prefix="a b+c/é", Delimiter="/",
                      MaxKeys=7, StartAfter="x=y&z")
    assert wire.auth().scheme == "v4-header"
    # Reordering the query does not matter: the canonical query is sorted.
    pieces = wire.query.split(b"&")
    assert replace(wire, query=b"&".join(reversed(pieces))).auth().scheme == "v4-header"


def test_botocore_trailer_checksum_over_https() -> None:
    wire, body = capture(boto_client(endpoint="https://s3.test"), "put_object", Bucket="bucket", Key="k",
                         Body=b"hello world")
    ctx = wire.auth()
    assert ctx.payload == "streaming-unsigned-trailer"
    assert ctx.content_sha256 is None and ctx.chunk_signer is None
    assert wire.headers["content-encoding"] == "aws-chunked"
    assert body.endswith(b"0\r\nx-amz-checksum-crc32:DUoRhQ==\r\n\r\n")


# boto3 clients sign SigV4 with awscrt's native signer when awscrt is installed (it is: the server needs it);
# botocore's pure-Python signers are exercised directly as well.


def python_signed(method: str, key: str, *, body: bytes = b"", headers: dict[str, str] | None = None,
                  presign_expires: int | None = None) -> Wire:
    endpoint, path = "http://s3.test:9000", "/bucket/" + quote(key, safe="/~")
    if presign_expires is None:
        signed = sign(endpoint, method, path, payload_hash=hashlib.sha256(body).hexdigest(), headers=headers,
                      access=KEY, secret=SECRET)
        return wire_from_url(method, endpoint + path, {name.lower(): value for name, value in signed.headers.items()})
    target = presign_v4(endpoint, method, path, expires=presign_expires, access=KEY, secret=SECRET, headers=headers)
    return wire_from_url(method, endpoint + target, {name.lower(): value for name, value in (headers or {}).items()})


@pytest.mark.parametrize("key", KEYS)
def test_python_sigv4_signer(key: str) -> None:
    headers = {"Content-Type": "a/b", "x-amz-meta-m": "  v  1 "}
    wire = python_signed("PUT", key, body=b"payload", headers=headers)
    ctx = wire.auth()
    digest = hashlib.sha256(b"payload").hexdigest()
    assert (ctx.scheme, ctx.payload, ctx.content_sha256) == ("v4-header", "sha256", digest)
    assert_fails("SignatureDoesNotMatch", wire.with_headers(content_type="a/c"))
    presigned = python_signed("GET", key, presign_expires=30)
    assert presigned.auth().scheme == "v4-presigned"
    assert_fails("AccessDenied", presigned, now=time.time() + 31)


def test_python_signer_date_header_instead_of_x_amz_date() -> None:
    # botocore signs with the Date header alone when one is set; the timestamp signed is that instant.
    wire = python_signed("GET", "k", headers={"Date": "placeholder"})
    assert "x-amz-date" not in wire.headers and "date" in wire.headers
    now = _http_time(wire.headers["date"])
    assert wire.auth(now=now).scheme == "v4-header"
    assert_fails("RequestTimeTooSkewed", wire, now=now + 3600)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(key=st.text(st.characters(exclude_categories=["Cs"]), min_size=1, max_size=40))
def test_botocore_sigv4_any_key(key: str) -> None:
    wire, _ = capture(boto_client(), "get_object", Bucket="bucket", Key=key)
    assert wire.auth().credentials is CREDS


def test_botocore_tampered_requests() -> None:
    client = boto_client()
    wire, _ = capture(client, "put_object", Bucket="bucket", Key="a+b c", Body=b"data",
                      Metadata={"owner": "worker-1"})
    now = time.time()
    assert wire.auth(now=now).scheme == "v4-header"
    assert_fails("SignatureDoesNotMatch", wire.with_headers(x_amz_meta_owner="worker-2"))
    assert_fails("SignatureDoesNotMatch", replace(wire, raw_path=wire.raw_path.replace("%2B", "%20")))
    assert_fails("SignatureDoesNotMatch", replace(wire, raw_path="/bucket/other"))
    assert_fails("SignatureDoesNotMatch", replace(wire, method="POST"))
    bad_secret, _ = capture(boto_client(secret="wrong"), "put_object", Bucket="bucket", Key="k", Body=b"")
    assert_fails("SignatureDoesNotMatch", bad_secret)
    unknown, _ = capture(boto_client(key="NOSUCHKEY"), "put_object", Bucket="bucket", Key="k", Body=b"")
    error = assert_fails("InvalidAccessKeyId", unknown)
    assert error.extra["AWSAccessKeyId"] == "NOSUCHKEY"
    assert_fails("RequestTimeTooSkewed", wire, now=now + 1000)
    assert_fails("RequestTimeTooSkewed", wire, now=now - 1000)
    assert wire.auth(now=now + 1000, max_skew=1200).scheme == "v4-header"


@pytest.mark.parametrize("key", KEYS)
def test_botocore_presigned_sigv4(key: str) -> None:
    url = boto_client().generate_presigned_url("get_object", Params={"Bucket": "bucket", "Key": key},
                                               ExpiresIn=600)
    wire = wire_from_url("GET", url)
    ctx = wire.auth()
    assert (ctx.credentials, ctx.scheme, ctx.payload) == (CREDS, "v4-presigned", "unsigned")
    assert ctx.content_sha256 is None
    assert_fails("SignatureDoesNotMatch", replace(wire, method="PUT"))
    assert_fails("SignatureDoesNotMatch", replace(wire, query=wire.query.replace(b"X-Amz-Expires=600",
                                                                                 b"X-Amz-Expires=6000")))
    error = assert_fails("AccessDenied", wire, now=time.time() + 601)
    assert error.message == "Request has expired"


def test_botocore_presigned_sigv4_signed_content_type() -> None:
    url = boto_client().generate_presigned_url(
        "put_object", Params={"Bucket": "bucket", "Key": "k", "ContentType": "application/octet-stream"},
        ExpiresIn=60)
    wire = wire_from_url("PUT", url, {"content-type": "application/octet-stream"})
    assert wire.auth().scheme == "v4-presigned"
    assert_fails("SignatureDoesNotMatch", wire.with_headers(content_type="text/html"))


def test_presigned_expires_limits_with_botocore() -> None:
    client = boto_client()
    week = client.generate_presigned_url("get_object", Params={"Bucket": "b", "Key": "k"}, ExpiresIn=604800)
    assert wire_from_url("GET", week).auth().scheme == "v4-presigned"
    too_long = client.generate_presigned_url("get_object", Params={"Bucket": "b", "Key": "k"},
                                             ExpiresIn=604801)
    assert_fails("AccessDenied", wire_from_url("GET", too_long))  # out of range: 403, as S3 suites expect
    # awscrt refuses to presign for 0 seconds; botocore's Python signer does not.
    assert_fails("AccessDenied", python_signed("GET", "k", presign_expires=0))


@pytest.mark.parametrize("key", KEYS)
@pytest.mark.parametrize("addressing", ["path", "virtual"])
def test_botocore_presigned_sigv2(key: str, addressing: str) -> None:
    client = boto_client(signature_version="s3", addressing=addressing)
    url = client.generate_presigned_url("get_object", Params={
        "Bucket": "bucket", "Key": key, "ResponseContentType": "text/plain; charset=utf-8",
        "ResponseContentDisposition": 'attachment; filename="a b+c.txt"'}, ExpiresIn=120)
    wire = wire_from_url("GET", url)
    bucket = "bucket" if addressing == "virtual" else None
    assert wire.headers["host"].startswith("bucket.") == (addressing == "virtual")
    ctx = wire.auth(virtual_bucket=bucket)
    assert (ctx.credentials, ctx.scheme, ctx.payload) == (CREDS, "v2-presigned", "unsigned")
    # The response-* overrides are signed.
    tampered = replace(wire, query=wire.query.replace(b"text%2Fplain", b"text%2Fhtml"))
    assert_fails("SignatureDoesNotMatch", tampered, virtual_bucket=bucket)
    error = assert_fails("AccessDenied", wire, now=time.time() + 121, virtual_bucket=bucket)
    assert error.message == "Request has expired"


def test_botocore_presigned_sigv2_put_with_signed_headers_in_query() -> None:
    # botocore moves the Content-Type and x-amz-* headers it signed into the query string.
    url = boto_client(signature_version="s3").generate_presigned_url(
        "put_object", Params={"Bucket": "bucket", "Key": "k", "ContentType": "text/plain",
                              "Metadata": {"owner": "w1"}}, ExpiresIn=60)
    wire = wire_from_url("PUT", url)
    assert b"x-amz-meta-owner=w1" in wire.query
    assert wire.auth().scheme == "v2-presigned"
    assert_fails("SignatureDoesNotMatch", replace(wire, query=wire.query.replace(b"=w1", b"=w2")))


def test_botocore_sigv2_header() -> None:
    client = boto_client(signature_version="s3")
    wire, _ = capture(client, "put_object", Bucket="bucket", Key="a b+c@d", Body=b"x",
                      Metadata={"owner": "w1"}, ContentType="text/plain")
    assert wire.headers["authorization"].startswith(f"AWS {KEY}:")
    ctx = wire.auth()
    assert (ctx.scheme, ctx.payload) == ("v2-header", "unsigned")
    assert_fails("SignatureDoesNotMatch", wire.with_headers(content_type="text/html"))
    acl, _ = capture(client, "get_object_acl", Bucket="bucket", Key="k")
    assert acl.query == b"acl"
    assert acl.auth().scheme == "v2-header"
    assert_fails("SignatureDoesNotMatch", replace(acl, query=b"tagging"))


# -- malformed and missing authentication ------------------------------------------------------------------


def _get_object_wire() -> Wire:
    return AWS_V4_EXAMPLES["GET Object"]


def test_no_authentication_is_access_denied() -> None:
    assert_fails("AccessDenied", Wire("GET", "/b/k", b"", {"host": "h"}))
    # Unrelated query parameters are not authentication.
    assert_fails("AccessDenied", Wire("GET", "/b/k", b"versionId=1&X-Amz-Date=x", {"host": "h"}))


def test_two_auth_mechanisms_rejected() -> None:
    wire = replace(_get_object_wire(), query=AWS_PRESIGNED.query)
    assert_fails("InvalidArgument", wire, now=T_2013_05_24)


_CREDENTIAL = f"AWS4-HMAC-SHA256 Credential={AWS_KEY}"
_REST = "SignedHeaders=host, Signature=a"


@pytest.mark.parametrize(
    "authorization",
    [
        "AWS4-HMAC-SHA256 SignedHeaders=host, Signature=abc",
        f"{_CREDENTIAL}/20130524/us-east-1/s3/aws4_request, Signature=abc",
        f"{_CREDENTIAL}/20130524/us-east-1/s3/aws4_request, SignedHeaders=host",
        f"{_CREDENTIAL}/20130524/us-east-1/s3, {_REST}",
        f"{_CREDENTIAL}/20130524/us-east-1/ec2/aws4_request, {_REST}",
        f"{_CREDENTIAL}/20130524/us-east-1/s3/aws5_request, {_REST}",
        f"{_CREDENTIAL}/20130525/us-east-1/s3/aws4_request, {_REST}",  # not the x-amz-date day
        f"{_CREDENTIAL}//us-east-1/s3/aws4_request, {_REST}",
        "AWS4-HMAC-SHA256 garbage",
    ],
)
def test_malformed_v4_authorization(authorization: str) -> None:
    wire = _get_object_wire().with_headers(authorization=authorization)
    assert_fails("AuthorizationHeaderMalformed", wire, now=T_2013_05_24)


def test_v4_header_region_taken_from_scope() -> None:
    # Any region is accepted; it only has to be the one the client signed with.
    wire, _ = capture(boto3.client("s3", endpoint_url="http://s3.test", aws_access_key_id=KEY,
                                   aws_secret_access_key=SECRET, region_name="eu-north-1",
                                   config=Config(s3={"addressing_style": "path"})),
                      "get_object", Bucket="b", Key="k")
    assert "/eu-north-1/s3/aws4_request" in wire.headers["authorization"]
    assert wire.auth().credentials is CREDS
    forged = wire.headers["authorization"].replace("eu-north-1", "us-east-1")
    assert_fails("SignatureDoesNotMatch", wire.with_headers(authorization=forged))


def test_v4_header_requires_signed_host_and_valid_date() -> None:
    wire = _get_object_wire()
    unsigned_host = wire.headers["authorization"].replace("SignedHeaders=host;", "SignedHeaders=")
    assert_fails("AccessDenied", wire.with_headers(authorization=unsigned_host), now=T_2013_05_24)
    assert_fails("AccessDenied", wire.with_headers(x_amz_date="yesterday"), now=T_2013_05_24)
    assert_fails("AccessDenied", wire.with_headers(x_amz_date=None), now=T_2013_05_24)
    assert_fails("InvalidRequest", wire.with_headers(x_amz_content_sha256=None), now=T_2013_05_24)
    assert_fails("InvalidArgument", wire.with_headers(x_amz_content_sha256="not-a-hash"), now=T_2013_05_24)
    assert_fails("InvalidArgument", wire.with_headers(authorization="Bearer token"), now=T_2013_05_24)
    other_key = wire.headers["authorization"].replace(AWS_KEY, "AKIDUNKNOWN")
    assert_fails("InvalidAccessKeyId", wire.with_headers(authorization=other_key), now=T_2013_05_24)


def test_authorization_without_spaces_or_with_extra_spaces() -> None:
    wire = _get_object_wire()
    spaced = wire.headers["authorization"].replace(",", ",  ")
    assert wire.with_headers(authorization=spaced).auth(now=T_2013_05_24).scheme == "v4-header"


def test_header_values_are_trimmed_and_collapsed() -> None:
    wire = _get_object_wire().with_headers(range="  bytes=0-9  ")
    assert wire.auth(now=T_2013_05_24).scheme == "v4-header"


@pytest.mark.parametrize(
    ("param", "value"),
    [
        (b"X-Amz-Algorithm", b"AWS4-HMAC-SHA1"),
        (b"X-Amz-Credential", b"AKIAIOSFODNN7EXAMPLE%2F20130524%2Fus-east-1%2Fsqs%2Faws4_request"),
        (b"X-Amz-Date", b"2013-05-24T00:00:00Z"),
        (b"X-Amz-Date", b"20130525T000000Z"),
        (b"X-Amz-SignedHeaders", b""),
    ],
)
def test_malformed_presigned(param: bytes, value: bytes) -> None:
    pieces = [
        param + b"=" + value if p.startswith(param + b"=") else p for p in AWS_PRESIGNED.query.split(b"&")
    ]
    wire = replace(AWS_PRESIGNED, query=b"&".join(pieces))
    assert_fails("AuthorizationQueryParametersError", wire, now=T_2013_05_24)


def test_presigned_missing_signature() -> None:
    query = b"&".join(p for p in AWS_PRESIGNED.query.split(b"&") if not p.startswith(b"X-Amz-Signature"))
    assert_fails("AuthorizationQueryParametersError", replace(AWS_PRESIGNED, query=query), now=T_2013_05_24)


def test_presigned_with_payload_hash() -> None:
    # A presigner may fix the payload hash; the caller must then check the body against it.
    digest = hashlib.sha256(b"body").hexdigest()
    wire = python_signed("PUT", "k", headers={"X-Amz-Content-SHA256": digest}, presign_expires=60)
    assert "x-amz-content-sha256" in wire.query.decode()  # signed as a header
    ctx = wire.auth()
    assert (ctx.payload, ctx.content_sha256) == ("sha256", digest)
    assert_fails("SignatureDoesNotMatch", wire.with_headers(x_amz_content_sha256=EMPTY_SHA256))
    # awscrt's presigner leaves the header unsigned and signs UNSIGNED-PAYLOAD.
    client = boto_client()

    def add_hash(request: Any, **_: Any) -> None:
        request.headers["X-Amz-Content-SHA256"] = digest

    client.meta.events.register("before-sign.s3", add_hash)
    url = client.generate_presigned_url("put_object", Params={"Bucket": "b", "Key": "k"}, ExpiresIn=60)
    ctx = wire_from_url("PUT", url, {"x-amz-content-sha256": digest}).auth()
    assert (ctx.payload, ctx.content_sha256) == ("unsigned", None)


def test_v2_malformed() -> None:
    date = time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime())
    base = Wire("GET", "/b/k", b"", {"host": "h", "date": date})
    assert_fails("AuthorizationHeaderMalformed", base.with_headers(authorization="AWS nocolon"))
    assert_fails("AccessDenied", base.with_headers(authorization=f"AWS {KEY}:sig", date=None))
    assert_fails("InvalidAccessKeyId", base.with_headers(authorization="AWS NOKEY:sig"))
    assert_fails("SignatureDoesNotMatch", base.with_headers(authorization=f"AWS {KEY}:c2lnbmF0dXJl"))
    query = Wire("GET", "/b/k", f"AWSAccessKeyId={KEY}&Signature=x&Expires=soon".encode(), {"host": "h"})
    assert_fails("AccessDenied", query)
    assert_fails("AccessDenied", replace(query, query=b"AWSAccessKeyId=" + KEY.encode() + b"&Signature=x"))


def test_signing_key_cache_is_bounded() -> None:
    from ctxstore.sigv4 import signing_key  # the one derivation, shared with the server

    info = signing_key.cache_info()
    assert info.maxsize == 256
