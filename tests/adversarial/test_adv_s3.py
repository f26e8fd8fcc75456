"""S3 input an attacker or an unusual client sends, and the S3 behaviours real clients rely on.

Numbers in S3 input are ASCII digits (issue #9: Unicode digits gave 500s, or were read as numbers);
``response-*`` overrides carrying CR/LF are refused (#10); and the behaviours SDKs and conformance suites
trip on: a retried CompleteMultipartUpload, conditional writes with ETags, ``Transfer-Encoding: chunked``
uploads, ``Content-Encoding`` kept as sent, checksum mismatches as BadDigest, an empty continuation token, and
ListObjects (V1) with ``encoding-type=url`` as boto3 reads it back. Every refused request stores nothing and
leaves the node serving, without a traceback in its log.
"""

from __future__ import annotations

import base64
import hashlib
import os
import secrets
from collections.abc import Iterator

import pytest
from botocore.exceptions import ClientError
from support.nodes import Node, make_client
from support.probes import Admin, alive, log_size, start_probed_node, tracebacks
from support.raw import UNSIGNED, UNSIGNED_TRAILER, RawClient, aws_chunked, crc32_b64, sign

KiB = 1 << 10
MiB = 1 << 20


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    started = start_probed_node(tmp_path_factory.mktemp("adv-s3"), "--memory", "256MiB", "--min-part-size", "1KiB",
                                "--max-object-size", "8MiB")
    yield started
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
    name = "adv-s3-" + secrets.token_hex(5)
    s3.create_bucket(Bucket=name)
    return name


@pytest.fixture(autouse=True)
def no_tracebacks(node: Node) -> Iterator[None]:
    """Whatever a test sends, the node logs no traceback and is alive afterwards."""
    start = log_size(node)
    yield
    assert alive(node), "the node died"
    assert tracebacks(node, start) == [], "the node logged a traceback"


def error_of(exc: pytest.ExceptionInfo[ClientError]) -> tuple[int, str]:
    return exc.value.response["ResponseMetadata"]["HTTPStatusCode"], exc.value.response["Error"]["Code"]


def upload_id(s3, bucket: str, key: str) -> str:
    return s3.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]


# ---------------------------------------------------------------------------- #9: ASCII digits only

# ² ¹ ١ (Arabic-Indic one) １ (fullwidth one) ①, percent-encoded as UTF-8
UNICODE_NUMBERS = ["%C2%B2", "%C2%B9", "%D9%A1", "%EF%BC%91", "%E2%91%A0"]


@pytest.mark.parametrize("number", UNICODE_NUMBERS)
def test_upload_part_number_in_unicode_digits_is_invalid_argument(s3, raw: RawClient, bucket: str,
                                                                  number: str) -> None:
    """``partNumber=%C2%B2`` answered 500 (``str.isdigit()`` then ``int()``); ``partNumber=١`` stored part 1."""
    uid = upload_id(s3, bucket, "k")
    reply = raw.s3("PUT", f"/{bucket}/k?partNumber={number}&uploadId={uid}", b"x" * KiB)
    assert (reply.status, reply.code) == (400, "InvalidArgument")
    assert s3.list_parts(Bucket=bucket, Key="k", UploadId=uid).get("Parts", []) == []


@pytest.mark.parametrize("param", ["max-parts", "part-number-marker"])
@pytest.mark.parametrize("number", UNICODE_NUMBERS)
def test_list_parts_numbers_in_unicode_digits_are_invalid_argument(s3, raw: RawClient, bucket: str, param: str,
                                                                   number: str) -> None:
    uid = upload_id(s3, bucket, "k")
    reply = raw.s3("GET", f"/{bucket}/k?uploadId={uid}&{param}={number}")
    assert (reply.status, reply.code) == (400, "InvalidArgument")


@pytest.mark.parametrize("number", ["²", "¹", "١", "１"])
def test_complete_part_number_that_is_not_ascii_digits_is_malformed_xml(s3, raw: RawClient, bucket: str,
                                                                       number: str) -> None:
    uid = upload_id(s3, bucket, "k")
    etag = s3.upload_part(Bucket=bucket, Key="k", UploadId=uid, PartNumber=1, Body=b"p" * KiB)["ETag"]
    xml = (f"<CompleteMultipartUpload><Part><PartNumber>{number}</PartNumber><ETag>{etag}</ETag></Part>"
           "</CompleteMultipartUpload>").encode()
    reply = raw.s3("POST", f"/{bucket}/k?uploadId={uid}", xml)
    assert (reply.status, reply.code) == (400, "MalformedXML")
    with pytest.raises(ClientError):
        s3.head_object(Bucket=bucket, Key="k")


@pytest.mark.parametrize("value", ["²", "¹", "³"])  # what a Latin-1 header can carry
def test_decoded_content_length_in_unicode_digits_is_invalid_argument(s3, raw: RawClient, bucket: str,
                                                                      value: str) -> None:
    payload = b"0123456789"
    body = aws_chunked(payload, trailer=("x-amz-checksum-crc32", crc32_b64(payload)))
    reply = raw.s3("PUT", f"/{bucket}/k", body, payload_hash=UNSIGNED_TRAILER, headers={
        "Content-Encoding": "aws-chunked", "x-amz-decoded-content-length": value,
        "x-amz-trailer": "x-amz-checksum-crc32"})
    assert (reply.status, reply.code) == (400, "InvalidArgument")
    with pytest.raises(ClientError):
        s3.head_object(Bucket=bucket, Key="k")


@pytest.mark.parametrize("value", ["%D9%A1", "%EF%BC%92", "1_0", "%C2%B2"])
@pytest.mark.parametrize("listing", ["", "list-type=2&", "versions&"], ids=["v1", "v2", "versions"])
def test_max_keys_that_is_not_ascii_digits_is_invalid_argument(s3, raw: RawClient, bucket: str, listing: str,
                                                               value: str) -> None:
    """Beyond the listed repros, the same defect: ``max-keys`` goes through ``int()``, which reads ``١``
    (Arabic-Indic one), ``２`` (fullwidth two) and ``1_0`` (ten) as numbers."""
    for key in ("a", "b", "c"):
        s3.put_object(Bucket=bucket, Key=key, Body=b"")
    reply = raw.s3("GET", f"/{bucket}?{listing}max-keys={value}")
    assert (reply.status, reply.code) == (400, "InvalidArgument")


# ---------------------------------------------------------------------------- #10: response-* with CR/LF

OVERRIDES = ["response-content-type", "response-content-language", "response-expires", "response-cache-control",
             "response-content-disposition", "response-content-encoding"]


@pytest.mark.parametrize("value", ["a%0D%0AX-Injected:%201", "a%0Ab", "a%0Db", "a%00b"])
@pytest.mark.parametrize("param", OVERRIDES)
def test_response_override_with_control_characters_is_invalid_argument(s3, raw: RawClient, bucket: str,
                                                                      param: str, value: str) -> None:
    """Answered with a traceback in the log and a dropped connection; must be 400 InvalidArgument."""
    s3.put_object(Bucket=bucket, Key="k", Body=b"data")
    reply = raw.s3("GET", f"/{bucket}/k?{param}={value}")
    assert (reply.status, reply.code) == (400, "InvalidArgument")
    assert "x-injected" not in reply.headers
    # The same connection still serves the next request.
    assert raw.s3("GET", f"/{bucket}/k").body == b"data"


@pytest.mark.parametrize("value", ["%D9%A1", "%E6%97%A5%E6%9C%AC", "%F0%9F%92%A5"])
def test_response_override_beyond_latin_1_is_not_an_internal_error(s3, raw: RawClient, bucket: str,
                                                                    value: str) -> None:
    """Found by the fuzzer, next to #10: a ``response-content-disposition`` that is not Latin-1 (``١``) ends
    in a UnicodeEncodeError, a traceback and a 500. Either carry it (200) or refuse it (400 InvalidArgument)."""
    s3.put_object(Bucket=bucket, Key="k", Body=b"data")
    reply = raw.s3("GET", f"/{bucket}/k?response-content-disposition={value}")
    assert (reply.status, reply.code) in ((200, None), (400, "InvalidArgument"))


@pytest.mark.parametrize("encoding", ["bogus", "utf-99"])
@pytest.mark.parametrize("operation", ["CreateBucket", "DeleteObjects", "CompleteMultipartUpload"])
def test_xml_body_declaring_an_unknown_encoding_is_malformed_xml(s3, raw: RawClient, bucket: str, encoding: str,
                                                                 operation: str) -> None:
    """Found by the XML fuzzer: ``<?xml version="1.0" encoding="bogus"?>`` makes the parser raise LookupError,
    answered 500 InternalError with a traceback; it is MalformedXML like any unreadable body."""
    decl = f'<?xml version="1.0" encoding="{encoding}"?>'
    if operation == "CreateBucket":
        target, xml = f"/{bucket}-x", decl + "<CreateBucketConfiguration/>"
        method = "PUT"
    elif operation == "DeleteObjects":
        s3.put_object(Bucket=bucket, Key="keep", Body=b"")
        target, xml, method = f"/{bucket}?delete", decl + "<Delete><Object><Key>keep</Key></Object></Delete>", "POST"
    else:
        uid = upload_id(s3, bucket, "k")
        etag = s3.upload_part(Bucket=bucket, Key="k", UploadId=uid, PartNumber=1, Body=b"p")["ETag"]
        xml = decl + ("<CompleteMultipartUpload><Part><PartNumber>1</PartNumber>"
                      f"<ETag>{etag}</ETag></Part></CompleteMultipartUpload>")
        target, method = f"/{bucket}/k?uploadId={uid}", "POST"
    body = xml.encode()
    reply = raw.s3(method, target, body, headers={"Content-MD5": base64.b64encode(hashlib.md5(body).digest()).decode()})
    assert (reply.status, reply.code) == (400, "MalformedXML")
    if operation == "DeleteObjects":
        assert s3.head_object(Bucket=bucket, Key="keep")["ContentLength"] == 0


def test_response_override_without_control_characters_still_works(s3, raw: RawClient, bucket: str) -> None:
    s3.put_object(Bucket=bucket, Key="k", Body=b"data")
    reply = raw.s3("GET", f"/{bucket}/k?response-content-type=text%2Fplain%3B%20charset%3Dutf-8")
    assert reply.status == 200 and reply.headers["content-type"] == "text/plain; charset=utf-8"


# ---------------------------------------------------------------------------- S3 behaviours


def test_complete_multipart_upload_retried_after_success_succeeds(s3, bucket: str) -> None:
    """SDKs (the CRT client LMCache and NIXL use) retry Complete after a timeout: the retry must succeed."""
    uid = upload_id(s3, bucket, "big")
    parts = [os.urandom(2 * KiB), os.urandom(KiB)]
    done = [{"PartNumber": i, "ETag": s3.upload_part(Bucket=bucket, Key="big", UploadId=uid, PartNumber=i,
                                                     Body=p)["ETag"]} for i, p in enumerate(parts, 1)]
    first = s3.complete_multipart_upload(Bucket=bucket, Key="big", UploadId=uid, MultipartUpload={"Parts": done})
    again = s3.complete_multipart_upload(Bucket=bucket, Key="big", UploadId=uid, MultipartUpload={"Parts": done})
    assert again["ETag"] == first["ETag"]
    assert s3.get_object(Bucket=bucket, Key="big")["Body"].read() == b"".join(parts)


def test_put_if_none_match_etag(s3, bucket: str) -> None:
    """``If-None-Match: <etag>``: 412 when the live object has that ETag, stored otherwise (not 501)."""
    etag = s3.put_object(Bucket=bucket, Key="k", Body=b"v1")["ETag"]
    with pytest.raises(ClientError) as info:
        s3.put_object(Bucket=bucket, Key="k", Body=b"v2", IfNoneMatch=etag)
    assert error_of(info) == (412, "PreconditionFailed")
    assert s3.get_object(Bucket=bucket, Key="k")["Body"].read() == b"v1"
    s3.put_object(Bucket=bucket, Key="k", Body=b"v3", IfNoneMatch='"00000000000000000000000000000000"')
    assert s3.get_object(Bucket=bucket, Key="k")["Body"].read() == b"v3"


def test_put_if_match_etag(s3, bucket: str) -> None:
    etag = s3.put_object(Bucket=bucket, Key="k", Body=b"v1")["ETag"]
    with pytest.raises(ClientError) as info:
        s3.put_object(Bucket=bucket, Key="k", Body=b"v2", IfMatch='"00000000000000000000000000000000"')
    assert error_of(info) == (412, "PreconditionFailed")
    s3.put_object(Bucket=bucket, Key="k", Body=b"v3", IfMatch=etag)
    assert s3.get_object(Bucket=bucket, Key="k")["Body"].read() == b"v3"


def test_complete_multipart_upload_if_none_match_etag(s3, bucket: str) -> None:
    etag = s3.put_object(Bucket=bucket, Key="k", Body=b"v1")["ETag"]
    uid = upload_id(s3, bucket, "k")
    part = s3.upload_part(Bucket=bucket, Key="k", UploadId=uid, PartNumber=1, Body=b"new")["ETag"]
    parts = {"Parts": [{"PartNumber": 1, "ETag": part}]}
    with pytest.raises(ClientError) as info:
        s3.complete_multipart_upload(Bucket=bucket, Key="k", UploadId=uid, MultipartUpload=parts, IfNoneMatch=etag)
    assert error_of(info) == (412, "PreconditionFailed")
    assert s3.get_object(Bucket=bucket, Key="k")["Body"].read() == b"v1"
    s3.complete_multipart_upload(Bucket=bucket, Key="k", UploadId=uid, MultipartUpload=parts,
                                 IfNoneMatch='"00000000000000000000000000000000"')
    assert s3.get_object(Bucket=bucket, Key="k")["Body"].read() == b"new"


def test_put_with_transfer_encoding_chunked_is_accepted(s3, raw: RawClient, node: Node, bucket: str) -> None:
    """No Content-Length, ``Transfer-Encoding: chunked``: accepted within the object size limit (RGW, MinIO)."""
    payload = os.urandom(300 * KiB)
    pieces = [payload[i:i + 50_000] for i in range(0, len(payload), 50_000)]
    body = b"".join(f"{len(p):x}\r\n".encode() + p + b"\r\n" for p in pieces) + b"0\r\n\r\n"
    reply = raw.s3("PUT", f"/{bucket}/chunked", body, payload_hash=UNSIGNED,
                   headers={"Transfer-Encoding": "chunked"}, content_length=False)
    assert reply.status == 200, reply.body[:300]
    assert s3.get_object(Bucket=bucket, Key="chunked")["Body"].read() == payload
    assert Admin(node).stats()["reserved"] == 0


def test_chunked_put_over_the_object_size_limit_stores_nothing(s3, raw: RawClient, node: Node,
                                                              bucket: str) -> None:
    """The node's --max-object-size is 8 MiB: a chunked body that grows past it is refused, stores nothing
    and keeps no reservation."""
    piece = os.urandom(1 * MiB)
    pieces = [f"{len(piece):x}\r\n".encode() + piece + b"\r\n" for _ in range(9)] + [b"0\r\n\r\n"]
    target = f"/{bucket}/too-big"
    headers = sign(raw.endpoint, "PUT", target, payload_hash=UNSIGNED,
                   headers={"Transfer-Encoding": "chunked"}).headers
    reply = raw.stream("PUT", target, headers, pieces, pause=0.05)
    assert (reply.status, reply.code) == (400, "EntityTooLarge")
    with pytest.raises(ClientError):
        s3.head_object(Bucket=bucket, Key="too-big")
    assert Admin(node).stats()["reserved"] == 0


@pytest.mark.parametrize("sent, kept", [
    ("deflate, gzip", "deflate, gzip"),
    ("aws-chunked, deflate, gzip", "deflate, gzip"),
    ("deflate, gzip, aws-chunked", "deflate, gzip"),
])
def test_content_encoding_is_kept_as_sent(s3, raw: RawClient, bucket: str, sent: str, kept: str) -> None:
    payload = b"z" * 1000
    if "aws-chunked" in sent:
        body = aws_chunked(payload, trailer=("x-amz-checksum-crc32", crc32_b64(payload)))
        headers = {"Content-Encoding": sent, "x-amz-decoded-content-length": str(len(payload)),
                   "x-amz-trailer": "x-amz-checksum-crc32"}
        reply = raw.s3("PUT", f"/{bucket}/k", body, payload_hash=UNSIGNED_TRAILER, headers=headers)
    else:
        reply = raw.s3("PUT", f"/{bucket}/k", payload, headers={"Content-Encoding": sent})
    assert reply.status == 200, reply.body[:300]
    assert s3.head_object(Bucket=bucket, Key="k")["ContentEncoding"] == kept


@pytest.mark.parametrize("algorithm, size", [("sha256", 32), ("crc64nvme", 8), ("crc32", 4), ("crc32c", 4),
                                             ("sha1", 20)])
def test_wrong_checksum_value_is_bad_digest(s3, raw: RawClient, bucket: str, algorithm: str, size: int) -> None:
    wrong = base64.b64encode(hashlib.sha256(b"something else").digest()[:size]).decode()
    reply = raw.s3("PUT", f"/{bucket}/k", b"payload", headers={f"x-amz-checksum-{algorithm}": wrong})
    assert (reply.status, reply.code) == (400, "BadDigest")
    with pytest.raises(ClientError):
        s3.head_object(Bucket=bucket, Key="k")


def malformed_values(algorithm: str) -> list[str]:
    size = {"sha256": 32, "crc64nvme": 8}[algorithm]
    return ["bad", base64.b64encode(b"\x01" * (size + 1)).decode(), hashlib.sha256(b"payload").hexdigest()]


@pytest.mark.parametrize("algorithm", ["sha256", "crc64nvme"])
@pytest.mark.parametrize("which", [0, 1, 2], ids=["not-base64", "wrong-length", "hex-digest"])
def test_checksum_value_that_cannot_match_is_bad_digest(s3, bucket: str, algorithm: str, which: int) -> None:
    """A value that cannot be the payload's checksum (not base64, the wrong length, a hex digest) is a wrong
    value like any other: BadDigest, not InvalidRequest (what conformance suites expect)."""
    argument = {"sha256": "ChecksumSHA256", "crc64nvme": "ChecksumCRC64NVME"}[algorithm]
    with pytest.raises(ClientError) as info:
        s3.put_object(Bucket=bucket, Key="k", Body=b"payload", ChecksumAlgorithm=algorithm.upper(),
                      **{argument: malformed_values(algorithm)[which]})
    assert error_of(info) == (400, "BadDigest")
    with pytest.raises(ClientError):
        s3.head_object(Bucket=bucket, Key="k")


def test_list_objects_v2_with_empty_continuation_token_lists_from_the_start(s3, raw: RawClient,
                                                                            bucket: str) -> None:
    for key in ("a", "b", "c"):
        s3.put_object(Bucket=bucket, Key=key, Body=b"")
    reply = raw.s3("GET", f"/{bucket}?list-type=2&continuation-token=")
    assert reply.status == 200, reply.body[:300]
    assert [b"<Key>a</Key>" in reply.body, b"<Key>c</Key>" in reply.body] == [True, True]
    listed = s3.list_objects_v2(Bucket=bucket, ContinuationToken="")
    assert [o["Key"] for o in listed["Contents"]] == ["a", "b", "c"]


@pytest.mark.parametrize("prefix", ["\n", "a b", "%", "ü/", "a+b"])
def test_list_objects_v1_url_encoding_gives_the_prefix_back_as_boto3_reads_it(s3, bucket: str,
                                                                             prefix: str) -> None:
    """boto3 asks ListObjects for ``encoding-type=url`` and decodes Marker, Delimiter, keys and common
    prefixes, but not the top-level Prefix: a prefix of ``"\\n"`` must come back as ``"\\n"``."""
    s3.put_object(Bucket=bucket, Key=prefix + "x", Body=b"")
    listed = s3.list_objects(Bucket=bucket, Prefix=prefix)
    assert listed["Prefix"] == prefix
    assert [o["Key"] for o in listed["Contents"]] == [prefix + "x"]
