"""Eviction order (ctxstore_server.engine.store): expired objects first, then least recently used, a chain's
tail before its head, replacing in a full store, and a victim found without scanning the buckets.

Pure and fast: no HTTP, no sleeping. Every engine gets a fake clock that the test advances by hand."""

from __future__ import annotations

import pytest

from ctxstore_server.engine import BlockWrite, errors
from support.inprocess import FakeClock

from engine_support import B, SIZE, T, Recorder, check_accounting, check_pins, keys_of, make_engine, payload, put


def test_expired_objects_go_first_even_if_recently_used(clock: FakeClock) -> None:
    engine = make_engine(clock)
    rec = Recorder(engine)
    for i in range(1, 5):
        put(engine, f"k{i}", ttl=500)
    put(engine, "k0", ttl=10)
    clock.advance(5)
    engine.store.get(T, B, "k0")  # most recently used
    clock.advance(5)  # ...and now expired
    put(engine, "k5", ttl=500)
    assert rec.reasons() == [("expired", "k0")]
    assert keys_of(engine) == ["k1", "k2", "k3", "k4", "k5"]
    assert engine.operator.stats()["expirations"] == 1 and engine.operator.stats()["evictions"] == 0
    check_accounting(engine)


def test_only_as_many_expired_objects_as_needed_are_reaped_on_write(clock: FakeClock) -> None:
    engine = make_engine(clock)
    rec = Recorder(engine)
    for i in range(5):
        put(engine, f"k{i}", ttl=10 + i)
    clock.advance(100)
    put(engine, "k5")
    assert rec.reasons() == [("expired", "k0")]  # the earliest expiry first, and only one
    check_accounting(engine)


def test_lru_get_refreshes_recency(clock: FakeClock) -> None:
    engine = make_engine(clock)
    rec = Recorder(engine)
    for i in range(5):
        put(engine, f"k{i}")
    engine.store.get(T, B, "k0")
    put(engine, "k5")
    assert rec.reasons() == [("evicted", "k1")]
    engine.store.lookup(T, B, ["k2", "missing"])  # lookup refreshes recency too
    put(engine, "k6")
    assert rec.reasons()[-1] == ("evicted", "k3")
    check_accounting(engine)


def test_eviction_takes_a_chain_tail_before_its_head(clock: FakeClock) -> None:
    # The keys of one bulk call are a chain's blocks in order: a hole ends the prefix, so what eviction leaves of
    # a chain must be its head. Committed first key first, the head was the oldest and went first.
    engine = make_engine(clock)  # 5 blocks fit
    rec = Recorder(engine)
    chain = [f"c{i}" for i in range(4)]
    out = engine.put_blocks(T, B, [BlockWrite(k, payload(k), '"e"', 0, None) for k in chain], ttl=None,
                            if_absent=False)
    assert [o.key for o in out] == chain  # the outcomes stay in the call's order
    put(engine, "x0")
    put(engine, "x1")
    put(engine, "x2")
    assert [k for _, k in rec.reasons()] == ["c3", "c2"]
    assert sorted(keys_of(engine)) == ["c0", "c1", "x0", "x1", "x2"]  # the chain's head, no hole
    # A bulk read (lookup, get) ranks the same way: the first key it names becomes the most recent.
    engine.store.lookup(T, B, ["c0", "c1", "x0"])
    put(engine, "x3")
    put(engine, "x4")
    assert [k for _, k in rec.reasons()][2:] == ["x1", "x2"]
    put(engine, "x5")
    assert [k for _, k in rec.reasons()][4:] == ["x0"]
    check_accounting(engine)


def test_lru_head_does_not_refresh_recency(clock: FakeClock) -> None:
    engine = make_engine(clock)
    rec = Recorder(engine)
    for i in range(5):
        put(engine, f"k{i}")
    hits = engine.operator.stats()["hits"]
    assert engine.store.get(T, B, "k0", record=False).key == "k0"
    assert engine.operator.stats()["hits"] == hits  # not counted either
    put(engine, "k5")
    assert rec.reasons() == [("evicted", "k0")]


def test_replacing_refreshes_recency(clock: FakeClock) -> None:
    engine = make_engine(clock)
    rec = Recorder(engine)
    for i in range(5):
        put(engine, f"k{i}")
    put(engine, "k0", payload("v2"))
    assert rec.reasons() == [("replaced", "k0")]
    put(engine, "k5")
    assert rec.reasons()[-1] == ("evicted", "k1")


def test_replacing_in_a_full_store_counts_the_old_object_as_free(clock: FakeClock) -> None:
    engine = make_engine(clock)
    rec = Recorder(engine)
    for i in range(5):
        put(engine, f"k{i}")
    put(engine, "k3", payload("v2"))  # same charge: nothing else has to go
    assert rec.reasons() == [("replaced", "k3")]
    put(engine, "k2", payload("v2", SIZE + 1500))  # 1500 more: k0 and k1 (LRU) go, not k2 itself
    assert rec.reasons()[1:] == [("evicted", "k0"), ("evicted", "k1"), ("replaced", "k2")]
    assert keys_of(engine) == ["k2", "k3", "k4"] and engine.budget.used == 4500
    check_accounting(engine)


def test_replacing_a_pinned_object_when_everything_is_pinned(clock: FakeClock) -> None:
    engine = make_engine(clock)
    rec = Recorder(engine)
    for i in range(5):
        put(engine, f"k{i}")
    engine.store.pin(T, B, [f"k{i}" for i in range(5)], 60)
    new = put(engine, "k1", payload("v2"))  # fits in the room of the object it replaces
    assert rec.reasons() == [("replaced", "k1")] and engine.store.get(T, B, "k1") is new
    assert engine.budget.pinned == 4000  # the new object is not pinned
    old = engine.store.get(T, B, "k2")
    with pytest.raises(errors.InsufficientCapacity):
        put(engine, "k2", payload("v2", SIZE + 1500))  # only k1 can go: not enough
    # The failed write changed nothing: the old value is still there and nothing was evicted.
    assert engine.store.get(T, B, "k2") is old and keys_of(engine) == [f"k{i}" for i in range(5)]
    assert rec.reasons() == [("replaced", "k1")]
    check_accounting(engine)
    check_pins(engine)


def test_choosing_a_victim_does_not_scan_the_buckets(clock: FakeClock) -> None:
    """The oldest object across thousands of buckets is found through the heads' heap (the LRU order holds)."""
    engine = make_engine(clock, budget=2_000_000, max_object_size=1000, max_buckets_per_tenant=5000)
    names = [f"b{i:04d}" for i in range(2000)]
    for name in names:
        engine.create_bucket(T, name)
        put(engine, "k", b"x" * 10, bucket=name)
    for name in names[:500]:  # read the first 500 again: they become the most recent
        engine.store.get(T, name, "k")
    oldest = [names[500], names[501], names[502]]
    rec = Recorder(engine)
    engine.operator.set_limits(budget=engine.budget.used - 2 * 720)  # room for three fewer objects
    assert [(reason, obj.bucket) for reason, _, _, obj in rec.removed[:3]] == [("evicted", n) for n in oldest]
    check_accounting(engine)
