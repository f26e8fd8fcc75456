"""S3 object operations through the real boto3 client: PutObject, GetObject, HeadObject, DeleteObject,
CopyObject, DeleteObjects, ListObjectVersions; keys, metadata, TTL, ranges, conditionals and integrity."""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import email.utils
import hashlib
import secrets
import time
from collections.abc import Iterator

import pytest
from botocore.exceptions import ClientError
from support.inprocess import InProcessNode

# conftest.start_node leaves its log file handle to the garbage collector; with warnings as errors that
# ResourceWarning would fail whichever test happens to start a node.

# --------------------------------------------------------------------------------------------------- helpers


def code_of(exc: pytest.ExceptionInfo[ClientError] | ClientError) -> tuple[str, int]:
    e = exc.value if isinstance(exc, pytest.ExceptionInfo) else exc
    return e.response["Error"]["Code"], e.response["ResponseMetadata"]["HTTPStatusCode"]


def headers_of(response: dict) -> dict[str, str]:
    return response["ResponseMetadata"]["HTTPHeaders"]


def md5_hex(data: bytes) -> str:
    return hashlib.md5(data).hexdigest()


@contextlib.contextmanager
def extra_headers(client, operation: str, headers: dict[str, str]) -> Iterator[None]:
    """Add raw headers to every ``operation`` request of ``client`` while the block runs (signed with it)."""

    def add(request, **_: object) -> None:
        for name, value in headers.items():
            if name in request.headers:
                del request.headers[name]  # setting alone would add a second header of that name
            request.headers[name] = value

    uid = "ctx-extra-" + secrets.token_hex(4)
    client.meta.events.register(f"before-sign.s3.{operation}", add, unique_id=uid)
    try:
        yield
    finally:
        client.meta.events.unregister(f"before-sign.s3.{operation}", unique_id=uid)


def put_with_ttl(client, bucket: str, key: str, body: bytes, ttl: str, **kwargs: object) -> dict:
    with extra_headers(client, "PutObject", {"x-ctx-ttl": ttl}):
        return client.put_object(Bucket=bucket, Key=key, Body=body, **kwargs)


def expires_at(response: dict) -> float:
    return float(headers_of(response)["x-ctx-expires-at"])


def keys_in(client, bucket: str) -> list[str]:
    return [o["Key"] for o in client.list_objects_v2(Bucket=bucket).get("Contents", [])]


# ------------------------------------------------------------------------------------------------ round trip


def test_put_get_head_delete_round_trip(s3, bucket: str) -> None:
    body = secrets.token_bytes(3000)
    put = s3.put_object(Bucket=bucket, Key="blocks/0001", Body=body)
    assert put["ETag"] == f'"{md5_hex(body)}"'

    got = s3.get_object(Bucket=bucket, Key="blocks/0001")
    assert got["Body"].read() == body
    assert got["ContentLength"] == len(body)
    assert got["ETag"] == put["ETag"]
    assert got["ContentType"] == "binary/octet-stream"  # S3's default when none is sent
    assert got["AcceptRanges"] == "bytes"
    assert isinstance(got["LastModified"], dt.datetime)
    assert abs(got["LastModified"].timestamp() - time.time()) < 30

    head = s3.head_object(Bucket=bucket, Key="blocks/0001")
    assert head["ContentLength"] == len(body)
    assert head["ETag"] == put["ETag"]
    assert head["ContentType"] == "binary/octet-stream"

    deleted = s3.delete_object(Bucket=bucket, Key="blocks/0001")
    assert deleted["ResponseMetadata"]["HTTPStatusCode"] == 204
    with pytest.raises(ClientError) as exc:
        s3.get_object(Bucket=bucket, Key="blocks/0001")
    assert code_of(exc) == ("NoSuchKey", 404)
    with pytest.raises(ClientError) as exc:
        s3.head_object(Bucket=bucket, Key="blocks/0001")
    assert code_of(exc) == ("404", 404)
    # Deleting a missing key is not an error in S3.
    assert s3.delete_object(Bucket=bucket, Key="blocks/0001")["ResponseMetadata"]["HTTPStatusCode"] == 204


def test_overwrite_replaces_value_and_etag(s3, bucket: str) -> None:
    s3.put_object(Bucket=bucket, Key="k", Body=b"first")
    second = s3.put_object(Bucket=bucket, Key="k", Body=b"second value")
    got = s3.get_object(Bucket=bucket, Key="k")
    assert got["Body"].read() == b"second value"
    assert got["ETag"] == second["ETag"] == f'"{md5_hex(b"second value")}"'
    assert keys_in(s3, bucket) == ["k"]


def test_empty_object(s3, bucket: str) -> None:
    put = s3.put_object(Bucket=bucket, Key="empty", Body=b"")
    assert put["ETag"] == f'"{md5_hex(b"")}"'
    got = s3.get_object(Bucket=bucket, Key="empty")
    assert got["ContentLength"] == 0
    assert got["Body"].read() == b""
    assert s3.head_object(Bucket=bucket, Key="empty")["ContentLength"] == 0


def test_get_missing_key_and_missing_bucket(s3, bucket: str) -> None:
    with pytest.raises(ClientError) as exc:
        s3.get_object(Bucket=bucket, Key="nope")
    assert code_of(exc) == ("NoSuchKey", 404)
    assert exc.value.response["Error"]["Key"] == "nope"
    with pytest.raises(ClientError) as exc:
        s3.get_object(Bucket="no-such-bucket-" + secrets.token_hex(4), Key="k")
    assert code_of(exc) == ("NoSuchBucket", 404)
    with pytest.raises(ClientError) as exc:
        s3.put_object(Bucket="no-such-bucket-" + secrets.token_hex(4), Key="k", Body=b"x")
    assert code_of(exc) == ("NoSuchBucket", 404)


# ------------------------------------------------------------------------------------------------------ keys

SPECIAL_KEYS = [
    "a/b/c",
    "with space",
    "plus+sign",
    "percent%20not-decoded-twice",
    "percent%2Fslash",
    "at@sign",
    "tilde~home",
    "many   spaces  ",
    "unicode/日本語/ключ/😀",
    "mixed @/%+ ~=&?#;:,$!'()*[]",
    "trailing/",
    "double//slash",
    "ümlaut-é",
]


@pytest.mark.parametrize("key", SPECIAL_KEYS)
def test_special_keys_round_trip(s3, bucket: str, key: str) -> None:
    body = key.encode() * 3
    s3.put_object(Bucket=bucket, Key=key, Body=body)
    assert s3.get_object(Bucket=bucket, Key=key)["Body"].read() == body
    assert s3.head_object(Bucket=bucket, Key=key)["ContentLength"] == len(body)
    assert keys_in(s3, bucket) == [key]
    s3.delete_object(Bucket=bucket, Key=key)
    assert keys_in(s3, bucket) == []


def test_unicode_normalization_forms_are_distinct_keys(s3, bucket: str) -> None:
    composed, decomposed = "caf\u00e9", "cafe\u0301"
    s3.put_object(Bucket=bucket, Key=composed, Body=b"nfc")
    s3.put_object(Bucket=bucket, Key=decomposed, Body=b"nfd")
    assert s3.get_object(Bucket=bucket, Key=composed)["Body"].read() == b"nfc"
    assert s3.get_object(Bucket=bucket, Key=decomposed)["Body"].read() == b"nfd"
    assert keys_in(s3, bucket) == sorted([composed, decomposed], key=lambda k: k.encode())


def test_large_object_round_trip(s3, bucket: str) -> None:
    import io

    body = secrets.token_bytes(9 * 1024 * 1024 + 5)
    assert s3.put_object(Bucket=bucket, Key="big", Body=body)["ETag"] == f'"{md5_hex(body)}"'
    streamed = s3.put_object(Bucket=bucket, Key="big-stream", Body=io.BytesIO(body))
    assert streamed["ETag"] == f'"{md5_hex(body)}"'
    for key in ("big", "big-stream"):
        got = s3.get_object(Bucket=bucket, Key=key)
        assert got["ContentLength"] == len(body)
        assert hashlib.md5(got["Body"].read()).hexdigest() == md5_hex(body)


def test_percent_keys_are_distinct_from_their_decoded_form(s3, bucket: str) -> None:
    s3.put_object(Bucket=bucket, Key="x%41", Body=b"encoded")
    s3.put_object(Bucket=bucket, Key="xA", Body=b"plain")
    s3.put_object(Bucket=bucket, Key="x+y", Body=b"plus")
    s3.put_object(Bucket=bucket, Key="x y", Body=b"space")
    assert s3.get_object(Bucket=bucket, Key="x%41")["Body"].read() == b"encoded"
    assert s3.get_object(Bucket=bucket, Key="xA")["Body"].read() == b"plain"
    assert s3.get_object(Bucket=bucket, Key="x+y")["Body"].read() == b"plus"
    assert s3.get_object(Bucket=bucket, Key="x y")["Body"].read() == b"space"
    assert sorted(keys_in(s3, bucket)) == sorted(["x%41", "xA", "x+y", "x y"])


@pytest.mark.parametrize("unit", ["a", "é", "日", "😀"])
def test_key_of_exactly_1024_utf8_bytes(s3, bucket: str, unit: str) -> None:
    width = len(unit.encode())
    key = "k/" + unit * ((1024 - 2) // width)
    key += "z" * (1024 - len(key.encode()))
    assert len(key.encode()) == 1024
    s3.put_object(Bucket=bucket, Key=key, Body=b"long")
    assert s3.get_object(Bucket=bucket, Key=key)["Body"].read() == b"long"
    assert keys_in(s3, bucket) == [key]

    too_long = key + "x"
    assert len(too_long.encode()) == 1025
    with pytest.raises(ClientError) as exc:
        s3.put_object(Bucket=bucket, Key=too_long, Body=b"x")
    assert code_of(exc) == ("KeyTooLongError", 400)
    with pytest.raises(ClientError) as exc:
        s3.get_object(Bucket=bucket, Key=too_long)
    assert code_of(exc) == ("KeyTooLongError", 400)
    assert keys_in(s3, bucket) == [key]


# -------------------------------------------------------------------------------------------------- metadata


def test_standard_headers_and_user_metadata_are_stored(s3, bucket: str) -> None:
    expires = dt.datetime(2031, 5, 17, 8, 30, tzinfo=dt.timezone.utc)
    expires_http = email.utils.format_datetime(expires, usegmt=True)
    s3.put_object(
        Bucket=bucket, Key="meta", Body=b"data", ContentType="application/x-kv-block",
        CacheControl="max-age=60, private", Expires=expires,
        ContentDisposition='attachment; filename="block.bin"', ContentLanguage="en-GB",
        ContentEncoding="zstd", Metadata={"model": "llama-3-8b", "Layer-Count": "32", "empty": ""},
    )
    for response in (s3.get_object(Bucket=bucket, Key="meta"), s3.head_object(Bucket=bucket, Key="meta")):
        assert response["ContentType"] == "application/x-kv-block"
        assert response["CacheControl"] == "max-age=60, private"
        assert response["ContentDisposition"] == 'attachment; filename="block.bin"'
        assert response["ContentLanguage"] == "en-GB"
        assert response["ContentEncoding"] == "zstd"
        assert headers_of(response)["expires"] == expires_http
        # Metadata names are case-insensitive on the wire; S3 returns them lower-cased.
        assert response["Metadata"] == {"model": "llama-3-8b", "layer-count": "32", "empty": ""}


def test_metadata_replaced_by_overwrite(s3, bucket: str) -> None:
    s3.put_object(Bucket=bucket, Key="k", Body=b"1", Metadata={"a": "1"}, CacheControl="no-cache")
    s3.put_object(Bucket=bucket, Key="k", Body=b"2", Metadata={"b": "2"})
    head = s3.head_object(Bucket=bucket, Key="k")
    assert head["Metadata"] == {"b": "2"}
    assert "CacheControl" not in head


def test_metadata_too_large(s3, bucket: str) -> None:
    with pytest.raises(ClientError) as exc:
        s3.put_object(Bucket=bucket, Key="big-meta", Body=b"x", Metadata={"m": "v" * 2100})
    assert code_of(exc) == ("MetadataTooLarge", 400)
    assert keys_in(s3, bucket) == []


def test_response_overrides(s3, bucket: str) -> None:
    s3.put_object(Bucket=bucket, Key="o", Body=b"payload", ContentType="text/plain", CacheControl="no-store")
    got = s3.get_object(
        Bucket=bucket, Key="o", ResponseContentType="application/json", ResponseContentLanguage="fr",
        ResponseCacheControl="max-age=5", ResponseContentDisposition="inline; filename=x.json",
        ResponseContentEncoding="identity",
        ResponseExpires=dt.datetime(2030, 1, 2, 3, 4, 5, tzinfo=dt.timezone.utc),
    )
    assert got["Body"].read() == b"payload"
    assert got["ContentType"] == "application/json"
    assert got["ContentLanguage"] == "fr"
    assert got["CacheControl"] == "max-age=5"
    assert got["ContentDisposition"] == "inline; filename=x.json"
    assert got["ContentEncoding"] == "identity"
    assert headers_of(got)["expires"] == "Wed, 02 Jan 2030 03:04:05 GMT"  # a Wednesday indeed
    # The stored object is unchanged.
    head = s3.head_object(Bucket=bucket, Key="o")
    assert head["ContentType"] == "text/plain"
    assert head["CacheControl"] == "no-store"


# ------------------------------------------------------------------------------------------------------- TTL


def test_expires_at_header_is_now_plus_ttl(s3, bucket: str) -> None:
    before = time.time()
    put = put_with_ttl(s3, bucket, "ttl-hdr", b"x", "120")
    assert before + 120 - 2 <= expires_at(put) <= time.time() + 120 + 2
    head = s3.head_object(Bucket=bucket, Key="ttl-hdr")
    get = s3.get_object(Bucket=bucket, Key="ttl-hdr")
    assert expires_at(head) == pytest.approx(expires_at(put), abs=0.01)
    assert expires_at(get) == pytest.approx(expires_at(put), abs=0.01)

    # Durations with units, and the metadata form plain S3 tools can send.
    put = put_with_ttl(s3, bucket, "ttl-unit", b"x", "5m")
    assert expires_at(put) == pytest.approx(time.time() + 300, abs=3)
    put = s3.put_object(Bucket=bucket, Key="ttl-meta", Body=b"x", Metadata={"ctx-ttl": "90"})
    assert expires_at(put) == pytest.approx(time.time() + 90, abs=3)

    # No TTL asked: the server default (1h on the session node).
    put = s3.put_object(Bucket=bucket, Key="ttl-default", Body=b"x")
    assert expires_at(put) == pytest.approx(time.time() + 3600, abs=3)


@pytest.mark.parametrize("value", ["0", "-5", "abc", "1.5x", ""])
def test_invalid_ttl_is_invalid_argument(s3, bucket: str, value: str) -> None:
    with pytest.raises(ClientError) as exc:
        put_with_ttl(s3, bucket, "bad-ttl", b"x", value)
    assert code_of(exc) == ("InvalidArgument", 400)
    with pytest.raises(ClientError) as exc:
        s3.put_object(Bucket=bucket, Key="bad-ttl", Body=b"x", Metadata={"ctx-ttl": value})
    assert code_of(exc) == ("InvalidArgument", 400)
    assert keys_in(s3, bucket) == []


def test_header_ttl_wins_over_metadata_ttl(s3, bucket: str) -> None:
    put = put_with_ttl(s3, bucket, "both", b"x", "60", Metadata={"ctx-ttl": "600"})
    assert expires_at(put) == pytest.approx(time.time() + 60, abs=3)


@pytest.fixture
def ttl_node() -> Iterator[InProcessNode]:
    """A node on a fake clock: time passes when the test says so."""
    node = InProcessNode(default_ttl=2.0, max_ttl=3.0)
    yield node
    node.close()


@pytest.fixture
def ttl_s3(ttl_node: InProcessNode):
    return ttl_node.client()


def test_max_ttl_caps_requested_ttl(ttl_s3) -> None:
    name = "cap-" + secrets.token_hex(4)
    ttl_s3.create_bucket(Bucket=name)
    put = put_with_ttl(ttl_s3, name, "long", b"x", "3600")
    assert expires_at(put) == pytest.approx(time.time() + 3, abs=1)
    put = ttl_s3.put_object(Bucket=name, Key="long-meta", Body=b"x", Metadata={"ctx-ttl": "7d"})
    assert expires_at(put) == pytest.approx(time.time() + 3, abs=1)
    put = ttl_s3.put_object(Bucket=name, Key="default", Body=b"x")
    assert expires_at(put) == pytest.approx(time.time() + 2, abs=1)


def test_expired_objects_vanish_from_get_head_and_listings(ttl_node: InProcessNode, ttl_s3) -> None:
    name = "exp-" + secrets.token_hex(4)
    ttl_s3.create_bucket(Bucket=name)
    put_with_ttl(ttl_s3, name, "one-second", b"a", "1")
    ttl_s3.put_object(Bucket=name, Key="meta-two", Body=b"b", Metadata={"ctx-ttl": "2"})
    ttl_s3.put_object(Bucket=name, Key="server-default", Body=b"c")  # default TTL 2s on this node
    put_with_ttl(ttl_s3, name, "capped", b"d", "60")  # capped at 3s
    assert keys_in(ttl_s3, name) == ["capped", "meta-two", "one-second", "server-default"]

    ttl_node.advance(1.3)
    with pytest.raises(ClientError) as exc:
        ttl_s3.get_object(Bucket=name, Key="one-second")
    assert code_of(exc) == ("NoSuchKey", 404)
    with pytest.raises(ClientError) as exc:
        ttl_s3.head_object(Bucket=name, Key="one-second")
    assert code_of(exc) == ("404", 404)
    assert ttl_s3.get_object(Bucket=name, Key="meta-two")["Body"].read() == b"b"
    assert keys_in(ttl_s3, name) == ["capped", "meta-two", "server-default"]

    ttl_node.advance(1.0)
    for key in ("meta-two", "server-default"):
        with pytest.raises(ClientError) as exc:
            ttl_s3.get_object(Bucket=name, Key=key)
        assert code_of(exc) == ("NoSuchKey", 404)
    listed_v1 = [o["Key"] for o in ttl_s3.list_objects(Bucket=name).get("Contents", [])]
    assert keys_in(ttl_s3, name) == listed_v1 == ["capped"]
    versions = ttl_s3.list_object_versions(Bucket=name).get("Versions", [])
    assert [v["Key"] for v in versions] == ["capped"]

    ttl_node.advance(1.0)
    assert keys_in(ttl_s3, name) == []
    # An expired object does not keep its bucket from being deleted.
    ttl_s3.delete_bucket(Bucket=name)


def test_expired_object_does_not_block_conditional_create(ttl_node: InProcessNode, ttl_s3) -> None:
    name = "exp-cond-" + secrets.token_hex(4)
    ttl_s3.create_bucket(Bucket=name)
    put_with_ttl(ttl_s3, name, "k", b"old", "1")
    with pytest.raises(ClientError) as exc:
        ttl_s3.put_object(Bucket=name, Key="k", Body=b"new", IfNoneMatch="*")
    assert code_of(exc) == ("PreconditionFailed", 412)
    ttl_node.advance(1.2)
    ttl_s3.put_object(Bucket=name, Key="k", Body=b"new", IfNoneMatch="*")
    assert ttl_s3.get_object(Bucket=name, Key="k")["Body"].read() == b"new"


# ---------------------------------------------------------------------------------------------------- ranges

BODY = bytes(range(256)) * 4  # 1024 bytes


@pytest.fixture
def ranged(s3, bucket: str) -> str:
    s3.put_object(Bucket=bucket, Key="r", Body=BODY)
    return bucket


@pytest.mark.parametrize(
    "header, start, end",
    [
        ("bytes=0-0", 0, 1),
        ("bytes=10-19", 10, 20),
        ("bytes=1000-", 1000, 1024),
        ("bytes=-24", 1000, 1024),
        ("bytes=-5000", 0, 1024),
        ("bytes=1020-5000", 1020, 1024),
        ("bytes=0-1023", 0, 1024),
    ],
)
def test_range_get(s3, ranged: str, header: str, start: int, end: int) -> None:
    # boto3 sends a CRC32 with the PUT and asks for checksums on GET (validating what comes back): a ranged
    # answer must not carry the whole object's checksum.
    got = s3.get_object(Bucket=ranged, Key="r", Range=header, ChecksumMode="ENABLED")
    assert "ChecksumCRC32" not in got
    assert got["ResponseMetadata"]["HTTPStatusCode"] == 206
    assert got["Body"].read() == BODY[start:end]
    assert got["ContentLength"] == end - start
    assert got["ContentRange"] == f"bytes {start}-{end - 1}/1024"
    head = s3.head_object(Bucket=ranged, Key="r", Range=header)
    assert head["ResponseMetadata"]["HTTPStatusCode"] == 206
    assert head["ContentLength"] == end - start
    assert head["ContentRange"] == f"bytes {start}-{end - 1}/1024"


@pytest.mark.parametrize("header", ["bytes=1024-", "bytes=1024-2000", "bytes=5000-6000"])
def test_range_beyond_end_is_invalid_range(s3, ranged: str, header: str) -> None:
    with pytest.raises(ClientError) as exc:
        s3.get_object(Bucket=ranged, Key="r", Range=header)
    assert code_of(exc) == ("InvalidRange", 416)
    assert headers_of(exc.value.response)["content-range"] == "bytes */1024"
    assert exc.value.response["Error"]["ActualObjectSize"] == "1024"


def test_head_range_beyond_end(s3, ranged: str) -> None:
    with pytest.raises(ClientError) as exc:
        s3.head_object(Bucket=ranged, Key="r", Range="bytes=2048-")
    assert code_of(exc) == ("416", 416)


def test_malformed_range_returns_whole_object(s3, ranged: str) -> None:
    for header in ("bytes=20-10", "items=0-5", "bytes=abc"):
        got = s3.get_object(Bucket=ranged, Key="r", Range=header)
        assert got["ResponseMetadata"]["HTTPStatusCode"] == 200, header
        assert got["Body"].read() == BODY


def test_range_on_empty_object(s3, bucket: str) -> None:
    s3.put_object(Bucket=bucket, Key="empty", Body=b"")
    for header in ("bytes=0-", "bytes=0-0"):
        with pytest.raises(ClientError) as exc:
            s3.get_object(Bucket=bucket, Key="empty", Range=header)
        assert code_of(exc) == ("InvalidRange", 416)
        assert headers_of(exc.value.response)["content-range"] == "bytes */0"


# ----------------------------------------------------------------------------------------- conditional reads


def test_conditional_get_etag(s3, bucket: str) -> None:
    etag = s3.put_object(Bucket=bucket, Key="c", Body=b"cond")["ETag"]
    assert s3.get_object(Bucket=bucket, Key="c", IfMatch=etag)["Body"].read() == b"cond"
    assert s3.get_object(Bucket=bucket, Key="c", IfMatch=etag.strip('"'))["Body"].read() == b"cond"
    assert s3.get_object(Bucket=bucket, Key="c", IfMatch="*")["Body"].read() == b"cond"
    assert s3.get_object(Bucket=bucket, Key="c", IfNoneMatch='"0123"')["Body"].read() == b"cond"

    with pytest.raises(ClientError) as exc:
        s3.get_object(Bucket=bucket, Key="c", IfMatch='"0123456789abcdef0123456789abcdef"')
    assert code_of(exc) == ("PreconditionFailed", 412)
    with pytest.raises(ClientError) as exc:
        s3.head_object(Bucket=bucket, Key="c", IfMatch='"0123456789abcdef0123456789abcdef"')
    assert code_of(exc) == ("412", 412)

    with pytest.raises(ClientError) as exc:
        s3.get_object(Bucket=bucket, Key="c", IfNoneMatch=etag)
    assert code_of(exc) == ("304", 304)
    assert headers_of(exc.value.response)["etag"] == etag
    with pytest.raises(ClientError) as exc:
        s3.head_object(Bucket=bucket, Key="c", IfNoneMatch=etag)
    assert code_of(exc) == ("304", 304)


def test_conditional_get_dates(s3, bucket: str) -> None:
    s3.put_object(Bucket=bucket, Key="d", Body=b"dated")
    modified = s3.head_object(Bucket=bucket, Key="d")["LastModified"]
    past = dt.datetime(2000, 1, 1, tzinfo=dt.timezone.utc)

    assert s3.get_object(Bucket=bucket, Key="d", IfModifiedSince=past)["Body"].read() == b"dated"
    with pytest.raises(ClientError) as exc:
        s3.get_object(Bucket=bucket, Key="d", IfModifiedSince=modified)
    assert code_of(exc) == ("304", 304)

    assert s3.get_object(Bucket=bucket, Key="d", IfUnmodifiedSince=modified)["Body"].read() == b"dated"
    with pytest.raises(ClientError) as exc:
        s3.get_object(Bucket=bucket, Key="d", IfUnmodifiedSince=past)
    assert code_of(exc) == ("PreconditionFailed", 412)

    # S3 (RFC 7232 section 6): If-Match true + If-Unmodified-Since false -> 200;
    # If-None-Match false + If-Modified-Since true -> 304.
    etag = s3.head_object(Bucket=bucket, Key="d")["ETag"]
    got = s3.get_object(Bucket=bucket, Key="d", IfMatch=etag, IfUnmodifiedSince=past)
    assert got["Body"].read() == b"dated"
    with pytest.raises(ClientError) as exc:
        s3.get_object(Bucket=bucket, Key="d", IfNoneMatch=etag, IfModifiedSince=past)
    assert code_of(exc) == ("304", 304)


# ---------------------------------------------------------------------------------------- conditional writes


def test_put_if_none_match(s3, bucket: str) -> None:
    first = s3.put_object(Bucket=bucket, Key="once", Body=b"original", IfNoneMatch="*")
    with pytest.raises(ClientError) as exc:
        s3.put_object(Bucket=bucket, Key="once", Body=b"replacement", IfNoneMatch="*")
    assert code_of(exc) == ("PreconditionFailed", 412)
    got = s3.get_object(Bucket=bucket, Key="once")
    assert got["Body"].read() == b"original"
    assert got["ETag"] == first["ETag"]


def test_put_if_match(s3, bucket: str) -> None:
    with pytest.raises(ClientError) as exc:
        s3.put_object(Bucket=bucket, Key="cas", Body=b"v0", IfMatch='"0123456789abcdef0123456789abcdef"')
    assert code_of(exc) == ("NoSuchKey", 404)
    assert keys_in(s3, bucket) == []

    v1 = s3.put_object(Bucket=bucket, Key="cas", Body=b"v1")["ETag"]
    v2 = s3.put_object(Bucket=bucket, Key="cas", Body=b"v2", IfMatch=v1)["ETag"]
    with pytest.raises(ClientError) as exc:
        s3.put_object(Bucket=bucket, Key="cas", Body=b"v3", IfMatch=v1)  # stale ETag
    assert code_of(exc) == ("PreconditionFailed", 412)
    got = s3.get_object(Bucket=bucket, Key="cas")
    assert got["Body"].read() == b"v2"
    assert got["ETag"] == v2


# ------------------------------------------------------------------------------------------------- integrity


def test_content_md5(s3, bucket: str) -> None:
    body = b"verified block"
    good = base64.b64encode(hashlib.md5(body).digest()).decode()
    assert s3.put_object(Bucket=bucket, Key="md5", Body=body, ContentMD5=good)["ETag"] == f'"{md5_hex(body)}"'

    wrong = base64.b64encode(hashlib.md5(b"other").digest()).decode()
    with pytest.raises(ClientError) as exc:
        s3.put_object(Bucket=bucket, Key="md5", Body=b"corrupted", ContentMD5=wrong)
    assert code_of(exc) == ("BadDigest", 400)
    for garbage in ("not base64!!", base64.b64encode(b"short").decode()):
        with pytest.raises(ClientError) as exc:
            s3.put_object(Bucket=bucket, Key="md5", Body=b"corrupted", ContentMD5=garbage)
        assert code_of(exc) == ("InvalidDigest", 400)
    # The failed writes left the earlier value alone.
    assert s3.get_object(Bucket=bucket, Key="md5")["Body"].read() == body


def test_wrong_checksum_header_is_bad_digest(s3, bucket: str) -> None:
    s3.put_object(Bucket=bucket, Key="ck", Body=b"keep")
    bogus = base64.b64encode(hashlib.sha256(b"something else").digest()).decode()
    with pytest.raises(ClientError) as exc:
        s3.put_object(Bucket=bucket, Key="ck", Body=b"replace", ChecksumSHA256=bogus)
    assert code_of(exc) == ("BadDigest", 400)
    assert s3.get_object(Bucket=bucket, Key="ck")["Body"].read() == b"keep"


def _expected_checksum(algorithm: str, data: bytes) -> str:
    from awscrt import checksums

    if algorithm == "SHA1":
        digest = hashlib.sha1(data).digest()
    elif algorithm == "SHA256":
        digest = hashlib.sha256(data).digest()
    elif algorithm == "CRC32":
        digest = checksums.crc32(data).to_bytes(4, "big")
    elif algorithm == "CRC32C":
        digest = checksums.crc32c(data).to_bytes(4, "big")
    else:
        digest = checksums.crc64nvme(data).to_bytes(8, "big")
    return base64.b64encode(digest).decode()


@pytest.mark.parametrize("algorithm", ["CRC32", "CRC32C", "SHA1", "SHA256", "CRC64NVME"])
def test_checksum_algorithms_stored_and_returned(s3, bucket: str, algorithm: str) -> None:
    body = secrets.token_bytes(5000)
    expected = _expected_checksum(algorithm, body)
    field = "Checksum" + algorithm
    put = s3.put_object(Bucket=bucket, Key="c", Body=body, ChecksumAlgorithm=algorithm)
    assert put[field] == expected
    assert put["ETag"] == f'"{md5_hex(body)}"'

    got = s3.get_object(Bucket=bucket, Key="c", ChecksumMode="ENABLED")
    assert got["Body"].read() == body
    assert got[field] == expected
    assert got["ChecksumType"] == "FULL_OBJECT"
    head = s3.head_object(Bucket=bucket, Key="c", ChecksumMode="ENABLED")
    assert head[field] == expected
    # Without ChecksumMode the checksum is not returned.
    plain = s3.head_object(Bucket=bucket, Key="c")
    assert field not in plain


def test_server_xxh3_header(s3, bucket: str) -> None:
    import xxhash

    body = secrets.token_bytes(777)
    put = s3.put_object(Bucket=bucket, Key="x", Body=body)
    want = f"{xxhash.xxh3_64_intdigest(body):016x}"
    assert headers_of(put)["x-ctx-xxh3"] == want
    assert headers_of(s3.head_object(Bucket=bucket, Key="x"))["x-ctx-xxh3"] == want


# ------------------------------------------------------------------------------------------------------ copy


def test_copy_object_copies_metadata_by_default(s3, bucket: str) -> None:
    body = secrets.token_bytes(2048)
    src = s3.put_object(Bucket=bucket, Key="src", Body=body, ContentType="application/x-a",
                        CacheControl="max-age=1", Metadata={"origin": "yes"})
    result = s3.copy_object(Bucket=bucket, Key="dst", CopySource={"Bucket": bucket, "Key": "src"})
    assert result["CopyObjectResult"]["ETag"] == src["ETag"]
    assert isinstance(result["CopyObjectResult"]["LastModified"], dt.datetime)
    got = s3.get_object(Bucket=bucket, Key="dst")
    assert got["Body"].read() == body
    assert got["ETag"] == src["ETag"]
    assert got["ContentType"] == "application/x-a"
    assert got["CacheControl"] == "max-age=1"
    assert got["Metadata"] == {"origin": "yes"}
    # The source is untouched.
    assert s3.get_object(Bucket=bucket, Key="src")["Body"].read() == body


def test_copy_object_replace_directive(s3, bucket: str) -> None:
    s3.put_object(Bucket=bucket, Key="src", Body=b"abc", ContentType="application/x-a", Metadata={"old": "1"},
                  CacheControl="max-age=1")
    s3.copy_object(Bucket=bucket, Key="dst", CopySource={"Bucket": bucket, "Key": "src"},
                   MetadataDirective="REPLACE", ContentType="text/plain", Metadata={"new": "2"})
    head = s3.head_object(Bucket=bucket, Key="dst")
    assert head["ContentType"] == "text/plain"
    assert head["Metadata"] == {"new": "2"}
    assert "CacheControl" not in head
    assert s3.get_object(Bucket=bucket, Key="dst")["Body"].read() == b"abc"


def test_copy_to_itself(s3, bucket: str) -> None:
    s3.put_object(Bucket=bucket, Key="self", Body=b"me", Metadata={"v": "1"})
    with pytest.raises(ClientError) as exc:
        s3.copy_object(Bucket=bucket, Key="self", CopySource={"Bucket": bucket, "Key": "self"})
    assert code_of(exc) == ("InvalidRequest", 400)
    # Changing the metadata makes a self-copy legal.
    s3.copy_object(Bucket=bucket, Key="self", CopySource={"Bucket": bucket, "Key": "self"},
                   MetadataDirective="REPLACE", Metadata={"v": "2"})
    head = s3.head_object(Bucket=bucket, Key="self")
    assert head["Metadata"] == {"v": "2"}
    assert s3.get_object(Bucket=bucket, Key="self")["Body"].read() == b"me"


def test_copy_source_conditionals(s3, bucket: str) -> None:
    etag = s3.put_object(Bucket=bucket, Key="src", Body=b"cs")["ETag"]
    modified = s3.head_object(Bucket=bucket, Key="src")["LastModified"]
    past = dt.datetime(2000, 1, 1, tzinfo=dt.timezone.utc)
    src = {"Bucket": bucket, "Key": "src"}
    failing = [
        {"CopySourceIfMatch": '"0123456789abcdef0123456789abcdef"'},
        {"CopySourceIfNoneMatch": etag},
        {"CopySourceIfUnmodifiedSince": past},
        {"CopySourceIfModifiedSince": modified},
    ]
    for condition in failing:
        with pytest.raises(ClientError) as exc:
            s3.copy_object(Bucket=bucket, Key="dst", CopySource=src, **condition)
        assert code_of(exc) == ("PreconditionFailed", 412), condition
    assert keys_in(s3, bucket) == ["src"]
    passing = [
        {"CopySourceIfMatch": etag},
        {"CopySourceIfNoneMatch": '"0123"'},
        {"CopySourceIfUnmodifiedSince": modified},
        {"CopySourceIfModifiedSince": past},
    ]
    for i, condition in enumerate(passing):
        s3.copy_object(Bucket=bucket, Key=f"dst{i}", CopySource=src, **condition)
    assert keys_in(s3, bucket) == ["dst0", "dst1", "dst2", "dst3", "src"]


def test_copy_destination_conditionals(s3, bucket: str) -> None:
    s3.put_object(Bucket=bucket, Key="src", Body=b"new")
    s3.put_object(Bucket=bucket, Key="dst", Body=b"old")
    with pytest.raises(ClientError) as exc:
        s3.copy_object(Bucket=bucket, Key="dst", CopySource={"Bucket": bucket, "Key": "src"}, IfNoneMatch="*")
    assert code_of(exc) == ("PreconditionFailed", 412)
    assert s3.get_object(Bucket=bucket, Key="dst")["Body"].read() == b"old"


def test_copy_missing_source(s3, bucket: str) -> None:
    with pytest.raises(ClientError) as exc:
        s3.copy_object(Bucket=bucket, Key="dst", CopySource={"Bucket": bucket, "Key": "missing"})
    assert code_of(exc) == ("NoSuchKey", 404)
    with pytest.raises(ClientError) as exc:
        s3.copy_object(Bucket=bucket, Key="dst",
                       CopySource={"Bucket": "nobucket-" + secrets.token_hex(4), "Key": "k"})
    assert code_of(exc) == ("NoSuchBucket", 404)


@pytest.mark.parametrize("key", ["sp ace/plus+/pct%2F/@at/~t", "日本語/😀 ключ", "q?x=1&y#frag"])
def test_copy_key_with_special_characters(s3, bucket: str, key: str) -> None:
    s3.put_object(Bucket=bucket, Key=key, Body=b"special")
    s3.copy_object(Bucket=bucket, Key=key + ".copy", CopySource={"Bucket": bucket, "Key": key})
    assert s3.get_object(Bucket=bucket, Key=key + ".copy")["Body"].read() == b"special"
    # The string form of CopySource works as well (botocore percent-encodes it).
    s3.copy_object(Bucket=bucket, Key="dst2", CopySource=f"{bucket}/{key}")
    assert s3.get_object(Bucket=bucket, Key="dst2")["Body"].read() == b"special"


def test_copy_source_malformed(s3, bucket: str) -> None:
    s3.put_object(Bucket=bucket, Key="k", Body=b"v")
    for source in (f"{bucket}/%FF%FE", bucket, f"{bucket}/k?versionId=abc"):
        with extra_headers(s3, "CopyObject", {"x-amz-copy-source": source}):
            with pytest.raises(ClientError) as exc:
                s3.copy_object(Bucket=bucket, Key="dst", CopySource={"Bucket": bucket, "Key": "k"})
        assert code_of(exc) == ("InvalidArgument", 400), source
    # versionId=null names the only version there is.
    s3.copy_object(Bucket=bucket, Key="dst", CopySource={"Bucket": bucket, "Key": "k", "VersionId": "null"})
    assert s3.get_object(Bucket=bucket, Key="dst")["Body"].read() == b"v"
    assert keys_in(s3, bucket) == ["dst", "k"]


def test_copy_across_buckets_and_ttl(s3, bucket: str) -> None:
    other = "copy-dst-" + secrets.token_hex(4)
    s3.create_bucket(Bucket=other)
    try:
        put_with_ttl(s3, bucket, "src", b"across", "100")
        s3.copy_object(Bucket=other, Key="dst", CopySource={"Bucket": bucket, "Key": "src"})
        head = s3.head_object(Bucket=other, Key="dst")
        # The copy keeps the source's TTL class (100 s from the copy), not the server default (1 h).
        assert expires_at(head) == pytest.approx(time.time() + 100, abs=5)
        with extra_headers(s3, "CopyObject", {"x-ctx-ttl": "200"}):
            s3.copy_object(Bucket=other, Key="dst2", CopySource={"Bucket": bucket, "Key": "src"})
        assert expires_at(s3.head_object(Bucket=other, Key="dst2")) == pytest.approx(time.time() + 200, abs=5)
        assert s3.get_object(Bucket=other, Key="dst2")["Body"].read() == b"across"
    finally:
        s3.delete_objects(Bucket=other, Delete={"Objects": [{"Key": "dst"}, {"Key": "dst2"}]})
        s3.delete_bucket(Bucket=other)


def test_copy_across_tenants_is_denied(s3, s3_other, bucket: str) -> None:
    s3.put_object(Bucket=bucket, Key="secret", Body=b"tenant default")
    theirs = "other-" + secrets.token_hex(4)
    s3_other.create_bucket(Bucket=theirs)
    try:
        # Other tenant pulling from our bucket.
        with pytest.raises(ClientError) as exc:
            s3_other.copy_object(Bucket=theirs, Key="stolen", CopySource={"Bucket": bucket, "Key": "secret"})
        assert code_of(exc)[0] in ("AccessDenied", "NoSuchBucket")
        assert code_of(exc)[1] in (403, 404)
        assert s3_other.list_objects_v2(Bucket=theirs).get("Contents", []) == []
        # Us pushing into their bucket.
        with pytest.raises(ClientError) as exc:
            s3.copy_object(Bucket=theirs, Key="pushed", CopySource={"Bucket": bucket, "Key": "secret"})
        assert code_of(exc)[0] in ("AccessDenied", "NoSuchBucket")
        assert s3_other.list_objects_v2(Bucket=theirs).get("Contents", []) == []
    finally:
        s3_other.delete_bucket(Bucket=theirs)


# --------------------------------------------------------------------------------------------- DeleteObjects


def test_delete_objects(s3, bucket: str) -> None:
    keys = [f"d/{i}" for i in range(5)] + ["sp ace", "plus+", "ü", "amp&<lt>\"'"]
    for key in keys:
        s3.put_object(Bucket=bucket, Key=key, Body=b"x")
    result = s3.delete_objects(
        Bucket=bucket, Delete={"Objects": [{"Key": k} for k in keys[:3] + ["never-existed", "sp ace"]]})
    assert sorted(d["Key"] for d in result["Deleted"]) == sorted(keys[:3] + ["never-existed", "sp ace"])
    assert "Errors" not in result
    assert sorted(keys_in(s3, bucket)) == sorted(keys[3:5] + ["plus+", "ü", "amp&<lt>\"'"])

    quiet = s3.delete_objects(Bucket=bucket,
                              Delete={"Objects": [{"Key": k} for k in keys[3:]], "Quiet": True})
    assert "Deleted" not in quiet
    assert "Errors" not in quiet
    assert keys_in(s3, bucket) == []


def test_delete_objects_limits(s3, bucket: str) -> None:
    s3.put_object(Bucket=bucket, Key="survivor", Body=b"x")
    with pytest.raises(ClientError) as exc:
        s3.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": f"k{i}"} for i in range(1001)]})
    assert code_of(exc) == ("MalformedXML", 400)
    with pytest.raises(ClientError) as exc:
        s3.delete_objects(Bucket=bucket, Delete={"Objects": []})
    assert code_of(exc) == ("MalformedXML", 400)
    # Exactly 1000 is allowed.
    result = s3.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": f"k{i}"} for i in range(999)]
                                                     + [{"Key": "survivor"}]})
    assert len(result["Deleted"]) == 1000
    assert keys_in(s3, bucket) == []


def test_delete_objects_verifies_body_checksums(s3, bucket: str) -> None:
    s3.put_object(Bucket=bucket, Key="keep", Body=b"x")
    delete = {"Objects": [{"Key": "keep"}]}
    # botocore sends x-amz-checksum-crc32 with DeleteObjects; a wrong one must not be obeyed.
    with extra_headers(s3, "DeleteObjects", {"x-amz-checksum-crc32": "AAAAAA=="}):
        with pytest.raises(ClientError) as exc:
            s3.delete_objects(Bucket=bucket, Delete=delete)
    assert code_of(exc) == ("BadDigest", 400)
    wrong_md5 = base64.b64encode(hashlib.md5(b"other body").digest()).decode()
    with extra_headers(s3, "DeleteObjects", {"Content-MD5": wrong_md5}):
        with pytest.raises(ClientError) as exc:
            s3.delete_objects(Bucket=bucket, Delete=delete)
    assert code_of(exc) == ("BadDigest", 400)
    assert keys_in(s3, bucket) == ["keep"]


def test_delete_objects_key_too_long_reported_per_key(s3, bucket: str) -> None:
    s3.put_object(Bucket=bucket, Key="ok", Body=b"x")
    result = s3.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": "ok"}, {"Key": "x" * 1025}]})
    assert [d["Key"] for d in result["Deleted"]] == ["ok"]
    assert [(e["Key"], e["Code"]) for e in result["Errors"]] == [("x" * 1025, "KeyTooLongError")]


def test_delete_objects_other_tenant_denied(s3, s3_other, bucket: str) -> None:
    s3.put_object(Bucket=bucket, Key="mine", Body=b"x")
    with pytest.raises(ClientError) as exc:
        s3_other.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": "mine"}]})
    assert code_of(exc)[0] in ("AccessDenied", "NoSuchBucket")
    assert keys_in(s3, bucket) == ["mine"]


# -------------------------------------------------------------------------------------------------- versions


def test_list_object_versions(s3, bucket: str) -> None:
    etags = {}
    for key in ("b", "a", "c/d"):
        etags[key] = s3.put_object(Bucket=bucket, Key=key, Body=key.encode())["ETag"]
    etags["a"] = s3.put_object(Bucket=bucket, Key="a", Body=b"rewritten")["ETag"]  # overwrite: still once
    result = s3.list_object_versions(Bucket=bucket)
    versions = result["Versions"]
    assert [v["Key"] for v in versions] == ["a", "b", "c/d"]
    for v in versions:
        assert v["VersionId"] == "null"
        assert v["IsLatest"] is True
        assert v["ETag"] == etags[v["Key"]]
    assert [v["Size"] for v in versions] == [len(b"rewritten"), 1, 3]
    assert "DeleteMarkers" not in result
    assert result["IsTruncated"] is False

    delimited = s3.list_object_versions(Bucket=bucket, Delimiter="/")
    assert [v["Key"] for v in delimited["Versions"]] == ["a", "b"]
    assert [p["Prefix"] for p in delimited["CommonPrefixes"]] == ["c/"]

    paged = s3.get_paginator("list_object_versions").paginate(Bucket=bucket, PaginationConfig={"PageSize": 1})
    assert [v["Key"] for page in paged for v in page.get("Versions", [])] == ["a", "b", "c/d"]
