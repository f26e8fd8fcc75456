"""The engine's budget (ctxstore_server.engine.budget): what an object is charged, filling to the budget and
evicting only what a write needs, reservations that grow as a body arrives and are released on failure, what is
refused for good (too large) or for now (everything left pinned), and a removed object still being sent.

Pure and fast: no HTTP, no sleeping. Every engine gets a fake clock that the test advances by hand."""

from __future__ import annotations

import hashlib

import pytest

from ctxstore_server.engine import BlockWrite, errors
from ctxstore_server.engine.objects import OBJECT_OVERHEAD, StoredObject, object_charge
from support.inprocess import FakeClock

from engine_support import (B, SIZE, T, T0, Recorder, check_accounting, check_pins, keys_of, make_engine, payload, put,
                            reserve)


def test_charge_is_payload_key_metadata_and_overhead(clock: FakeClock) -> None:
    engine = make_engine(clock)
    obj = put(engine, "kk", b"x" * 10, headers={"cache-control": "no"}, user_meta={"a": "bc"},
              checksums={"crc32": "AAAA"})
    assert obj.charge == 10 + 2 + len("cache-control") + 2 + 1 + 2 + len("crc32") + 4 + OBJECT_OVERHEAD
    assert obj.charge == object_charge("kk", b"x" * 10, obj.headers, obj.user_meta, obj.checksums)
    assert engine.budget.used == obj.charge
    check_accounting(engine)


def test_fill_exactly_to_budget_then_evict_only_what_is_needed(clock: FakeClock) -> None:
    engine = make_engine(clock)
    rec = Recorder(engine)
    for i in range(5):
        assert put(engine, f"k{i}").charge == 1000
    assert engine.budget.used == engine.config.budget == 5000
    assert rec.removed == []
    put(engine, "k5")
    assert rec.reasons() == [("evicted", "k0")]
    assert keys_of(engine) == ["k1", "k2", "k3", "k4", "k5"]
    assert engine.budget.used == 5000
    assert engine.operator.stats()["evictions"] == 1
    check_accounting(engine)


def test_reserve_makes_room_as_the_body_arrives_and_put_consumes_it(clock: FakeClock) -> None:
    engine = make_engine(clock)
    rec = Recorder(engine)
    for i in range(5):
        put(engine, f"k{i}")
    reservation = engine.store.capacity.reserve(T, B, SIZE)
    # Opened, it holds nothing: a request that sends no body makes nothing be evicted.
    assert reservation.nbytes == 0 and engine.budget.reserved == 0 and rec.reasons() == []
    reservation.grow(1)  # the first bytes: the fixed charge and one growth step (the whole object, here)
    # Room is made as the body arrives, not at commit time.
    assert rec.reasons() == [("evicted", "k0")]
    assert reservation.nbytes == SIZE + OBJECT_OVERHEAD
    assert engine.budget.reserved == SIZE + OBJECT_OVERHEAD
    assert engine.budget.used == 4000 + SIZE + OBJECT_OVERHEAD
    check_accounting(engine)
    put(engine, "k5", reservation=reservation)
    assert reservation.nbytes == 0 and engine.budget.reserved == 0
    # The object's charge (key included) is 2 bytes more than the reservation: one more eviction is allowed.
    assert engine.budget.used <= engine.config.budget
    assert keys_of(engine)[-1] == "k5"
    check_accounting(engine)


def test_reservation_released_on_failure_returns_the_budget(clock: FakeClock) -> None:
    engine = make_engine(clock)
    put(engine, "k0")
    before = engine.budget.used
    with pytest.raises(RuntimeError):
        with reserve(engine, 2000) as reservation:
            assert engine.budget.used == before + 2000 + OBJECT_OVERHEAD
            raise RuntimeError("client went away")
    assert engine.budget.used == before and engine.budget.reserved == 0
    reservation.release()  # idempotent
    assert engine.budget.used == before and engine.budget.reserved == 0
    check_accounting(engine)


def test_reservations_count_against_the_budget(clock: FakeClock) -> None:
    engine = make_engine(clock)
    r1 = reserve(engine, 4200 - OBJECT_OVERHEAD)
    with pytest.raises(errors.InsufficientCapacity) as exc:
        put(engine, "k0")  # charged 1000, only 800 left and nothing to evict
    assert exc.value.retry_after > 0
    assert engine.budget.used == 4200 and keys_of(engine) == []
    put(engine, "k0", b"x" * (800 - 2 - OBJECT_OVERHEAD))  # exactly what is left
    assert engine.budget.used == 5000
    r1.release()
    assert engine.budget.used == 800
    check_accounting(engine)


def test_failed_put_releases_its_reservation(clock: FakeClock) -> None:
    engine = make_engine(clock)
    put(engine, "k0")
    for kwargs, exc in [({"if_none_match": True}, errors.PreconditionFailed),
                        ({"if_match": '"nope"'}, errors.PreconditionFailed),
                        ({"ttl": -1.0}, errors.InvalidArgument)]:
        reservation = reserve(engine, SIZE)
        with pytest.raises(exc):
            put(engine, "k0", payload("other"), reservation=reservation, **kwargs)
        assert reservation.nbytes == 0
        assert engine.budget.reserved == 0 and engine.budget.used == 1000
    reservation = reserve(engine, SIZE)
    with pytest.raises(errors.NoSuchKey):
        put(engine, "k1", reservation=reservation, if_match="*")
    assert engine.budget.reserved == 0 and engine.budget.used == 1000
    check_accounting(engine)


def test_failed_put_part_releases_its_reservation(clock: FakeClock) -> None:
    engine = make_engine(clock)
    upload = engine.multipart.create(T, B, "mp", ttl=None, content_type="x", headers={}, user_meta={})
    reservation = reserve(engine, 100)
    with pytest.raises(errors.InvalidArgument):
        engine.multipart.put_part(T, B, "mp", upload.upload_id, 0, b"x" * 100, md5=hashlib.md5(b"x" * 100).digest(),
                        checksums={}, reservation=reservation)
    assert engine.budget.reserved == 0 and engine.budget.used == engine.budget.state
    # The upload is aborted while the part's body is still being read.
    reservation = reserve(engine, 100)
    engine.multipart.abort(T, B, "mp", upload.upload_id)
    with pytest.raises(errors.NoSuchUpload):
        engine.multipart.put_part(T, B, "mp", upload.upload_id, 1, b"x" * 100, md5=hashlib.md5(b"x" * 100).digest(),
                        checksums={}, reservation=reservation)
    assert engine.budget.reserved == 0 and engine.budget.used == 0
    check_accounting(engine)


def test_entity_too_large(clock: FakeClock) -> None:
    engine = make_engine(clock, budget=5000, max_object_size=4000)
    for i in range(4):
        put(engine, f"k{i}")
    before = engine.budget.used
    with pytest.raises(errors.EntityTooLarge):
        reserve(engine, 4001)  # over max_object_size
    small_budget = make_engine(FakeClock(T0), budget=1000, max_object_size=4000)
    with pytest.raises(errors.EntityTooLarge):
        reserve(small_budget, 1000 - OBJECT_OVERHEAD + 1)  # fits max size, never fits the budget
    with pytest.raises(errors.EntityTooLarge):
        put(engine, "big", b"x" * 5000)  # bigger than the whole budget
    # Nothing was evicted to make room for something that can never fit.
    assert engine.budget.used == before and keys_of(engine) == ["k0", "k1", "k2", "k3"]
    assert engine.budget.reserved == 0
    check_accounting(engine)


def test_insufficient_capacity_only_when_everything_left_is_pinned(clock: FakeClock) -> None:
    engine = make_engine(clock)
    rec = Recorder(engine)
    for i in range(5):
        put(engine, f"k{i}")
    assert engine.store.pin(T, B, [f"k{i}" for i in range(5)], 60) == 5
    with pytest.raises(errors.InsufficientCapacity) as exc:
        put(engine, "k5")
    assert exc.value.retry_after > 0
    with pytest.raises(errors.InsufficientCapacity):
        reserve(engine, 10)
    assert rec.removed == [] and engine.budget.used == 5000 and engine.budget.reserved == 0
    assert keys_of(engine) == [f"k{i}" for i in range(5)]
    # One unpinned object is enough: it, and only it, goes.
    assert engine.store.unpin(T, B, ["k3"]) == 1
    put(engine, "k5")
    assert rec.reasons() == [("evicted", "k3")]
    check_accounting(engine)
    check_pins(engine)


def test_insufficient_capacity_when_budget_is_held_by_parts(clock: FakeClock) -> None:
    engine = make_engine(clock, max_object_size=4500)  # the upload may become one object of 4,200 bytes
    upload = engine.multipart.create(T, B, "mp", ttl=None, content_type="x", headers={}, user_meta={})
    data = b"p" * (4200 - engine.budget.state)  # the upload's own record is charged too
    engine.multipart.put_part(T, B, "mp", upload.upload_id, 1, data, md5=hashlib.md5(data).digest(), checksums={})
    assert engine.budget.parts + engine.budget.state == 4200
    put(engine, "k0", b"x" * (800 - 2 - OBJECT_OVERHEAD))
    assert engine.budget.used == 5000
    with pytest.raises(errors.InsufficientCapacity):
        put(engine, "k1")  # k0 may go, but that is not enough: parts are never evicted
    assert keys_of(engine) == ["k0"]  # and nothing was evicted for nothing
    engine.multipart.abort(T, B, "mp", upload.upload_id)
    assert engine.budget.parts == 0 and engine.budget.used == 800
    check_accounting(engine)


def test_a_part_that_makes_its_upload_too_large_ever_to_complete_is_refused_for_good(clock: FakeClock) -> None:
    engine = make_engine(clock, max_object_size=10_000)
    upload = engine.multipart.create(T, B, "mp", ttl=None, content_type="x", headers={}, user_meta={})
    data = b"p" * 3000
    engine.multipart.put_part(T, B, "mp", upload.upload_id, 1, data, md5=hashlib.md5(data).digest(), checksums={})
    # 3,000 + 2,500 bytes of parts could never be held by a 5,000-byte budget (parts are never evicted): it was
    # an InsufficientCapacity (503 SlowDown, retried in vain).
    with pytest.raises(errors.EntityTooLarge, match="more than the node.s budget of 5000"):
        engine.multipart.check_part(T, B, "mp", upload.upload_id, 2, 2500)
    more = b"q" * 2500
    with pytest.raises(errors.EntityTooLarge):
        engine.multipart.put_part(T, B, "mp", upload.upload_id, 2, more, md5=hashlib.md5(more).digest(), checksums={})
    engine.multipart.check_part(T, B, "mp", upload.upload_id, 1, 4900)  # replacing part 1: its bytes are freed
    engine.multipart.check_part(T, B, "mp", upload.upload_id, 2, 1900)
    assert engine.budget.parts == 3000
    check_accounting(engine)


def test_a_reservation_holds_budget_only_as_its_body_arrives(clock: FakeClock) -> None:
    engine = make_engine(clock)
    rec = Recorder(engine)
    for i in range(5):
        put(engine, f"k{i}")
    reservation = engine.store.capacity.reserve(T, B, 3000)  # the headers of a 3000-byte PUT, no body yet
    assert reservation.nbytes == 0 and rec.removed == []
    reservation.grow(500)  # the first bytes: it grows by whole steps (1 MiB), capped at what it declared
    assert reservation.nbytes == 3000 + OBJECT_OVERHEAD == engine.budget.reserved
    assert engine.budget.used <= engine.config.budget
    assert rec.reasons() == [("evicted", f"k{i}") for i in range(4)]
    with pytest.raises(errors.EntityTooLarge):
        reservation.grow(3001)  # more than it declared
    reservation.release()
    assert engine.budget.reserved == 0
    check_accounting(engine)


def test_one_reservation_for_a_run_of_blocks_holds_their_room_until_the_first_commits(clock: FakeClock) -> None:
    # A bulk put of small new blocks reserves a run of them at once (bulk/put.py): the run's room is made when it
    # grows (evicting LRU blocks), each block then commits against it, and it is released exactly once.
    engine = make_engine(clock)
    rec = Recorder(engine)
    for i in range(5):
        put(engine, f"k{i}")
    run = engine.store.capacity.reserve_run(T, B, 3 * SIZE, 3 * (OBJECT_OVERHEAD + 2))  # three 1000-byte blocks
    assert run.nbytes == 0 and rec.removed == []
    run.grow_all()
    assert run.nbytes == engine.budget.reserved == 3000 and engine.budget.used == 5000
    assert rec.reasons() == [("evicted", "k0"), ("evicted", "k1"), ("evicted", "k2")]
    for key in ("r0", "r1", "r2"):
        put(engine, key, reservation=run)  # the first releases the run; each then charges its own block
    assert engine.budget.reserved == 0 and engine.budget.used == 5000 and rec.reasons()[3:] == []
    run.release()  # again, when the call ends: nothing more
    assert engine.budget.used == 5000
    check_accounting(engine)


def test_a_run_that_cannot_get_room_fails_and_its_release_returns_everything(clock: FakeClock) -> None:
    engine = make_engine(clock)
    for i in range(5):
        put(engine, f"k{i}")
    engine.store.pin(T, B, [f"k{i}" for i in range(5)], 60)
    run = engine.store.capacity.reserve_run(T, B, 2 * SIZE, 2 * (OBJECT_OVERHEAD + 2))
    with pytest.raises(errors.InsufficientCapacity):
        run.grow_all()
    run.release()
    assert engine.budget.reserved == 0 and engine.budget.used == 5000
    assert engine.budget.tenant_declared[T] == 0  # nothing left counted as in flight for the tenant
    check_accounting(engine)


def test_blocks_committed_in_one_call_each_get_their_own_outcome(clock: FakeClock) -> None:
    # A bulk put commits its verified blocks in one engine call (put_blocks): a key that became live meanwhile
    # is PreconditionFailed, a block with no room left is a capacity error, the others are stored.
    engine = make_engine(clock)
    held = ["k1", "p0", "p1", "p2", "p3"]
    for key in held:
        put(engine, key)
    engine.store.pin(T, B, held, 60)  # the whole budget
    out = engine.put_blocks(T, B, [BlockWrite(k, payload(k), '"e"', 0, None) for k in ("k0", "k1")], ttl=None,
                            if_absent=True)
    assert isinstance(out[0], errors.InsufficientCapacity) and isinstance(out[1], errors.PreconditionFailed)
    engine.store.unpin(T, B, held)
    run = engine.store.capacity.reserve_run(T, B, 2 * SIZE, 2 * (OBJECT_OVERHEAD + 2))
    run.grow_all()  # evicts two of the unpinned blocks
    out = engine.put_blocks(T, B, [BlockWrite(k, payload(k), '"e"', 7, run) for k in ("k0", "k2")], ttl=30,
                            if_absent=True)
    assert [o.key for o in out if isinstance(o, StoredObject)] == ["k0", "k2"]
    assert all(o.xxh3 == 7 and o.ttl == 30 for o in out if isinstance(o, StoredObject))
    assert engine.budget.reserved == 0 and len(keys_of(engine)) == 5 and {"k0", "k2"} <= set(keys_of(engine))
    check_accounting(engine)


def test_what_could_never_be_stored_is_refused_when_the_reservation_opens(clock: FakeClock) -> None:
    engine = make_engine(clock)
    engine.create_bucket("other", "theirs")
    put(engine, "mine-1", bucket="theirs", tenant="other")
    engine.set_tenant_quota(T, 1500)
    with pytest.raises(errors.EntityTooLarge):
        engine.store.capacity.reserve(T, B, 2000)  # over the tenant's quota whatever it evicts
    engine.set_bucket_policy(B, quota=1200)
    with pytest.raises(errors.EntityTooLarge):
        engine.store.capacity.reserve(T, B, 1300)
    assert keys_of(engine, "theirs", "other") == ["mine-1"] and engine.budget.reserved == 0


def test_a_removed_object_being_sent_stays_charged_until_the_send_ends(clock: FakeClock) -> None:
    engine = make_engine(clock)
    old = put(engine, "k")
    release = engine.store.lease(old)
    put(engine, "k", payload("new"))  # replaced while a reader is still sending the old payload
    assert engine.budget.sending == old.charge
    assert engine.budget.used == old.charge + engine.store.get(T, B, "k", record=False).charge
    for i in range(4):  # the budget counts the old payload: it is not handed out again
        put(engine, f"x{i}")
    assert engine.budget.used <= engine.config.budget
    release()
    release()  # idempotent
    assert engine.budget.sending == 0
    check_accounting(engine)
