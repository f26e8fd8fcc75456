"""Space: the capacity is never exceeded under churn; the oldest segment goes first and its blocks are reported;
mostly-dead segments are compacted; hot blocks can be re-appended before their segment is evicted."""

from __future__ import annotations

from pathlib import Path

from flash_support import MiB, append_all, check_payload, dir_bytes, record, run, small_store

from ctxstore_server.flash import EVICTED, Removal


def test_capacity_is_never_exceeded_under_churn_and_evictions_are_reported(tmp_path: Path) -> None:
    capacity = 8 * MiB
    removed: list[Removal] = []

    async def go() -> None:
        store = small_store(tmp_path, capacity, on_remove=removed.extend)
        await store.open()
        written = 0
        for wave in range(30):  # 30 × 2 MiB through an 8 MiB store
            recs = [record(f"w{wave:02d}-{i:02d}", wave, 64 * 1024) for i in range(32)]
            results: list = []
            store.append(recs, results.extend)
            for _ in range(3):
                size, alloc = dir_bytes(tmp_path)
                assert size <= capacity and alloc <= capacity, (wave, size, alloc)
                await store.housekeep()
            await store.flush()
            written += sum(r.stored for r in results)
            size, alloc = dir_bytes(tmp_path)
            assert size <= capacity and alloc <= capacity and store.stats().disk_bytes <= capacity
        s = store.stats()
        assert s.evicted > 0 and s.evicted == len(removed) and {r.reason for r in removed} == {EVICTED}
        assert s.blocks + s.evicted == written
        # the oldest went first: everything of the last wave is still there
        last = await store.read_many("b", [f"w29-{i:02d}" for i in range(32)])
        assert all(b is not None and check_payload(f"w29-{i:02d}", b.payload) == 29 for i, b in enumerate(last))
        first = await store.read_many("b", [f"w00-{i:02d}" for i in range(32)])
        assert all(b is None for b in first)
        assert {r.key for r in removed} >= {f"w00-{i:02d}" for i in range(32)}
        await store.close()

    run(go())


def test_mostly_dead_segments_are_compacted_with_bounded_work(tmp_path: Path) -> None:
    keys = [f"m{i:03d}" for i in range(96)]
    keep = keys[::5]

    async def first() -> None:
        store = small_store(tmp_path, 32 * MiB, compact_bytes=256 * 1024)
        await store.open()
        await append_all(store, [record(k, 1, 60_000) for k in keys])  # ~6 segments
        await store.flush()
        await store.housekeep()
        before = store.stats().segments
        store.delete_many("b", [k for k in keys if k not in keep])
        for _ in range(20):
            await store.housekeep()
        await store.flush()
        s = store.stats()
        assert s.compactions >= 2 and s.segments < before
        blocks = await store.read_many("b", keep)
        assert all(b is not None and check_payload(k, b.payload) == 1 for k, b in zip(keep, blocks))
        await store.close()

    async def second() -> None:
        store = small_store(tmp_path, 32 * MiB)
        report = await store.open()
        assert report.blocks == len(keep)
        blocks = await store.read_many("b", keys)
        assert [k for k, b in zip(keys, blocks) if b is not None] == keep
        await store.close()

    run(first())
    run(second())


def test_hot_blocks_are_re_appended_when_their_segment_is_evicted(tmp_path: Path) -> None:
    async def go() -> None:
        store = small_store(tmp_path, 8 * MiB, rewrite_hot_bytes=256 * 1024)
        await store.open()
        await append_all(store, [record(f"h{i:02d}", 1, 64 * 1024) for i in range(14)])  # the oldest segment
        await store.housekeep()
        assert await store.read("b", "h03") is not None  # hot now
        for wave in range(6):
            await append_all(store, [record(f"x{wave}-{i:02d}", 1, 64 * 1024) for i in range(14)])
            await store.housekeep()
        assert store.stats().evicted > 0
        assert await store.read("b", "h00") is None
        hot = await store.read("b", "h03")
        assert hot is not None and check_payload("h03", hot.payload) == 1
        await store.close()

    run(go())
