"""The bulk query op (server/bulk/query.py): what a node holds of a prompt's blocks, per tier. Tokens are cut and
hashed by the node exactly as a client's namespace hashes them (every scheme, salted or not), keys and Dynamo's
u64 hashes name the same blocks, a query is not a read (no hit, miss, LRU or TTL change), the blocks per query
are capped, a tenant asks only of its own buckets, and each malformed request gets its own clear bulk error.

In-process (support.fixtures) except the tiers, which need a node with a flash tier: a real process whose
large blocks go to flash as they are written (``--disk-direct-size``), so which tier holds each block is known."""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import xxhash
from support.inprocess import InProcessNode
from support.nodes import OTHER_ACCESS_KEY, OTHER_SECRET_KEY, Node, make_client
from support.probes import Admin, start_probed_node, wait_until
from support.raw import RawResponse, bulk_frame, signed_request

from ctxstore import wire
from ctxstore.hashing import SCHEMES, Fingerprint, block_hashes

KiB = 1 << 10
BS = 4
RAM, DISK, ABSENT = wire.TIER_RAM, wire.TIER_DISK, wire.TIER_ABSENT


def call(node: Node | InProcessNode, bucket: str, body: bytes, op: str = "query", **kwargs: Any) -> RawResponse:
    return signed_request(node, "POST", wire.path(bucket, op), body, **kwargs)


def query(node: Node | InProcessNode, bucket: str, request: wire.QueryRequest, n: int) -> wire.QueryResponse:
    reply = call(node, bucket, wire.encode_query_request(request))
    assert reply.status == 200, reply.frame
    return wire.decode_query_response(wire.unpack_head(reply.body, wire.answer_schema("query", n))[0], n)


def put(node: Node | InProcessNode, bucket: str, blocks: dict[str, bytes]) -> None:
    data = list(blocks.values())
    head = wire.encode_put_head(wire.PutRequest(list(blocks), [len(d) for d in data],
                                                [xxhash.xxh3_64_intdigest(d) for d in data]))
    reply = call(node, bucket, head + b"".join(data), "put")
    assert reply.status == 200, reply.frame
    assert set(wire.decode_put_response(reply.frame, len(blocks)).results) == {"stored"}


def tokens_for(n_blocks: int, extra: int = 0) -> list[int]:
    return [secrets.randbelow(1 << 32) for _ in range(n_blocks * BS + extra)]


FP = Fingerprint(model="m", block_size=BS, tenant_salt="a secret", kv_dtype="bfloat16")


# ---------------------------------------------------------------------------- which blocks, named three ways


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("salted", [True, False], ids=["namespace", "unsalted"])
def test_tokens_are_hashed_as_the_clients_namespace_hashes_them(inprocess: InProcessNode, bucket: str,
                                                               scheme: str, salted: bool) -> None:
    tokens = tokens_for(10, extra=BS - 1)  # a trailing partial block has no key
    keys = FP.block_hashes(tokens, scheme) if salted else block_hashes(tokens, BS, scheme)
    assert len(keys) == 10
    put(inprocess, bucket, {k: b"kv" for i, k in enumerate(keys) if i != 6})  # a hole at block 6
    request = wire.QueryRequest(tokens=tokens, block_size=BS, scheme=scheme,
                                fingerprint=FP.hexdigest() if salted else "")
    answer = query(inprocess, bucket, request, 10)
    assert answer.tiers == [RAM] * 6 + [ABSENT] + [RAM] * 3
    assert (answer.prefix, answer.ram, answer.disk) == (6, 6, 0)
    assert query(inprocess, bucket, wire.QueryRequest(keys=keys), 10) == answer
    other = wire.QueryRequest(tokens=tokens, block_size=BS, scheme=scheme,
                              fingerprint=Fingerprint(model="another", block_size=BS).hexdigest())
    assert query(inprocess, bucket, other, 10).tiers == [ABSENT] * 10  # another namespace's keys


def test_hashes_name_the_dynamo_schemes_keys(inprocess: InProcessNode, bucket: str) -> None:
    tokens = tokens_for(5)
    keys = FP.block_hashes(tokens, "dynamo")
    put(inprocess, bucket, {k: b"kv" for k in keys[:3]})
    answer = query(inprocess, bucket, wire.QueryRequest(hashes=[int(k, 16) for k in keys]), 5)
    assert answer.tiers == [RAM] * 3 + [ABSENT] * 2 and answer.prefix == 3


def test_an_empty_query_holds_nothing(inprocess: InProcessNode, bucket: str) -> None:
    assert query(inprocess, bucket, wire.QueryRequest(keys=[]), 0) == wire.QueryResponse(0, 0, 0, [])
    short = wire.QueryRequest(tokens=[1, 2, 3], block_size=BS)  # less than one block
    assert query(inprocess, bucket, short, 0) == wire.QueryResponse(0, 0, 0, [])


def test_a_query_is_not_a_read(inprocess: InProcessNode, bucket: str) -> None:
    keys = [f"q/{i}" for i in range(4)]
    put(inprocess, bucket, {k: b"kv" for k in keys[:2]})
    stored = inprocess.engine.store.buckets[bucket]
    stats = stored.stats
    ticks = [stored.objects[k].tick for k in keys[:2]]
    operator = inprocess.engine.operator
    before = (stats.hits, stats.misses, operator.stats()["hits"], operator.stats()["misses"])
    assert query(inprocess, bucket, wire.QueryRequest(keys=keys), 4).prefix == 2
    assert (stats.hits, stats.misses, operator.stats()["hits"], operator.stats()["misses"]) == before
    assert [stored.objects[k].tick for k in keys[:2]] == ticks  # LRU untouched
    lookup = call(inprocess, bucket, wire.encode_keys_request("lookup", wire.KeysRequest(keys)), "lookup")
    assert lookup.status == 200 and (stats.hits, stats.misses) == (before[0] + 2, before[1] + 2)  # a lookup is a read


# ---------------------------------------------------------------------------- bounds, auth, bad requests


@pytest.fixture(scope="module")
def small() -> Iterator[InProcessNode]:
    node = InProcessNode(keep_time=True, bulk_max_keys=8)
    yield node
    node.close()


def test_blocks_per_query_are_capped_by_bulk_max_keys(small: InProcessNode) -> None:
    bucket = "small-" + secrets.token_hex(6)
    small.client().create_bucket(Bucket=bucket)
    assert query(small, bucket, wire.QueryRequest(keys=[f"k{i}" for i in range(8)]), 8).prefix == 0
    assert query(small, bucket, wire.QueryRequest(tokens=tokens_for(8, BS - 1), block_size=BS), 8).prefix == 0
    for request in (wire.QueryRequest(keys=[f"k{i}" for i in range(9)]), wire.QueryRequest(hashes=list(range(9))),
                    wire.QueryRequest(tokens=tokens_for(9), block_size=BS),
                    wire.QueryRequest(tokens=[0] * (wire.QUERY_MAX_TOKENS + 1), block_size=1 << 16)):
        reply = call(small, bucket, wire.encode_query_request(request))
        assert (reply.status, reply.code) == (400, "TooManyKeys"), reply.frame
        assert "per" in reply.frame["message"]


def test_a_tenant_asks_only_of_its_own_buckets(inprocess: InProcessNode, bucket: str) -> None:
    put(inprocess, bucket, {"mine": b"kv"})
    body = wire.encode_query_request(wire.QueryRequest(keys=["mine"]))
    reply = call(inprocess, bucket, body, access=OTHER_ACCESS_KEY, secret=OTHER_SECRET_KEY)
    assert (reply.status, reply.code) == (403, "AccessDenied")
    reply = call(inprocess, "no-such-" + secrets.token_hex(4), body)
    assert (reply.status, reply.code) == (404, "NoSuchBucket")
    reply = call(inprocess, bucket, body, secret="not-the-secret")
    assert (reply.status, reply.code) == (403, "SignatureDoesNotMatch")


BAD: dict[str, tuple[dict[str, Any], str]] = {
    "no blocks named": ({}, "InvalidArgument"),
    "keys and tokens": ({"keys": ["a"], "tokens": [1], "block_size": 1}, "InvalidArgument"),
    "tokens without a block size": ({"tokens": [1, 2]}, "InvalidArgument"),
    "a block size of 0": ({"tokens": [1, 2], "block_size": 0}, "InvalidArgument"),
    "a block size too large": ({"tokens": [1, 2], "block_size": (1 << 16) + 1}, "InvalidArgument"),
    "an unknown scheme": ({"tokens": [1, 2], "block_size": 1, "scheme": "md5"}, "InvalidArgument"),
    "a fingerprint not hex": ({"tokens": [1], "block_size": 1, "fingerprint": "z" * 32}, "InvalidArgument"),
    "a short fingerprint": ({"tokens": [1], "block_size": 1, "fingerprint": "ab"}, "InvalidArgument"),
    "a token out of range": ({"tokens": [1 << 32], "block_size": 1}, "InvalidArgument"),
    "a negative token": ({"tokens": [-1], "block_size": 1}, "InvalidArgument"),
    "a token not an integer": ({"tokens": ["a"], "block_size": 1}, "InvalidArgument"),
    "a scheme with keys": ({"keys": ["a"], "scheme": "dynamo"}, "InvalidArgument"),
    "an empty key": ({"keys": [""]}, "InvalidArgument"),
    "a hash not an integer": ({"hashes": ["a"]}, "MalformedFrame"),
    "an unknown field": ({"keys": ["a"], "pin": 1.0}, "MalformedFrame"),
    "tokens not a list": ({"tokens": 5, "block_size": 1}, "MalformedFrame"),
}


@pytest.mark.parametrize("case", BAD)
def test_a_bad_request_gets_a_clear_bulk_error(inprocess: InProcessNode, bucket: str, case: str) -> None:
    head, code = BAD[case]
    reply = call(inprocess, bucket, bulk_frame({"v": wire.VERSION, **head}))
    assert (reply.status, reply.code) == (wire.ERROR_STATUS[code], code), reply.frame
    assert reply.frame["message"]
    assert reply.headers["content-type"] == wire.CONTENT_TYPE


def test_garbage_and_payloads_are_malformed_frames(inprocess: InProcessNode, bucket: str) -> None:
    body = wire.encode_query_request(wire.QueryRequest(keys=["a"]))
    for sent in (b"\x00\x00\x00\x05garbage", body + b"payload", bulk_frame(msgpack.packb([1, 2]))):
        reply = call(inprocess, bucket, sent)
        assert (reply.status, reply.code) == (400, "MalformedFrame"), reply.frame


# ---------------------------------------------------------------------------- tiers, on a node with flash


@pytest.fixture(scope="module")
def flash_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    tmp = tmp_path_factory.mktemp("query-flash")
    node = start_probed_node(tmp, "--memory", "32MiB", "--disk", str(tmp / "flash"), "--disk-size", "64MiB",
                             "--disk-segment-size", "4MiB", "--disk-direct-size", "16KiB", "--disk-min-ttl", "1")
    yield node
    node.stop()


def test_each_block_is_answered_in_the_tier_that_holds_it(flash_node: Node) -> None:
    bucket = "tiers-" + secrets.token_hex(6)
    make_client(flash_node.endpoint).create_bucket(Bucket=bucket)
    tokens = tokens_for(12)
    keys = FP.block_hashes(tokens, "dynamo")
    # Blocks of 32 KiB go to flash as they are written; blocks of 1 KiB stay in RAM; block 9 is never saved.
    layout = [RAM, RAM, RAM, DISK, RAM, DISK, DISK, RAM, DISK, ABSENT, RAM, DISK]
    put(flash_node, bucket, {k: secrets.token_bytes(32 * KiB if t == DISK else KiB)
                             for k, t in zip(keys, layout, strict=True) if t != ABSENT})
    admin = Admin(flash_node)
    assert wait_until(lambda: admin.stats()["disk_queued_bytes"] == 0)
    request = wire.QueryRequest(tokens=tokens, block_size=BS, scheme="dynamo", fingerprint=FP.hexdigest())
    answer = query(flash_node, bucket, request, 12)
    assert answer.tiers == layout
    assert (answer.prefix, answer.ram, answer.disk) == (9, 3, 4)
    hits = admin.stats()["hits"]
    lookup = call(flash_node, bucket, wire.encode_keys_request("lookup", wire.KeysRequest(keys)), "lookup")
    assert wire.decode_lookup_response(lookup.frame, 12).tiers == layout  # lookup, the read, agrees
    assert admin.stats()["hits"] == hits + 11

    # What the node drops leaves the answer: a delete on flash, one in RAM.
    deleted = call(flash_node, bucket, wire.encode_keys_request("delete", wire.KeysRequest([keys[5], keys[1]])),
                   "delete")
    assert deleted.status == 200
    answer = query(flash_node, bucket, request, 12)
    assert answer.tiers == [RAM, ABSENT, RAM, DISK, RAM, ABSENT, DISK, RAM, DISK, ABSENT, RAM, DISK]
    assert (answer.prefix, answer.ram, answer.disk) == (1, 1, 0)


def test_expired_blocks_leave_the_answer_in_both_tiers(flash_node: Node) -> None:
    bucket = "expiry-" + secrets.token_hex(6)
    make_client(flash_node.endpoint).create_bucket(Bucket=bucket)
    keys = [f"e/{i}" for i in range(4)]
    data = [secrets.token_bytes(32 * KiB if i % 2 else KiB) for i in range(4)]
    head = wire.encode_put_head(wire.PutRequest(keys, [len(d) for d in data],
                                                [xxhash.xxh3_64_intdigest(d) for d in data], ttl=4.0))
    assert call(flash_node, bucket, head + b"".join(data), "put").status == 200
    assert wait_until(lambda: Admin(flash_node).stats()["disk_queued_bytes"] == 0)
    assert query(flash_node, bucket, wire.QueryRequest(keys=keys), 4).tiers == [RAM, DISK, RAM, DISK]
    # Expired (4 s after the put): gone from the answer in both tiers, without a read that would reap them.
    assert wait_until(lambda: query(flash_node, bucket, wire.QueryRequest(keys=keys), 4).tiers == [ABSENT] * 4,
                      timeout=10, interval=0.2)


def test_round_trips_of_the_query_messages() -> None:
    for request in (wire.QueryRequest(keys=["a", "b"]), wire.QueryRequest(hashes=[0, (1 << 64) - 1]),
                    wire.QueryRequest(tokens=[0, (1 << 32) - 1], block_size=2, scheme="dynamo",
                                      fingerprint=FP.hexdigest())):
        head = wire.unpack_head(wire.encode_query_request(request), wire.request_schema("query", 8))[0]
        assert wire.decode_query_request(head, 8) == request
    answer = wire.query_summary([RAM, DISK, RAM, ABSENT, RAM])
    assert answer == wire.QueryResponse(3, 1, 1, [RAM, DISK, RAM, ABSENT, RAM])
    head = wire.unpack_head(wire.encode_query_response(answer), wire.answer_schema("query", 5))[0]
    assert wire.decode_query_response(head, 5) == answer
    with pytest.raises(wire.WireError):
        wire.decode_query_response({**head, "prefix": 4}, 5)


def test_the_summary_is_the_prefixes_of_its_tiers() -> None:
    for n in range(6):
        for tiers in itertools.product((ABSENT, RAM, DISK), repeat=n):
            prefix = next((i for i, t in enumerate(tiers) if t == ABSENT), n)
            ram = next((i for i, t in enumerate(tiers) if t != RAM), n)
            disk = sum(1 for t in tiers[:prefix] if t == DISK)
            assert wire.query_summary(tiers) == wire.QueryResponse(prefix, ram, disk, list(tiers))
    for tiers in ([3], [True], [-1], "x", [1.0]):
        with pytest.raises(wire.WireError):
            wire.decode_query_response({"v": 1, "prefix": 0, "ram": 0, "disk": 0, "tiers": tiers}, 1)
