"""Buckets: tenants see only their own, deleting a bucket, and listing its objects in code-point order.

Pure and fast: no HTTP, no sleeping. Every engine gets a fake clock that the test advances by hand."""

from __future__ import annotations

import hashlib

import pytest

from ctxstore_server.engine import errors
from support.inprocess import FakeClock

from engine_support import B, T, check_accounting, keys_of, make_engine, put


def test_tenancy(clock: FakeClock) -> None:
    engine = make_engine(clock)
    assert engine.create_bucket(T, B) is False  # already own it: not an error
    with pytest.raises(errors.BucketAlreadyExists):
        engine.create_bucket("bob", B)
    assert engine.create_bucket("bob", "bobs") is True
    engine.create_bucket(T, "a-second")
    assert [b.name for b in engine.store.list_buckets(T)] == ["a-second", B]
    assert [b.name for b in engine.store.list_buckets("bob")] == ["bobs"]
    assert engine.store.list_buckets("carol") == []
    put(engine, "k0")
    for call in (lambda: engine.store.bucket("bob", B), lambda: engine.store.get("bob", B, "k0"),
                 lambda: put(engine, "k1", tenant="bob"), lambda: engine.store.delete("bob", B, "k0"),
                 lambda: list(engine.store.iter_objects("bob", B)), lambda: engine.store.lookup("bob", B, ["k0"]),
                 lambda: engine.store.pin("bob", B, ["k0"], 10), lambda: engine.store.touch("bob", B, ["k0"]),
                 lambda: engine.delete_bucket("bob", B),
                 lambda: engine.multipart.create("bob", B, "k", ttl=None, content_type="", headers={},
                                              user_meta={})):
        with pytest.raises(errors.AccessDenied):
            call()
    with pytest.raises(errors.NoSuchBucket):
        engine.store.get(T, "nope", "k0")
    assert keys_of(engine) == ["k0"]


def test_delete_bucket(clock: FakeClock) -> None:
    engine = make_engine(clock)
    put(engine, "k0", ttl=10)
    put(engine, "k1", ttl=20)
    with pytest.raises(errors.BucketNotEmpty):
        engine.delete_bucket(T, B)
    clock.advance(10)
    with pytest.raises(errors.BucketNotEmpty):
        engine.delete_bucket(T, B)
    assert keys_of(engine) == ["k1"]
    clock.advance(10)
    upload = engine.multipart.create(T, B, "mp", ttl=None, content_type="x", headers={}, user_meta={})
    engine.multipart.put_part(T, B, "mp", upload.upload_id, 1, b"x" * 50, md5=hashlib.md5(b"x" * 50).digest(),
                    checksums={})
    engine.delete_bucket(T, B)  # only expired objects (and an upload in flight) left
    assert B not in engine.store.buckets and engine.store.list_buckets(T) == []
    assert engine.budget.used == 0 and engine.budget.parts == 0 and engine.multipart.uploads == {}
    s = engine.operator.stats()
    assert (s["puts"], s["expirations"], s["objects"]) == (2, 2, 0)  # global counters survive the bucket
    with pytest.raises(errors.NoSuchBucket):
        engine.store.get(T, B, "k0")
    assert engine.create_bucket("bob", B) is True  # the name is free again
    check_accounting(engine)


def test_iter_objects_code_point_order_and_start(clock: FakeClock) -> None:
    engine = make_engine(clock, budget=100_000)
    keys = ["b", "a", "B", "a/b", "a0", "é", "\uffff", "\U0001f600", "ab", "Z", "\u00e9x", " "]
    for k in keys:
        put(engine, k, b"v")
    expected = sorted(keys, key=lambda k: k.encode("utf-8"))  # code point order == UTF-8 byte order
    assert keys_of(engine) == expected
    assert [o.key for o in engine.store.iter_objects(T, B, start="a0")] == expected[expected.index("a0"):]
    assert [o.key for o in engine.store.iter_objects(T, B, start="a0", inclusive=False)] == \
        expected[expected.index("a0") + 1:]
    assert [o.key for o in engine.store.iter_objects(T, B, start="aa")] == expected[expected.index("ab"):]
    assert [o.key for o in engine.store.iter_objects(T, B, start="\uffff", inclusive=False)] == ["\U0001f600"]
    assert list(engine.store.iter_objects(T, B, start="\U0010ffff")) == []


def test_iter_objects_skips_expired(clock: FakeClock) -> None:
    engine = make_engine(clock)
    put(engine, "a", ttl=5)
    put(engine, "b", ttl=50)
    put(engine, "c", ttl=5)
    clock.advance(5)
    assert keys_of(engine) == ["b"]
