"""The engine with a flash tier, in process: demotion of RAM's victims, verified reads, promotion, prefetch, and
deletes, overwrites, TTLs, conditions, listing, buckets and restarts applied to both tiers.

A real flash store on real files under tmp_path, driven through the engine's facade on one event loop; the
clock is the test's (TTL tests move it instead of sleeping)."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
from flash_support import Clock, check_payload, make_payload

from ctxstore_server.engine import BlockWrite, Engine, EngineConfig, StoredObject, errors
from ctxstore_server.engine import reads as reads_module
from ctxstore_server.engine import flash_writes

T = TypeVar("T")
KiB, MiB = 1 << 10, 1 << 20
TENANT, OTHER, BUCKET = "t", "u", "b"
BLOCK = 16 * KiB


def run(make: Callable[[], Awaitable[T]]) -> T:
    return asyncio.run(make())  # type: ignore[arg-type]


def config(tmp: Path, **overrides: Any) -> EngineConfig:
    values: dict[str, Any] = dict(budget=512 * KiB, disk_path=str(tmp / "disk"), disk_size=8 * MiB,
                                  disk_segment_size=256 * KiB, bucket_overhead=0, upload_overhead=0,
                                  part_overhead=0, disk_min_ttl=1.0)
    values.update(overrides)
    return EngineConfig(**values)


async def opened(tmp: Path, clock: Clock, **overrides: Any) -> Engine:
    engine = Engine(config(tmp, **overrides), clock=clock)
    await engine.open()
    return engine


async def settle(engine: Engine) -> None:
    """Let queued demotions reach flash and their callbacks run."""
    assert engine.tier is not None
    for _ in range(3):
        await asyncio.sleep(0)
        await engine.tier.flash.flush()
        await asyncio.sleep(0.01)


def put(engine: Engine, key: str, version: int = 0, size: int = BLOCK, *, tenant: str = TENANT,
        bucket: str = BUCKET, ttl: float | None = None) -> StoredObject:
    data = make_payload(key, version, size)
    return engine.put(tenant, bucket, key, data, etag=f'"{hashlib.md5(data).hexdigest()}"', ttl=ttl)


def fill(engine: Engine, n: int, version: int = 0) -> list[str]:
    keys = [f"k{i:04d}" for i in range(n)]
    for key in keys:
        put(engine, key, version)
    return keys


def on_flash(engine: Engine, key: str, bucket: str = BUCKET) -> bool:
    assert engine.tier is not None
    return engine.tier.flash.lookup(bucket, key) is not None


def in_ram(engine: Engine, key: str, bucket: str = BUCKET) -> bool:
    obj = engine.store.buckets[bucket].objects.get(key)
    return obj is not None and obj.live


# ---------------------------------------------------------------------------- demotion and reads


def test_victims_are_demoted_and_every_block_reads_back_verified(tmp_path: Path) -> None:
    clock = Clock()

    async def go() -> None:
        engine = await opened(tmp_path, clock)
        engine.create_bucket(TENANT, BUCKET)
        keys = fill(engine, 96)  # 1.5 MiB of payload against a 512 KiB budget
        await settle(engine)
        stats = engine.operator.stats()
        assert stats["used"] <= stats["budget"]
        assert stats["evictions"] == 0 and stats["demotions"] >= 96 - stats["objects"]
        assert stats["disk_objects"] + stats["objects"] >= 96
        for key in keys:
            obj = await engine.fetch(TENANT, BUCKET, key)
            assert check_payload(key, obj.data) == 0
        await engine.housekeep_disk()  # the flash index lives in RAM: it is charged to the budget
        stats = engine.operator.stats()
        assert stats["disk_index_bytes"] > 0 and stats["state_bytes"] >= stats["disk_index_bytes"]
        stats = engine.operator.stats()
        assert stats["hits"] == 96 and stats["misses"] == 0
        assert 0 < stats["disk_hits"] <= 96
        assert stats["promotions"] > 0
        await engine.close()

    run(go)


def test_read_buffers_kept_for_the_next_flash_read_are_charged_to_the_budget(tmp_path: Path) -> None:
    clock = Clock()

    async def go() -> None:
        # Every block straight to flash, never promoted: each fetch reads flash.
        engine = await opened(tmp_path, clock, budget=16 * MiB, disk_size=64 * MiB, disk_segment_size=4 * MiB,
                              disk_direct_size=1, disk_promote=False)
        engine.create_bucket(TENANT, BUCKET)
        keys = fill(engine, 96)  # 1.5 MiB of 16 KiB blocks, adjacent on flash: one run, a 2 MiB buffer
        await settle(engine)
        assert engine.operator.stats()["objects"] == 0
        await engine.housekeep_disk()
        before = engine.budget.state
        got = await engine.fetch_many(TENANT, BUCKET, keys)
        assert [check_payload(k, o.data) if o else None for k, o in zip(keys, got)] == [0] * 96
        del got
        await asyncio.sleep(0)
        assert engine.tier is not None
        kept = engine.tier.flash.stats().buffer_bytes
        assert 0 < kept <= 2 * MiB  # an eighth of the budget at most
        await engine.housekeep_disk()
        assert engine.budget.state == before + kept
        await engine.close()

    run(go)


def test_a_victim_is_served_from_ram_until_its_flash_write_lands(tmp_path: Path) -> None:
    clock = Clock()

    async def go() -> None:
        engine = await opened(tmp_path, clock)
        assert engine.tier is not None
        engine.create_bucket(TENANT, BUCKET)
        fill(engine, 40)  # no await: the demotions are queued, not written
        assert engine.tier.writes.demoting, "expected victims waiting for their write"
        waiting = next(iter(engine.tier.writes.demoting.values()))
        assert not on_flash(engine, waiting.key) and not in_ram(engine, waiting.key)
        got = await engine.fetch_many(TENANT, BUCKET, [waiting.key])
        assert got[0] is not None and check_payload(waiting.key, got[0].data) == 0
        await settle(engine)
        assert not engine.tier.writes.demoting and engine.operator.stats()["disk_queued_bytes"] == 0
        await engine.close()

    run(go)


def test_a_write_that_finds_the_demotion_queue_full_is_refused_and_no_victim_is_dropped(tmp_path: Path) -> None:
    # A victim that found the queue full used to be dropped while its write answered "stored": a save beyond
    # RAM lost blocks in the middle of its chains (485 of 768 found).
    clock = Clock()
    removed: list[tuple[str, str]] = []

    async def go() -> None:
        engine = await opened(tmp_path, clock, disk_queue=2 * BLOCK)
        engine.subscribe(on_remove=lambda obj, reason: removed.append((obj.key, reason)))
        engine.create_bucket(TENANT, BUCKET)
        stored: list[str] = []
        with pytest.raises(errors.FlashQueueFull):  # all at once, nothing waits: the queue holds two blocks
            for i in range(60):
                put(engine, f"k{i:04d}")
                stored.append(f"k{i:04d}")
        assert isinstance(errors.FlashQueueFull(), errors.InsufficientCapacity)  # SlowDown to a client
        await drain(engine)
        assert {r for _, r in removed} == {"demoted"}
        assert engine.operator.stats()["evictions"] == 0 and engine.operator.stats()["disk_queued_bytes"] == 0
        for key in stored:  # every write that was answered is readable, from RAM or flash
            assert (await engine.fetch(TENANT, BUCKET, key, record=False)) is not None, key
        await engine.close()

    run(go)


def test_writes_wait_for_the_demotion_queue_and_every_one_is_kept(tmp_path: Path) -> None:
    clock = Clock()
    removed: list[str] = []

    async def go() -> None:
        engine = await opened(tmp_path, clock, disk_queue=2 * BLOCK, disk_write_wait=5.0)
        engine.subscribe(on_remove=lambda obj, reason: removed.append(reason))
        engine.create_bucket(TENANT, BUCKET)
        keys = [f"k{i:04d}" for i in range(120)]  # almost 4x RAM, in a burst
        for key in keys:
            await engine.tier.with_write_room(lambda key=key: put(engine, key))  # type: ignore[misc]
        await drain(engine)
        stats = engine.operator.stats()
        assert stats["disk_write_waits"] > 0 and stats["disk_write_refusals"] == 0
        assert set(removed) == {"demoted"} and stats["evictions"] == 0
        for key in keys:
            got = await engine.fetch(TENANT, BUCKET, key, record=False)
            assert got is not None, key
            assert check_payload(key, got.data) == 0
        await engine.close()

    run(go)


def test_a_write_waits_at_most_disk_write_wait_for_a_stalled_device(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock()

    async def go() -> None:
        engine = await opened(tmp_path, clock, disk_queue=2 * BLOCK, disk_write_wait=0.3)
        assert engine.tier is not None
        engine.create_bucket(TENANT, BUCKET)
        # The device stops taking writes (they are accepted and never land), as a stalled disk would.
        monkeypatch.setattr(engine.tier.flash, "append", lambda records, done, force=False: [None] * len(records))
        written: list[str] = []
        with pytest.raises(errors.InsufficientCapacity, match="stayed full for 0.3 s") as refused:
            for i in range(60):
                await engine.tier.with_write_room(lambda i=i: put(engine, f"k{i:04d}"))  # type: ignore[misc]
                written.append(f"k{i:04d}")
        assert not isinstance(refused.value, errors.FlashQueueFull)
        assert engine.operator.stats()["disk_write_refusals"] == 1
        for key in written:  # what was acknowledged is still served (from RAM or the demotion queue)
            assert (await engine.fetch(TENANT, BUCKET, key, record=False)) is not None, key
        monkeypatch.undo()

    run(go)


async def drain(engine: Engine) -> None:
    """Settle until no demotion is queued and no direct write waits (a bounded number of rounds)."""
    assert engine.tier is not None
    for _ in range(100):
        await settle(engine)
        if not engine.tier.writes.demoting and not engine.tier.writes.direct_waiting:
            return
    raise AssertionError("the flash tier did not drain")


def test_direct_writes_that_find_the_queue_full_wait_in_ram_and_go_down_in_turn(tmp_path: Path) -> None:
    clock = Clock()

    async def go() -> None:
        engine = await opened(tmp_path, clock, disk_queue=2 * BLOCK, disk_direct_size=BLOCK, disk_promote=False,
                              disk_write_back=False)  # the block that shrinks below the direct size stays in RAM
        assert engine.tier is not None
        engine.create_bucket(TENANT, BUCKET)
        keys = fill(engine, 12)  # all at once: two fit the queue, ten wait in RAM, oldest first
        assert engine.operator.stats()["disk_direct_waiting"] == 10
        assert [key for _, key in engine.tier.writes.direct_waiting] == keys[2:]
        assert all(in_ram(engine, key) for key in keys[2:])
        got = await engine.fetch_many(TENANT, BUCKET, keys)
        assert [check_payload(k, o.data) if o else None for k, o in zip(keys, got)] == [0] * 12
        deleted, shrunk = keys[5], keys[6]
        assert engine.store.delete(TENANT, BUCKET, deleted)
        put(engine, shrunk, version=1, size=BLOCK // 2)  # below the direct size now: it stays in RAM
        await drain(engine)
        sent = [k for k in keys if k not in (deleted, shrunk)]
        assert all(on_flash(engine, k) and not in_ram(engine, k) for k in sent)
        assert not on_flash(engine, deleted) and not on_flash(engine, shrunk) and in_ram(engine, shrunk)
        stats = engine.operator.stats()
        assert stats["disk_objects"] == 10 and stats["disk_direct_waiting"] == 0 and stats["evictions"] == 0
        got = await engine.fetch_many(TENANT, BUCKET, sent + [shrunk])
        assert [check_payload(k, o.data) if o else None for k, o in zip(sent + [shrunk], got)] == [0] * 10 + [1]
        await engine.close()

    run(go)


def test_a_direct_write_larger_than_the_demotion_queue_stays_in_ram_and_holds_up_no_other(tmp_path: Path) -> None:
    clock = Clock()

    async def go() -> None:
        engine = await opened(tmp_path, clock, disk_queue=2 * BLOCK, disk_direct_size=BLOCK)
        assert engine.tier is not None
        engine.create_bucket(TENANT, BUCKET)
        put(engine, "big", size=3 * BLOCK)
        keys = fill(engine, 6)
        await drain(engine)
        assert in_ram(engine, "big") and not on_flash(engine, "big")
        assert all(on_flash(engine, k) and not in_ram(engine, k) for k in keys)
        await engine.close()

    run(go)


def test_the_direct_writes_waiting_are_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Beyond the bound the oldest is forgotten: it stays in RAM and goes down only when it is evicted."""
    clock = Clock()
    monkeypatch.setattr(flash_writes, "DIRECT_WAITING", 4)

    async def go() -> None:
        engine = await opened(tmp_path, clock, disk_queue=2 * BLOCK, disk_direct_size=BLOCK)
        assert engine.tier is not None
        engine.create_bucket(TENANT, BUCKET)
        keys = fill(engine, 12)
        assert [key for _, key in engine.tier.writes.direct_waiting] == keys[8:]
        await drain(engine)
        assert all(on_flash(engine, k) for k in keys[:2] + keys[8:])
        assert all(in_ram(engine, k) and not on_flash(engine, k) for k in keys[2:8])
        await engine.close()

    run(go)


def test_short_lived_victims_are_dropped_not_demoted(tmp_path: Path) -> None:
    clock = Clock()

    async def go() -> None:
        engine = await opened(tmp_path, clock, disk_min_ttl=30.0)
        engine.create_bucket(TENANT, BUCKET)
        for i in range(60):
            put(engine, f"s{i}", ttl=10.0)
        await settle(engine)
        stats = engine.operator.stats()
        assert stats["demotions"] == 0 and stats["evictions"] > 0 and stats["disk_objects"] == 0
        await engine.close()

    run(go)


def test_a_promoted_block_goes_back_to_flash_without_being_written_again(tmp_path: Path) -> None:
    clock = Clock()

    async def go() -> None:
        engine = await opened(tmp_path, clock)
        engine.create_bucket(TENANT, BUCKET)
        keys = fill(engine, 64)
        await settle(engine)
        first = keys[0]
        assert on_flash(engine, first) and not in_ram(engine, first)
        await engine.fetch(TENANT, BUCKET, first)  # promoted
        assert in_ram(engine, first)
        written = engine.operator.stats()["disk_bytes_written"]
        for i in range(64, 128):  # push it out of RAM again
            put(engine, f"k{i:04d}")
        await settle(engine)
        assert not in_ram(engine, first) and on_flash(engine, first)
        extra = engine.operator.stats()["disk_bytes_written"] - written
        # 64 new blocks were written; the promoted one was not written a second time.
        assert extra < 65 * BLOCK + 64 * 4096
        assert check_payload(first, (await engine.fetch(TENANT, BUCKET, first)).data) == 0
        await engine.close()

    run(go)


def test_write_back_copies_every_block_to_flash_and_eviction_then_writes_nothing(tmp_path: Path) -> None:
    clock = Clock()

    async def go() -> None:
        engine = await opened(tmp_path, clock)  # write-back is the default
        engine.create_bucket(TENANT, BUCKET)
        keys = fill(engine, 16)  # half of RAM: nothing has to be evicted
        await drain(engine)
        assert all(in_ram(engine, k) and on_flash(engine, k) for k in keys), "inclusive: in RAM and on flash"
        written = engine.operator.stats()["disk_bytes_written"]
        assert written >= 16 * BLOCK
        more = [f"m{i:04d}" for i in range(40)]
        for key in more:  # three times what is left of RAM: the first blocks are evicted
            put(engine, key)
        await drain(engine)
        gone = [k for k in keys if not in_ram(engine, k)]
        assert gone and all(on_flash(engine, k) for k in gone)
        stats = engine.operator.stats()
        assert stats["evictions"] == 0 and stats["demotions"] >= len(gone)
        # The evicted blocks were not written again: only the new blocks' copies were.
        assert stats["disk_bytes_written"] - written < 40 * (BLOCK + 4096)
        for key in keys + more:
            got = await engine.fetch(TENANT, BUCKET, key, record=False)
            assert check_payload(key, got.data) == 0
        await engine.close()

    run(go)


def test_a_key_deleted_or_replaced_while_its_copy_is_written_never_comes_back(tmp_path: Path) -> None:
    clock = Clock()

    async def go() -> None:
        engine = await opened(tmp_path, clock)
        engine.create_bucket(TENANT, BUCKET)
        put(engine, "deleted")
        put(engine, "replaced")
        assert engine.tier is not None and len(engine.tier.writes.copying) == 2  # copies queued, not yet written
        assert engine.store.delete(TENANT, BUCKET, "deleted")
        put(engine, "replaced", version=1)
        put(engine, "in-writer")
        await asyncio.sleep(0)  # its copy handed to the flash writer (written or not yet: both must hold)
        assert engine.store.delete(TENANT, BUCKET, "in-writer")
        await drain(engine)
        assert not on_flash(engine, "deleted") and not on_flash(engine, "in-writer")
        await engine.close()
        # After a restart only flash speaks: the deleted key stays deleted, the replaced one is the new version.
        engine = await opened(tmp_path, clock)
        for key in ("deleted", "in-writer"):
            with pytest.raises(errors.NoSuchKey):
                await engine.fetch(TENANT, BUCKET, key)
        assert check_payload("replaced", (await engine.fetch(TENANT, BUCKET, "replaced")).data) == 1
        await engine.close()

    run(go)


def test_without_promotion_flash_hits_are_sent_from_a_transient_buffer_counted_while_sent(tmp_path: Path) -> None:
    clock = Clock()

    async def go() -> None:
        engine = await opened(tmp_path, clock, disk_promote=False)
        engine.create_bucket(TENANT, BUCKET)
        keys = fill(engine, 64)
        await settle(engine)
        used = engine.budget.used
        obj = await engine.fetch(TENANT, BUCKET, keys[0])
        assert obj.transient and not in_ram(engine, keys[0])
        release = engine.store.lease(obj)
        assert engine.budget.used == used + obj.charge and engine.budget.sending >= obj.charge
        release()
        assert engine.budget.used == used
        await engine.close()

    run(go)


# ---------------------------------------------------------------------------- both tiers are one store


def test_overwrite_and_delete_reach_the_flash_copy_and_stay_so_after_a_restart(tmp_path: Path) -> None:
    clock = Clock()

    async def go() -> None:
        engine = await opened(tmp_path, clock)
        engine.create_bucket(TENANT, BUCKET)
        keys = fill(engine, 64)
        await settle(engine)
        replaced, deleted = keys[0], keys[1]
        assert on_flash(engine, replaced) and on_flash(engine, deleted)
        put(engine, replaced, version=1)
        assert engine.store.delete(TENANT, BUCKET, deleted)
        assert check_payload(replaced, (await engine.fetch(TENANT, BUCKET, replaced)).data) == 1
        with pytest.raises(errors.NoSuchKey):
            await engine.fetch(TENANT, BUCKET, deleted)
        await engine.close()  # no spill: the new version lived in RAM only

        again = await opened(tmp_path, clock)
        with pytest.raises(errors.NoSuchKey):
            await again.fetch(TENANT, BUCKET, deleted)
        try:  # the new version is gone with RAM; the old one must not come back
            got = await again.fetch(TENANT, BUCKET, replaced)
            assert check_payload(replaced, got.data) == 1
        except errors.NoSuchKey:
            pass
        await again.close()

    run(go)


def test_expiry_applies_on_flash_and_across_a_restart(tmp_path: Path) -> None:
    clock = Clock()

    async def go() -> None:
        engine = await opened(tmp_path, clock)
        engine.create_bucket(TENANT, BUCKET)
        for i in range(40):
            put(engine, f"short{i}", ttl=60.0)
        for i in range(40):
            put(engine, f"long{i}", ttl=3600.0)
        await settle(engine)
        assert on_flash(engine, "short0")
        await engine.close(spill_seconds=5)
        clock.t += 120  # the node was down for two minutes
        again = await opened(tmp_path, clock)
        for i in range(40):
            with pytest.raises(errors.NoSuchKey):
                await again.fetch(TENANT, BUCKET, f"short{i}")
            assert check_payload(f"long{i}", (await again.fetch(TENANT, BUCKET, f"long{i}")).data) == 0
        await again.close()

    run(go)


def test_touch_and_sliding_ttl_extend_flash_resident_blocks(tmp_path: Path) -> None:
    clock = Clock()

    async def go() -> None:
        engine = await opened(tmp_path, clock, disk_promote=False)
        engine.create_bucket(TENANT, BUCKET)
        keys = [f"t{i}" for i in range(48)]
        for key in keys:
            put(engine, key, ttl=100.0)
        await settle(engine)
        first = keys[0]
        assert on_flash(engine, first) and not in_ram(engine, first)
        assert engine.store.touch(TENANT, BUCKET, [first], ttl=1000.0) == 1
        clock.t += 500
        assert check_payload(first, (await engine.fetch(TENANT, BUCKET, first)).data) == 0
        with pytest.raises(errors.NoSuchKey):
            await engine.fetch(TENANT, BUCKET, keys[1])  # not touched: expired at 100 s
        await engine.close()

    run(go)


def test_conditional_writes_see_flash_resident_objects(tmp_path: Path) -> None:
    clock = Clock()

    async def go() -> None:
        engine = await opened(tmp_path, clock)
        engine.create_bucket(TENANT, BUCKET)
        keys = fill(engine, 64)
        await settle(engine)
        key = keys[0]
        assert on_flash(engine, key) and not in_ram(engine, key)
        data = make_payload(key, 5, BLOCK)
        with pytest.raises(errors.PreconditionFailed):
            engine.put(TENANT, BUCKET, key, data, etag='"x"', if_none_match=True)
        with pytest.raises(errors.InsufficientCapacity):  # its ETag is on flash: bring it in first
            engine.put(TENANT, BUCKET, key, data, etag='"x"', if_match='"nope"')
        await engine.resident(TENANT, BUCKET, key)
        assert in_ram(engine, key)
        with pytest.raises(errors.PreconditionFailed):
            engine.put(TENANT, BUCKET, key, data, etag='"x"', if_match='"nope"')
        etag = engine.store.buckets[BUCKET].objects[key].etag
        engine.put(TENANT, BUCKET, key, data, etag='"x"', if_match=etag)
        assert check_payload(key, (await engine.fetch(TENANT, BUCKET, key)).data) == 5
        assert engine.exists(TENANT, BUCKET, keys[5])
        await engine.close()

    run(go)


def test_listing_merges_both_tiers_in_order_once_each(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reads_module, "LIST_CHUNK", 7)  # many chunk boundaries
    clock = Clock()

    async def go() -> None:
        engine = await opened(tmp_path, clock)
        engine.create_bucket(TENANT, BUCKET)
        keys = fill(engine, 70)
        await settle(engine)
        await engine.fetch(TENANT, BUCKET, keys[3])  # promoted: in both tiers
        listed = [o.key async for o in engine.list_objects(TENANT, BUCKET)]
        assert listed == sorted(keys)
        after = [o.key async for o in engine.list_objects(TENANT, BUCKET, keys[20], inclusive=False)]
        assert after == sorted(keys)[21:]
        sizes = {o.key: o.size async for o in engine.list_objects(TENANT, BUCKET, keys[10])}
        assert set(sizes) == set(sorted(keys)[10:]) and set(sizes.values()) == {BLOCK}
        await engine.close()

    run(go)


def test_locate_and_prefetch(tmp_path: Path) -> None:
    clock = Clock()

    async def go() -> None:
        engine = await opened(tmp_path, clock)
        engine.create_bucket(TENANT, BUCKET)
        keys = fill(engine, 64)
        await settle(engine)
        sizes, where = engine.locate(TENANT, BUCKET, keys + ["absent"])
        assert sizes[-1] == -1 and where[-1] is None
        assert set(where[:-1]) == {"ram", "disk"} and sizes[:-1] == [BLOCK] * len(keys)
        cold = [k for k, t in zip(keys, where) if t == "disk"][:8]
        answer = engine.prefetch(TENANT, BUCKET, cold + ["absent"])
        assert answer == {"ram": 0, "disk": 8, "missing": 1, "started": 8}
        for _ in range(50):
            await asyncio.sleep(0.01)
            if all(in_ram(engine, k) for k in cold):
                break
        assert all(in_ram(engine, k) for k in cold)
        stats = engine.operator.stats()
        assert stats["prefetches"] == 8 and stats["promotions"] >= 8
        await engine.close()

    run(go)


# ---------------------------------------------------------------------------- buckets, tenants, restarts


def test_buckets_policies_and_quotas_come_back_and_dropped_buckets_stay_empty(tmp_path: Path) -> None:
    clock = Clock()

    async def go() -> None:
        engine = await opened(tmp_path, clock)
        engine.create_bucket(TENANT, BUCKET)
        engine.create_bucket(TENANT, "gone")
        engine.set_bucket_policy(BUCKET, default_ttl=1234.0, sliding_ttl=True)
        engine.set_tenant_quota(TENANT, 4 * MiB)
        keys = fill(engine, 64)
        for i in range(40):
            put(engine, f"g{i}", bucket="gone")
        await settle(engine)
        with pytest.raises(errors.BucketNotEmpty):
            engine.delete_bucket(TENANT, "gone")  # flash still holds its blocks
        assert await engine.flush("gone") >= 40
        engine.delete_bucket(TENANT, "gone")
        await engine.close(spill_seconds=5)

        again = await opened(tmp_path, clock)
        bucket = again.store.buckets[BUCKET]
        assert (bucket.owner, bucket.default_ttl, bucket.sliding_ttl) == (TENANT, 1234.0, True)
        assert again.budget.tenant_usage(TENANT)[0] == 4 * MiB
        assert "gone" not in again.store.buckets
        again.create_bucket(OTHER, "gone")  # another tenant takes the name: it sees nothing of the old one
        assert [o async for o in again.list_objects(OTHER, "gone")] == []
        with pytest.raises(errors.NoSuchKey):
            await again.fetch(OTHER, "gone", "g0")
        for key in keys:
            assert check_payload(key, (await again.fetch(TENANT, BUCKET, key)).data) == 0
        await again.close()

    run(go)


def test_a_clean_shutdown_spills_ram_so_a_restart_has_everything(tmp_path: Path) -> None:
    clock = Clock()

    async def go() -> None:
        engine = await opened(tmp_path, clock, disk_write_back=False)  # RAM-only blocks, for the spill
        engine.create_bucket(TENANT, BUCKET)
        keys = fill(engine, 20)  # fits in RAM: nothing demoted
        await settle(engine)
        assert engine.operator.stats()["demotions"] == 0
        assert await engine.close(spill_seconds=5) == 20
        again = Engine(config(tmp_path), clock=clock)
        seen: list[tuple[str, str, str | None]] = []
        again.subscribe(on_disk=lambda kind, block, reason: seen.append((kind, block.key, reason)))
        await again.open()
        again.announce_recovered()  # what a router hears after the restart
        for _ in range(50):
            await asyncio.sleep(0.01)
            if len(seen) == 20:
                break
        assert sorted(seen) == sorted(("stored", k, None) for k in keys)
        for key in keys:
            assert check_payload(key, (await again.fetch(TENANT, BUCKET, key)).data) == 0
        await again.close()

    run(go)


def test_a_shutdown_spill_of_blocks_larger_than_its_batches_writes_every_one(tmp_path: Path) -> None:
    """A batch is a quarter of the demotion queue or one block, whichever is more: three 48 KiB batches in
    flight are more than the 64 KiB queue, and the flash store's own bound must not refuse them."""
    clock = Clock()

    async def go() -> None:
        engine = await opened(tmp_path, clock, disk_queue=4 * BLOCK, disk_write_back=False)
        engine.create_bucket(TENANT, BUCKET)
        keys = [f"big{i}" for i in range(8)]
        for key in keys:
            put(engine, key, size=3 * BLOCK)
        assert await engine.close(spill_seconds=30) == 8
        again = await opened(tmp_path, clock, disk_queue=4 * BLOCK)
        for key in keys:
            assert check_payload(key, (await again.fetch(TENANT, BUCKET, key)).data) == 0
        await again.close()

    run(go)


@pytest.mark.parametrize("seconds", [30.0, 1e-9])
def test_a_shutdown_spill_of_many_batches_keeps_to_its_deadline(tmp_path: Path, seconds: float) -> None:
    clock = Clock()

    async def go() -> None:
        # 16 MiB of RAM: batches of 2 MiB (a quarter of the 8 MiB demotion queue), up to three in flight.
        engine = await opened(tmp_path, clock, budget=16 * MiB, disk_size=64 * MiB, disk_segment_size=4 * MiB,
                              disk_write_back=False)
        engine.create_bucket(TENANT, BUCKET)
        keys = fill(engine, 384)  # 6 MiB, all in RAM: three batches
        assert engine.operator.stats()["disk_objects"] == 0
        spilled = await engine.close(spill_seconds=seconds)
        again = await opened(tmp_path, clock, budget=16 * MiB, disk_size=64 * MiB, disk_segment_size=4 * MiB)
        assert again.operator.stats()["disk_objects"] == spilled
        if seconds > 1:
            assert spilled == 384
        else:  # past the deadline after the first batch: what it wrote, no more, and no wait
            assert 0 < spilled < 384
        for key in keys:
            try:
                obj = await again.fetch(TENANT, BUCKET, key)
            except errors.NoSuchKey:
                continue
            assert check_payload(key, obj.data) == 0
        await again.close()

    run(go)


def test_a_full_flash_tier_drops_a_chain_from_its_tail(tmp_path: Path) -> None:
    # A full flash tier drops its oldest segment first: a bulk put's blocks (a chain in order) are copied to
    # flash last key first, so what it drops of a chain spanning segments is the tail, never the head.
    clock = Clock()

    async def go() -> None:
        engine = await opened(tmp_path, clock, budget=2 * MiB, disk_size=4 * MiB)  # 16 segments of 256 KiB
        engine.create_bucket(TENANT, BUCKET)
        chain = [f"c{i:03d}" for i in range(48)]  # 768 KiB: three segments' worth, in one call
        engine.put_blocks(TENANT, BUCKET, [BlockWrite(k, make_payload(k, 0, BLOCK), '"e"', 0, None) for k in chain],
                          ttl=None, if_absent=False)
        await drain(engine)
        for i in range(120):  # 1.9 MiB more: the oldest segments go
            put(engine, f"x{i:04d}")
            if i % 16 == 15:
                await drain(engine)
                await engine.housekeep_disk()
        await drain(engine)
        await engine.housekeep_disk()
        held = [in_ram(engine, k) or on_flash(engine, k) for k in chain]
        kept = sum(held)
        assert 0 < kept < len(chain), "the flash tier had to drop some of the chain, not all"
        assert held == [True] * kept + [False] * (len(chain) - kept), held
        await engine.close()

    run(go)


def test_a_tenant_with_a_quota_keeps_to_its_share_of_flash(tmp_path: Path) -> None:
    clock = Clock()

    async def go() -> None:
        # Budget 512 KiB, flash 8 MiB: a quota of 128 KiB (a quarter) may hold 2 MiB of flash.
        engine = await opened(tmp_path, clock)
        assert engine.tier is not None
        engine.create_bucket(TENANT, BUCKET)
        engine.create_bucket(OTHER, "theirs")
        engine.set_tenant_quota(TENANT, 128 * KiB)
        for i in range(300):  # 4.7 MiB through a 128 KiB quota
            put(engine, f"q{i}")
            if i % 50 == 0:
                await settle(engine)
                await engine.housekeep_disk()
        await settle(engine)
        await engine.housekeep_disk()
        share = 128 * KiB * (8 * MiB) // (512 * KiB)
        assert engine.tier.context.tenant_disk[TENANT] <= share + BLOCK
        assert engine.operator.stats()["evictions"] > 0  # beyond its share its victims were dropped
        await engine.close()

    run(go)


def test_a_victim_a_segment_cannot_hold_is_dropped_as_too_large_and_never_said_to_be_on_flash(tmp_path: Path) -> None:
    # 256 KiB segments hold records of 256 KiB - 16 KiB - 72 bytes, less the record's header and footer entry. A
    # block just under 240 KiB was taken as fitting: removed from RAM as "demoted", announced on flash, then
    # refused by the store and counted as not writing.
    clock = Clock()
    disk: list[tuple[str, str, str | None]] = []

    async def go() -> None:
        engine = await opened(tmp_path, clock, disk_write_back=False)
        engine.subscribe(on_disk=lambda kind, block, reason: disk.append((kind, block.key, reason)))
        engine.create_bucket(TENANT, BUCKET)
        for i in range(4):  # 4 x ~240 KiB in 512 KiB of RAM: at least two are evicted
            put(engine, f"big{i}", size=240 * KiB - 8)
        await settle(engine)
        stats = engine.operator.stats()
        assert stats["disk_dropped_too_large"] >= 2 and stats["disk_dropped_not_writing"] == 0, stats
        assert stats["disk_objects"] == 0 and disk == []
        await engine.close()

    run(go)


def test_demotion_events_are_a_medium_change(tmp_path: Path) -> None:
    clock = Clock()
    disk: list[tuple[str, str, str | None]] = []
    ram: list[tuple[str, str]] = []

    async def go() -> None:
        engine = await opened(tmp_path, clock)
        engine.subscribe(on_remove=lambda obj, reason: ram.append((obj.key, reason)),
                         on_disk=lambda kind, block, reason: disk.append((kind, block.key, reason)))
        engine.create_bucket(TENANT, BUCKET)
        keys = fill(engine, 64)
        await settle(engine)
        first = keys[0]
        assert (first, "demoted") in ram
        i = disk.index(("removed", first, "demoted"))
        assert disk[i + 1] == ("stored", first, None)  # at once after it
        engine.store.delete(TENANT, BUCKET, first)
        assert disk[-1] == ("removed", first, "deleted")
        await engine.close()

    run(go)


def test_a_corrupted_record_is_a_counted_miss_never_served(tmp_path: Path) -> None:
    clock = Clock()

    async def go() -> None:
        engine = await opened(tmp_path, clock, disk_promote=False)
        engine.create_bucket(TENANT, BUCKET)
        keys = fill(engine, 64)
        await settle(engine)
        victim = next(k for k in keys if on_flash(engine, k) and not in_ram(engine, k))
        assert engine.tier is not None
        entry = engine.tier.flash.lookup(BUCKET, victim)
        assert entry is not None
        segment = tmp_path / "disk" / f"seg-{entry.segment:016x}.dat"
        with segment.open("r+b") as f:  # one bit of the payload, in the middle
            f.seek(entry.offset + entry.header_len + BLOCK // 2)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0x01]))
        with pytest.raises(errors.NoSuchKey):
            await engine.fetch(TENANT, BUCKET, victim)
        assert engine.operator.stats()["disk_corrupt"] == 1
        with pytest.raises(errors.NoSuchKey):  # dropped: still a miss
            await engine.fetch(TENANT, BUCKET, victim)
        await engine.close()

    run(go)
