"""What a write does: conditional writes (If-None-Match, If-Match), replacing an object, checksums taken or
computed, and the listeners that see every stored and removed object.

Pure and fast: no HTTP, no sleeping. Every engine gets a fake clock that the test advances by hand."""

from __future__ import annotations

import pytest

from ctxstore_server.engine import REMOVAL_REASONS, errors, etag_matches
from support.inprocess import FakeClock

from engine_support import B, T, Recorder, check_accounting, keys_of, make_engine, payload, put


def test_if_none_match_over_a_live_object_fails_and_keeps_it(clock: FakeClock) -> None:
    engine = make_engine(clock)
    old = put(engine, "k0")
    rec = Recorder(engine)
    used = engine.budget.used
    with pytest.raises(errors.PreconditionFailed) as exc:
        put(engine, "k0", payload("other", 10), if_none_match=True)
    assert (exc.value.bucket, exc.value.key) == (B, "k0")
    assert engine.store.get(T, B, "k0") is old and old.live and bytes(old.data) == payload("k0")
    assert engine.budget.used == used and rec.removed == [] and rec.stored == []
    assert engine.store.bucket(T, B).stats.puts == 1
    check_accounting(engine)


def test_if_match(clock: FakeClock) -> None:
    engine = make_engine(clock)
    old = put(engine, "k0")
    with pytest.raises(errors.PreconditionFailed):
        put(engine, "k0", payload("x"), if_match='"0123456789abcdef0123456789abcdef"')
    assert engine.store.get(T, B, "k0") is old
    with pytest.raises(errors.NoSuchKey):
        put(engine, "missing", if_match=old.etag)
    assert keys_of(engine) == ["k0"]
    new = put(engine, "k0", payload("v2"), if_match=old.etag)
    assert engine.store.get(T, B, "k0") is new and not old.live
    newer = put(engine, "k0", payload("v3"), if_match=f'"nope", W/{new.etag}')
    newest = put(engine, "k0", payload("v4"), if_match="*")
    assert not newer.live and engine.store.get(T, B, "k0") is newest
    check_accounting(engine)


def test_etag_matches() -> None:
    assert etag_matches('"abc"', '"abc"')
    assert etag_matches("abc", '"abc"')
    assert etag_matches('W/"abc"', '"abc"')
    assert etag_matches('"x", "abc"', '"abc"')
    assert etag_matches("*", '"abc"')
    assert not etag_matches('"abcd"', '"abc"')
    assert not etag_matches('"x","y"', '"abc"')


def test_replace_keeps_exactly_one_object_and_the_accounting(clock: FakeClock) -> None:
    engine = make_engine(clock)
    rec = Recorder(engine)
    old = put(engine, "k0", b"a" * 100)
    new = put(engine, "k0", b"b" * 300, user_meta={"m": "v"})
    assert rec.reasons() == [("replaced", "k0")] and rec.removed[0][3] is old
    assert not old.live and new.live
    assert keys_of(engine) == ["k0"]
    assert engine.budget.used == new.charge
    s = engine.operator.stats()
    assert (s["objects"], s["bytes"], s["puts"], s["bytes_in"]) == (1, 300, 2, 400)
    assert (s["deletes"], s["evictions"], s["expirations"]) == (0, 0, 0)
    assert bytes(engine.store.get(T, B, "k0").data) == b"b" * 300
    check_accounting(engine)


def test_xxh3_is_computed_or_taken_from_the_caller(clock: FakeClock) -> None:
    import xxhash

    engine = make_engine(clock)
    assert put(engine, "k0", b"hello").xxh3 == xxhash.xxh3_64_intdigest(b"hello")
    assert put(engine, "k1", b"hello", xxh3=42).xxh3 == 42


def test_listeners_get_every_reason(clock: FakeClock) -> None:
    engine = make_engine(clock)
    rec = Recorder(engine)
    a = put(engine, "a1", ttl=10)
    b = put(engine, "b1", ttl=500)
    c = put(engine, "c1", ttl=500)
    c2 = put(engine, "c1", payload("c2"), ttl=500)
    assert engine.store.delete(T, B, "b1")
    put(engine, "d1", ttl=500)
    put(engine, "e1", ttl=500)
    put(engine, "f1", ttl=500)
    clock.advance(10)
    put(engine, "g1", ttl=500)  # a1 expired: it makes the room
    put(engine, "h1", ttl=500)  # full: c1 (v2) is the least recently used
    assert [(reason, key) for reason, _, key, _ in rec.removed] == [
        ("replaced", "c1"), ("deleted", "b1"), ("expired", "a1"), ("evicted", "c1")]
    assert [o for *_, o in rec.removed] == [c, b, a, c2]
    assert all(not o.live for *_, o in rec.removed)
    assert [o.key for o in rec.stored] == ["a1", "b1", "c1", "c1", "d1", "e1", "f1", "g1", "h1"]
    assert {reason for reason, *_ in rec.removed} <= set(REMOVAL_REASONS)
    s = engine.store.bucket(T, B).stats
    assert (s.deletes, s.expirations, s.evictions) == (1, 1, 1)


def test_listener_sees_a_committed_object(clock: FakeClock) -> None:
    engine = make_engine(clock)
    seen = []
    engine.store.on_store.append(lambda obj: seen.append(engine.store.get(T, B, obj.key, record=False) is obj))
    put(engine, "k0")
    assert seen == [True]
