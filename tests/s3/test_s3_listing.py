"""ListObjects (V1), ListObjectsV2 and their paging through the real boto3 client, checked against a model:
the sorted list of keys (UTF-8 byte order), grouped by prefix and delimiter."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import unquote_plus

import botocore.handlers
import pytest
from botocore.exceptions import ClientError
from support.inprocess import InProcessNode
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

# ----------------------------------------------------------------------------------------------------- model


def utf8_sorted(keys: list[str] | set[str]) -> list[str]:
    return sorted(keys, key=lambda k: k.encode("utf-8"))


def model(keys: list[str] | set[str], prefix: str = "", delimiter: str = "",
          after: str = "") -> list[tuple[str, bool]]:
    """What a listing returns, in order: (key, False) for an object, (common prefix, True) for a group."""
    out: list[tuple[str, bool]] = []
    seen: set[str] = set()
    for key in utf8_sorted(keys):
        if not key.startswith(prefix) or key.encode() <= after.encode():
            continue
        if delimiter:
            cut = key.find(delimiter, len(prefix))
            if cut >= 0:
                group = key[: cut + len(delimiter)]
                if group not in seen:
                    seen.add(group)
                    out.append((group, True))
                continue
        out.append((key, False))
    return out


def entries(page: dict) -> list[tuple[str, bool]]:
    """A page's entries in the model's order (contents and prefixes merged by UTF-8 order)."""
    found = [(o["Key"], False) for o in page.get("Contents", [])]
    found += [(p["Prefix"], True) for p in page.get("CommonPrefixes", [])]
    return sorted(found, key=lambda e: e[0].encode())


def fill(client, bucket: str, keys: list[str] | set[str]) -> None:
    keys = list(keys)
    if len(keys) <= 8:
        for key in keys:
            client.put_object(Bucket=bucket, Key=key, Body=key.encode())
        return
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda k: client.put_object(Bucket=bucket, Key=k, Body=k.encode()), keys))


@pytest.fixture(scope="module")
def s3_pool(inprocess: InProcessNode):
    """A client with room for concurrent puts."""
    return inprocess.client(max_pool_connections=16)


@pytest.fixture
def scratch(s3_pool) -> Iterator[str]:
    """A fresh bucket, emptied and deleted afterwards (also usable inside hypothesis examples)."""
    name = new_bucket(s3_pool)
    yield name
    drop_bucket(s3_pool, name)


def new_bucket(client) -> str:
    name = "list-" + secrets.token_hex(6)
    client.create_bucket(Bucket=name)
    return name


def drop_bucket(client, name: str) -> None:
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=name):
        objects = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if objects:
            client.delete_objects(Bucket=name, Delete={"Objects": objects, "Quiet": True})
    client.delete_bucket(Bucket=name)


def raw_client(inprocess: InProcessNode):
    """A boto3 client that does not add EncodingType=url to listings (botocore does so by default)."""
    client = inprocess.client()
    for op in ("ListObjects", "ListObjectsV2", "ListObjectVersions"):
        client.meta.events.unregister(f"before-parameter-build.s3.{op}",
                                      botocore.handlers.set_list_objects_encoding_type_url)
    return client


# -------------------------------------------------------------------------------------------------- examples

TREE = [
    "a", "a/b", "a/b/c", "a/c", "a+b", "a b", "a-z", "b/1", "b/2", "b/3/x", "c", "ä/x", "日本/語", "😀",
    "\uffee",
]


def test_delimiter_groups_and_prefix(s3_pool, scratch: str) -> None:
    fill(s3_pool, scratch, TREE)
    page = s3_pool.list_objects_v2(Bucket=scratch, Delimiter="/")
    assert [o["Key"] for o in page["Contents"]] == ["a", "a b", "a+b", "a-z", "c", "\uffee", "😀"]
    assert [p["Prefix"] for p in page["CommonPrefixes"]] == ["a/", "b/", "ä/", "日本/"]
    assert page["KeyCount"] == 11
    assert page["Delimiter"] == "/"
    assert page["IsTruncated"] is False

    page = s3_pool.list_objects_v2(Bucket=scratch, Prefix="a/", Delimiter="/")
    assert [o["Key"] for o in page["Contents"]] == ["a/b", "a/c"]
    assert [p["Prefix"] for p in page["CommonPrefixes"]] == ["a/b/"]
    assert page["Prefix"] == "a/"

    page = s3_pool.list_objects_v2(Bucket=scratch, Prefix="b")
    assert [o["Key"] for o in page["Contents"]] == ["b/1", "b/2", "b/3/x"]
    assert "CommonPrefixes" not in page

    # A multi-character delimiter, and one that never occurs.
    page = s3_pool.list_objects_v2(Bucket=scratch, Delimiter="/b")
    assert [p["Prefix"] for p in page["CommonPrefixes"]] == ["a/b"]
    page = s3_pool.list_objects_v2(Bucket=scratch, Delimiter="#")
    assert [o["Key"] for o in page["Contents"]] == utf8_sorted(TREE)

    # Object sizes and ETags are reported.
    for obj in s3_pool.list_objects_v2(Bucket=scratch)["Contents"]:
        assert obj["Size"] == len(obj["Key"].encode())
        assert obj["ETag"].startswith('"') and len(obj["ETag"]) == 34
        assert obj["StorageClass"] == "STANDARD"


def test_max_keys_counts_keys_and_common_prefixes(s3_pool, scratch: str) -> None:
    fill(s3_pool, scratch, TREE)
    expected = model(TREE, delimiter="/")
    page = s3_pool.list_objects_v2(Bucket=scratch, Delimiter="/", MaxKeys=3)
    assert entries(page) == expected[:3]
    assert page["KeyCount"] == 3
    assert page["MaxKeys"] == 3
    assert page["IsTruncated"] is True
    rest = s3_pool.list_objects_v2(Bucket=scratch, Delimiter="/", MaxKeys=100,
                                   ContinuationToken=page["NextContinuationToken"])
    assert rest["ContinuationToken"] == page["NextContinuationToken"]
    assert entries(rest) == expected[3:]
    assert rest["IsTruncated"] is False
    assert "NextContinuationToken" not in rest

    v1 = s3_pool.list_objects(Bucket=scratch, Delimiter="/", MaxKeys=4)
    assert entries(v1) == expected[:4]
    assert v1["IsTruncated"] is True
    assert v1["NextMarker"] == expected[3][0]


def test_max_keys_zero_and_invalid(s3_pool, scratch: str) -> None:
    fill(s3_pool, scratch, ["x", "y"])
    page = s3_pool.list_objects_v2(Bucket=scratch, MaxKeys=0)
    assert page["KeyCount"] == 0
    assert "Contents" not in page
    with pytest.raises(ClientError) as exc:
        s3_pool.list_objects_v2(Bucket=scratch, MaxKeys=-1)
    assert exc.value.response["Error"]["Code"] == "InvalidArgument"
    assert exc.value.response["ResponseMetadata"]["HTTPStatusCode"] == 400


def test_start_after(s3_pool, scratch: str) -> None:
    fill(s3_pool, scratch, TREE)
    for after in ("a", "a b", "a/b/c", "b", "zzz", "日", "", "\U0010ffff"):
        page = s3_pool.list_objects_v2(Bucket=scratch, StartAfter=after)
        assert [o["Key"] for o in page.get("Contents", [])] == [k for k, _ in model(TREE, after=after)], after
        if after:
            assert page["StartAfter"] == after
    # A StartAfter that is a proper prefix of a common prefix keeps that group (it sorts after it).
    page = s3_pool.list_objects_v2(Bucket=scratch, StartAfter="a", Delimiter="/")
    assert [p["Prefix"] for p in page["CommonPrefixes"]] == ["a/", "b/", "ä/", "日本/"]
    assert [o["Key"] for o in page["Contents"]] == ["a b", "a+b", "a-z", "c", "\uffee", "😀"]
    # StartAfter is echoed on every page of a paginated listing, and is ignored once a token is given.
    pages = list(s3_pool.get_paginator("list_objects_v2").paginate(
        Bucket=scratch, StartAfter="a-z", PaginationConfig={"PageSize": 2}))
    listed = [o["Key"] for p in pages for o in p.get("Contents", [])]
    assert listed == [k for k, _ in model(TREE, after="a-z")]
    assert len(pages) > 2


def test_invalid_continuation_token(s3_pool, scratch: str) -> None:
    for token in ("not base64 !!", "%%%", "////"):
        with pytest.raises(ClientError) as exc:
            s3_pool.list_objects_v2(Bucket=scratch, ContinuationToken=token)
        assert exc.value.response["Error"]["Code"] == "InvalidArgument"


def test_v1_marker_always_present(s3_pool, scratch: str) -> None:
    fill(s3_pool, scratch, ["k1", "k2", "k3"])
    page = s3_pool.list_objects(Bucket=scratch)
    assert page["Marker"] == ""
    assert page["IsTruncated"] is False
    assert "NextMarker" not in page
    page = s3_pool.list_objects(Bucket=scratch, Marker="k1", MaxKeys=1)
    assert page["Marker"] == "k1"
    assert [o["Key"] for o in page["Contents"]] == ["k2"]
    assert page["IsTruncated"] is True
    # V1 always has owners.
    assert all("ID" in o["Owner"] for o in page["Contents"])


def test_url_encoding(inprocess: InProcessNode, s3_pool, scratch: str) -> None:
    keys = ["sp ace/x", "plus+/y", "pct%41", "amp&<lt>\"'", "日本/語", "tab\tend", "~tilde", "😀/"]
    fill(s3_pool, scratch, keys)
    # boto3's default: it asks for url encoding and decodes what comes back.
    page = s3_pool.list_objects_v2(Bucket=scratch)
    assert [o["Key"] for o in page["Contents"]] == utf8_sorted(keys)
    page = s3_pool.list_objects_v2(Bucket=scratch, Delimiter="/", Prefix="")
    assert [p["Prefix"] for p in page["CommonPrefixes"]] == ["plus+/", "sp ace/", "日本/", "😀/"]
    v1 = s3_pool.list_objects(Bucket=scratch, Marker="pct%41", Delimiter="/")
    assert v1["Marker"] == "pct%41"
    assert [o["Key"] for o in v1["Contents"]] == ["tab\tend", "~tilde"]
    assert [p["Prefix"] for p in v1["CommonPrefixes"]] == ["plus+/", "sp ace/", "日本/", "😀/"]

    # Asked for explicitly, boto3 leaves the values encoded: they decode to the keys.
    page = s3_pool.list_objects_v2(Bucket=scratch, EncodingType="url", StartAfter="amp&<lt>\"'")
    assert page["EncodingType"] == "url"
    encoded = [o["Key"] for o in page["Contents"]]
    assert all(" " not in k and "&" not in k and "\t" not in k and k.isascii() for k in encoded)
    assert [unquote_plus(k) for k in encoded] == utf8_sorted(keys)[1:]
    assert unquote_plus(page["StartAfter"]) == "amp&<lt>\"'"

    # Without encoding the keys travel as XML text.
    raw = raw_client(inprocess)
    page = raw.list_objects_v2(Bucket=scratch)
    assert "EncodingType" not in page
    assert [o["Key"] for o in page["Contents"]] == utf8_sorted(keys)
    page = raw.list_objects(Bucket=scratch, Delimiter="/")
    assert [p["Prefix"] for p in page["CommonPrefixes"]] == ["plus+/", "sp ace/", "日本/", "😀/"]


def test_invalid_encoding_type(inprocess: InProcessNode, scratch: str) -> None:
    raw = raw_client(inprocess)
    with pytest.raises(ClientError) as exc:
        raw.list_objects_v2(Bucket=scratch, EncodingType="base64")
    assert exc.value.response["Error"]["Code"] == "InvalidArgument"


def test_fetch_owner(s3_pool, scratch: str) -> None:
    fill(s3_pool, scratch, ["o"])
    plain = s3_pool.list_objects_v2(Bucket=scratch)["Contents"][0]
    assert "Owner" not in plain
    owned = s3_pool.list_objects_v2(Bucket=scratch, FetchOwner=True)["Contents"][0]
    assert owned["Owner"]["DisplayName"] == "default"
    assert len(owned["Owner"]["ID"]) == 64
    owners = s3_pool.list_buckets()["Owner"]
    assert owners["ID"] == owned["Owner"]["ID"]


def test_listing_more_than_1000_keys(s3_pool, scratch: str) -> None:
    keys = [f"many/{i:05d}" for i in range(1003)]
    fill(s3_pool, scratch, keys)
    page = s3_pool.list_objects_v2(Bucket=scratch, MaxKeys=5000)
    assert page["KeyCount"] == 1000
    assert page["MaxKeys"] == 1000
    assert page["IsTruncated"] is True
    assert [o["Key"] for o in page["Contents"]] == keys[:1000]
    rest = s3_pool.list_objects_v2(Bucket=scratch, ContinuationToken=page["NextContinuationToken"])
    assert [o["Key"] for o in rest["Contents"]] == keys[1000:]
    v1 = s3_pool.list_objects(Bucket=scratch)
    assert len(v1["Contents"]) == 1000
    assert v1["IsTruncated"] is True
    # Delimiter: all of them roll up into one prefix.
    grouped = s3_pool.list_objects_v2(Bucket=scratch, Delimiter="/")
    assert [p["Prefix"] for p in grouped["CommonPrefixes"]] == ["many/"]
    assert grouped["IsTruncated"] is False


def test_listing_missing_or_foreign_bucket(s3_pool, s3_other, scratch: str) -> None:
    with pytest.raises(ClientError) as exc:
        s3_pool.list_objects_v2(Bucket="missing-" + secrets.token_hex(5))
    assert exc.value.response["Error"]["Code"] == "NoSuchBucket"
    fill(s3_pool, scratch, ["private"])
    for call in (s3_other.list_objects_v2, s3_other.list_objects, s3_other.list_object_versions):
        with pytest.raises(ClientError) as exc:
            call(Bucket=scratch)
        assert exc.value.response["Error"]["Code"] in ("AccessDenied", "NoSuchBucket")
        assert "Contents" not in exc.value.response


# ------------------------------------------------------------------------------------------------ properties

ALPHABET = ["a", "b", "/", "-", " ", "+", "%", "~", "é", "日", "😀", "\uff5e", "\ue000", "0"]
key_strategy = st.text(alphabet=st.sampled_from(ALPHABET), min_size=1, max_size=6)
key_sets = st.sets(key_strategy, min_size=0, max_size=14)
delimiters = st.sampled_from(["", "/", "b", "é", "日", "/a"])

PROPERTY_SETTINGS = settings(
    max_examples=12, deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def _prefixes(keys: set[str]) -> st.SearchStrategy[str]:
    options = [""] + [k[:n] for k in sorted(keys) for n in (1, 2)]
    return st.sampled_from(options) | key_strategy


@PROPERTY_SETTINGS
@given(keys=key_sets, data=st.data())
def test_v2_pagination_matches_model(s3_pool, keys: set[str], data: st.DataObject) -> None:
    prefix = data.draw(_prefixes(keys), label="prefix")
    delimiter = data.draw(delimiters, label="delimiter")
    page_size = data.draw(st.integers(1, 5), label="page_size")
    bucket = new_bucket(s3_pool)
    try:
        fill(s3_pool, bucket, keys)
        expected = model(keys, prefix, delimiter)
        pages = list(s3_pool.get_paginator("list_objects_v2").paginate(
            Bucket=bucket, Prefix=prefix, Delimiter=delimiter, PaginationConfig={"PageSize": page_size}))
        seen: list[tuple[str, bool]] = []
        for i, page in enumerate(pages):
            got = entries(page)
            assert page["KeyCount"] == len(got) <= page_size
            last = i == len(pages) - 1
            assert page["IsTruncated"] is (not last)
            if not last:
                assert len(got) == page_size
            seen += got
        assert seen == expected
        # The whole listing in one request agrees.
        whole = s3_pool.list_objects_v2(Bucket=bucket, Prefix=prefix, Delimiter=delimiter)
        assert entries(whole) == expected
        assert whole["IsTruncated"] is False
    finally:
        drop_bucket(s3_pool, bucket)


@PROPERTY_SETTINGS
@given(keys=key_sets, data=st.data())
def test_v1_pagination_and_start_after_match_model(s3_pool, keys: set[str], data: st.DataObject) -> None:
    prefix = data.draw(_prefixes(keys), label="prefix")
    delimiter = data.draw(delimiters, label="delimiter")
    page_size = data.draw(st.integers(1, 4), label="page_size")
    after = data.draw(st.sampled_from([""] + sorted(keys)) | key_strategy, label="start_after")
    bucket = new_bucket(s3_pool)
    try:
        fill(s3_pool, bucket, keys)
        pages = list(s3_pool.get_paginator("list_objects").paginate(
            Bucket=bucket, Prefix=prefix, Delimiter=delimiter, PaginationConfig={"PageSize": page_size}))
        seen = [e for page in pages for e in entries(page)]
        assert seen == model(keys, prefix, delimiter)
        assert all(len(entries(p)) <= page_size for p in pages)
        assert all("Marker" in p for p in pages)

        # StartAfter (V2) and Marker (V1), without a delimiter: every key under the prefix after it.
        v2 = s3_pool.list_objects_v2(Bucket=bucket, Prefix=prefix, StartAfter=after)
        want = [k for k, _ in model(keys, prefix, "", after)]
        assert [o["Key"] for o in v2.get("Contents", [])] == want
        v1 = s3_pool.list_objects(Bucket=bucket, Prefix=prefix, Marker=after)
        assert [o["Key"] for o in v1.get("Contents", [])] == want
        assert v1["Marker"] == after
    finally:
        drop_bucket(s3_pool, bucket)
