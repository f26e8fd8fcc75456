"""Multipart uploads through the real boto3 client: create, upload part, complete, abort, list parts, list
uploads; part-size rules, ETags, checksums, conditional completion and the byte budget."""

from __future__ import annotations

import base64
import hashlib
import io
import secrets
import time
from collections.abc import Iterator

import pytest
from botocore.exceptions import ClientError
from support.inprocess import InProcessNode, like_the_session_node

KIB = 1024
MIB = 1024 * KIB
PART = 2 * KIB  # on the small-part node, parts of at least 1 KiB are fine


def code_of(exc: pytest.ExceptionInfo[ClientError]) -> tuple[str, int]:
    return exc.value.response["Error"]["Code"], exc.value.response["ResponseMetadata"]["HTTPStatusCode"]


def multipart_etag(parts: list[bytes]) -> str:
    joined = b"".join(hashlib.md5(p).digest() for p in parts)
    return f'"{hashlib.md5(joined).hexdigest()}-{len(parts)}"'


def upload_parts(client, bucket: str, key: str, upload_id: str, parts: list[bytes],
                 **kwargs: object) -> list[dict]:
    done = []
    for number, data in enumerate(parts, start=1):
        response = client.upload_part(Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number,
                                      Body=data, **kwargs)
        assert response["ETag"] == f'"{hashlib.md5(data).hexdigest()}"'
        done.append({"PartNumber": number, "ETag": response["ETag"]})
    return done


def complete(client, bucket: str, key: str, upload_id: str, parts: list[dict], **kwargs: object) -> dict:
    return client.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id,
                                            MultipartUpload={"Parts": parts}, **kwargs)


@pytest.fixture(scope="module")
def small_parts_node() -> Iterator[InProcessNode]:
    node = like_the_session_node(min_part_size=KIB)
    yield node
    node.close()


@pytest.fixture(scope="module")
def mp(small_parts_node: InProcessNode):
    return small_parts_node.client()


@pytest.fixture
def mp_bucket(mp) -> Iterator[str]:
    name = "mp-" + secrets.token_hex(6)
    mp.create_bucket(Bucket=name)
    yield name
    for upload in mp.list_multipart_uploads(Bucket=name).get("Uploads", []):
        mp.abort_multipart_upload(Bucket=name, Key=upload["Key"], UploadId=upload["UploadId"])
    for page in mp.get_paginator("list_objects_v2").paginate(Bucket=name):
        for obj in page.get("Contents", []):
            mp.delete_object(Bucket=name, Key=obj["Key"])
    mp.delete_bucket(Bucket=name)


# ------------------------------------------------------------------------------------------- real part sizes


def test_multipart_with_5mib_parts_on_default_settings(s3, bucket: str) -> None:
    parts = [secrets.token_bytes(5 * MIB), secrets.token_bytes(5 * MIB), b"tail"]
    upload_id = s3.create_multipart_upload(Bucket=bucket, Key="big/object")["UploadId"]
    done = upload_parts(s3, bucket, "big/object", upload_id, parts)
    result = complete(s3, bucket, "big/object", upload_id, done)
    assert result["ETag"] == multipart_etag(parts)
    assert result["Key"] == "big/object"
    assert result["Bucket"] == bucket
    got = s3.get_object(Bucket=bucket, Key="big/object")
    assert got["ContentLength"] == 10 * MIB + 4
    assert got["ETag"] == multipart_etag(parts)
    body = got["Body"].read()
    assert hashlib.sha256(body).digest() == hashlib.sha256(b"".join(parts)).digest()
    ranged = s3.get_object(Bucket=bucket, Key="big/object", Range=f"bytes={5 * MIB - 2}-{5 * MIB + 1}")
    assert ranged["Body"].read() == parts[0][-2:] + parts[1][:2]


def test_default_minimum_part_size_is_5mib(s3, bucket: str) -> None:
    parts = [secrets.token_bytes(5 * MIB - 1), b"last"]
    upload_id = s3.create_multipart_upload(Bucket=bucket, Key="small-first")["UploadId"]
    done = upload_parts(s3, bucket, "small-first", upload_id, parts)
    with pytest.raises(ClientError) as exc:
        complete(s3, bucket, "small-first", upload_id, done)
    assert code_of(exc) == ("EntityTooSmall", 400)
    assert s3.list_objects_v2(Bucket=bucket).get("Contents", []) == []
    s3.abort_multipart_upload(Bucket=bucket, Key="small-first", UploadId=upload_id)
    # A single part may be of any size: it is the last one.
    upload_id = s3.create_multipart_upload(Bucket=bucket, Key="single")["UploadId"]
    done = upload_parts(s3, bucket, "single", upload_id, [b"only part"])
    assert complete(s3, bucket, "single", upload_id, done)["ETag"] == multipart_etag([b"only part"])
    assert s3.get_object(Bucket=bucket, Key="single")["Body"].read() == b"only part"


# ----------------------------------------------------------------------------------------------- small parts


def test_round_trip_metadata_and_parts_count(mp, mp_bucket: str) -> None:
    parts = [secrets.token_bytes(PART), secrets.token_bytes(PART + 7), secrets.token_bytes(100)]
    created = mp.create_multipart_upload(Bucket=mp_bucket, Key="k/ü +@", ContentType="application/x-kv",
                                         CacheControl="max-age=9", Metadata={"layer": "7"})
    assert created["Bucket"] == mp_bucket
    assert created["Key"] == "k/ü +@"
    upload_id = created["UploadId"]
    # Nothing is visible before completion.
    assert mp.list_objects_v2(Bucket=mp_bucket).get("Contents", []) == []
    done = upload_parts(mp, mp_bucket, "k/ü +@", upload_id, parts)
    result = complete(mp, mp_bucket, "k/ü +@", upload_id, done)
    assert result["ETag"] == multipart_etag(parts)
    assert float(result["ResponseMetadata"]["HTTPHeaders"]["x-ctx-expires-at"]) > time.time()

    head = mp.head_object(Bucket=mp_bucket, Key="k/ü +@")
    assert head["ContentType"] == "application/x-kv"
    assert head["CacheControl"] == "max-age=9"
    assert head["Metadata"] == {"layer": "7"}
    assert head["ContentLength"] == sum(map(len, parts))
    assert head["PartsCount"] == 3
    assert mp.get_object(Bucket=mp_bucket, Key="k/ü +@")["Body"].read() == b"".join(parts)
    assert [o["Key"] for o in mp.list_objects_v2(Bucket=mp_bucket)["Contents"]] == ["k/ü +@"]


def test_completion_replaces_existing_object(mp, mp_bucket: str) -> None:
    mp.put_object(Bucket=mp_bucket, Key="k", Body=b"old")
    upload_id = mp.create_multipart_upload(Bucket=mp_bucket, Key="k")["UploadId"]
    # The old value stays readable while the upload is in progress.
    done = upload_parts(mp, mp_bucket, "k", upload_id, [b"a" * PART])
    assert mp.get_object(Bucket=mp_bucket, Key="k")["Body"].read() == b"old"
    complete(mp, mp_bucket, "k", upload_id, done)
    assert mp.get_object(Bucket=mp_bucket, Key="k")["Body"].read() == b"a" * PART


def test_subset_of_parts_and_reuploaded_part(mp, mp_bucket: str) -> None:
    upload_id = mp.create_multipart_upload(Bucket=mp_bucket, Key="subset")["UploadId"]
    datas = {n: secrets.token_bytes(PART) for n in (1, 3, 5, 9)}
    etags = {}
    for n, data in datas.items():
        etags[n] = mp.upload_part(Bucket=mp_bucket, Key="subset", UploadId=upload_id, PartNumber=n,
                                  Body=data)["ETag"]
    # Uploading a part number again replaces it.
    datas[3] = secrets.token_bytes(PART + 1)
    etags[3] = mp.upload_part(Bucket=mp_bucket, Key="subset", UploadId=upload_id, PartNumber=3,
                              Body=datas[3])["ETag"]
    listed = mp.list_parts(Bucket=mp_bucket, Key="subset", UploadId=upload_id)
    assert [(p["PartNumber"], p["ETag"], p["Size"]) for p in listed["Parts"]] == [
        (n, etags[n], len(datas[n])) for n in (1, 3, 5, 9)
    ]
    # Complete with parts 1, 3 and 9 only (gaps are allowed; 5 is dropped).
    chosen = [1, 3, 9]
    result = complete(mp, mp_bucket, "subset", upload_id,
                      [{"PartNumber": n, "ETag": etags[n]} for n in chosen])
    assert result["ETag"] == multipart_etag([datas[n] for n in chosen])
    body = mp.get_object(Bucket=mp_bucket, Key="subset")["Body"].read()
    assert body == b"".join(datas[n] for n in chosen)


def test_entity_too_small(mp, mp_bucket: str) -> None:
    upload_id = mp.create_multipart_upload(Bucket=mp_bucket, Key="tiny")["UploadId"]
    done = upload_parts(mp, mp_bucket, "tiny", upload_id, [b"x" * (KIB - 1), b"y" * PART])
    with pytest.raises(ClientError) as exc:
        complete(mp, mp_bucket, "tiny", upload_id, done)
    assert code_of(exc) == ("EntityTooSmall", 400)
    # The upload is still there and can be completed with valid parts.
    assert len(mp.list_parts(Bucket=mp_bucket, Key="tiny", UploadId=upload_id)["Parts"]) == 2
    complete(mp, mp_bucket, "tiny", upload_id, done[1:])
    assert mp.get_object(Bucket=mp_bucket, Key="tiny")["Body"].read() == b"y" * PART


def test_invalid_part_and_part_order(mp, mp_bucket: str) -> None:
    upload_id = mp.create_multipart_upload(Bucket=mp_bucket, Key="k")["UploadId"]
    done = upload_parts(mp, mp_bucket, "k", upload_id, [b"a" * PART, b"b" * PART])
    cases = {
        "wrong etag": ([done[0], {"PartNumber": 2, "ETag": '"0123456789abcdef0123456789abcdef"'}],
                       "InvalidPart"),
        "missing part": ([done[0], done[1], {"PartNumber": 3, "ETag": done[1]["ETag"]}], "InvalidPart"),
        "descending": ([done[1], done[0]], "InvalidPartOrder"),
        "duplicate": ([done[0], done[0]], "InvalidPartOrder"),
    }
    for name, (parts, code) in cases.items():
        with pytest.raises(ClientError) as exc:
            complete(mp, mp_bucket, "k", upload_id, parts)
        assert code_of(exc) == (code, 400), name
    assert mp.list_objects_v2(Bucket=mp_bucket).get("Contents", []) == []
    # Unquoted ETags are accepted, as S3 does.
    fixed = [{"PartNumber": p["PartNumber"], "ETag": p["ETag"].strip('"')} for p in done]
    result = complete(mp, mp_bucket, "k", upload_id, fixed)
    assert result["ETag"] == multipart_etag([b"a" * PART, b"b" * PART])


def test_empty_part_list_is_malformed(mp, mp_bucket: str) -> None:
    upload_id = mp.create_multipart_upload(Bucket=mp_bucket, Key="k")["UploadId"]
    with pytest.raises(ClientError) as exc:
        complete(mp, mp_bucket, "k", upload_id, [])
    assert code_of(exc) == ("MalformedXML", 400)


@pytest.mark.parametrize("number", [0, 10001])
def test_part_number_out_of_range(mp, mp_bucket: str, number: int) -> None:
    upload_id = mp.create_multipart_upload(Bucket=mp_bucket, Key="k")["UploadId"]
    with pytest.raises(ClientError) as exc:
        mp.upload_part(Bucket=mp_bucket, Key="k", UploadId=upload_id, PartNumber=number, Body=b"x")
    assert code_of(exc) == ("InvalidArgument", 400)
    assert mp.list_parts(Bucket=mp_bucket, Key="k", UploadId=upload_id).get("Parts", []) == []


def test_no_such_upload_after_abort_and_retried_complete_answers_again(mp, mp_bucket: str) -> None:
    upload_id = mp.create_multipart_upload(Bucket=mp_bucket, Key="k")["UploadId"]
    done = upload_parts(mp, mp_bucket, "k", upload_id, [b"a" * PART])
    assert mp.abort_multipart_upload(Bucket=mp_bucket, Key="k", UploadId=upload_id)[
        "ResponseMetadata"]["HTTPStatusCode"] == 204
    attempts = {
        "upload_part": lambda: mp.upload_part(Bucket=mp_bucket, Key="k", UploadId=upload_id, PartNumber=2,
                                              Body=b"x"),
        "list_parts": lambda: mp.list_parts(Bucket=mp_bucket, Key="k", UploadId=upload_id),
        "complete": lambda: complete(mp, mp_bucket, "k", upload_id, done),
        "abort": lambda: mp.abort_multipart_upload(Bucket=mp_bucket, Key="k", UploadId=upload_id),
    }
    for name, attempt in attempts.items():
        with pytest.raises(ClientError) as exc:
            attempt()
        assert code_of(exc) == ("NoSuchUpload", 404), name
    assert mp.list_objects_v2(Bucket=mp_bucket).get("Contents", []) == []

    upload_id = mp.create_multipart_upload(Bucket=mp_bucket, Key="k")["UploadId"]
    done = upload_parts(mp, mp_bucket, "k", upload_id, [b"a" * PART])
    first = complete(mp, mp_bucket, "k", upload_id, done)
    # A retried Complete (its answer was lost) answers what the first one did, as S3 does ...
    assert complete(mp, mp_bucket, "k", upload_id, done)["ETag"] == first["ETag"]
    # ... but the upload itself is gone: no more parts, no listing, and not for another key.
    with pytest.raises(ClientError) as exc:
        complete(mp, mp_bucket, "other-key", upload_id, done)
    assert code_of(exc) == ("NoSuchUpload", 404)
    with pytest.raises(ClientError) as exc:
        mp.list_parts(Bucket=mp_bucket, Key="k", UploadId=upload_id)
    assert code_of(exc) == ("NoSuchUpload", 404)
    with pytest.raises(ClientError) as exc:
        mp.upload_part(Bucket=mp_bucket, Key="k", UploadId=upload_id, PartNumber=1, Body=b"x")
    assert code_of(exc) == ("NoSuchUpload", 404)


def test_upload_id_is_bound_to_its_key_bucket_and_tenant(mp, small_parts_node: InProcessNode,
                                                         mp_bucket: str) -> None:
    upload_id = mp.create_multipart_upload(Bucket=mp_bucket, Key="mine")["UploadId"]
    with pytest.raises(ClientError) as exc:
        mp.upload_part(Bucket=mp_bucket, Key="other-key", UploadId=upload_id, PartNumber=1, Body=b"x")
    assert code_of(exc) == ("NoSuchUpload", 404)
    with pytest.raises(ClientError) as exc:
        mp.upload_part(Bucket=mp_bucket, Key="mine", UploadId="made-up-upload-id", PartNumber=1, Body=b"x")
    assert code_of(exc) == ("NoSuchUpload", 404)
    other_bucket = "mp-other-" + secrets.token_hex(4)
    mp.create_bucket(Bucket=other_bucket)
    try:
        with pytest.raises(ClientError) as exc:
            mp.list_parts(Bucket=other_bucket, Key="mine", UploadId=upload_id)
        assert code_of(exc) == ("NoSuchUpload", 404)
    finally:
        mp.delete_bucket(Bucket=other_bucket)


def test_list_parts_paging(mp, mp_bucket: str) -> None:
    upload_id = mp.create_multipart_upload(Bucket=mp_bucket, Key="p")["UploadId"]
    done = upload_parts(mp, mp_bucket, "p", upload_id, [bytes([n]) * (PART + n) for n in range(5)])
    page = mp.list_parts(Bucket=mp_bucket, Key="p", UploadId=upload_id, MaxParts=2)
    assert [p["PartNumber"] for p in page["Parts"]] == [1, 2]
    assert page["IsTruncated"] is True
    assert page["NextPartNumberMarker"] == 2
    assert page["MaxParts"] == 2
    assert page["UploadId"] == upload_id
    assert page["Key"] == "p"
    page = mp.list_parts(Bucket=mp_bucket, Key="p", UploadId=upload_id, PartNumberMarker=2, MaxParts=10)
    assert [p["PartNumber"] for p in page["Parts"]] == [3, 4, 5]
    assert page["IsTruncated"] is False
    paged = mp.get_paginator("list_parts").paginate(Bucket=mp_bucket, Key="p", UploadId=upload_id,
                                                     PaginationConfig={"PageSize": 2})
    parts = [p for pg in paged for p in pg.get("Parts", [])]
    assert [(p["PartNumber"], p["ETag"], p["Size"]) for p in parts] == [
        (d["PartNumber"], d["ETag"], PART + d["PartNumber"] - 1) for d in done
    ]


def test_list_multipart_uploads(mp, mp_bucket: str) -> None:
    ids = {k: mp.create_multipart_upload(Bucket=mp_bucket, Key=k)["UploadId"] for k in ("b/2", "a/1", "b/3")}
    listed = mp.list_multipart_uploads(Bucket=mp_bucket)
    expected = [(k, ids[k]) for k in ("a/1", "b/2", "b/3")]
    assert [(u["Key"], u["UploadId"]) for u in listed["Uploads"]] == expected
    prefixed = mp.list_multipart_uploads(Bucket=mp_bucket, Prefix="b/")
    assert [u["Key"] for u in prefixed["Uploads"]] == ["b/2", "b/3"]
    mp.abort_multipart_upload(Bucket=mp_bucket, Key="b/2", UploadId=ids["b/2"])
    done = upload_parts(mp, mp_bucket, "a/1", ids["a/1"], [b"x" * PART])
    complete(mp, mp_bucket, "a/1", ids["a/1"], done)
    assert [u["Key"] for u in mp.list_multipart_uploads(Bucket=mp_bucket).get("Uploads", [])] == ["b/3"]


def test_conditional_complete(mp, mp_bucket: str) -> None:
    existing = mp.put_object(Bucket=mp_bucket, Key="taken", Body=b"first writer")["ETag"]
    upload_id = mp.create_multipart_upload(Bucket=mp_bucket, Key="taken")["UploadId"]
    done = upload_parts(mp, mp_bucket, "taken", upload_id, [b"z" * PART])
    with pytest.raises(ClientError) as exc:
        complete(mp, mp_bucket, "taken", upload_id, done, IfNoneMatch="*")
    assert code_of(exc) == ("PreconditionFailed", 412)
    assert mp.get_object(Bucket=mp_bucket, Key="taken")["Body"].read() == b"first writer"
    with pytest.raises(ClientError) as exc:
        complete(mp, mp_bucket, "taken", upload_id, done, IfMatch='"0123456789abcdef0123456789abcdef"')
    assert code_of(exc) == ("PreconditionFailed", 412)
    assert mp.get_object(Bucket=mp_bucket, Key="taken")["Body"].read() == b"first writer"
    complete(mp, mp_bucket, "taken", upload_id, done, IfMatch=existing)
    assert mp.get_object(Bucket=mp_bucket, Key="taken")["Body"].read() == b"z" * PART

    # If-None-Match: * on a free key succeeds.
    upload_id = mp.create_multipart_upload(Bucket=mp_bucket, Key="free")["UploadId"]
    done = upload_parts(mp, mp_bucket, "free", upload_id, [b"f" * PART])
    complete(mp, mp_bucket, "free", upload_id, done, IfNoneMatch="*")
    assert mp.get_object(Bucket=mp_bucket, Key="free")["Body"].read() == b"f" * PART

    # If-Match on a missing key: NoSuchKey.
    upload_id = mp.create_multipart_upload(Bucket=mp_bucket, Key="absent")["UploadId"]
    done = upload_parts(mp, mp_bucket, "absent", upload_id, [b"f" * PART])
    with pytest.raises(ClientError) as exc:
        complete(mp, mp_bucket, "absent", upload_id, done, IfMatch=existing)
    assert code_of(exc) == ("NoSuchKey", 404)


@pytest.mark.parametrize("algorithm", ["SHA256", "SHA1", "CRC32", "CRC32C"])
def test_checksum_algorithm(mp, mp_bucket: str, algorithm: str) -> None:
    field = "Checksum" + algorithm
    parts = [secrets.token_bytes(PART), secrets.token_bytes(300)]
    created = mp.create_multipart_upload(Bucket=mp_bucket, Key="ck", ChecksumAlgorithm=algorithm)
    assert created["ChecksumAlgorithm"] == algorithm
    upload_id = created["UploadId"]
    done = []
    digests = []
    for number, data in enumerate(parts, start=1):
        response = mp.upload_part(Bucket=mp_bucket, Key="ck", UploadId=upload_id, PartNumber=number,
                                  Body=data, ChecksumAlgorithm=algorithm)
        digest = _digest(algorithm, data)
        assert response[field] == base64.b64encode(digest).decode()
        digests.append(digest)
        done.append({"PartNumber": number, "ETag": response["ETag"], field: response[field]})
    listed = mp.list_parts(Bucket=mp_bucket, Key="ck", UploadId=upload_id)
    assert listed["ChecksumAlgorithm"] == algorithm
    assert [p[field] for p in listed["Parts"]] == [d[field] for d in done]

    result = complete(mp, mp_bucket, "ck", upload_id, done)
    composite = base64.b64encode(_digest(algorithm, b"".join(digests))).decode() + "-2"
    assert result[field] == composite
    got = mp.get_object(Bucket=mp_bucket, Key="ck", ChecksumMode="ENABLED")
    assert got["Body"].read() == b"".join(parts)
    assert got[field] == composite
    assert got["ChecksumType"] == "COMPOSITE"


def _digest(algorithm: str, data: bytes) -> bytes:
    from awscrt import checksums

    if algorithm in ("SHA256", "SHA1"):
        return hashlib.new(algorithm.lower(), data).digest()
    crc = checksums.crc32(data) if algorithm == "CRC32" else checksums.crc32c(data)
    return crc.to_bytes(4, "big")


def test_part_with_wrong_checksum_is_rejected(mp, mp_bucket: str) -> None:
    upload_id = mp.create_multipart_upload(Bucket=mp_bucket, Key="bad")["UploadId"]
    bogus = base64.b64encode(hashlib.sha256(b"not this").digest()).decode()
    with pytest.raises(ClientError) as exc:
        mp.upload_part(Bucket=mp_bucket, Key="bad", UploadId=upload_id, PartNumber=1, Body=b"q" * PART,
                       ChecksumSHA256=bogus)
    assert code_of(exc) == ("BadDigest", 400)
    wrong_md5 = base64.b64encode(hashlib.md5(b"not this").digest()).decode()
    with pytest.raises(ClientError) as exc:
        mp.upload_part(Bucket=mp_bucket, Key="bad", UploadId=upload_id, PartNumber=1, Body=b"q" * PART,
                       ContentMD5=wrong_md5)
    assert code_of(exc) == ("BadDigest", 400)
    assert mp.list_parts(Bucket=mp_bucket, Key="bad", UploadId=upload_id).get("Parts", []) == []


def test_multipart_ttl(mp, mp_bucket: str) -> None:
    def add_ttl(request, **_: object) -> None:
        request.headers["x-ctx-ttl"] = "77"

    mp.meta.events.register("before-sign.s3.CreateMultipartUpload", add_ttl, unique_id="mp-ttl")
    try:
        upload_id = mp.create_multipart_upload(Bucket=mp_bucket, Key="ttl")["UploadId"]
    finally:
        mp.meta.events.unregister("before-sign.s3.CreateMultipartUpload", unique_id="mp-ttl")
    done = upload_parts(mp, mp_bucket, "ttl", upload_id, [b"t" * PART])
    result = complete(mp, mp_bucket, "ttl", upload_id, done)
    expires = float(result["ResponseMetadata"]["HTTPHeaders"]["x-ctx-expires-at"])
    assert expires == pytest.approx(time.time() + 77, abs=5)
    with pytest.raises(ClientError) as exc:
        mp.create_multipart_upload(Bucket=mp_bucket, Key="ttl", Metadata={"ctx-ttl": "-1"})
    assert code_of(exc) == ("InvalidArgument", 400)


def test_upload_part_copy_not_implemented(mp, mp_bucket: str) -> None:
    mp.put_object(Bucket=mp_bucket, Key="src", Body=b"s" * PART)
    upload_id = mp.create_multipart_upload(Bucket=mp_bucket, Key="dst")["UploadId"]
    with pytest.raises(ClientError) as exc:
        mp.upload_part_copy(Bucket=mp_bucket, Key="dst", UploadId=upload_id, PartNumber=1,
                            CopySource={"Bucket": mp_bucket, "Key": "src"})
    assert code_of(exc) == ("NotImplemented", 501)


def test_abandoned_upload_is_dropped_after_upload_ttl() -> None:
    node = InProcessNode(upload_ttl=1.0, min_part_size=1024)  # on a fake clock
    client = node.client()
    client.create_bucket(Bucket="stale")
    upload_id = client.create_multipart_upload(Bucket="stale", Key="k")["UploadId"]
    upload_parts(client, "stale", "k", upload_id, [b"p" * PART])
    uploads = client.list_multipart_uploads(Bucket="stale")["Uploads"]
    assert [u["UploadId"] for u in uploads] == [upload_id]
    node.advance(0.9)
    node.housekeep()
    assert [u["UploadId"] for u in client.list_multipart_uploads(Bucket="stale")["Uploads"]] == [upload_id]
    node.advance(0.2)  # past the upload TTL: the next housekeeping pass drops it and frees its parts
    node.housekeep()
    assert client.list_multipart_uploads(Bucket="stale").get("Uploads", []) == []
    assert node.engine.budget.parts == 0
    with pytest.raises(ClientError) as exc:
        client.upload_part(Bucket="stale", Key="k", UploadId=upload_id, PartNumber=2, Body=b"x")
    assert code_of(exc) == ("NoSuchUpload", 404)
    node.close()


# ---------------------------------------------------------------------------------------------------- budget

BUDGET = 256 * KIB


@pytest.fixture
def tight() -> Iterator:
    """A node with a 256 KiB budget; its client does not retry (503s would be retried)."""
    node = like_the_session_node(memory=BUDGET, min_part_size=KIB)
    client = node.client(retries={"total_max_attempts": 1})
    client.create_bucket(Bucket="tight")
    yield client
    node.close()


def _slow_down(exc: pytest.ExceptionInfo[ClientError]) -> None:
    assert code_of(exc) == ("SlowDown", 503)
    assert int(exc.value.response["ResponseMetadata"]["HTTPHeaders"]["retry-after"]) >= 1


def test_parts_count_against_the_budget_and_abort_releases_them(tight) -> None:
    upload_id = tight.create_multipart_upload(Bucket="tight", Key="mp")["UploadId"]
    upload_parts(tight, "tight", "mp", upload_id, [secrets.token_bytes(60 * KIB) for _ in range(3)])
    # 180 KiB of parts cannot be evicted: a 100 KiB object does not fit.
    with pytest.raises(ClientError) as exc:
        tight.put_object(Bucket="tight", Key="obj", Body=io.BytesIO(secrets.token_bytes(100 * KIB)))
    _slow_down(exc)
    # Another upload's part could fit once this upload ends: retry later.
    other = tight.create_multipart_upload(Bucket="tight", Key="other")["UploadId"]
    with pytest.raises(ClientError) as exc:
        tight.upload_part(Bucket="tight", Key="other", UploadId=other, PartNumber=1,
                          Body=io.BytesIO(secrets.token_bytes(100 * KIB)))
    _slow_down(exc)
    # But this upload's own 280 KiB could never fit a 256 KiB budget: refused for good at once (it was a
    # SlowDown, retried in vain, before).
    with pytest.raises(ClientError) as exc:
        tight.upload_part(Bucket="tight", Key="mp", UploadId=upload_id, PartNumber=4,
                          Body=io.BytesIO(secrets.token_bytes(100 * KIB)))
    assert code_of(exc) == ("EntityTooLarge", 400)
    assert "could never complete" in exc.value.response["Error"]["Message"]
    tight.abort_multipart_upload(Bucket="tight", Key="other", UploadId=other)
    assert tight.list_objects_v2(Bucket="tight").get("Contents", []) == []

    tight.abort_multipart_upload(Bucket="tight", Key="mp", UploadId=upload_id)
    body = secrets.token_bytes(200 * KIB)
    tight.put_object(Bucket="tight", Key="obj", Body=body)
    assert tight.get_object(Bucket="tight", Key="obj")["Body"].read() == body


def test_stored_objects_are_evicted_for_parts(tight) -> None:
    tight.put_object(Bucket="tight", Key="old", Body=secrets.token_bytes(150 * KIB))
    upload_id = tight.create_multipart_upload(Bucket="tight", Key="mp")["UploadId"]
    upload_parts(tight, "tight", "mp", upload_id, [secrets.token_bytes(60 * KIB) for _ in range(2)])
    # The least recently used object made room for the parts.
    assert [o["Key"] for o in tight.list_objects_v2(Bucket="tight").get("Contents", [])] == []
    with pytest.raises(ClientError) as exc:
        tight.get_object(Bucket="tight", Key="old")
    assert code_of(exc) == ("NoSuchKey", 404)


def test_complete_fits_when_parts_take_most_of_the_budget(tight) -> None:
    parts = [secrets.token_bytes(60 * KIB) for _ in range(3)]  # 180 KiB of a 256 KiB budget
    upload_id = tight.create_multipart_upload(Bucket="tight", Key="mp")["UploadId"]
    done = upload_parts(tight, "tight", "mp", upload_id, parts)
    complete(tight, "tight", "mp", upload_id, done)
    assert tight.get_object(Bucket="tight", Key="mp")["Body"].read() == b"".join(parts)
    # The parts were released: the completed object is evictable for new writes.
    tight.put_object(Bucket="tight", Key="next", Body=secrets.token_bytes(150 * KIB))
    assert [o["Key"] for o in tight.list_objects_v2(Bucket="tight")["Contents"]] == ["next"]


def test_failed_writes_do_not_keep_budget(tight) -> None:
    """Each failure below reads a 10 KiB body; 30 of them are more than the budget if any byte is kept."""
    tight.put_object(Bucket="tight", Key="k", Body=b"first")
    upload_id = tight.create_multipart_upload(Bucket="tight", Key="mp")["UploadId"]
    wrong_md5 = base64.b64encode(hashlib.md5(b"nope").digest()).decode()
    for _ in range(30):
        with pytest.raises(ClientError) as exc:
            tight.put_object(Bucket="tight", Key="k", Body=secrets.token_bytes(10 * KIB), IfNoneMatch="*")
        assert code_of(exc) == ("PreconditionFailed", 412)
        with pytest.raises(ClientError) as exc:
            tight.put_object(Bucket="tight", Key="k", Body=secrets.token_bytes(10 * KIB), IfMatch='"00"')
        assert code_of(exc) == ("PreconditionFailed", 412)
        with pytest.raises(ClientError) as exc:
            tight.put_object(Bucket="tight", Key="j", Body=secrets.token_bytes(10 * KIB),
                             ContentMD5=wrong_md5)
        assert code_of(exc) == ("BadDigest", 400)
        with pytest.raises(ClientError) as exc:
            tight.upload_part(Bucket="tight", Key="mp", UploadId=upload_id, PartNumber=10001,
                              Body=secrets.token_bytes(10 * KIB))
        assert code_of(exc) == ("InvalidArgument", 400)
    tight.abort_multipart_upload(Bucket="tight", Key="mp", UploadId=upload_id)
    body = secrets.token_bytes(200 * KIB)
    tight.put_object(Bucket="tight", Key="big", Body=body)
    assert tight.get_object(Bucket="tight", Key="big")["Body"].read() == body
    assert tight.get_object(Bucket="tight", Key="k")["Body"].read() == b"first"


def test_overwrite_in_a_full_budget(tight) -> None:
    tight.put_object(Bucket="tight", Key="k", Body=secrets.token_bytes(200 * KIB))
    body = secrets.token_bytes(200 * KIB)
    tight.put_object(Bucket="tight", Key="k", Body=body)
    assert tight.get_object(Bucket="tight", Key="k")["Body"].read() == body
