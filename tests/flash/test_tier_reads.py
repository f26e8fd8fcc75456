"""The flash tier's reads, in process: one device read per record however many callers want it at once (a
prefetch and the get that follows it, concurrent gets, a cancelled or failed reader), never a version older
than a write or delete that happened during the read, and RAM back within the budget once reads are done.

A real flash store on real files under tmp_path, driven through the engine's facade on one event loop. How
much the device read is the flash store's own counter (``disk_bytes_read``): records are read whole, in runs
of adjacent records rounded to 4 KiB blocks, so reading each record once costs a little more than its payload
and reading it twice costs twice that."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
from flash_support import Clock, check_payload, make_payload

from ctxstore_server.engine import Engine, EngineConfig, StoredObject, errors

T = TypeVar("T")
KiB, MiB = 1 << 10, 1 << 20
TENANT, BUCKET = "t", "b"
BLOCK = 64 * KiB


def run(make: Callable[[], Awaitable[T]]) -> T:
    return asyncio.run(make())  # type: ignore[arg-type]


async def opened(tmp: Path, clock: Clock, **overrides: Any) -> Engine:
    # Every block straight to flash (disk_direct_size=1): what is read afterwards comes from the device.
    values: dict[str, Any] = dict(budget=8 * MiB, disk_path=str(tmp / "disk"), disk_size=64 * MiB,
                                  disk_segment_size=4 * MiB, bucket_overhead=0, upload_overhead=0,
                                  part_overhead=0, disk_min_ttl=1.0, disk_direct_size=1)
    values.update(overrides)
    engine = Engine(EngineConfig(**values), clock=clock)
    await engine.open()
    engine.create_bucket(TENANT, BUCKET)
    return engine


def put(engine: Engine, key: str, version: int = 0, size: int = BLOCK) -> StoredObject:
    data = make_payload(key, version, size)
    return engine.put(TENANT, BUCKET, key, data, etag=f'"{hashlib.md5(data).hexdigest()}"')


async def drain(engine: Engine) -> None:
    """Until every block written is on flash: none queued, none waiting for the queue."""
    tier = engine.tier
    assert tier is not None
    for _ in range(200):
        await tier.flash.flush()
        await asyncio.sleep(0.005)
        if not tier.writes.demoting and not tier.writes.direct_waiting:
            return
    raise AssertionError("demotions did not settle")


async def on_flash(engine: Engine, keys: list[str], size: int = BLOCK) -> None:
    for start in range(0, len(keys), 64):
        for key in keys[start:start + 64]:
            put(engine, key, size=size)
        await drain(engine)
    assert not any(k in engine.store.buckets[BUCKET].objects for k in keys)


def device_bytes(engine: Engine) -> int:
    assert engine.tier is not None
    return engine.tier.flash.stats().device_bytes_read


def in_ram(engine: Engine, key: str) -> bool:
    obj = engine.store.buckets[BUCKET].objects.get(key)
    return obj is not None and obj.live


class Gate:
    """Holds back what the flash store's reads found until opened, and counts the reads: a device read in
    flight for as long as a test needs. ``fail``: the reads it held raise instead."""

    def __init__(self, engine: Engine, monkeypatch: pytest.MonkeyPatch, *, first_only: bool = False,
                 fail: bool = False) -> None:
        assert engine.tier is not None
        self.opened = asyncio.Event()
        self.calls: list[list[str]] = []
        flash = engine.tier.flash
        real = flash.read_many

        async def read_many(bucket: str, keys: Any) -> Any:
            self.calls.append(list(keys))
            found = await real(bucket, keys)
            if not first_only or len(self.calls) == 1:
                await self.opened.wait()
                if fail:
                    raise OSError("the test's device failed")
            return found

        monkeypatch.setattr(flash, "read_many", read_many)

    def open(self) -> None:
        self.opened.set()


async def turns(n: int = 5) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


# ---------------------------------------------------------------------------- one read per record


def test_a_prefetch_and_the_get_that_follows_it_read_each_record_once(tmp_path: Path) -> None:
    """What the vLLM connector does: prefetch a prefix, then load it at once. The get used to read every record
    the prefetch was reading a second time (twice the payload read from the device)."""
    clock = Clock()

    async def go() -> None:
        engine = await opened(tmp_path, clock)
        keys = [f"k{i:03d}" for i in range(48)]  # 3 MiB against 8 MiB: every block can be promoted
        await on_flash(engine, keys)
        before = device_bytes(engine)
        assert engine.prefetch(TENANT, BUCKET, keys)["started"] == 48
        got = await engine.fetch_many(TENANT, BUCKET, keys)
        assert [check_payload(k, o.data) if o else None for k, o in zip(keys, got)] == [0] * 48
        for _ in range(100):
            await asyncio.sleep(0.01)
            if all(in_ram(engine, k) for k in keys):
                break
        assert all(in_ram(engine, k) for k in keys)
        read = device_bytes(engine) - before
        assert 48 * BLOCK <= read < 1.1 * 48 * BLOCK, read / (48 * BLOCK)
        stats = engine.operator.stats()
        assert stats["promotions"] == 48 and stats["disk_corrupt"] == 0
        # In RAM now: another prefetch reads nothing.
        assert engine.prefetch(TENANT, BUCKET, keys)["started"] == 0
        await engine.close()

    run(go)


def test_concurrent_gets_of_the_same_flash_blocks_share_one_read(tmp_path: Path) -> None:
    clock = Clock()

    async def go() -> None:
        engine = await opened(tmp_path, clock, disk_promote=False)  # every get would read the device
        keys = [f"k{i:03d}" for i in range(32)]
        await on_flash(engine, keys)
        before, used = device_bytes(engine), engine.budget.used
        answers = await asyncio.gather(*(engine.fetch_many(TENANT, BUCKET, keys) for _ in range(4)),
                                       engine.fetch(TENANT, BUCKET, keys[5]))
        read = device_bytes(engine) - before
        assert 32 * BLOCK <= read < 1.1 * 32 * BLOCK, read / (32 * BLOCK)
        *gets, single = answers
        for got in gets:
            assert [check_payload(k, o.data) if o else None for k, o in zip(keys, got)] == [0] * 32
        assert check_payload(keys[5], single.data) == 0
        # Each reader has its own object (sent and counted on its own), over the one payload read.
        assert gets[0][5] is not gets[1][5] and gets[0][5] is not single
        releases = [engine.store.lease(o) for got in gets for o in got if o is not None]
        assert engine.budget.sending > 0
        for release in releases:
            release()
        assert engine.budget.used == used and engine.budget.sending == 0
        assert engine.tier is not None and not engine.tier.reads._reading  # nothing left joinable
        await engine.close()

    run(go)


def test_a_cancelled_reader_leaves_the_read_to_the_others(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock()

    async def go() -> None:
        engine = await opened(tmp_path, clock, disk_promote=False)
        keys = [f"k{i:03d}" for i in range(8)]
        await on_flash(engine, keys)
        gate = Gate(engine, monkeypatch)
        first = asyncio.create_task(engine.fetch_many(TENANT, BUCKET, keys))
        await turns()
        second = asyncio.create_task(engine.fetch_many(TENANT, BUCKET, keys))
        await turns()
        first.cancel()  # its client went away while the device was reading
        await turns()
        gate.open()
        got = await second
        assert first.cancelled()
        assert [check_payload(k, o.data) if o else None for k, o in zip(keys, got)] == [0] * 8
        assert gate.calls == [keys], "the second get joined the first one's read"
        assert engine.tier is not None and not engine.tier.reads._reading
        await engine.close()

    run(go)


def test_a_read_that_fails_is_a_miss_for_every_reader(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock()

    async def go() -> None:
        engine = await opened(tmp_path, clock, disk_promote=False)
        keys = [f"k{i:03d}" for i in range(8)]
        await on_flash(engine, keys)
        gate = Gate(engine, monkeypatch, fail=True)
        readers = [asyncio.create_task(engine.fetch_many(TENANT, BUCKET, keys)) for _ in range(3)]
        await turns()
        gate.open()
        for reader in readers:
            assert await reader == [None] * 8  # misses (the client recomputes), never an error
        assert len(gate.calls) == 1
        monkeypatch.undo()  # the device is back: the next read reads again
        got = await engine.fetch_many(TENANT, BUCKET, keys)
        assert [check_payload(k, o.data) if o else None for k, o in zip(keys, got)] == [0] * 8
        await engine.close()

    run(go)


# ---------------------------------------------------------------------------- versions


def test_a_block_deleted_while_it_is_being_read_is_served_to_no_reader(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader that got the deleted version promoted it back into RAM: the delete was undone."""
    clock = Clock()

    async def go() -> None:
        engine = await opened(tmp_path, clock)
        await on_flash(engine, ["gone"])
        gate = Gate(engine, monkeypatch, first_only=True)
        early = asyncio.create_task(engine.fetch(TENANT, BUCKET, "gone"))
        await turns()
        assert engine.store.delete(TENANT, BUCKET, "gone")
        late = asyncio.create_task(engine.fetch(TENANT, BUCKET, "gone"))
        await turns()
        gate.open()
        for reader in (early, late):
            with pytest.raises(errors.NoSuchKey):
                await reader
        assert not in_ram(engine, "gone")
        with pytest.raises(errors.NoSuchKey):
            await engine.fetch(TENANT, BUCKET, "gone")
        await engine.close()

    run(go)


@pytest.mark.parametrize("landed", [False, True], ids=["queued", "on-flash"])
def test_a_block_overwritten_while_it_is_being_read_is_served_in_its_new_version(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, landed: bool) -> None:
    clock = Clock()

    async def go() -> None:
        engine = await opened(tmp_path, clock, disk_promote=False)
        await on_flash(engine, ["k"])
        gate = Gate(engine, monkeypatch, first_only=True)
        early = asyncio.create_task(engine.fetch(TENANT, BUCKET, "k"))
        await turns()
        put(engine, "k", version=1)  # straight to flash again: queued, then written
        if landed:
            await drain(engine)
        late = asyncio.create_task(engine.fetch(TENANT, BUCKET, "k"))
        await turns()
        gate.open()
        assert check_payload("k", (await early).data) == 1
        assert check_payload("k", (await late).data) == 1
        await engine.close()

    run(go)


# ---------------------------------------------------------------------------- RAM at rest


def test_ram_is_back_within_the_budget_once_flash_reads_are_done(tmp_path: Path) -> None:
    """The read buffers the flash store keeps for the next read are charged to the budget (state); charging
    them after reads had filled RAM with promoted blocks left the node over its budget until the next write."""
    clock = Clock()

    async def go() -> None:
        engine = await opened(tmp_path, clock, disk_size=128 * MiB)
        keys = [f"k{i:04d}" for i in range(384)]  # 24 MiB: three times RAM
        await on_flash(engine, keys)
        for start in range(0, len(keys), 8):  # reads of 512 KiB: the flash store keeps their 1 MiB buffers
            got = await engine.fetch_many(TENANT, BUCKET, keys[start:start + 8])
            assert all(o is not None and check_payload(k, o.data) == 0 for k, o in zip(keys[start:], got))
            releases = [engine.store.lease(o) for o in got if o is not None]  # sent, then done
            for release in releases:
                release()
            del got
        engine.prefetch(TENANT, BUCKET, keys[:64])
        for _ in range(100):
            await asyncio.sleep(0.01)
            if all(in_ram(engine, k) for k in keys[:64]):
                break
        await engine.housekeep_disk()  # what a node does every second
        assert engine.tier is not None
        stats = engine.operator.stats()
        kept = engine.tier.flash.stats().buffer_bytes
        assert kept > 0, "the read buffers came back (promoted blocks are copies, not views of them)"
        assert stats["state_bytes"] >= kept + stats["disk_index_bytes"]
        assert stats["sending_bytes"] == 0
        assert stats["used"] <= stats["budget"], stats["used"] / stats["budget"]
        assert stats["promotions"] > 0
        await engine.close()

    run(go)


def test_read_buffers_give_way_when_no_room_can_be_made(tmp_path: Path) -> None:
    """Everything in RAM pinned: the kept read buffers are trimmed to the room left instead of going over."""
    clock = Clock()

    async def go() -> None:
        engine = await opened(tmp_path, clock, disk_direct_size=BLOCK)
        keys = [f"k{i:04d}" for i in range(64)]
        await on_flash(engine, keys)
        got = await engine.fetch_many(TENANT, BUCKET, keys[:8])
        assert all(o is not None for o in got)
        del got
        # The read's last references go with the loop's turn and the reader threads' return (later on a busy
        # machine): wait for its buffers to come back, at most 5 s.
        assert engine.tier is not None
        for _ in range(500):
            if engine.tier.flash.stats().buffer_bytes > 0:
                break
            await asyncio.sleep(0.01)
        assert engine.tier.flash.stats().buffer_bytes > 0
        pinned = 0
        for i in range(200):  # fill RAM with pinned blocks (smaller than direct writes: they stay in RAM)
            try:
                obj = engine.put(TENANT, BUCKET, f"p{i}", b"x" * (48 * KiB), etag='"x"')
            except errors.InsufficientCapacity:
                break
            engine.store.pin(TENANT, BUCKET, [obj.key], 600)
            pinned += 1
        assert pinned > 0
        await engine.housekeep_disk()
        stats = engine.operator.stats()
        assert stats["used"] <= stats["budget"], stats["used"] / stats["budget"]
        await engine.close()

    run(go)
