"""Payload buffers kept for reuse (ctxstore_server.engine.buffers): a buffer comes back only once nothing refers
to it, what is kept is charged to the budget (or bounded when the budget is full), kept buffers go before any
live block when room is made, and an idle node gives them all back. In-process, fake clock."""

from __future__ import annotations

import gc

import numpy as np
from support.inprocess import FakeClock

from ctxstore_server.engine import Engine, EngineConfig
from ctxstore_server.engine.buffers import IDLE_SECONDS, MIN_POOLED, PAGE, PayloadBuffers
from ctxstore_server.engine.objects import OBJECT_OVERHEAD

T, B = "alice", "blocks"
KiB, MiB = 1 << 10, 1 << 20
BLOCK = 64 * KiB


def make_engine(clock: FakeClock, budget: int = 64 * MiB) -> Engine:
    engine = Engine(EngineConfig(budget=budget, default_ttl=100.0, max_ttl=1000.0, bucket_overhead=0),
                    clock=clock)
    engine.create_bucket(T, B)
    return engine


def address(buf: bytearray | memoryview) -> int:
    return int(np.frombuffer(buf, np.uint8).ctypes.data)


def fill(buf: bytearray | memoryview, byte: int) -> bytearray | memoryview:
    memoryview(buf)[:] = bytes([byte]) * len(buf)
    return buf


def store(engine: Engine, key: str, byte: int, size: int = BLOCK) -> None:
    data = fill(engine.store.buffers.take(size), byte)
    engine.put(T, B, key, data, etag='"x"')


def store_then_delete(engine: Engine, n: int, prefix: str = "k", size: int = BLOCK) -> None:
    """``n`` blocks written, all of them then deleted: their buffers come back to the pool."""
    for i in range(n):
        store(engine, f"{prefix}{i}", i % 251, size)
    for i in range(n):
        engine.store.delete(T, B, f"{prefix}{i}")


def test_buffers_have_the_size_asked_and_take_any_bytes(clock: FakeClock) -> None:
    engine = make_engine(clock)
    for size in (0, 1, MIN_POOLED - 1, MIN_POOLED, (1 << 20) + 3, 8 << 20):
        buf = engine.store.buffers.take(size)
        assert len(buf) == size and not memoryview(buf).readonly
        assert isinstance(buf, bytearray) == (size < MIN_POOLED)  # small ones come from the C heap
        memoryview(buf)[:] = b"\xa5" * size
        assert bytes(buf).count(0xA5) == size


def test_a_dead_blocks_buffer_serves_the_next_block_of_its_size(clock: FakeClock) -> None:
    engine = make_engine(clock)
    pool = engine.store.buffers
    store(engine, "a", 1)
    first = address(engine.store.get(T, B, "a").data)
    assert engine.store.delete(T, B, "a")
    engine.reap()  # sorts in what came back
    assert pool.kept == pool.charged == -(-BLOCK // PAGE) * PAGE
    again = engine.store.buffers.take(BLOCK)
    assert address(again) == first and len(again) == BLOCK
    assert (pool.fresh, pool.reused) == (1, 1)
    assert pool.kept == pool.charged == 0


def test_a_buffer_is_not_reused_while_any_view_of_it_lives(clock: FakeClock) -> None:
    """A reply still sending the old block (or a demotion still writing it) holds a view: the next block of
    the same size must get other memory, and the old bytes stay as they were."""
    engine = make_engine(clock)
    store(engine, "a", 7)
    held = memoryview(engine.store.get(T, B, "a").data)[100:200]  # what a reply in flight holds
    first = address(held) - 100
    assert engine.store.delete(T, B, "a")
    engine.reap()
    for i in range(5):
        store(engine, f"b{i}", 9)
        assert address(engine.store.get(T, B, f"b{i}").data) != first
    assert held.tobytes() == bytes([7]) * 100
    del held
    gc.collect()
    engine.reap()
    assert address(engine.store.buffers.take(BLOCK)) == first


def test_kept_buffers_are_charged_and_room_drops_them_before_any_block(clock: FakeClock) -> None:
    budget = 16 * MiB
    engine = make_engine(clock, budget=budget)
    pool = engine.store.buffers
    # Blocks of 64 KiB, deleted: their buffers are kept, charged up to a sixteenth of the budget, and a
    # 128th more uncharged.
    store_then_delete(engine, 64)
    engine.reap()
    assert pool.charged == pool.keep_limit() == budget // 16
    assert pool.kept - pool.charged == pool.loose_limit() == budget // 128
    assert engine.budget.state == pool.charged
    # Fill the rest of the budget with blocks of another size: the kept buffers give way, no block goes.
    size = 128 * KiB
    fits = (budget - OBJECT_OVERHEAD) // (size + OBJECT_OVERHEAD + 1)
    for i in range(fits):
        store(engine, f"big{i}", 3, size)
    assert engine.operator.stats()["evictions"] == 0
    assert engine.budget.used <= budget
    assert pool.charged < budget // 16


def test_a_full_budget_keeps_a_bounded_uncharged_share(clock: FakeClock) -> None:
    """A full node evicts a block for each new one: the victim's buffer, kept uncharged (the budget has no
    room for it), is the one the next block gets."""
    budget = 8 * MiB
    engine = make_engine(clock, budget=budget)
    pool = engine.store.buffers
    per_block = BLOCK + OBJECT_OVERHEAD + 1
    n = budget // per_block
    for i in range(n + 40):
        store(engine, f"k{i}", i % 251)
        assert engine.budget.used <= budget
        assert pool.kept - pool.charged <= pool.loose_limit()
    assert engine.operator.stats()["evictions"] >= 40
    assert pool.reused >= 35  # after the first evictions every block reuses its victim's buffer
    assert engine.store.get(T, B, f"k{n + 39}").data[0] == (n + 39) % 251


def test_what_comes_back_at_once_is_bounded(clock: FakeClock) -> None:
    """Removing thousands of blocks at once keeps only the pool's limits, not all their memory."""
    engine = make_engine(clock, budget=256 * MiB)
    pool = engine.store.buffers
    store_then_delete(engine, 600)
    assert pool._returned_bytes <= pool.keep_limit() + pool.loose_limit()
    engine.reap()
    assert pool.charged <= pool.keep_limit() and pool.kept - pool.charged <= pool.loose_limit()


def test_an_idle_node_gives_every_kept_buffer_back(clock: FakeClock) -> None:
    engine = make_engine(clock)
    pool = engine.store.buffers
    for i in range(8):
        store(engine, f"k{i}", i)
        engine.store.delete(T, B, f"k{i}")
    engine.reap()
    assert pool.kept > 0
    clock.now += IDLE_SECONDS / 2
    engine.reap()
    assert pool.kept > 0
    clock.now += IDLE_SECONDS
    engine.reap()
    assert pool.kept == pool.charged == 0 and engine.budget.state == 0


def test_a_smaller_budget_shrinks_what_is_kept(clock: FakeClock) -> None:
    engine = make_engine(clock, budget=64 * MiB)
    pool = engine.store.buffers
    store_then_delete(engine, 40)
    engine.reap()
    assert pool.charged > 1 * MiB
    engine.config.budget = 16 * MiB  # what the admin API's settings do
    engine.reap()
    assert pool.charged <= pool.keep_limit() == 1 * MiB
    assert engine.budget.state == pool.charged


def test_buffers_dropped_on_another_thread_come_back(clock: FakeClock) -> None:
    import threading

    budget = Engine(EngineConfig(budget=64 * MiB)).budget
    charged: list[int] = []
    pool = PayloadBuffers(budget, charged.append, clock)
    bufs = [pool.take(BLOCK) for _ in range(4)]
    thread = threading.Thread(target=bufs.clear)
    thread.start()
    thread.join()
    pool.housekeep()
    assert pool.kept == 4 * BLOCK and sum(charged) == 4 * BLOCK


def test_a_size_no_longer_asked_for_gives_its_room_to_another(clock: FakeClock) -> None:
    """Kept 64 KiB buffers fill the pool's share; the node now writes 1 MiB blocks only. Within IDLE_SECONDS
    the small ones go (though buffers are being taken all the time) and the large ones are kept instead."""
    budget = 64 * MiB
    engine = make_engine(clock, budget=budget)
    pool = engine.store.buffers
    store_then_delete(engine, 100, "s")
    engine.reap()
    assert pool.charged == pool.keep_limit()  # all of it small buffers
    for step in range(int(IDLE_SECONDS) + 2):
        for i in range(4):
            store(engine, f"big{step}-{i}", 2, MiB)
            engine.store.delete(T, B, f"big{step}-{i}")
        clock.now += 1
        engine.reap()
    assert MiB in pool._free and -(-BLOCK // PAGE) * PAGE not in pool._free
    reused = pool.reused
    store(engine, "last", 3, MiB)
    assert pool.reused == reused + 1


def test_room_is_made_after_a_size_was_taken_empty(clock: FakeClock) -> None:
    """Regression: taking the last kept buffer of a size left an empty list behind, and making room then
    picked it and failed (IndexError: 500 InternalError on S3 PUTs under mixed load)."""
    budget = 8 * MiB
    engine = make_engine(clock, budget=budget)
    pool = engine.store.buffers
    store(engine, "big", 1, 2 * BLOCK)  # the largest size, kept once, then taken again
    store(engine, "small", 2)
    engine.store.delete(T, B, "big")
    engine.store.delete(T, B, "small")
    engine.reap()
    store(engine, "big2", 3, 2 * BLOCK)
    assert pool.charged > 0
    size = 1 * MiB  # fill the budget: room must come from the kept buffer, then from blocks
    for i in range(12):
        store(engine, f"fill{i}", 4, size)
    assert engine.budget.used <= budget and pool.charged == 0


def test_a_run_taken_at_once_reuses_and_uncharges_as_one_by_one(clock: FakeClock) -> None:
    # A bulk put takes a run's buffers in one call (take_many): same buffers, same charge as taking them singly.
    engine = make_engine(clock, budget=16 * MiB)
    pool = engine.store.buffers
    store_then_delete(engine, 80)
    engine.reap()
    kept, charged = pool.kept, pool.charged
    assert charged == engine.budget.state > 0 and kept > charged
    n = kept // BLOCK - 4  # fewer than are kept, so some charged ones are left
    sizes = [BLOCK] * n + [100, MIN_POOLED - 1]  # the small ones come from the heap, as ever
    reused = pool.reused
    run = pool.take_many(sizes)
    assert [len(b) for b in run] == sizes
    assert pool.kept == kept - n * BLOCK and pool.charged == min(charged, pool.kept) == engine.budget.state
    assert pool.reused == reused + n and len({address(b) for b in run[:n]}) == n
    del run
    gc.collect()
    engine.reap()
    assert pool.kept == kept and pool.charged == charged == engine.budget.state
