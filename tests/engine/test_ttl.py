"""TTL: per-object and default TTLs and their cap, expired objects invisible at once and reaped in bounded
batches, touch and sliding TTLs that extend and never shorten.

Pure and fast: no HTTP, no sleeping. Every engine gets a fake clock that the test advances by hand."""

from __future__ import annotations

import math

import pytest

from ctxstore_server.engine import errors
from support.inprocess import FakeClock

from engine_support import B, T, T0, Recorder, check_accounting, keys_of, make_engine, payload, put


def test_per_object_ttl(clock: FakeClock) -> None:
    engine = make_engine(clock)
    obj = put(engine, "k0", ttl=30)
    assert obj.ttl == 30 and obj.expires_at == T0 + 30
    clock.advance(29.5)
    assert engine.store.get(T, B, "k0") is obj
    clock.advance(0.5)
    with pytest.raises(errors.NoSuchKey):
        engine.store.get(T, B, "k0")


def test_ttl_defaults_and_cap(clock: FakeClock) -> None:
    engine = make_engine(clock, default_ttl=100.0, max_ttl=1000.0)
    assert put(engine, "k0").ttl == 100.0  # server default
    engine.store.bucket(T, B).default_ttl = 250.0
    assert put(engine, "k1").ttl == 250.0  # bucket default
    assert put(engine, "k2", ttl=7.5).ttl == 7.5  # request wins
    assert put(engine, "k3", ttl=5000).ttl == 1000.0  # capped
    engine.store.bucket(T, B).default_ttl = 9000.0
    assert put(engine, "k4").ttl == 1000.0  # the bucket default is capped too
    assert put(engine, "k5", ttl=math.inf).ttl == 1000.0


@pytest.mark.parametrize("ttl", [0, 0.0, -1, -0.5, math.nan])
def test_invalid_ttl_is_rejected(clock: FakeClock, ttl: float) -> None:
    engine = make_engine(clock)
    with pytest.raises(errors.InvalidArgument):
        put(engine, "k0", ttl=ttl)
    assert keys_of(engine) == [] and engine.budget.used == 0
    put(engine, "k1")
    with pytest.raises(errors.InvalidArgument):
        engine.store.touch(T, B, ["k1"], ttl)
    with pytest.raises(errors.InvalidArgument):
        engine.multipart.create(T, B, "mp", ttl=ttl, content_type="x", headers={}, user_meta={})
    assert engine.multipart.uploads == {}


def test_expired_objects_are_invisible_at_once(clock: FakeClock) -> None:
    engine = make_engine(clock)
    rec = Recorder(engine)
    old = put(engine, "k0", ttl=10)
    put(engine, "k1", ttl=100)
    clock.advance(10)
    with pytest.raises(errors.NoSuchKey):
        engine.store.get(T, B, "k0", record=False)
    assert engine.store.lookup(T, B, ["k0", "k1"])[0] is None
    assert keys_of(engine) == ["k1"]
    with pytest.raises(errors.NoSuchKey):
        put(engine, "k0", if_match=old.etag)  # an expired object matches nothing
    assert engine.store.delete(T, B, "k0") is False
    new = put(engine, "k0", payload("v2"), if_none_match=True)  # nothing live there
    assert engine.store.get(T, B, "k0") is new
    assert all(reason == "expired" for reason, _ in rec.reasons())
    check_accounting(engine)


def test_expired_objects_are_invisible_before_they_are_reaped(clock: FakeClock) -> None:
    # No read path runs here, so the expired object is still held; every check must still skip it.
    engine = make_engine(clock)
    old = put(engine, "k0", ttl=10)
    clock.advance(10)
    assert list(engine.store.iter_objects(T, B)) == []
    assert engine.store.bucket(T, B).objects["k0"] is old  # still held, invisible
    rec = Recorder(engine)
    put(engine, "k0", payload("v2"), if_none_match=True)
    assert rec.reasons() == [("expired", "k0")]
    assert engine.operator.stats()["expirations"] == 1


def test_delete_returns_whether_a_live_object_was_removed(clock: FakeClock) -> None:
    engine = make_engine(clock)
    rec = Recorder(engine)
    put(engine, "k0", ttl=10)
    put(engine, "k1", ttl=10)
    assert engine.store.delete(T, B, "k0") is True
    assert engine.store.delete(T, B, "k0") is False
    assert engine.store.delete(T, B, "never") is False
    clock.advance(10)
    assert engine.store.delete(T, B, "k1") is False
    assert rec.reasons() == [("deleted", "k0"), ("expired", "k1")]
    s = engine.operator.stats()
    assert (s["deletes"], s["expirations"], s["objects"]) == (1, 1, 0)
    assert engine.budget.used == 0


def test_reap_reclaims_expired_objects_in_bounded_batches(clock: FakeClock) -> None:
    engine = make_engine(clock, budget=100_000)
    rec = Recorder(engine)
    for i in range(10):
        put(engine, f"e{i}", ttl=10 + i)
    for i in range(3):
        put(engine, f"l{i}", ttl=100)
    assert engine.reap() == 0
    clock.advance(50)
    assert engine.reap(limit=4) == 4
    assert engine.budget.used == 9 * 1000  # 6 expired still held + 3 live
    assert [k for _, k in rec.reasons()] == ["e0", "e1", "e2", "e3"]  # earliest expiry first
    assert engine.reap(limit=4) == 4
    assert engine.reap(limit=4) == 2
    assert engine.reap(limit=4) == 0
    assert engine.budget.used == 3000
    assert keys_of(engine) == ["l0", "l1", "l2"]
    assert engine.operator.stats()["expirations"] == 10
    assert engine.store.bucket(T, B).stats.expirations == 10
    assert all(reason == "expired" for reason, _ in rec.reasons())
    check_accounting(engine)


def test_reap_skips_objects_whose_ttl_was_extended(clock: FakeClock) -> None:
    engine = make_engine(clock)
    put(engine, "k0", ttl=10)
    engine.store.touch(T, B, ["k0"], 100)
    clock.advance(50)
    assert engine.reap() == 0
    assert keys_of(engine) == ["k0"]
    clock.advance(50)
    assert engine.reap() == 1


def test_touch_extends_and_never_shortens(clock: FakeClock) -> None:
    engine = make_engine(clock, max_ttl=1000.0)
    obj = put(engine, "k0", ttl=100)
    put(engine, "k1", ttl=10)
    clock.advance(50)
    assert engine.store.touch(T, B, ["k0", "missing"], 10) == 1  # live, but 10s would shorten it
    assert obj.expires_at == T0 + 100
    assert engine.store.touch(T, B, ["k0"]) == 1  # its own TTL again, from now
    assert obj.expires_at == T0 + 150
    assert engine.store.touch(T, B, ["k0"], 5000) == 1  # capped by max_ttl
    assert obj.expires_at == T0 + 50 + 1000
    assert engine.store.touch(T, B, ["k1"], 100) == 0  # k1 expired at T0+10: touch does not resurrect
    with pytest.raises(errors.NoSuchKey):
        engine.store.get(T, B, "k1")
    clock.advance(999)
    assert engine.store.get(T, B, "k0") is obj
    clock.advance(1)
    with pytest.raises(errors.NoSuchKey):
        engine.store.get(T, B, "k0")


def test_sliding_ttl_extends_on_get_only(clock: FakeClock) -> None:
    engine = make_engine(clock)
    engine.store.bucket(T, B).sliding_ttl = True
    engine.create_bucket(T, "fixed")
    obj = put(engine, "k0", ttl=10)
    fixed = put(engine, "k0", bucket="fixed", ttl=10)
    clock.advance(8)
    assert engine.store.get(T, "fixed", "k0") is fixed
    assert fixed.expires_at == T0 + 10  # not a sliding bucket
    for _ in range(5):
        assert engine.store.get(T, B, "k0") is obj
        assert obj.expires_at == clock.now + 10
        clock.advance(8)
    engine.store.get(T, B, "k0", record=False)  # HEAD does not slide
    assert obj.expires_at == clock.now - 8 + 10
    engine.store.lookup(T, B, ["k0"])  # lookup reads: it slides
    assert obj.expires_at == clock.now + 10
    clock.advance(10)
    with pytest.raises(errors.NoSuchKey):
        engine.store.get(T, B, "k0")
    with pytest.raises(errors.NoSuchKey):
        engine.store.get(T, "fixed", "k0")  # never slid
    assert fixed.expires_at == T0 + 10


def test_sliding_ttl_does_not_shorten_a_touched_object(clock: FakeClock) -> None:
    engine = make_engine(clock)
    engine.store.bucket(T, B).sliding_ttl = True
    obj = put(engine, "k0", ttl=10)
    engine.store.touch(T, B, ["k0"], 500)
    assert obj.expires_at == T0 + 500
    engine.store.get(T, B, "k0")
    assert obj.expires_at == T0 + 500
    clock.advance(100)
    assert engine.store.get(T, B, "k0") is obj


def test_a_lookup_that_names_an_expired_key_twice_removes_it_once(clock: FakeClock) -> None:
    engine = make_engine(clock)
    events = Recorder(engine)
    engine.put(T, B, "gone", payload(1), etag='"e"', ttl=1)
    engine.put(T, B, "kept", payload(2), etag='"e"', ttl=100)
    clock.advance(2)
    found = engine.store.lookup(T, B, ["gone", "kept", "gone", "kept"])
    assert [o.key if o is not None else None for o in found] == [None, "kept", None, "kept"]
    assert events.reasons() == [("expired", "gone")]
    stats = engine.operator.stats()
    assert stats["objects"] == 1 and stats["hits"] == 2 and stats["misses"] == 2
    engine.store.delete(T, B, "kept")
    assert engine.budget.used == engine.store.budget.state  # every object's charge came back exactly once
