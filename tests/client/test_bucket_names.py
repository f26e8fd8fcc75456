"""Bucket names: the client checks S3's naming rules itself and raises ConfigurationError naming the broken rule
before any request (a name like ``kv-a/llama3`` used to become object ``llama3`` of bucket ``kv-a``, and every
save after it failed in silence); the node checks the same table; what the client sends is percent-encoded."""

from __future__ import annotations

import asyncio
import secrets

import pytest
from support.nodes import ACCESS_KEY, SECRET_KEY, Node, free_port

from ctxstore import AsyncContextStore, ConfigurationError, ContextStore, wire
from ctxstore.buckets import RULES, broken_rule, check_bucket, path_segment
from ctxstore.buffers import Destinations

# (name, a fragment of the rule it breaks); the names of tests/s3/test_s3_buckets.py and the user's own.
BAD_NAMES = [
    ("kv-a/llama3", "only lowercase letters, digits, hyphens and dots"),
    ("kv-a?x=1", "only lowercase letters"),
    ("kv a", "only lowercase letters"),
    ("KV_Llama3", "only lowercase letters"),
    ("abc\n", "only lowercase letters"),
    ("ab", "3 to 63 characters"),
    ("a" * 64, "3 to 63 characters"),
    ("", "3 to 63 characters"),
    ("-leading-dash", "begins and ends with a letter or a digit"),
    ("trailing-dot.", "begins and ends with a letter or a digit"),
    ("double..dot", "no two dots in a row"),
    ("dot.-dash", "no dot next to a hyphen"),
    ("dash-.dot", "no dot next to a hyphen"),
    ("192.168.10.1", "not an IP address"),
    ("xn--punycode", "does not begin with xn--"),
    ("sthree-reserved", "sthree-"),
    ("name-s3alias", "does not end with -s3alias"),
    ("name--ol-s3", "--ol-s3"),
]
GOOD_NAMES = ["abc", "a" * 63, "kv-llama3-8b", "with.dots.0", "0digits-a", "a-b.c-d", "1.2.3.4a"]


@pytest.mark.parametrize(("name", "rule"), BAD_NAMES)
def test_a_bad_name_names_the_rule_it_breaks(name: str, rule: str) -> None:
    broken = broken_rule(name)
    assert broken is not None and rule in broken
    with pytest.raises(ConfigurationError, match="bad bucket name") as info:
        check_bucket(name)
    assert rule in str(info.value) and repr(name) in str(info.value)


@pytest.mark.parametrize("name", GOOD_NAMES)
def test_good_names_pass(name: str) -> None:
    assert broken_rule(name) is None and check_bucket(name) == name


def test_every_rule_says_what_a_name_must_be() -> None:
    for rule, _ in RULES:
        assert rule.split()[0] in ("is", "has", "begins", "does"), rule


def test_a_name_that_is_not_a_string_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError, match="str"):
        check_bucket(["kv"])  # type: ignore[arg-type]


def test_path_segments_are_percent_encoded() -> None:
    assert wire.path("kv-a", "get") == "/_ctx/v1/bulk/kv-a/get"
    assert wire.path("kv-a/llama3?x=1", "get") == "/_ctx/v1/bulk/kv-a%2Fllama3%3Fx%3D1/get"
    assert path_segment("a b@c") == "a%20b%40c"


@pytest.mark.parametrize(("name", "rule"), BAD_NAMES[:4])
def test_no_request_is_sent_for_a_bad_name(name: str, rule: str) -> None:
    # Nothing listens on this port: a request would be NodeUnavailable (strict), not ConfigurationError.
    with ContextStore(f"127.0.0.1:{free_port()}", access_key=ACCESS_KEY, secret_key=SECRET_KEY,
                      strict=True) as store:
        calls = [
            lambda: store.namespace(name, model="m"),
            lambda: store.namespace(name, model="m", create=False),
            lambda: store.create_bucket(name),
            lambda: store.lookup_keys(name, ["k"]),
            lambda: store.locate_keys(name, ["k"]),
            lambda: store.prefetch_keys(name, ["k"]),
            lambda: store.get_keys(name, ["k"], Destinations(None, 1)),
            lambda: store.put_keys(name, ["k"], [memoryview(b"x")]),
            lambda: store.keys_op(name, "delete", ["k"]),
        ]
        for call in calls:
            with pytest.raises(ConfigurationError, match=rule):
                call()
        assert all(h["up"] for h in store.metrics_snapshot()["nodes"].values())  # type: ignore[union-attr]


def test_the_async_client_checks_too() -> None:
    async def run() -> None:
        async with AsyncContextStore(f"127.0.0.1:{free_port()}", access_key=ACCESS_KEY, secret_key=SECRET_KEY,
                                     strict=True) as store:
            with pytest.raises(ConfigurationError, match="only lowercase"):
                await store.namespace("kv-a/llama3", model="m")
            with pytest.raises(ConfigurationError, match="only lowercase"):
                await store.get_keys_staged("KV_A", ["k"], bytearray(1))

    asyncio.run(run())


def test_a_slash_no_longer_writes_an_object_into_another_bucket(server: Node, s3) -> None:
    outer = "kv-" + secrets.token_hex(4)
    s3.create_bucket(Bucket=outer)
    try:
        with ContextStore(server.endpoint, access_key=ACCESS_KEY, secret_key=SECRET_KEY) as store:
            with pytest.raises(ConfigurationError, match="only lowercase letters"):
                store.namespace(f"{outer}/llama3", model="m")
            ns = store.namespace(outer, model="m", block_size=4)  # the same bucket by a valid name works
            assert ns.save(list(range(8)), [b"a" * 64, b"b" * 64]).stored == 2
            assert ns.lookup(list(range(8))) == 2
        keys = [o["Key"] for o in s3.list_objects_v2(Bucket=outer).get("Contents", [])]
        assert "llama3" not in keys and len(keys) == 2
    finally:
        for o in s3.list_objects_v2(Bucket=outer).get("Contents", []):
            s3.delete_object(Bucket=outer, Key=o["Key"])
        s3.delete_bucket(Bucket=outer)


def test_the_node_refuses_what_the_client_refuses(server: Node, s3) -> None:
    # The node's CreateBucket checks the same table (boto3 validates some names itself: only names it lets through).
    from botocore.exceptions import ClientError

    for name in ("dot.-dash", "192.168.10.1", "xn--punycode", "name--ol-s3"):
        with pytest.raises(ClientError) as info:
            s3.create_bucket(Bucket=name)
        assert info.value.response["Error"]["Code"] == "InvalidBucketName"
