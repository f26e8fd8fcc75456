"""Multipart uploads in the engine (ctxstore_server.engine.multipart): complete, part replacement, errors, abort,
stale uploads reaped, conditional completes and the object size cap.

Pure and fast: no HTTP, no sleeping. Every engine gets a fake clock that the test advances by hand."""

from __future__ import annotations

import hashlib

import pytest

from ctxstore_server.engine import Engine, errors
from support.inprocess import FakeClock

from engine_support import B, T, Recorder, check_accounting, make_engine, md5_etag, put


def _upload(engine: Engine, key: str = "mp", **kw: object):
    args = {"ttl": None, "content_type": "application/x-kv", "headers": {"cache-control": "no-cache"},
            "user_meta": {"layer": "7"}}
    args.update(kw)
    return engine.multipart.create(T, B, key, **args)  # type: ignore[arg-type]


def _part(engine: Engine, upload, number: int, data: bytes, key: str = "mp", **kw: object):
    return engine.multipart.put_part(T, B, key, upload.upload_id, number, data, md5=hashlib.md5(data).digest(),
                           checksums={}, **kw)  # type: ignore[arg-type]


def test_multipart_complete(clock: FakeClock) -> None:
    engine = make_engine(clock, min_part_size=10)
    rec = Recorder(engine)
    upload = _upload(engine, ttl=42.0)
    chunks = [b"a" * 10, b"b" * 12, b"c" * 3]
    parts = [_part(engine, upload, i + 1, c) for i, c in enumerate(chunks)]
    assert [p.etag for p in parts] == [md5_etag(c) for c in chunks]
    assert engine.budget.parts == 25 and engine.budget.used == 25 + engine.budget.state
    check_accounting(engine)
    obj = engine.complete_upload(T, B, "mp", upload.upload_id, [(p.number, p.etag) for p in parts])
    expected = hashlib.md5(b"".join(hashlib.md5(c).digest() for c in chunks)).hexdigest()
    assert obj.etag == f'"{expected}-3"'
    assert bytes(obj.data) == b"".join(chunks) and obj.size == 25 and obj.parts_count == 3
    assert obj.ttl == 42.0 and obj.content_type == "application/x-kv"
    assert obj.headers == {"cache-control": "no-cache"} and obj.user_meta == {"layer": "7"}
    import xxhash

    assert obj.xxh3 == xxhash.xxh3_64_intdigest(b"".join(chunks))
    assert rec.stored == [obj]
    assert engine.multipart.uploads == {} and engine.budget.parts == 0 and engine.budget.reserved == 0
    assert engine.budget.used == obj.charge
    with pytest.raises(errors.NoSuchUpload):
        engine.multipart.abort(T, B, "mp", upload.upload_id)
    check_accounting(engine)


def test_multipart_etag_accepts_unquoted_part_etags_and_a_subset(clock: FakeClock) -> None:
    engine = make_engine(clock, min_part_size=1)
    upload = _upload(engine)
    p1 = _part(engine, upload, 1, b"one")
    _part(engine, upload, 2, b"two")
    p3 = _part(engine, upload, 3, b"three")
    obj = engine.complete_upload(T, B, "mp", upload.upload_id, [(1, p1.etag.strip('"')), (3, p3.etag)])
    assert bytes(obj.data) == b"onethree"
    assert obj.etag == f'"{hashlib.md5(p1.md5 + p3.md5).hexdigest()}-2"'
    assert engine.budget.parts == 0 and engine.budget.used == obj.charge  # the unused part is freed too
    check_accounting(engine)


def test_multipart_part_replacement(clock: FakeClock) -> None:
    engine = make_engine(clock, min_part_size=1)
    upload = _upload(engine)
    old = _part(engine, upload, 1, b"x" * 100)
    new = _part(engine, upload, 1, b"y" * 40)
    assert engine.budget.parts == 40 and engine.budget.used == 40 + engine.budget.state and upload.charged == 40
    with pytest.raises(errors.InvalidPart):
        engine.complete_upload(T, B, "mp", upload.upload_id, [(1, old.etag)])
    obj = engine.complete_upload(T, B, "mp", upload.upload_id, [(1, new.etag)])
    assert bytes(obj.data) == b"y" * 40
    check_accounting(engine)


def test_multipart_errors(clock: FakeClock) -> None:
    engine = make_engine(clock, min_part_size=10, max_parts=5)
    upload = _upload(engine)
    p1 = _part(engine, upload, 1, b"a" * 5)  # small: only valid as the last part
    p2 = _part(engine, upload, 2, b"b" * 10)
    p3 = _part(engine, upload, 3, b"c" * 10)
    uid = upload.upload_id
    with pytest.raises(errors.InvalidPart):
        engine.complete_upload(T, B, "mp", uid, [])
    with pytest.raises(errors.InvalidPart):
        engine.complete_upload(T, B, "mp", uid, [(2, p2.etag), (3, p2.etag)])
    with pytest.raises(errors.InvalidPart):
        engine.complete_upload(T, B, "mp", uid, [(2, p2.etag), (4, p2.etag)])
    with pytest.raises(errors.InvalidPartOrder):
        engine.complete_upload(T, B, "mp", uid, [(3, p3.etag), (2, p2.etag)])
    with pytest.raises(errors.InvalidPartOrder):
        engine.complete_upload(T, B, "mp", uid, [(2, p2.etag), (2, p2.etag)])
    with pytest.raises(errors.EntityTooSmall):
        engine.complete_upload(T, B, "mp", uid, [(1, p1.etag), (2, p2.etag)])
    for number in (0, 6, -1):
        with pytest.raises(errors.InvalidArgument):
            _part(engine, upload, number, b"z")
    with pytest.raises(errors.NoSuchUpload):
        _part(engine, upload, 1, b"z", key="other-key")
    with pytest.raises(errors.NoSuchUpload):
        engine.multipart.get(T, B, "mp", "no-such-upload-id")
    engine.create_bucket("bob", "bobs")
    with pytest.raises(errors.AccessDenied):
        engine.multipart.get("bob", B, "mp", uid)
    # Every failure left the upload intact and the accounting right.
    assert uid in engine.multipart.uploads and engine.budget.parts == 25 and engine.budget.reserved == 0
    check_accounting(engine)
    obj = engine.complete_upload(T, B, "mp", uid, [(2, p2.etag), (3, p3.etag)])
    assert bytes(obj.data) == b"b" * 10 + b"c" * 10
    check_accounting(engine)


def test_multipart_abort_frees_parts(clock: FakeClock) -> None:
    engine = make_engine(clock, min_part_size=1)
    put(engine, "k0")
    upload = _upload(engine)
    _part(engine, upload, 1, b"a" * 300)
    _part(engine, upload, 2, b"b" * 200)
    assert engine.budget.parts == 500 and engine.budget.used == 1500 + engine.budget.state
    engine.multipart.abort(T, B, "mp", upload.upload_id)
    assert engine.budget.parts == 0 and engine.budget.used == 1000 and engine.multipart.uploads == {}
    with pytest.raises(errors.NoSuchUpload):
        _part(engine, upload, 3, b"c")
    with pytest.raises(errors.NoSuchUpload):
        engine.complete_upload(T, B, "mp", upload.upload_id, [(1, md5_etag(b"a" * 300))])
    check_accounting(engine)


def test_stale_uploads_are_reaped_after_upload_ttl(clock: FakeClock) -> None:
    engine = make_engine(clock, upload_ttl=100.0)
    old = _upload(engine, "old")
    _part(engine, old, 1, b"a" * 100, key="old")
    clock.advance(60)
    young = _upload(engine, "young")
    _part(engine, young, 1, b"b" * 50, key="young")
    assert engine.reap() == 0 and len(engine.multipart.uploads) == 2
    clock.advance(40)
    engine.reap()
    assert list(engine.multipart.uploads) == [young.upload_id]
    assert engine.budget.parts == 50 and engine.budget.used == 50 + engine.budget.state
    with pytest.raises(errors.NoSuchUpload):
        engine.complete_upload(T, B, "old", old.upload_id, [(1, md5_etag(b"a" * 100))])
    clock.advance(60)
    engine.reap()
    assert engine.multipart.uploads == {} and engine.budget.used == 0
    check_accounting(engine)


def test_multipart_complete_with_if_none_match(clock: FakeClock) -> None:
    engine = make_engine(clock, min_part_size=1)
    existing = put(engine, "mp", ttl=10)
    upload = _upload(engine)
    p1 = _part(engine, upload, 1, b"data")
    with pytest.raises(errors.PreconditionFailed):
        engine.complete_upload(T, B, "mp", upload.upload_id, [(1, p1.etag)], if_none_match=True)
    assert engine.store.get(T, B, "mp") is existing
    assert upload.upload_id in engine.multipart.uploads and engine.budget.reserved == 0
    check_accounting(engine)
    with pytest.raises(errors.PreconditionFailed):
        engine.complete_upload(T, B, "mp", upload.upload_id, [(1, p1.etag)], if_match='"other"')
    obj = engine.complete_upload(T, B, "mp", upload.upload_id, [(1, p1.etag)], if_match=existing.etag)
    assert not existing.live and engine.store.get(T, B, "mp") is obj
    # If-None-Match over an expired object succeeds.
    upload2 = _upload(engine, "mp2", ttl=5.0)
    q1 = _part(engine, upload2, 1, b"more", key="mp2")
    put(engine, "mp2", ttl=5)
    clock.advance(5)
    obj2 = engine.complete_upload(T, B, "mp2", upload2.upload_id, [(1, q1.etag)], if_none_match=True)
    assert bytes(engine.store.get(T, B, "mp2").data) == b"more" and obj2.ttl == 5.0
    check_accounting(engine)


def test_multipart_complete_over_max_object_size(clock: FakeClock) -> None:
    engine = make_engine(clock, min_part_size=1, max_object_size=150)
    upload = _upload(engine)
    p1 = _part(engine, upload, 1, b"a" * 100)
    p2 = _part(engine, upload, 2, b"b" * 100)
    with pytest.raises(errors.EntityTooLarge):
        engine.complete_upload(T, B, "mp", upload.upload_id, [(1, p1.etag), (2, p2.etag)])
    assert upload.upload_id in engine.multipart.uploads and engine.budget.reserved == 0
    check_accounting(engine)
