"""Pins: a pinned object is never evicted, a pin is capped and never shortened, and ``pinned_bytes`` stays exact
through repins, unpins, deletes and expiry.

Pure and fast: no HTTP, no sleeping. Every engine gets a fake clock that the test advances by hand."""

from __future__ import annotations

import math

import pytest

from ctxstore_server.engine import errors
from support.inprocess import FakeClock

from engine_support import B, T, T0, Recorder, check_accounting, check_pins, keys_of, make_engine, payload, put


def test_pinned_objects_are_never_evicted(clock: FakeClock) -> None:
    engine = make_engine(clock)
    rec = Recorder(engine)
    for i in range(5):
        put(engine, f"k{i}")
    assert engine.store.pin(T, B, ["k0", "k2", "missing"], 60) == 2
    for i in range(5, 12):
        put(engine, f"k{i}")
        clock.advance(1)
    evicted = [k for reason, k in rec.reasons() if reason == "evicted"]
    assert "k0" not in evicted and "k2" not in evicted
    assert evicted[:3] == ["k1", "k3", "k4"]  # the others in LRU order
    assert {"k0", "k2"} <= set(keys_of(engine))
    check_accounting(engine)
    check_pins(engine)


def test_pin_expiry_makes_the_object_evictable_again(clock: FakeClock) -> None:
    engine = make_engine(clock)
    rec = Recorder(engine)
    for i in range(5):
        put(engine, f"k{i}", ttl=1000)
    engine.store.pin(T, B, [f"k{i}" for i in range(5)], 10)
    clock.advance(9.5)
    with pytest.raises(errors.InsufficientCapacity):
        put(engine, "k5")
    clock.advance(0.5)  # pins end at exactly now: no longer pinned
    put(engine, "k5")
    assert rec.reasons() == [("evicted", "k0")]
    check_accounting(engine)
    check_pins(engine)


def test_pin_is_capped_by_max_pin_and_never_shortened(clock: FakeClock) -> None:
    engine = make_engine(clock, max_pin=30.0)
    for i in range(5):
        put(engine, f"k{i}", ttl=1000)
    assert engine.store.pin(T, B, ["k0"], 1e9) == 1
    assert engine.store.bucket(T, B).objects["k0"].pinned_until == T0 + 30
    assert engine.store.pin(T, B, ["k0"], 5) == 1  # counted, but does not shorten the pin
    assert engine.store.bucket(T, B).objects["k0"].pinned_until == T0 + 30
    assert engine.budget.pinned == 1000
    clock.advance(30)
    put(engine, "k5")
    assert "k0" not in keys_of(engine)
    check_pins(engine)


@pytest.mark.parametrize("seconds", [0, -1, math.nan])
def test_pin_rejects_non_positive_durations(clock: FakeClock, seconds: float) -> None:
    engine = make_engine(clock)
    put(engine, "k0")
    with pytest.raises(errors.InvalidArgument):
        engine.store.pin(T, B, ["k0"], seconds)
    assert engine.budget.pinned == 0


def test_pin_skips_expired_and_missing_objects(clock: FakeClock) -> None:
    engine = make_engine(clock)
    put(engine, "k0", ttl=5)
    put(engine, "k1", ttl=50)
    clock.advance(5)
    assert engine.store.pin(T, B, ["k0", "k1", "nope"], 60) == 1
    assert engine.budget.pinned == 1000
    check_pins(engine)


def test_unpin_makes_objects_evictable(clock: FakeClock) -> None:
    engine = make_engine(clock)
    rec = Recorder(engine)
    for i in range(5):
        put(engine, f"k{i}")
    engine.store.pin(T, B, ["k0", "k1"], 60)
    assert engine.budget.pinned == 2000
    assert engine.store.unpin(T, B, ["k0", "k4", "missing"]) == 1  # k4 was not pinned
    assert engine.budget.pinned == 1000
    put(engine, "k5")
    assert rec.reasons() == [("evicted", "k0")]
    check_pins(engine)


def test_pinned_bytes_after_repinning_an_expired_pin(clock: FakeClock) -> None:
    engine = make_engine(clock)
    for i in range(5):
        put(engine, f"k{i}", ttl=1000)
    engine.store.pin(T, B, ["k0"], 10)
    clock.advance(20)  # the pin ended; nothing has drained it yet
    engine.store.pin(T, B, ["k0"], 10)
    clock.advance(20)
    check_pins(engine)  # nothing is pinned any more
    # Consequence of a miscount: a write would believe everything evictable is pinned.
    engine.store.pin(T, B, ["k1", "k2", "k3", "k4"], 100)
    put(engine, "k5")
    assert "k0" not in keys_of(engine)


def test_pinned_bytes_after_deleting_an_object_whose_pin_ended(clock: FakeClock) -> None:
    engine = make_engine(clock)
    for i in range(5):
        put(engine, f"k{i}", ttl=1000)
    engine.store.pin(T, B, ["k0"], 10)
    clock.advance(20)
    assert engine.store.delete(T, B, "k0") is True
    check_pins(engine)
    put(engine, "k0")
    engine.store.pin(T, B, ["k1", "k2", "k3", "k4"], 100)
    put(engine, "k5")  # k0 is the only unpinned object: it must be evictable
    assert "k0" not in keys_of(engine)


def test_pinned_bytes_after_unpin_and_repin_to_the_same_instant(clock: FakeClock) -> None:
    engine = make_engine(clock)
    for i in range(3):
        put(engine, f"k{i}", ttl=1000)
    engine.store.pin(T, B, ["k0"], 10)
    engine.store.unpin(T, B, ["k0"])
    engine.store.pin(T, B, ["k0"], 10)  # the same end as the first pin
    assert engine.budget.pinned == 1000
    clock.advance(10)
    check_pins(engine)


def test_pinned_bytes_when_a_pinned_object_is_replaced_deleted_or_expires(clock: FakeClock) -> None:
    engine = make_engine(clock)
    for i in range(4):
        put(engine, f"k{i}", ttl=50)
    engine.store.pin(T, B, ["k0", "k1", "k2", "k3"], 100)
    put(engine, "k0", payload("v2"))  # replaced: the new object is not pinned
    assert engine.store.delete(T, B, "k1") is True
    assert engine.budget.pinned == 2000
    check_pins(engine)
    clock.advance(50)  # k2, k3 expire while pinned
    assert engine.reap() == 2
    check_pins(engine)
    assert engine.budget.pinned == 0
    check_accounting(engine)


def test_max_pinned_scan_bounds_the_work_of_one_write(clock: FakeClock) -> None:
    engine = make_engine(clock, max_pinned_scan=2)
    for i in range(5):
        put(engine, f"k{i}")
    engine.store.pin(T, B, ["k0", "k1", "k2"], 60)
    with pytest.raises(errors.InsufficientCapacity):
        put(engine, "k5")
    check_accounting(engine)
