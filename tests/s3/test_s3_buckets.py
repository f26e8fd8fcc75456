"""Bucket operations, tenant isolation, unsupported sub-resources, virtual-hosted-style addressing and the
shape of S3 error responses, through the real boto3 client (and a raw SigV4-signed HTTP client where boto3
cannot express the request)."""

from __future__ import annotations

import contextlib
import secrets
import urllib.parse
from collections.abc import Iterator
from xml.etree import ElementTree

import pytest
from botocore.exceptions import ClientError
from support.inprocess import InProcessNode, scratch_bucket
from support.nodes import ACCESS_KEY, OTHER_ACCESS_KEY, OTHER_SECRET_KEY, SECRET_KEY
from support.raw import raw_request, signed_request

DOMAIN = "s3.ctx.test"
NS = "{http://s3.amazonaws.com/doc/2006-03-01/}"


def code_of(exc: pytest.ExceptionInfo[ClientError]) -> tuple[str, int]:
    return exc.value.response["Error"]["Code"], exc.value.response["ResponseMetadata"]["HTTPStatusCode"]


def unique(prefix: str = "bkt") -> str:
    return f"{prefix}-{secrets.token_hex(6)}"


@contextlib.contextmanager
def raw_responses(client) -> Iterator[list]:
    """Collect the raw HTTP responses (status, headers, body bytes) of every call ``client`` makes."""
    seen: list = []

    def grab(http_response, **_: object) -> None:
        seen.append(http_response)

    uid = "ctx-raw-" + secrets.token_hex(4)
    client.meta.events.register("after-call.s3", grab, unique_id=uid)
    try:
        yield seen
    finally:
        client.meta.events.unregister("after-call.s3", unique_id=uid)


# ----------------------------------------------------------------------------------------------- bucket CRUD

INVALID_NAMES = [
    "ab",  # too short
    "a" * 64,  # too long
    "UpperCase",
    "under_score",
    "-leading-dash",
    "trailing-dash-",
    ".leading-dot",
    "trailing-dot.",
    "double..dot",
    "dot.-dash",
    "dash-.dot",
    "192.168.10.1",
    "xn--punycode",
    "sthree-reserved",
    "name-s3alias",
    "name--ol-s3",
]


@pytest.mark.parametrize("name", INVALID_NAMES)
def test_invalid_bucket_names(s3, name: str) -> None:
    with pytest.raises(ClientError) as exc:
        s3.create_bucket(Bucket=name)
    assert code_of(exc) == ("InvalidBucketName", 400)
    assert name not in [b["Name"] for b in s3.list_buckets()["Buckets"]]


@pytest.mark.parametrize("shape", ["{t}", "{t}" + "a" * 51, "with.dots.{t}", "0digits-{t}", "a-b.c-{t}"])
def test_valid_bucket_names(s3, shape: str) -> None:
    name = shape.format(t=secrets.token_hex(6))  # 3 to 63 characters
    assert 3 <= len(name) <= 63
    with scratch_bucket(s3, name=name):
        s3.head_bucket(Bucket=name)
        assert name in [b["Name"] for b in s3.list_buckets()["Buckets"]]


def test_create_head_delete_bucket(s3) -> None:
    name = unique()
    created = s3.create_bucket(Bucket=name)
    assert created["ResponseMetadata"]["HTTPStatusCode"] == 200
    assert created["Location"] == f"/{name}"
    head = s3.head_bucket(Bucket=name)
    assert head["ResponseMetadata"]["HTTPStatusCode"] == 200
    assert head["BucketRegion"] == "us-east-1"
    # Re-creating one's own bucket answers 200 (us-east-1 legacy behaviour) and keeps its contents.
    s3.put_object(Bucket=name, Key="kept", Body=b"x")
    assert s3.create_bucket(Bucket=name)["ResponseMetadata"]["HTTPStatusCode"] == 200
    assert s3.get_object(Bucket=name, Key="kept")["Body"].read() == b"x"

    with pytest.raises(ClientError) as exc:
        s3.delete_bucket(Bucket=name)
    assert code_of(exc) == ("BucketNotEmpty", 409)
    assert exc.value.response["Error"]["BucketName"] == name
    s3.delete_object(Bucket=name, Key="kept")
    assert s3.delete_bucket(Bucket=name)["ResponseMetadata"]["HTTPStatusCode"] == 204

    with pytest.raises(ClientError) as exc:
        s3.head_bucket(Bucket=name)
    assert code_of(exc) == ("404", 404)
    with pytest.raises(ClientError) as exc:
        s3.delete_bucket(Bucket=name)
    assert code_of(exc) == ("NoSuchBucket", 404)
    with pytest.raises(ClientError) as exc:
        s3.list_objects_v2(Bucket=name)
    assert code_of(exc) == ("NoSuchBucket", 404)


def test_create_bucket_with_location_configuration(s3) -> None:
    name = unique()
    s3.create_bucket(Bucket=name, CreateBucketConfiguration={"LocationConstraint": "us-west-2"})
    try:
        s3.head_bucket(Bucket=name)
    finally:
        s3.delete_bucket(Bucket=name)


def test_create_bucket_with_malformed_body(inprocess: InProcessNode, s3) -> None:
    name = unique()
    raw = signed_request(inprocess, "PUT", f"/{name}", body=b"<NotAConfiguration/>")
    assert raw.status == 400
    assert raw.xml().findtext("Code") == "MalformedXML"
    raw = signed_request(inprocess, "PUT", f"/{name}", body=b"<<<not xml")
    assert raw.status == 400
    assert raw.xml().findtext("Code") == "MalformedXML"
    assert name not in [b["Name"] for b in s3.list_buckets()["Buckets"]]


def test_get_bucket_location(s3, bucket: str) -> None:
    location = s3.get_bucket_location(Bucket=bucket)
    assert location["LocationConstraint"] in (None, "")  # us-east-1 is reported empty, as S3 does
    with pytest.raises(ClientError) as exc:
        s3.get_bucket_location(Bucket=unique("missing"))
    assert code_of(exc) == ("NoSuchBucket", 404)


def test_region_setting_is_reported() -> None:
    node = InProcessNode(region="eu-west-3")
    try:
        client = node.client()
        client.create_bucket(Bucket="regional")
        assert client.get_bucket_location(Bucket="regional")["LocationConstraint"] == "eu-west-3"
        assert client.head_bucket(Bucket="regional")["BucketRegion"] == "eu-west-3"
    finally:
        node.close()


def test_list_buckets_shows_only_own_buckets(s3, s3_other) -> None:
    mine = [unique("mine") for _ in range(3)]
    theirs = unique("theirs")
    for name in mine:
        s3.create_bucket(Bucket=name)
    s3_other.create_bucket(Bucket=theirs)
    try:
        listed = s3.list_buckets()
        names = [b["Name"] for b in listed["Buckets"]]
        assert set(mine) <= set(names)
        assert theirs not in names
        assert names == sorted(names)
        assert all(b["CreationDate"].year >= 2024 for b in listed["Buckets"])
        assert listed["Owner"]["DisplayName"] == "default"
        other_listed = s3_other.list_buckets()
        other_names = [b["Name"] for b in other_listed["Buckets"]]
        assert theirs in other_names
        assert not set(mine) & set(other_names)
        assert other_listed["Owner"]["ID"] != listed["Owner"]["ID"]
    finally:
        for name in mine:
            s3.delete_bucket(Bucket=name)
        s3_other.delete_bucket(Bucket=theirs)


def test_bucket_name_taken_by_another_tenant(s3, s3_other, bucket: str) -> None:
    with pytest.raises(ClientError) as exc:
        s3_other.create_bucket(Bucket=bucket)
    assert code_of(exc) == ("BucketAlreadyExists", 409)
    assert bucket not in [b["Name"] for b in s3_other.list_buckets()["Buckets"]]
    s3.head_bucket(Bucket=bucket)  # still ours


# ------------------------------------------------------------------------------------------------- isolation


def test_other_tenant_cannot_touch_objects(s3, s3_other, bucket: str) -> None:
    s3.put_object(Bucket=bucket, Key="secret", Body=b"tenant-default-data")
    attempts = {
        "get_object": lambda: s3_other.get_object(Bucket=bucket, Key="secret"),
        "head_object": lambda: s3_other.head_object(Bucket=bucket, Key="secret"),
        "put_object": lambda: s3_other.put_object(Bucket=bucket, Key="secret", Body=b"overwritten"),
        "put_new": lambda: s3_other.put_object(Bucket=bucket, Key="planted", Body=b"x"),
        "delete_object": lambda: s3_other.delete_object(Bucket=bucket, Key="secret"),
        "delete_objects": lambda: s3_other.delete_objects(Bucket=bucket,
                                                          Delete={"Objects": [{"Key": "secret"}]}),
        "list_v2": lambda: s3_other.list_objects_v2(Bucket=bucket),
        "list_v1": lambda: s3_other.list_objects(Bucket=bucket),
        "head_bucket": lambda: s3_other.head_bucket(Bucket=bucket),
        "delete_bucket": lambda: s3_other.delete_bucket(Bucket=bucket),
        "location": lambda: s3_other.get_bucket_location(Bucket=bucket),
        "multipart": lambda: s3_other.create_multipart_upload(Bucket=bucket, Key="mp"),
        "uploads": lambda: s3_other.list_multipart_uploads(Bucket=bucket),
        "copy_in": lambda: s3_other.copy_object(Bucket=bucket, Key="copied",
                                                CopySource={"Bucket": bucket, "Key": "secret"}),
    }
    for name, attempt in attempts.items():
        with pytest.raises(ClientError) as exc:
            attempt()
        code, status = code_of(exc)
        refused = {("AccessDenied", 403), ("NoSuchBucket", 404), ("403", 403), ("404", 404)}
        assert (code, status) in refused, name
        assert b"tenant-default-data" not in exc.value.response.get("Body", b""), name
    # Nothing changed.
    assert s3.get_object(Bucket=bucket, Key="secret")["Body"].read() == b"tenant-default-data"
    assert [o["Key"] for o in s3.list_objects_v2(Bucket=bucket)["Contents"]] == ["secret"]
    s3.head_bucket(Bucket=bucket)


def test_other_tenant_presigned_url_denied(inprocess: InProcessNode, s3, s3_other, bucket: str) -> None:
    s3.put_object(Bucket=bucket, Key="secret", Body=b"tenant-default-data")
    url = s3_other.generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": "secret"})
    parts = urllib.parse.urlsplit(url)
    response = raw_request(inprocess, "GET", f"{parts.path}?{parts.query}", {})
    assert response.status in (403, 404)
    assert b"tenant-default-data" not in response.body
    # The owner's presigned URL works (the check above is about the tenant, not presigning).
    url = s3.generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": "secret"})
    parts = urllib.parse.urlsplit(url)
    response = raw_request(inprocess, "GET", f"{parts.path}?{parts.query}", {})
    assert response.status == 200
    assert response.body == b"tenant-default-data"


# ------------------------------------------------------------------------------------------- not implemented


def test_unsupported_sub_resources_are_not_implemented(s3, bucket: str) -> None:
    s3.put_object(Bucket=bucket, Key="obj", Body=b"x")
    calls = {
        "get_bucket_acl": lambda: s3.get_bucket_acl(Bucket=bucket),
        "put_bucket_versioning": lambda: s3.put_bucket_versioning(
            Bucket=bucket, VersioningConfiguration={"Status": "Enabled"}),
        "get_bucket_versioning": lambda: s3.get_bucket_versioning(Bucket=bucket),
        "get_bucket_policy": lambda: s3.get_bucket_policy(Bucket=bucket),
        "put_bucket_policy": lambda: s3.put_bucket_policy(Bucket=bucket, Policy="{}"),
        "get_bucket_lifecycle_configuration": lambda: s3.get_bucket_lifecycle_configuration(Bucket=bucket),
        "get_bucket_cors": lambda: s3.get_bucket_cors(Bucket=bucket),
        "get_bucket_tagging": lambda: s3.get_bucket_tagging(Bucket=bucket),
        "get_object_tagging": lambda: s3.get_object_tagging(Bucket=bucket, Key="obj"),
        "put_object_tagging": lambda: s3.put_object_tagging(
            Bucket=bucket, Key="obj", Tagging={"TagSet": [{"Key": "a", "Value": "b"}]}),
        "get_object_acl": lambda: s3.get_object_acl(Bucket=bucket, Key="obj"),
        "get_object_attributes": lambda: s3.get_object_attributes(
            Bucket=bucket, Key="obj", ObjectAttributes=["ETag"]),
    }
    for name, call in calls.items():
        with pytest.raises(ClientError) as exc:
            call()
        assert code_of(exc) == ("NotImplemented", 501), name
    # None of them changed anything.
    assert s3.get_object(Bucket=bucket, Key="obj")["Body"].read() == b"x"


def test_get_with_part_number_not_implemented(s3, bucket: str) -> None:
    s3.put_object(Bucket=bucket, Key="obj", Body=b"x")
    with pytest.raises(ClientError) as exc:
        s3.get_object(Bucket=bucket, Key="obj", PartNumber=1)
    assert code_of(exc) == ("NotImplemented", 501)


def test_unknown_method_target_is_method_not_allowed(inprocess: InProcessNode, bucket: str) -> None:
    raw = signed_request(inprocess, "POST", f"/{bucket}/key")  # POST an object without ?uploads/?uploadId
    assert raw.status == 405
    root = raw.xml()
    assert root.findtext("Code") == "MethodNotAllowed"
    assert root.findtext("Method") == "POST"
    raw = signed_request(inprocess, "DELETE", "/")
    assert raw.status == 405


# --------------------------------------------------------------------------------------------- virtual hosts


def virtual_client(inprocess: InProcessNode, access: str = ACCESS_KEY, secret: str = SECRET_KEY):
    """boto3 with virtual-hosted addressing on ``s3.ctx.test`` (the Host header of each request is recorded
    in ``sent_hosts``)."""
    client = inprocess.client(access, secret, endpoint=f"http://{DOMAIN}:{inprocess.port}",
                              s3={"addressing_style": "virtual"})
    hosts: list[str] = []

    def record(request, **_: object) -> None:
        hosts.append(urllib.parse.urlsplit(request.url).netloc)

    client.meta.events.register("before-sign.s3", record)
    client.sent_hosts = hosts  # type: ignore[attr-defined]
    return client


def test_virtual_hosted_style_addresses_the_bucket(inprocess: InProcessNode, s3, bucket: str) -> None:
    v = virtual_client(inprocess)
    key = "dir/sp ace+plus@at%pct~/日本"
    put = v.put_object(Bucket=bucket, Key=key, Body=b"virtual", Metadata={"via": "vhost"})
    assert v.sent_hosts[-1] == f"{bucket}.{DOMAIN}:{inprocess.port}"
    # Path-style sees the same object under the same key.
    got = s3.get_object(Bucket=bucket, Key=key)
    assert got["Body"].read() == b"virtual"
    assert got["ETag"] == put["ETag"]
    assert got["Metadata"] == {"via": "vhost"}

    s3.put_object(Bucket=bucket, Key="second", Body=b"path")
    assert v.get_object(Bucket=bucket, Key="second")["Body"].read() == b"path"
    assert v.head_object(Bucket=bucket, Key="second")["ContentLength"] == 4
    assert [o["Key"] for o in v.list_objects_v2(Bucket=bucket)["Contents"]] == [key, "second"]
    assert v.head_bucket(Bucket=bucket)["ResponseMetadata"]["HTTPStatusCode"] == 200
    v.copy_object(Bucket=bucket, Key="third", CopySource={"Bucket": bucket, "Key": "second"})
    v.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": "second"}]})
    v.delete_object(Bucket=bucket, Key=key)
    assert [o["Key"] for o in s3.list_objects_v2(Bucket=bucket)["Contents"]] == ["third"]
    with pytest.raises(ClientError) as exc:
        v.get_object(Bucket=bucket, Key="second")
    assert code_of(exc) == ("NoSuchKey", 404)
    # ListBuckets goes to the bare domain: the service.
    assert bucket in [b["Name"] for b in v.list_buckets()["Buckets"]]
    assert v.sent_hosts[-1] == f"{DOMAIN}:{inprocess.port}"


def test_virtual_hosted_create_and_delete_bucket(inprocess: InProcessNode, s3) -> None:
    v = virtual_client(inprocess)
    name = unique("vhost")
    v.create_bucket(Bucket=name)
    assert v.sent_hosts[-1] == f"{name}.{DOMAIN}:{inprocess.port}"
    s3.head_bucket(Bucket=name)
    v.delete_bucket(Bucket=name)
    with pytest.raises(ClientError) as exc:
        s3.head_bucket(Bucket=name)
    assert code_of(exc) == ("404", 404)


def test_virtual_hosted_bucket_with_dots(inprocess: InProcessNode, s3) -> None:
    name = f"with.dots.{secrets.token_hex(4)}"
    with scratch_bucket(s3, name=name):
        s3.put_object(Bucket=name, Key="k", Body=b"dotted")
        raw = signed_request(inprocess, "GET", "/k", host=f"{name}.{DOMAIN}:{inprocess.port}")
        assert raw.status == 200
        assert raw.body == b"dotted"


def test_virtual_hosted_raw_request(inprocess: InProcessNode, s3, bucket: str) -> None:
    s3.put_object(Bucket=bucket, Key="bucket-looking/key", Body=b"raw")
    host = f"{bucket}.{DOMAIN}:{inprocess.port}"
    raw = signed_request(inprocess, "GET", "/bucket-looking/key", host=host)
    assert raw.status == 200
    assert raw.body == b"raw"
    # A Host without the port, in another case: the same bucket.
    raw = signed_request(inprocess, "GET", "/bucket-looking/key", host=f"{bucket}.{DOMAIN.upper()}")
    assert raw.status == 200
    assert raw.body == b"raw"
    listing = signed_request(inprocess, "GET", "/?list-type=2", host=host)
    assert listing.status == 200
    root = listing.xml()
    assert root.findtext(f"{NS}Name") == bucket
    assert [k.text for k in root.iter(f"{NS}Key")] == ["bucket-looking/key"]
    # The path's first segment is part of the key, not a bucket name.
    raw = signed_request(inprocess, "GET", f"/{bucket}/bucket-looking/key", host=host)
    assert raw.status == 404
    assert raw.xml().findtext("Code") == "NoSuchKey"
    # Another tenant through the virtual host is still refused.
    raw = signed_request(inprocess, "GET", "/bucket-looking/key", host=host, access=OTHER_ACCESS_KEY,
                         secret=OTHER_SECRET_KEY)
    assert raw.status in (403, 404)
    assert raw.body != b"raw"


# ----------------------------------------------------------------------------------------------- error shape


def test_error_xml_has_code_message_resource_and_request_id(s3, bucket: str) -> None:
    with raw_responses(s3) as seen, pytest.raises(ClientError) as exc:
        s3.get_object(Bucket=bucket, Key="missing/key")
    response = seen[-1]
    assert response.status_code == 404
    assert response.headers["content-type"] == "application/xml"
    root = ElementTree.fromstring(response.content)
    assert root.tag == "Error"
    assert root.findtext("Code") == "NoSuchKey"
    assert root.findtext("Message")
    assert root.findtext("Key") == "missing/key"
    assert root.findtext("Resource") == f"/{bucket}/missing/key"
    request_id = response.headers["x-amz-request-id"]
    assert request_id
    assert root.findtext("RequestId") == request_id
    assert exc.value.response["ResponseMetadata"]["RequestId"] == request_id


def test_error_codes_and_statuses(s3, bucket: str) -> None:
    missing = unique("missing")
    with raw_responses(s3) as seen, pytest.raises(ClientError) as exc:
        s3.list_objects_v2(Bucket=missing)
    assert code_of(exc) == ("NoSuchBucket", 404)
    root = ElementTree.fromstring(seen[-1].content)
    assert root.findtext("BucketName") == missing
    assert root.findtext("Resource") == f"/{missing}"
    assert root.findtext("RequestId") == seen[-1].headers["x-amz-request-id"]


def test_request_ids_are_unique(s3, bucket: str) -> None:
    ids = {s3.head_bucket(Bucket=bucket)["ResponseMetadata"]["RequestId"] for _ in range(5)}
    assert len(ids) == 5
    assert all(ids)


def test_head_errors_have_no_body(s3, bucket: str) -> None:
    with raw_responses(s3) as seen:
        with pytest.raises(ClientError) as exc:
            s3.head_object(Bucket=bucket, Key="missing")
        assert code_of(exc) == ("404", 404)
        with pytest.raises(ClientError) as exc:
            s3.head_bucket(Bucket=unique("missing"))
        assert code_of(exc) == ("404", 404)
    for response in seen:
        assert response.content == b""
        assert response.headers["x-amz-request-id"]


def test_not_modified_has_no_body(s3, bucket: str) -> None:
    etag = s3.put_object(Bucket=bucket, Key="k", Body=b"body")["ETag"]
    with raw_responses(s3) as seen, pytest.raises(ClientError) as exc:
        s3.get_object(Bucket=bucket, Key="k", IfNoneMatch=etag)
    assert code_of(exc) == ("304", 304)
    assert seen[-1].content == b""


def test_bad_credentials(inprocess: InProcessNode, bucket: str) -> None:
    unknown = inprocess.client("CTXUNKNOWNACCESSKEY1", "whatever-secret-key")
    with pytest.raises(ClientError) as exc:
        unknown.list_objects_v2(Bucket=bucket)
    assert code_of(exc) == ("InvalidAccessKeyId", 403)
    wrong_secret = inprocess.client(ACCESS_KEY, "not-the-secret-key")
    with pytest.raises(ClientError) as exc:
        wrong_secret.list_objects_v2(Bucket=bucket)
    assert code_of(exc) == ("SignatureDoesNotMatch", 403)
