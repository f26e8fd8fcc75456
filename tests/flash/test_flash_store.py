"""The flash store on real files: round trips, restarts, deletes, TTL, listing, the manifest, refusals."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest
import xxhash
from flash_support import Clock, MiB, append_all, check_payload, make_payload, record, run, small_store

from ctxstore_server.flash import (
    ALREADY_EXPIRED,
    QUEUE_FULL,
    SUPERSEDED,
    TOO_LARGE,
    FlashRecord,
    FlashStore,
    Removal,
)
from ctxstore_server.flash.store import LIST_CACHE_IDLE


def test_many_records_round_trip_byte_for_byte_and_after_a_restart(tmp_path: Path) -> None:
    sizes = [1, 100, 4095, 4096, 4097, 65536, 300_000, 700_000]  # 700 KB spans several write buffers
    keys = [f"k/{i:04d}@%x" for i in range(240)]  # 32 MB: no eviction in 64 MiB
    recs = [record(k, 0, sizes[i % len(sizes)]) for i, k in enumerate(keys)]
    recs[5] = FlashRecord("b", keys[5], memoryview(bytearray(make_payload(keys[5], 0, 5000))), time.time() + 60,
                          time.time(), b"")  # a memoryview payload, no metadata

    async def first() -> None:
        store = small_store(tmp_path, 64 * MiB)
        await store.open()
        results = await append_all(store, recs)
        assert len(results) == len(recs) and all(r.stored for r in results)
        await _check_all(store, keys, recs)
        assert store.stats().blocks == len(keys)
        await store.close()

    async def second() -> None:
        store = small_store(tmp_path, 64 * MiB)
        report = await store.open()
        assert report.blocks == len(keys) and report.discarded_records == 0
        assert report.bytes == sum(len(r.payload) for r in recs)
        await _check_all(store, keys, recs)
        await store.close()

    run(first())
    run(second())


async def _check_all(store: FlashStore, keys: list[str], recs: list[FlashRecord]) -> None:
    blocks = await store.read_many("b", keys)
    for key, rec, block in zip(keys, recs, blocks):
        assert block is not None, key
        assert bytes(block.payload) == bytes(rec.payload)
        assert block.key == key and block.metadata == rec.metadata
        assert block.xxh3 == xxhash.xxh3_64_intdigest(bytes(rec.payload))
        assert block.created == rec.created
    metas = await store.read_meta_many("b", keys[:50])
    assert [m.size if m else None for m in metas] == [len(r.payload) for r in recs[:50]]
    entries = store.lookup_many("b", keys)
    assert all(e is not None and e.size == len(r.payload) for e, r in zip(entries, recs))
    present, sizes = store.present_many("b", keys + ["absent"])
    assert present.tolist() == [True] * len(keys) + [False]
    assert sizes[:len(keys)].tolist() == [len(r.payload) for r in recs]


def test_lookup_of_absent_keys_and_other_buckets(tmp_path: Path) -> None:
    async def go() -> None:
        store = small_store(tmp_path)
        await store.open()
        await append_all(store, [record("a", bucket="one"), record("a", 1, bucket="two")])
        assert store.lookup("one", "b") is None
        assert store.lookup("three", "a") is None
        one, two = await store.read_many("one", ["a"]), await store.read_many("two", ["a"])
        assert check_payload("a", one[0].payload) == 0 and check_payload("a", two[0].payload) == 1  # type: ignore
        assert await store.read("one", "zzz") is None
        await store.close()

    run(go())


def test_delete_replace_and_drop_bucket_survive_a_restart(tmp_path: Path) -> None:
    async def first() -> None:
        store = small_store(tmp_path)
        await store.open()
        await append_all(store, [record(f"k{i}") for i in range(50)] + [record(f"x{i}", bucket="gone")
                                                                          for i in range(20)])
        assert store.delete("b", "k1") and not store.delete("b", "k1")
        assert store.delete_many("b", ["k2", "k3", "nope"]) == 2
        await append_all(store, [record("k4", version=7)])  # replaces version 0
        assert store.drop_bucket("gone") == 20
        assert await store.read("b", "k1") is None and await store.read("gone", "x0") is None
        assert check_payload("k4", (await store.read("b", "k4")).payload) == 7  # type: ignore[union-attr]
        await append_all(store, [record("x5", version=9, bucket="gone")])  # the bucket again, after the drop
        await store.close()

    async def second() -> None:
        store = small_store(tmp_path)
        report = await store.open()
        assert report.blocks == 50 - 3 + 1
        blocks = await store.read_many("b", [f"k{i}" for i in range(50)])
        assert [i for i, b in enumerate(blocks) if b is None] == [1, 2, 3]
        assert check_payload("k4", blocks[4].payload) == 7  # type: ignore[union-attr]
        gone = await store.read_many("gone", [f"x{i}" for i in range(20)])
        assert [i for i, b in enumerate(gone) if b is not None] == [5]
        assert check_payload("x5", gone[5].payload) == 9  # type: ignore[union-attr]
        await store.close()

    run(first())
    run(second())


def test_a_write_overtaken_by_a_delete_is_superseded_and_stays_dead_after_a_restart(tmp_path: Path) -> None:
    async def first() -> None:
        store = small_store(tmp_path)
        await store.open()
        results: list = []
        assert store.append([record("k", 1), record("j", 1)], results.extend) == [None, None]
        assert store.delete("b", "k")  # before the write completed
        await store.flush()
        by_key = {r.record.key: r for r in results}
        assert not by_key["k"].stored and by_key["k"].reason == SUPERSEDED
        assert by_key["j"].stored
        assert await store.read("b", "k") is None
        await store.close()

    async def second() -> None:
        store = small_store(tmp_path)
        await store.open()
        assert await store.read("b", "k") is None and await store.read("b", "j") is not None
        await store.close()

    run(first())
    run(second())


def test_ttl_expired_blocks_are_misses_and_gone_after_a_restart(tmp_path: Path) -> None:
    clock = Clock()
    t0 = clock.t
    removed: list[Removal] = []

    async def first() -> None:
        store = small_store(tmp_path, clock=clock)
        await store.open()
        await append_all(store, [record(f"s{i}", ttl=100, now=t0) for i in range(30)]
                         + [record(f"l{i}", ttl=10_000, now=t0) for i in range(30)])
        clock.t = t0 + 101
        assert store.lookup("b", "s0") is None and await store.read("b", "s0") is None
        assert store.lookup("b", "l0") is not None
        assert store.stats().blocks == 30
        await store.close()

    async def second() -> None:
        clock.t = t0 + 200  # the node was down while the short ones expired
        store = small_store(tmp_path, clock=clock, on_remove=removed.extend)
        report = await store.open()
        assert report.blocks == 30 and report.expired == 30
        assert all(b is None for b in await store.read_many("b", [f"s{i}" for i in range(30)]))
        assert all(b is not None for b in await store.read_many("b", [f"l{i}" for i in range(30)]))
        clock.t = t0 + 20_000
        rep = await store.housekeep()
        assert rep.expired_blocks == 30
        assert sorted(r.key for r in removed) == sorted(f"l{i}" for i in range(30))
        assert {r.reason for r in removed} == {"expired"}
        assert store.stats().segments == 0
        await store.close()

    run(first())
    run(second())


def test_touch_extends_expiry_in_the_index(tmp_path: Path) -> None:
    clock = Clock()

    async def go() -> None:
        store = small_store(tmp_path, clock=clock)
        await store.open()
        await append_all(store, [record("k", ttl=10, now=clock.t)])
        assert store.touch("b", "k", clock.t + 1000)
        clock.t += 500
        block = await store.read("b", "k")
        assert block is not None and block.expires_at == pytest.approx(clock.t + 500)
        assert not store.touch("b", "nope", clock.t + 1)
        await store.close()

    run(go())


def test_list_keys_in_order_with_pagination_across_open_and_sealed_segments(tmp_path: Path) -> None:
    async def go() -> None:
        store = small_store(tmp_path)
        await store.open()
        keys = [f"p/{i:05d}" for i in range(400)]
        await append_all(store, [record(k, size=8000) for k in keys] + [record("other", bucket="c")])
        store.delete("b", "p/00007")
        got = []
        start = ""
        while True:
            page = await store.list_keys("b", start, 128)
            got.extend(page)
            if len(page) < 128:
                break
            start = page[-1]
        expected = [k for k in keys if k != "p/00007"]
        assert got == expected
        assert [k async for k in store.iter_keys("b", "p/00390")] == expected[-9:]
        assert await store.list_keys("c") == ["other"]
        assert store.buckets() == ["b", "c"]
        await store.close()

    run(go())


def test_a_walk_over_every_key_holds_one_segment_and_a_listing_is_let_go_when_idle(tmp_path: Path) -> None:
    """Announcing a restart's blocks walks every key: a sorted listing of a million keys kept in RAM cost ~80 B
    per flash block for as long as the node ran (the restart benchmark's RSS per block)."""
    clock = Clock()

    async def go() -> None:
        store = small_store(tmp_path, clock=clock)
        await store.open()
        keys = [f"w/{i:05d}" for i in range(300)]
        await append_all(store, [record(k, size=8000, now=clock.t) for k in keys] + [record("x", bucket="c")])
        pages = [page async for page in store.keys_by_segment("b")]
        assert len(pages) > 1 and sorted(k for page in pages for k in page) == keys
        assert [page async for page in store.keys_by_segment("nope")] == []
        assert store._listing.cache is None  # the walk kept no listing
        assert await store.list_keys("b", "", 10) == keys[:10]
        assert store._listing.cache is not None  # paging through the bucket costs one scan
        clock.t += LIST_CACHE_IDLE / 2
        await store.housekeep()
        assert store._listing.cache is not None
        clock.t += LIST_CACHE_IDLE + 1
        await store.housekeep()
        assert store._listing.cache is None
        assert await store.list_keys("b", keys[-2]) == keys[-1:]  # and listing still works
        await store.close()

    run(go())


def test_manifest_is_saved_atomically_and_loaded_back(tmp_path: Path) -> None:
    manifest = {"buckets": [{"name": "b", "owner": "t", "policy": {"default_ttl": 60}}], "version": 3}

    async def first() -> None:
        store = small_store(tmp_path)
        report = await store.open()
        assert report.manifest is None
        assert await store.save_manifest(manifest)
        await store.close()

    async def second() -> None:
        store = small_store(tmp_path)
        report = await store.open()
        assert report.manifest == manifest and store.manifest == manifest
        await store.close()

    run(first())
    assert not (tmp_path / "state.json.tmp").exists()
    run(second())


def test_reset_starts_empty(tmp_path: Path) -> None:
    async def go(reset: bool) -> int:
        store = small_store(tmp_path)
        report = await store.open(reset=reset)
        if not reset:
            await append_all(store, [record("k")])
            await store.save_manifest({"x": 1})
        await store.close()
        return report.blocks

    run(go(False))
    assert run(go(True)) == 0
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("seg-")] == []


def test_refusals_too_large_expired_and_a_full_queue(tmp_path: Path) -> None:
    async def go() -> None:
        store = small_store(tmp_path, queue_bytes=64 * 1024)
        await store.open()
        now = time.time()
        out = store.append([FlashRecord("b", "big", bytes(MiB), now + 60, now),
                            FlashRecord("b", "old", b"x", now - 1, now - 2)])
        assert out == [TOO_LARGE, ALREADY_EXPIRED]
        out = store.append([record(f"q{i}", size=20_000) for i in range(10)])
        assert out[0] is None and QUEUE_FULL in out
        await store.flush()
        assert store.stats().refused == 2 + out.count(QUEUE_FULL)
        await store.close()

    run(go())


def test_a_second_store_on_the_same_directory_is_refused(tmp_path: Path) -> None:
    async def go() -> None:
        a = small_store(tmp_path)
        await a.open()
        with pytest.raises(OSError, match="in use"):
            await small_store(tmp_path).open()
        await a.close()

    run(go())


def test_stats_per_bucket(tmp_path: Path) -> None:
    async def go() -> None:
        store = small_store(tmp_path)
        await store.open()
        await append_all(store, [record(f"k{i}", size=1000) for i in range(10)]
                         + [record("z", size=5000, bucket="c")])
        await store.read_many("b", ["k1", "k2", "missing"])
        s = store.stats()
        assert (s.blocks, s.bytes, s.reads, s.bytes_read, s.misses) == (11, 15000, 2, 2000, 1)
        assert s.buckets["b"].blocks == 10 and s.buckets["c"].bytes == 5000 and s.buckets["b"].reads == 2
        assert s.buckets["b"].bytes_written == 10_000
        assert s.index_bytes > 0 and s.disk_bytes <= s.capacity_bytes and s.degraded is None
        await store.close()

    run(go())


def test_lookup_many_is_vectorized_over_thousands_of_keys(tmp_path: Path) -> None:
    async def go() -> None:
        store = small_store(tmp_path, 64 * MiB)
        await store.open()
        keys = [os.urandom(16).hex() for _ in range(3000)]
        await append_all(store, [record(k, size=64) for k in keys])
        entries = store.lookup_many("b", keys[:2048] + ["x"] * 10)
        assert sum(e is not None for e in entries) == 2048
        present, _ = store.present_many("b", keys)
        assert bool(np.all(present))
        await store.close()

    run(go())


def test_open_keeps_only_the_index_in_ram(tmp_path: Path) -> None:
    """Regression: recovery's arrays outlived open() (held by the executor's future), doubling RAM per block."""
    import tracemalloc

    async def fill() -> None:
        store = small_store(tmp_path, 64 * MiB, segment_bytes=8 * MiB, batch_bytes=1 * MiB)
        await store.open()
        now = time.time()
        await append_all(store, [FlashRecord("b", f"{i:032x}", b"x" * 16, now + 3600, now) for i in range(50_000)])
        await store.close()

    async def reopen() -> tuple[int, int, int]:
        store = small_store(tmp_path, 64 * MiB, segment_bytes=8 * MiB)
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            report = await store.open()
            held = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        index = store.index.nbytes()
        await store.close()
        return report.blocks, held, index

    run(fill())
    blocks, held, index = run(reopen())
    assert blocks == 50_000
    assert held < 1.3 * index, (held, index)
