"""The worker's client against a real pod of three ``ctxstore serve`` processes on loopback."""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import json
import os
import random
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator

import numpy as np
import pytest

from support.nodes import ACCESS_KEY, SECRET_KEY, Node, make_client
from ctxstore import (
    AsyncContextStore,
    AsyncNamespace,
    ConfigurationError,
    ContextStore,
    Limits,
    Namespace,
    Timeouts,
    wire,
)
from ctxstore.hashing import SCHEMES

BS = 16  # tokens per block
BLOCK = 4096  # bytes per block


def blocks_for(n: int, seed: int = 0, size: int = BLOCK) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(size) for _ in range(n)]


def tokens_for(n_blocks: int, seed: int = 0, extra: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1 << 17) for _ in range(n_blocks * BS + extra)]


def new_bucket() -> str:
    return "t-" + secrets.token_hex(6)


def endpoints(pod: list[Node]) -> list[str]:
    return [n.endpoint for n in pod]


@pytest.fixture(scope="module")
def store(pod: list[Node]) -> Iterator[ContextStore]:
    with ContextStore(endpoints(pod), access_key=ACCESS_KEY, secret_key=SECRET_KEY) as s:
        yield s


@pytest.fixture
def ns(store: ContextStore) -> Namespace:
    return store.namespace(new_bucket(), model="test/model", block_size=BS)


# ---------------------------------------------------------------------------- save / restore across processes

RESTORE_SCRIPT = """
import hashlib, json, sys
from ctxstore import ContextStore
bucket, tokens = sys.argv[1], json.loads(sys.argv[2])
with ContextStore() as store:  # nodes and credentials from CTXSTORE_NODES / _ACCESS_KEY / _SECRET_KEY
    ns = store.namespace(bucket, model="test/model", block_size=16, create=False)
    result = ns.restore(tokens)
    print(json.dumps({"lookup": ns.lookup(tokens), "n_tokens": result.n_tokens,
                      "sha256": [hashlib.sha256(b).hexdigest() for b in result.blocks]}))
"""


def test_restore_in_another_process_is_byte_identical(pod: list[Node], ns: Namespace) -> None:
    tokens = tokens_for(24, seed=1, extra=5)
    blocks = blocks_for(24, seed=1)
    assert ns.save(tokens, blocks).stored == 24
    env = {**os.environ, "CTXSTORE_NODES": ",".join(f"127.0.0.1:{n.port}" for n in pod),
           "CTXSTORE_ACCESS_KEY": ACCESS_KEY, "CTXSTORE_SECRET_KEY": SECRET_KEY}
    out = subprocess.run([sys.executable, "-c", RESTORE_SCRIPT, ns.bucket, json.dumps(tokens)], env=env,
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    answer = json.loads(out.stdout)
    assert answer["lookup"] == 24 and answer["n_tokens"] == 24 * BS
    assert answer["sha256"] == [hashlib.sha256(b).hexdigest() for b in blocks]


def test_blocks_are_spread_over_every_node_by_owner(pod: list[Node], ns: Namespace) -> None:
    tokens = tokens_for(60, seed=2)
    assert ns.save(tokens, blocks_for(60, seed=2)).stored == 60
    keys = ns.block_hashes(tokens)
    placement = AsyncContextStore(endpoints(pod), access_key=ACCESS_KEY, secret_key=SECRET_KEY).pod
    held_by: dict[int, set[str]] = {}
    for node in pod:  # ask each node alone which keys it holds
        with ContextStore([node.endpoint], access_key=ACCESS_KEY, secret_key=SECRET_KEY) as single:
            sizes = single.lookup_keys(ns.bucket, keys)
        held_by[node.port] = {k for k, size in zip(keys, sizes) if size == BLOCK}
        assert all(size in (BLOCK, wire.ABSENT) for size in sizes)
    assert all(len(held) >= 5 for held in held_by.values()), {p: len(h) for p, h in held_by.items()}
    assert sorted(k for held in held_by.values() for k in held) == sorted(keys)  # each block on exactly one
    for key in keys:
        assert key in held_by[placement.owner(key).port]
    # The S3 view of one node agrees: its bucket lists exactly its share.
    s3 = make_client(pod[0].endpoint)
    listed = {o["Key"] for o in s3.list_objects_v2(Bucket=ns.bucket).get("Contents", [])}
    assert listed == held_by[pod[0].port]


# ---------------------------------------------------------------------------- lookup semantics


def test_lookup_returns_the_exact_shared_prefix(ns: Namespace) -> None:
    base = tokens_for(8, seed=3)
    assert ns.save(base, blocks_for(8, seed=3)).stored == 8
    assert ns.lookup(base) == 8
    for j in range(8):  # diverge inside block j: blocks 0..j-1 are shared
        other = list(base)
        other[j * BS + 5] += 1
        assert ns.lookup(other) == j, j
        assert ns.restore(other).n_blocks == j
    assert ns.lookup(base + [1, 2, 3]) == 8  # a partial trailing block is never a block
    assert ns.lookup(base[:5 * BS + 7]) == 5
    assert ns.lookup(base[:BS - 1]) == 0
    assert ns.lookup(base + tokens_for(3, seed=99)) == 8  # longer prompt: the cached part
    assert ns.lookup([]) == 0
    empty = ns.restore([])
    assert (empty.n_blocks, empty.n_tokens, empty.blocks) == (0, 0, [])


def test_save_of_a_prefix_only(ns: Namespace) -> None:
    tokens = tokens_for(10, seed=4)
    blocks = blocks_for(10, seed=4)
    assert ns.save(tokens, blocks[:4]).stored == 4
    assert ns.lookup(tokens) == 4
    assert ns.save(tokens, blocks[:7]).__dict__ == {"stored": 3, "existed": 4, "failed": 0}
    assert ns.lookup(tokens) == 7
    with pytest.raises(ConfigurationError):
        ns.save(tokens[:3 * BS], blocks[:4])  # more blocks than full blocks of tokens
    with pytest.raises(ConfigurationError):
        ns.save(tokens, blocks[:1], ttl=0)


def test_existing_blocks_are_skipped_first_write_wins(ns: Namespace) -> None:
    tokens = tokens_for(6, seed=5)
    first, second = blocks_for(6, seed=5), blocks_for(6, seed=6)
    assert ns.save(tokens, first).__dict__ == {"stored": 6, "existed": 0, "failed": 0}
    assert ns.save(tokens, second).__dict__ == {"stored": 0, "existed": 6, "failed": 0}
    assert [bytes(b) for b in ns.restore(tokens).blocks] == first


# ---------------------------------------------------------------------------- restore destinations

N = 6


Saved = tuple[Namespace, list[int], list[bytes]]


@pytest.fixture
def saved(ns: Namespace) -> Saved:
    tokens = tokens_for(N, seed=7, extra=3)
    blocks = blocks_for(N, seed=7)
    assert ns.save(tokens, blocks).stored == N
    return ns, tokens, blocks


def test_restore_allocates_without_out(saved: Saved) -> None:
    ns, tokens, blocks = saved
    result = ns.restore(tokens)
    assert (result.n_blocks, result.n_tokens) == (N, N * BS)
    assert [bytes(b) for b in result.blocks] == blocks


def test_restore_into_a_list_of_buffers(saved: Saved) -> None:
    ns, tokens, blocks = saved
    out = [bytearray(BLOCK + 100) for _ in range(N)]  # bigger than needed is fine
    result = ns.restore(tokens, out=out)
    assert result.n_blocks == N
    for i in range(N):
        assert bytes(out[i][:BLOCK]) == blocks[i] and bytes(out[i][BLOCK:]) == bytes(100)
        assert result.blocks[i].obj is out[i] and len(result.blocks[i]) == BLOCK  # a view, not a copy


@pytest.mark.parametrize("slot", [BLOCK, BLOCK + 512])
def test_restore_into_one_buffer_in_equal_slots(saved: Saved, slot: int) -> None:
    ns, tokens, blocks = saved
    out = bytearray(N * slot)
    assert ns.restore(tokens, out=out).n_blocks == N
    for i in range(N):
        assert bytes(out[i * slot:i * slot + BLOCK]) == blocks[i]


def test_restore_into_a_memoryview(saved: Saved) -> None:
    ns, tokens, blocks = saved
    backing = bytearray(N * BLOCK)
    result = ns.restore(tokens, out=memoryview(backing))
    assert result.n_blocks == N and bytes(backing) == b"".join(blocks)


@pytest.mark.parametrize(("dtype", "shape"), [
    (np.uint8, (N, BLOCK)), (np.float16, (N, BLOCK // 2)), (np.float16, (N, 2, 8, BLOCK // 32)),
])
def test_restore_into_numpy(saved: Saved, dtype: type, shape: tuple[int, ...]) -> None:
    ns, tokens, blocks = saved
    out = np.zeros(shape, dtype=dtype)
    assert ns.restore(tokens, out=out).n_blocks == N
    raw = out.view(np.uint8).reshape(N, BLOCK)
    for i in range(N):
        assert raw[i].tobytes() == blocks[i]
    per_block = [np.zeros(BLOCK // 2, dtype=np.float16) for _ in range(N)]
    assert ns.restore(tokens, out=per_block).n_blocks == N
    assert all(per_block[i].tobytes() == blocks[i] for i in range(N))


def test_numpy_blocks_save_and_restore(ns: Namespace) -> None:
    tokens = tokens_for(3, seed=8)
    kv = np.random.default_rng(8).standard_normal((3, 2, 64, 16)).astype(np.float16)  # 4 KiB per block
    assert ns.save(tokens, list(kv)).stored == 3
    out = np.empty_like(kv)
    assert ns.restore(tokens, out=out).n_blocks == 3
    assert np.array_equal(out, kv)


def test_blocks_too_big_for_their_buffers_are_misses_or_raise_in_strict_mode(pod: list[Node], store: ContextStore,
                                                                           saved: Saved) -> None:
    ns, tokens, blocks = saved
    before = store.metrics_snapshot()["oversized_blocks"]
    assert ns.restore(tokens, out=bytearray(N * BLOCK - 1)).n_blocks == 0  # every slot one byte short
    last_short = [bytearray(BLOCK) for _ in range(N - 1)] + [bytearray(BLOCK - 1)]
    result = ns.restore(tokens, out=last_short)  # the last block does not fit: the prefix before it does
    assert result.n_blocks == N - 1 and [bytes(b) for b in result.blocks] == blocks[:N - 1]
    assert store.metrics_snapshot()["oversized_blocks"] == before + N + 1
    with ContextStore(endpoints(pod), access_key=ACCESS_KEY, secret_key=SECRET_KEY, strict=True) as strict:
        strict_ns = strict.namespace(ns.bucket, model="test/model", block_size=BS, create=False)
        with pytest.raises(ConfigurationError, match="holds"):
            strict_ns.restore(tokens, out=last_short)


def test_too_few_or_read_only_destinations_raise(saved: Saved) -> None:
    ns, tokens, _ = saved
    with pytest.raises(ConfigurationError):
        ns.restore(tokens, out=[bytearray(BLOCK)] * (N - 1))  # too few buffers
    with pytest.raises(ConfigurationError):
        ns.restore(tokens, out=bytes(N * BLOCK))
    with pytest.raises(ConfigurationError):
        ns.restore(tokens, out=[bytes(BLOCK)] * N)
    frozen = np.zeros((N, BLOCK), dtype=np.uint8)
    frozen.flags.writeable = False
    with pytest.raises(ConfigurationError):
        ns.restore(tokens, out=frozen)
    with pytest.raises(ConfigurationError):
        ns.restore(tokens, out=np.zeros((BLOCK, N), dtype=np.uint8).T)  # not C-contiguous
    assert ns.restore(tokens, out=bytearray(N * BLOCK)).n_blocks == N  # the store is fine afterwards


# ---------------------------------------------------------------------------- keys operations, park


def test_touch_pin_unpin_delete_counts(ns: Namespace) -> None:
    tokens = tokens_for(7, seed=9)
    assert ns.save(tokens, blocks_for(5, seed=9)).stored == 5
    assert ns.touch(tokens) == 5  # 7 asked, 5 live
    assert ns.touch(tokens, ttl=120) == 5
    assert ns.pin(tokens, 30) == 5
    assert ns.unpin(tokens) == 5
    with pytest.raises(ConfigurationError):
        ns.pin(tokens, 0)

    assert ns.delete(tokens[:2 * BS]) == 2
    assert ns.lookup(tokens) == 0  # the chain now starts with a hole
    assert ns.touch(tokens) == 3
    assert ns.delete(tokens) == 3
    assert ns.delete(tokens) == 0
    assert ns.touch([]) == 0


def test_lookup_keys_can_pin_what_it_finds(store: ContextStore, ns: Namespace) -> None:
    # A lookup that a restore follows pins the blocks it finds in the same round trip.
    tokens = tokens_for(6, seed=10)
    assert ns.save(tokens, blocks_for(4, seed=10)).stored == 4
    keys = ns.block_hashes(tokens)
    assert store.keys_op(ns.bucket, "unpin", keys) == 0  # nothing pinned yet
    assert wire.prefix_length(store.lookup_keys(ns.bucket, keys)) == 4
    assert store.keys_op(ns.bucket, "unpin", keys) == 0  # a plain lookup pins nothing
    assert wire.prefix_length(store.lookup_keys(ns.bucket, keys, pin=30)) == 4
    assert store.keys_op(ns.bucket, "unpin", keys) == 4


def test_lookup_keys_fills_the_callers_list(store: ContextStore, ns: Namespace) -> None:
    # An async caller that stops waiting at its own deadline keeps, in that list, what the nodes in time answered.
    tokens = tokens_for(3, seed=11)
    assert ns.save(tokens, blocks_for(3, seed=11)).stored == 3
    keys = [*ns.block_hashes(tokens), "absent-key"]
    sizes = [wire.ABSENT] * len(keys)
    assert store.lookup_keys(ns.bucket, keys, sizes=sizes) is sizes
    assert sizes == [BLOCK] * 3 + [wire.ABSENT]
    with pytest.raises(ConfigurationError, match="3 slots for 4 keys"):
        store.lookup_keys(ns.bucket, keys, sizes=[wire.ABSENT] * 3)


def test_park_saves_with_its_ttl(pod: list[Node], ns: Namespace) -> None:
    tokens = tokens_for(4, seed=10, extra=9)
    blocks = blocks_for(4, seed=10)
    before = time.time()
    assert ns.park(tokens, blocks, ttl=600, pin=60).stored == 4
    assert ns.lookup(tokens) == 4
    placement = AsyncContextStore(endpoints(pod), access_key=ACCESS_KEY, secret_key=SECRET_KEY).pod
    key = ns.block_hashes(tokens)[0]
    owner = next(n for n in pod if n.port == placement.owner(key).port)
    head = make_client(owner.endpoint).head_object(Bucket=ns.bucket, Key=key)
    expires = float(head["ResponseMetadata"]["HTTPHeaders"]["x-ctx-expires-at"])
    assert before + 590 < expires < time.time() + 610  # the park's TTL, not the node's 1 h default
    assert ns.unpin(tokens) == 4  # it was pinned


# ---------------------------------------------------------------------------- namespaces and schemes


def test_different_fingerprints_never_see_each_others_blocks(store: ContextStore) -> None:
    bucket = new_bucket()
    tokens = tokens_for(4, seed=11)
    base = store.namespace(bucket, model="m", block_size=BS, kv_dtype="bfloat16", tp_size=2)
    assert base.save(tokens, blocks_for(4, seed=11)).stored == 4
    assert base.lookup(tokens) == 4
    variants = [
        dict(model="m2", block_size=BS, kv_dtype="bfloat16", tp_size=2),
        dict(model="m", block_size=BS, kv_dtype="float16", tp_size=2),
        dict(model="m", block_size=BS, kv_dtype="bfloat16", tp_size=2, tp_rank=1),
        dict(model="m", block_size=BS // 2, kv_dtype="bfloat16", tp_size=2),
        dict(model="m", block_size=BS, kv_dtype="bfloat16", tp_size=2, revision="v2"),
        dict(model="m", block_size=BS, kv_dtype="bfloat16", tp_size=2, lora="adapter-1"),  # an extra fact
    ]
    for fields in variants:
        other = store.namespace(bucket, create=False, **fields)  # type: ignore[arg-type]
        assert other.lookup(tokens) == 0, fields
        assert other.restore(tokens).n_blocks == 0, fields
    same = store.namespace(bucket, model="m", block_size=BS, kv_dtype="bfloat16", tp_size=2, create=False)
    assert same.lookup(tokens) == 4


@pytest.mark.parametrize("scheme", SCHEMES)
def test_every_hashing_scheme_end_to_end(store: ContextStore, scheme: str) -> None:
    ns = store.namespace(new_bucket(), model="m", block_size=BS, scheme=scheme)
    tokens = tokens_for(5, seed=12, extra=1)
    blocks = blocks_for(5, seed=12)
    keys = ns.block_hashes(tokens)
    assert len(keys) == 5 and len(set(keys)) == 5
    assert ns.save(tokens, blocks).stored == 5
    assert ns.lookup(tokens) == 5
    other = list(tokens)
    other[3 * BS] += 1
    assert ns.lookup(other) == 3
    assert [bytes(b) for b in ns.restore(tokens).blocks] == blocks
    # The scheme is part of the namespace: the same tokens under another scheme are other keys.
    for other_scheme in SCHEMES:
        if other_scheme != scheme:
            peer = store.namespace(ns.bucket, model="m", block_size=BS, scheme=other_scheme, create=False)
            assert peer.lookup(tokens) == 0


# ---------------------------------------------------------------------------- metrics


def test_metrics_snapshot(pod: list[Node]) -> None:
    with ContextStore(endpoints(pod), access_key=ACCESS_KEY, secret_key=SECRET_KEY) as fresh:
        snap = fresh.metrics_snapshot()
        for name in ("hits", "misses", "bytes_in", "bytes_out", "checksum_failures", "errors"):
            assert snap[name] == 0, name  # present from the start
        ns = fresh.namespace(new_bucket(), model="m", block_size=BS)
        tokens = tokens_for(5, seed=13)
        ns.save(tokens, blocks_for(3, seed=13))
        assert ns.lookup(tokens) == 3
        assert ns.restore(tokens).n_blocks == 3
        snap = fresh.metrics_snapshot()
        assert snap["hits"] == 6 and snap["misses"] == 4
        assert snap["bytes_out"] == 3 * BLOCK and snap["bytes_in"] == 3 * BLOCK
        assert snap["errors"] == 0 and snap["checksum_failures"] == 0
        latency = snap["latency"]
        assert isinstance(latency, dict)
        for op in ("put", "lookup", "get"):
            assert latency[op]["count"] >= 1
            assert 0 < latency[op]["p50_ms"] <= latency[op]["p99_ms"] < 10_000
        nodes = snap["nodes"]
        assert isinstance(nodes, dict)
        assert sorted(nodes) == sorted(f"127.0.0.1:{n.port}" for n in pod)
        assert all(h["up"] is True and h["failures"] == 0 for h in nodes.values())
        json.dumps(snap)  # plain data, ready for any exporter


# ---------------------------------------------------------------------------- limits splitting


def test_small_client_limits_split_calls(pod: list[Node]) -> None:
    limits = Limits(keys_per_call=3, bytes_per_call=2 * BLOCK)
    with ContextStore(endpoints(pod), access_key=ACCESS_KEY, secret_key=SECRET_KEY, limits=limits) as small:
        ns = small.namespace(new_bucket(), model="m", block_size=BS)
        tokens = tokens_for(20, seed=14)
        blocks = blocks_for(20, seed=14)
        assert ns.save(tokens, blocks).stored == 20
        assert ns.lookup(tokens) == 20
        assert [bytes(b) for b in ns.restore(tokens).blocks] == blocks
        assert ns.touch(tokens) == 20
        latency = small.metrics_snapshot()["latency"]
        assert latency["put"]["count"] >= 10  # at most two blocks per put  # type: ignore[index]


def test_a_large_restore_goes_as_several_calls_into_the_same_buffer(pod: list[Node]) -> None:
    limits = Limits(bytes_per_get=3 * BLOCK)  # 20 blocks over the pod: several gets per node
    with ContextStore(endpoints(pod), access_key=ACCESS_KEY, secret_key=SECRET_KEY, limits=limits) as split:
        ns = split.namespace(new_bucket(), model="m", block_size=BS)
        tokens = tokens_for(20, seed=15)
        blocks = blocks_for(20, seed=15)
        assert ns.save(tokens, blocks).stored == 20
        out = bytearray(20 * BLOCK)
        got = ns.restore(tokens, out=out)
        assert got.n_blocks == 20 and bytes(out) == b"".join(blocks)
        per_block = [bytearray(BLOCK) for _ in range(20)]
        assert ns.restore(tokens, out=per_block).n_blocks == 20
        assert [bytes(b) for b in per_block] == blocks
        gets = split.metrics_snapshot()["latency"]["get"]["count"]  # type: ignore[index]
        assert gets >= 2 * 20 // 3  # at most three blocks per get, twice
        assert ns.restore(tokens).n_blocks == 20  # new memory: sizes unknown, one get per node and thread
        gets_after = split.metrics_snapshot()["latency"]["get"]["count"]  # type: ignore[index]
        assert gets_after <= gets + len(pod) * split.threads


# ---------------------------------------------------------------------------- sync / async parity

_PAIRS = {"aclose": "close", "__aenter__": "__enter__", "__aexit__": "__exit__"}


def _surface(cls: type) -> dict[str, inspect.Signature]:
    out = {}
    for name, member in inspect.getmembers(cls, inspect.isfunction):
        if name.startswith("_") and name not in _PAIRS.values() and name not in _PAIRS:
            continue
        out[_PAIRS.get(name, name)] = inspect.signature(member)
    return out


@pytest.mark.parametrize(("async_cls", "sync_cls"),
                         [(AsyncContextStore, ContextStore), (AsyncNamespace, Namespace)])
def test_sync_and_async_surfaces_are_identical(async_cls: type, sync_cls: type) -> None:
    a, s = _surface(async_cls), _surface(sync_cls)
    assert sorted(a) == sorted(s)
    for name in a:
        if name in ("__exit__",):
            continue
        assert list(a[name].parameters.values()) == list(s[name].parameters.values()), name
        async_name = {v: k for k, v in _PAIRS.items()}.get(name, name)
        is_coroutine = inspect.iscoroutinefunction(getattr(async_cls, async_name))
        assert is_coroutine == (name not in ("block_hashes", "metrics_snapshot")), name


def test_sync_store_accepts_every_async_constructor_argument(pod: list[Node]) -> None:
    params = inspect.signature(AsyncContextStore.__init__).parameters
    kwargs = dict(access_key=ACCESS_KEY, secret_key=SECRET_KEY, region="us-east-1", timeouts=Timeouts(),
                  limits=Limits(), strict=False, pool_size=2, probe_interval=0.5, dns_refresh=30.0, threads=2,
                  staging="auto", staging_bytes=64 << 20, tls_ca=None)
    assert set(kwargs) | {"self", "nodes"} == set(params)
    with ContextStore(endpoints(pod), **kwargs) as s:  # type: ignore[arg-type]
        assert s.threads == 2
        assert s.namespace(new_bucket(), model="m").lookup(tokens_for(1)) == 0


def test_sync_and_async_give_the_same_results(pod: list[Node], store: ContextStore) -> None:
    bucket = new_bucket()
    tokens = tokens_for(9, seed=15, extra=2)
    blocks = blocks_for(9, seed=15)
    sync_ns = store.namespace(bucket, model="m", block_size=BS)

    async def run() -> dict[str, object]:
        async with AsyncContextStore(endpoints(pod), access_key=ACCESS_KEY, secret_key=SECRET_KEY) as astore:
            ans = await astore.namespace(bucket, model="m", block_size=BS)
            assert ans.block_hashes(tokens) == sync_ns.block_hashes(tokens)
            saved = await ans.save(tokens, blocks[:6])
            restored = await ans.restore(tokens)
            return {
                "saved": saved.__dict__, "lookup": await ans.lookup(tokens),
                "restore": [bytes(b) for b in restored.blocks], "n_tokens": restored.n_tokens,
                "touch": await ans.touch(tokens), "pin": await ans.pin(tokens, 5),
                "unpin": await ans.unpin(tokens),
                "again": (await ans.save(tokens, blocks[:6])).__dict__,
            }

    from_async = asyncio.run(run())
    restored = sync_ns.restore(tokens)
    from_sync = {
        "saved": {"stored": 6, "existed": 0, "failed": 0}, "lookup": sync_ns.lookup(tokens),
        "restore": [bytes(b) for b in restored.blocks], "n_tokens": restored.n_tokens,
        "touch": sync_ns.touch(tokens), "pin": sync_ns.pin(tokens, 5), "unpin": sync_ns.unpin(tokens),
        "again": sync_ns.save(tokens, blocks[:6]).__dict__,
    }
    assert from_async == from_sync
    assert from_sync["lookup"] == 6 and from_sync["restore"] == blocks[:6]
    assert from_sync["again"] == {"stored": 0, "existed": 6, "failed": 0}


def test_async_namespace_concurrent_calls(pod: list[Node]) -> None:
    """Many restores in flight on one event loop share the pools and each lands in its own buffers."""
    bucket = new_bucket()

    async def run() -> None:
        async with AsyncContextStore(endpoints(pod), access_key=ACCESS_KEY, secret_key=SECRET_KEY,
                                     pool_size=2) as astore:
            ans = await astore.namespace(bucket, model="m", block_size=BS)
            prompts = [tokens_for(4, seed=100 + i) for i in range(12)]
            contents = [blocks_for(4, seed=100 + i) for i in range(12)]
            await asyncio.gather(*(ans.save(p, c) for p, c in zip(prompts, contents)))
            outs = [bytearray(4 * BLOCK) for _ in prompts]
            results = await asyncio.gather(*(ans.restore(p, out=o) for p, o in zip(prompts, outs)))
            assert all(r.n_blocks == 4 for r in results)
            assert all(bytes(o) == b"".join(c) for o, c in zip(outs, contents))

    asyncio.run(run())
