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


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_copying_and_zero_copy_interfaces_read_each_others_pages(node: Node, layout: str) -> None:
    """SGLang without ``interface_v1`` hands ``batch_set``/``batch_get`` flat pages (``get_data_page``); in the
    layer-first layout their order (every layer's K, then every V) is not the page buffers' (K and V per layer)."""
    import torch

    src, dst = sglang_cpu.HostPool(layout), sglang_cpu.HostPool(layout)
    src.fill_random(9)
    store, reader = backend(addr(node), src), backend(addr(node), dst)
    try:
        copied, zero_copied = keys(4, salt=f"copying-{layout}"), keys(4, salt=f"zero-copy-{layout}")
        flat = [src.get_data_page(i * PAGE) for i in range(4)]
        assert store.batch_set(copied, flat) is True
        assert reader.batch_get_v1(copied, dst.indices(0, 4)) == [True] * 4
        assert dst.page_bytes(dst.indices(0, 4)) == src.page_bytes(src.indices(0, 4))
        assert store.batch_set_v1(zero_copied, src.indices(0, 4)) == [True] * 4
        targets = [dst.get_dummy_flat_data_page() for _ in range(4)]
        got = reader.batch_get(zero_copied, targets)
        assert all(g is t for g, t in zip(got, targets))
        assert all(torch.equal(t.view(torch.int16), f.view(torch.int16)) for t, f in zip(targets, flat))  # bits
        assert reader.batch_get(zero_copied, targets[:2]) == [None] * 4  # a target short: misses, no exception
    finally:
        store.close()
        reader.close()


def test_fp8_pools_keep_their_formats_apart(node: Node) -> None:
    """SGLang's host pool holds fp8 KV as uint8 whatever the format: the backend needs the format named."""
    import torch

    from ctxstore.errors import ConfigurationError

    pool = sglang_cpu.HostPool("page_first", dtype=torch.uint8)
    with pytest.raises(ConfigurationError, match="kv_cache_dtype"):
        backend(addr(node), pool)
    e4m3, again, e5m2 = (backend(addr(node), pool, extra={"kv_cache_dtype": fmt})
                         for fmt in ("fp8_e4m3", "fp8_e4m3", "fp8_e5m2"))
    try:
        ks = keys(4, salt="fp8")
        assert e4m3.batch_set_v1(ks, pool.indices(0, 4)) == [True] * 4
        assert again.batch_exists(ks) == 4 and e5m2.batch_exists(ks) == 0
    finally:
        for store in (e4m3, again, e5m2):
            store.close()


@pytest.mark.parametrize("setting", [{"ttl": 0}, {"ttl": -5}, {"lookup_timeout": 0}, {"call_timeout": "soon"},
                                     {"bucket": "Bad_Bucket!"}, {"model": None}])
def test_configuration_mistakes_are_refused_at_start(node: Node, setting: dict[str, Any]) -> None:
    from ctxstore.errors import ConfigurationError

    extra_settings = {k: v for k, v in setting.items() if k != "model"}
    config = sglang_cpu.storage_config(extra(addr(node), **extra_settings), model=setting.get("model", "m"))
    with pytest.raises(ConfigurationError):
        StorageBackendFactory.create_backend("dynamic", config, sglang_cpu.HostPool("page_first"))


def test_unknown_settings_and_the_copying_interface_are_warned_about(node: Node,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    pool = sglang_cpu.HostPool("page_first")
    config = sglang_cpu.storage_config({**extra(addr(node), lookup_timout=2.0), "interface_v1": 0})
    with caplog.at_level("WARNING", logger="ctxstore.sglang"):
        StorageBackendFactory.create_backend("dynamic", config, pool).close()
    assert "lookup_timout" in caplog.text and "interface_v1" in caplog.text


def test_loaded_pages_live_on(node: Node) -> None:
    """A page in use has its TTL restarted by each load (SGLang backs a page up once)."""
    import boto3

    pool = sglang_cpu.HostPool("page_first")
    pool.fill_random(10)
    store = backend(addr(node), pool, extra={"ttl": 600})
    s3 = boto3.client("s3", endpoint_url=node.endpoint, aws_access_key_id=ACCESS_KEY,
                      aws_secret_access_key=SECRET_KEY, region_name="us-east-1")

    def expires_at(key: str) -> float:
        head = s3.head_object(Bucket=store.bucket, Key=store._key(key))
        return float(head["ResponseMetadata"]["HTTPHeaders"]["x-ctx-expires-at"])

    try:
        ks = keys(2, salt="live-on")
        assert store.batch_set_v1(ks, pool.indices(0, 2)) == [True] * 2
        stored = [expires_at(k) for k in ks]
        time.sleep(1.1)
        assert store.batch_get_v1(ks[:1], pool.indices(10, 1)) == [True]
        deadline = time.monotonic() + 5
        while expires_at(ks[0]) <= stored[0] and time.monotonic() < deadline:  # the touch is not waited for
            time.sleep(0.05)
        assert expires_at(ks[0]) >= stored[0] + 1.0
        assert expires_at(ks[1]) == stored[1]  # not loaded: its TTL runs on
    finally:
        store.close()


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


def test_a_hung_node_costs_only_its_own_pages(tmp_path: Path) -> None:
    """At the lookup deadline the pages of the nodes that answered count: a hung node does not empty the prefix."""
    import os
    import signal

    nodes = [start_node(tmp_path, "--memory", "128MiB") for _ in range(2)]
    hung = nodes[1]
    pool = sglang_cpu.HostPool("page_first")
    store = backend(",".join(map(addr, nodes)), pool,
                    extra={"connect_timeout": 0.3, "read_timeout": 5.0, "lookup_timeout": 0.5})
    try:
        ks = keys(32, salt="hung")
        assert store.batch_set_v1(ks, pool.indices(0, 32)) == [True] * 32
        owners = store.store.pod.group([store._key(k) for k in ks])
        on_hung = {i for node, idx in owners.items() if node.port == hung.port for i in idx}
        healthy = [k for i, k in enumerate(ks) if i not in on_hung]
        assert healthy and on_hung  # 32 pages over 2 nodes: P(all on one) = 2**-31
        os.kill(hung.proc.pid, signal.SIGSTOP)
        try:
            # A chain of the other node's pages, then one of the hung node's.
            assert store.batch_exists(healthy + [ks[min(on_hung)]]) == len(healthy)
        finally:
            os.kill(hung.proc.pid, signal.SIGCONT)
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
        store.register_mem_host_pool_v2(pool, PoolName.KV)  # SGLang registers the KV pool this way too
        store.on_host_pools_registered()
        assert store.batch_set_v1(ks, pool.indices(0, 4)) == [True] * 4
        assert store.batch_exists_v2(ks).kv_hit_pages == 4
        mamba = PoolTransfer(name=PoolName.MAMBA, keys=ks[-1:], host_indices=pool.indices(0, 1))
        assert store.batch_exists_v2(ks, [mamba]).kv_hit_pages == 0
        assert store.batch_get_v2([mamba]) == {"mamba": [False]}
        assert store.batch_set_v2([mamba]) == {"mamba": [False]}
        # A side pool registered later (SGLang's dynamic sidecars): no more hits, nothing more backed up.
        store.register_mem_host_pool_v2(pool, PoolName.DRAFT)
        assert store.batch_exists(ks) == 0 and store.batch_set_v1(ks, pool.indices(0, 4)) == [False] * 4
    finally:
        store.close()


def test_a_model_with_side_pools_is_refused_at_attach(node: Node) -> None:
    """SGLang would back up such a model's KV for L3 hits that can never come (every hit needs its side pools)."""
    from sglang.srt.mem_cache.hicache_storage import PoolName

    from ctxstore.errors import ConfigurationError

    pool = sglang_cpu.HostPool("page_first")
    store = backend(addr(node), pool)
    try:
        for name in (PoolName.KV, PoolName.MAMBA):
            store.register_mem_host_pool_v2(pool, name)
        with pytest.raises(ConfigurationError, match="mamba"):
            store.on_host_pools_registered()  # SGLang: "raising fails the attach"
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
