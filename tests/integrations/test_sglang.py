"""SGLang HiCache L3 on ctxstore (docs/integrations.md, "SGLang HiCache"): the native backend and the stock one.

Against SGLang 0.5.23's own ``HiCacheStorage`` ABC, ``StorageBackendFactory`` and ``seaweedfs`` backend, with
a host pool laid out as SGLang's and SGLang's own ``get_page_buffer_meta`` (tests/support/sglang_cpu.py), and
real nodes. Skips, with the reason, where sglang is not installed (scripts/test installs it).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
from support import sglang_cpu
from support.faultproxy import FaultProxy, Rule, flip
from support.nodes import ACCESS_KEY, SECRET_KEY, Node, start_node

_REASON = sglang_cpu.load()
if _REASON:
    pytest.skip(_REASON, allow_module_level=True)

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

from ctxstore.hashing import block_hashes, sglang_namespace_seed  # noqa: E402
from ctxstore.integrations import sglang as sglang_module  # noqa: E402
from ctxstore.integrations.sglang import CtxStoreHiCacheStorage  # noqa: E402

pytestmark = [pytest.mark.timeout(60), pytest.mark.real_engine]
LAYOUTS = ["page_first", "layer_first"]
PAGE = 4  # tokens a page


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory):
    node = start_node(tmp_path_factory.mktemp("sglang-node"), "--memory", "256MiB", "--default-ttl", "1h")
    yield node
    node.stop()


def extra(nodes: str, **more: Any) -> dict[str, Any]:
    return {"backend_name": "ctxstore", "module_path": "ctxstore.integrations.sglang",
            "class_name": "CtxStoreHiCacheStorage", "interface_v1": 1, "nodes": nodes, "access_key": ACCESS_KEY,
            "secret_key": SECRET_KEY, **more}


def backend(nodes: str, pool: sglang_cpu.HostPool, **more: Any) -> CtxStoreHiCacheStorage:
    """Created as SGLang's cache controller does: the factory, then the host pool registered."""
    config = sglang_cpu.storage_config(extra(nodes, **more.pop("extra", {})), layout=pool.layout, **more)
    store = StorageBackendFactory.create_backend("dynamic", config, pool)
    store.register_mem_pool_host(pool)
    assert isinstance(store, CtxStoreHiCacheStorage)
    return store


def keys(n: int, salt: str | None = None, start: int = 0) -> list[str]:
    tokens = list(range(start, start + n * PAGE))
    return block_hashes(tokens, PAGE, "sglang-sha256", seed=sglang_namespace_seed(None, salt))


def addr(node: Node) -> str:
    return f"127.0.0.1:{node.port}"


def test_the_factory_loads_it_as_sglang_documents(node: Node) -> None:
    store = backend(addr(node), sglang_cpu.HostPool("page_first"))
    try:
        assert isinstance(store, HiCacheStorage)
        assert store.page_bytes == 2 * 3 * 4 * 2 * 16 * 2  # K and V x layers x tokens x heads x dim x bf16
        assert store.batch_exists(keys(4)) == 0
        assert store.get_stats() is None or hasattr(store.get_stats(), "prefetch_pgs")
    finally:
        store.close()


def test_namespace_seed_is_sglangs() -> None:
    import hashlib
    from typing import Optional

    theirs = sglang_cpu.sglang_function("srt/mem_cache/utils.py", "storage_namespace_seed",
                                        namespace={"hashlib": hashlib, "Optional": Optional})
    for args in [(None, None), ("", None), (None, ""), ("ab", "c"), ("a", "bc"), ("lora", "tenant-é")]:
        assert sglang_namespace_seed(*args) == theirs(*args)
    assert sglang_namespace_seed("lora-a", "tenant-1") == \
        "7d5eebadb5b6d118f6fb1bee6a7270aef93f903baf6224b4d5dc6579365f3491"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_pages_round_trip_byte_exact(node: Node, layout: str) -> None:
    src_pool, dst_pool = sglang_cpu.HostPool(layout), sglang_cpu.HostPool(layout)
    src_pool.fill_random(1)
    writer, reader = backend(addr(node), src_pool), backend(addr(node), dst_pool)
    try:
        ks = keys(128, salt=f"round-trip-{layout}")
        assert writer.batch_set_v1(ks, src_pool.indices(0, 128)) == [True] * 128
        assert reader.batch_exists(ks) == 128
        # into other host slots of a pool that has never seen them
        assert reader.batch_get_v1(ks, dst_pool.indices(100, 128)) == [True] * 128
        assert dst_pool.page_bytes(dst_pool.indices(100, 128)) == src_pool.page_bytes(src_pool.indices(0, 128))
        assert reader.counters["got_pages"] == 128 and writer.counters["stored_pages"] == 128
    finally:
        writer.close()
        reader.close()


def test_layouts_and_models_do_not_share_pages(node: Node) -> None:
    pool = sglang_cpu.HostPool("page_first")
    pool.fill_random(2)
    stores = [backend(addr(node), pool), backend(addr(node), sglang_cpu.HostPool("layer_first")),
              backend(addr(node), pool, model="other/model"), backend(addr(node), pool, tp_rank=1, tp_size=2)]
    try:
        ks = keys(8, salt="layouts")
        assert stores[0].batch_set_v1(ks, pool.indices(0, 8)) == [True] * 8
        assert [s.batch_exists(ks) for s in stores] == [8, 0, 0, 0]
    finally:
        for s in stores:
            s.close()


def test_batch_exists_counts_leading_hits(node: Node) -> None:
    pool = sglang_cpu.HostPool("page_first")
    store = backend(addr(node), pool)
    try:
        ks = keys(16, salt="leading")
        assert store.batch_set_v1(ks[:10], pool.indices(0, 10)) == [True] * 10
        assert store.batch_set_v1(ks[12:13], pool.indices(12, 1)) == [True]
        assert store.batch_exists(ks) == 10
        assert store.batch_exists(ks[10:]) == 0
        assert store.batch_exists(ks[:5]) == 5
        assert store.exists(ks[12]) and not store.exists(ks[11])
        assert store.batch_exists([]) == 0
    finally:
        store.close()


def test_cache_salt_tenants_are_isolated(node: Node) -> None:
    pool = sglang_cpu.HostPool("page_first")
    pool.fill_random(3)
    store, other_tenant = backend(addr(node), pool), backend(addr(node), pool, extra={"tenant": "team-b"})
    try:
        a, b = keys(8, salt="tenant-a"), keys(8, salt="tenant-b")
        assert not set(a) & set(b) and a != keys(8)  # SGLang's seeded chains: same tokens, other keys
        assert store.batch_set_v1(a, pool.indices(0, 8)) == [True] * 8
        assert store.batch_exists(a) == 8 and store.batch_exists(b) == 0
        assert other_tenant.batch_exists(a) == 0  # the backend's own tenant setting isolates as well
        assert other_tenant.batch_get_v1(a, pool.indices(50, 8)) == [False] * 8
    finally:
        store.close()
        other_tenant.close()


def test_mla_replicas_share_the_writers_pages(node: Node) -> None:
    pool = sglang_cpu.HostPool("page_first")
    pool.fill_random(4)
    writer = backend(addr(node), pool, mla=True, tp_rank=0, tp_size=2)
    replica = backend(addr(node), sglang_cpu.HostPool("page_first"), mla=True, tp_rank=1, tp_size=2)
    try:
        ks = keys(4, salt="mla")
        assert replica.batch_set_v1(ks, pool.indices(0, 4)) == [True] * 4  # not the writer: stores nothing
        assert writer.batch_exists(ks) == 0
        assert writer.batch_set_v1(ks, pool.indices(0, 4)) == [True] * 4
        assert replica.batch_exists(ks) == 4
    finally:
        writer.close()
        replica.close()


def test_a_corrupted_page_is_a_miss(node: Node) -> None:
    pool = sglang_cpu.HostPool("page_first")
    pool.fill_random(5)
    page = 768 * 2
    with FaultProxy(("127.0.0.1", node.port), [flip("payload", offset=5 * page + 100, path="/get", times=1)]) as proxy:
        store = backend(proxy.address, pool, extra={"read_timeout": 2.0})
        try:
            ks = keys(16, salt="corrupt")
            assert store.batch_set_v1(ks, pool.indices(0, 16)) == [True] * 16
            got = store.batch_get_v1(ks, pool.indices(100, 16))
            assert proxy.faults_applied("flip")
            assert got == [True] * 5 + [False] + [True] * 10
            assert store.store.metrics.counters["checksum_failures"] == 1
        finally:
            store.close()


def test_nothing_lands_in_the_pool_after_a_load_gave_up(node: Node) -> None:
    """A load past its deadline is False, and its late bytes never reach the host pool (SGLang reuses the slots)."""
    pool = sglang_cpu.HostPool("page_first")
    pool.fill_random(8)
    late = Rule("delay", seconds=2.0, path="/get", times=1)  # the answer comes whole, 2 s late
    with FaultProxy(("127.0.0.1", node.port), [late]) as proxy:
        store = backend(proxy.address, pool, extra={"read_timeout": 5.0, "call_timeout": 0.5})
        try:
            ks = keys(8, salt="late")
            assert store.batch_set_v1(ks, pool.indices(0, 8)) == [True] * 8
            pool.kv_buffer[:, 8 * 4:16 * 4].zero_()
            t0 = time.monotonic()
            assert store.batch_get_v1(ks, pool.indices(8, 8)) == [False] * 8
            assert time.monotonic() - t0 < 0.5 + 1.0
            time.sleep(2.5)  # past the delayed answer
            assert not pool.kv_buffer[:, 8 * 4:16 * 4].any()
            assert store.batch_get_v1(ks, pool.indices(8, 8)) == [True] * 8  # the rule fired once
        finally:
            store.close()


def test_a_node_killed_mid_batch_gives_misses_in_bounded_time(tmp_path: Path) -> None:
    nodes = [start_node(tmp_path, "--memory", "128MiB") for _ in range(2)]
    pool = sglang_cpu.HostPool("page_first")
    pool.fill_random(6)
    store = backend(",".join(map(addr, nodes)), pool,
                    extra={"connect_timeout": 0.3, "read_timeout": 1.0, "lookup_timeout": 1.0, "call_timeout": 3.0})
    try:
        ks = keys(128, salt="kill")
        assert store.batch_set_v1(ks, pool.indices(0, 128)) == [True] * 128
        results: list[tuple[float, int, list[bool]]] = []
        errors: list[BaseException] = []
        stop = threading.Event()

        def load() -> None:
            while not stop.is_set():
                try:
                    t0 = time.monotonic()
                    hits = store.batch_exists(ks)
                    got = store.batch_get_v1(ks, pool.indices(128, 128))
                    results.append((time.monotonic() - t0, hits, got))
                except BaseException as exc:  # noqa: BLE001
                    errors.append(exc)
                    return

        thread = threading.Thread(target=load)
        thread.start()
        time.sleep(0.3)
        nodes[1].proc.kill()  # SIGKILL, calls in flight
        nodes[1].proc.wait()
        time.sleep(2.0)
        stop.set()
        thread.join(15)
        assert not thread.is_alive() and not errors
        assert max(r[0] for r in results) < 1.0 + 3.0 + 1.0  # lookup + get deadlines, and slack
        _, hits, got = results[-1]
        assert 0 < got.count(True) < 128 and hits < 128  # the live node's pages still arrive
        assert store.batch_set_v1(ks[:4], pool.indices(0, 4)) is not None  # no exception either
    finally:
        store.close()
        for n in nodes:
            n.stop()


def test_nothing_raises_when_the_pod_is_unreachable() -> None:
    pool = sglang_cpu.HostPool("layer_first")
    store = backend("127.0.0.1:9", pool, extra={"connect_timeout": 0.2, "call_timeout": 1.0, "lookup_timeout": 0.5})
    try:
        ks = keys(8)
        t0 = time.monotonic()
        assert store.batch_exists(ks) == 0
        assert store.batch_get_v1(ks, pool.indices(0, 8)) == [False] * 8
        assert store.batch_set_v1(ks, pool.indices(0, 8)) == [False] * 8
        assert store.batch_get(ks, None) == [None] * 8 and store.set(ks[0], pool.kv_buffer[0, :4]) is False
        assert time.monotonic() - t0 < 4.0
    finally:
        store.close()
    assert store.batch_exists(ks) == 0 and store.batch_get_v1(ks, pool.indices(0, 8)) == [False] * 8  # closed


def test_hybrid_models_miss_instead_of_raising(node: Node) -> None:
    """The v2 interface (side pools of hybrid models) is not stored: misses and failures, never an exception."""
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    pool = sglang_cpu.HostPool("page_first")
    store = backend(addr(node), pool)
    try:
        ks = keys(4, salt="hybrid")
        assert store.batch_set_v1(ks, pool.indices(0, 4)) == [True] * 4
        assert store.batch_exists_v2(ks).kv_hit_pages == 4
        mamba = PoolTransfer(name=PoolName.MAMBA, keys=ks[-1:], host_indices=pool.indices(0, 1))
        assert store.batch_exists_v2(ks, [mamba]).kv_hit_pages == 0
        assert store.batch_get_v2([mamba]) == {"mamba": [False]}
        assert store.batch_set_v2([mamba]) == {"mamba": [False]}
    finally:
        store.close()


def test_clear_deletes_what_it_stored(node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    pool = sglang_cpu.HostPool("page_first")
    store = backend(addr(node), pool)
    try:
        ks = keys(8, salt="clear")
        assert store.batch_set_v1(ks, pool.indices(0, 8)) == [True] * 8
        assert store.clear() is True
        assert store.batch_exists(ks) == 0
        # What it remembers for clear() is bounded: past the bound the oldest pages are left to their TTL.
        monkeypatch.setattr(sglang_module, "MAX_TRACKED_PAGES", 5)
        assert store.batch_set_v1(ks, pool.indices(0, 8)) == [True] * 8
        assert store.clear() is True
        assert [store.exists(k) for k in ks] == [True] * 3 + [False] * 5  # the last five deleted
    finally:
        store.close()


def test_the_stock_seaweedfs_backend_works_against_a_node(node: Node) -> None:
    """The zero-code route: SGLang's own S3 backend, unchanged, on a ctxstore node (path-style, SigV4)."""
    pool, dst = sglang_cpu.HostPool("page_first"), sglang_cpu.HostPool("page_first")
    pool.fill_random(7)
    config = sglang_cpu.storage_config({"endpoint": f"http://127.0.0.1:{node.port}", "bucket": "seaweed-route",
                                        "access_key": ACCESS_KEY, "secret_key": SECRET_KEY})
    stock = StorageBackendFactory.create_backend("seaweedfs", config, pool)
    stock.register_mem_pool_host(pool)
    ks = keys(32, salt="seaweedfs")
    assert stock.batch_set_v1(ks, pool.indices(0, 32)) == [True] * 32
    assert stock.batch_exists(ks) == 32
    stock.register_mem_pool_host(dst)
    assert stock.batch_get_v1(ks, dst.indices(0, 32)) == [True] * 32
    assert dst.page_bytes(dst.indices(0, 32)) == pool.page_bytes(pool.indices(0, 32))
    stock.clear()
    assert stock.batch_exists(ks) == 0
