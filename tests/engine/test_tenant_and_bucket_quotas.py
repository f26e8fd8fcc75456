"""Tenants' shares of the budget: reservations in flight, quotas that evict only the tenant's own blocks, and the
charges and caps of buckets, uploads and parts.

Pure and fast: no HTTP, no sleeping. Every engine gets a fake clock that the test advances by hand."""

from __future__ import annotations

import hashlib

import pytest

from ctxstore_server.engine import Engine, EngineConfig, errors
from support.inprocess import FakeClock

from engine_support import B, SIZE, T, check_accounting, keys_of, make_engine, put


def test_a_tenant_may_have_a_quarter_of_the_budget_in_flight(clock: FakeClock) -> None:
    engine = make_engine(clock)  # budget 5000: 1250 bytes of bodies in flight per tenant
    first = engine.store.capacity.reserve(T, B, 2000)  # one body in flight is always allowed, whatever its size
    with pytest.raises(errors.InsufficientCapacity):
        engine.store.capacity.reserve(T, B, 100)
    engine.create_bucket("other", "theirs")
    other = engine.store.capacity.reserve("other", "theirs", 100)  # another tenant's limit is its own
    first.release()
    engine.store.capacity.reserve(T, B, 100).release()
    other.release()
    assert engine.operator.stats()["reserved"] == 0


def test_a_reservation_for_a_tenant_with_a_quota_evicts_only_its_own_blocks(clock: FakeClock) -> None:
    engine = make_engine(clock, budget=5000)
    engine.create_bucket("other", "theirs")
    for i in range(3):
        put(engine, f"theirs-{i}", bucket="theirs", tenant="other")
    put(engine, "mine-0")
    engine.set_tenant_quota(T, 1600)
    reservation = engine.store.capacity.reserve(T, B, SIZE)
    reservation.grow(SIZE)  # over its quota with mine-0: mine-0 goes, not the other tenant's
    assert keys_of(engine) == [] and len(keys_of(engine, "theirs", "other")) == 3
    reservation.release()
    check_accounting(engine)


def test_buckets_uploads_and_parts_are_charged_and_capped(clock: FakeClock) -> None:
    engine = Engine(EngineConfig(budget=100_000, max_buckets_per_tenant=3, max_uploads_per_tenant=2,
                                 min_part_size=1), clock=clock)
    for name in ("b1", "b2", "b3"):
        engine.create_bucket(T, name)
    assert engine.budget.state == 3 * engine.config.bucket_overhead == engine.budget.used
    with pytest.raises(errors.TooManyBuckets):
        engine.create_bucket(T, "b4")
    engine.create_bucket("other", "b4")  # the cap is per tenant
    before = engine.budget.used
    meta = {"cache-control": "x" * 1000}
    first = engine.multipart.create(T, "b1", "k", ttl=None, content_type="t", headers=meta, user_meta={})
    assert engine.budget.used - before == engine.config.upload_overhead + 1 + 1 + len("cache-control") + 1000
    engine.multipart.create(T, "b1", "k2", ttl=None, content_type="t", headers={}, user_meta={})
    with pytest.raises(errors.TooManyUploads):
        engine.multipart.create(T, "b1", "k3", ttl=None, content_type="t", headers={}, user_meta={})
    before = engine.budget.used
    engine.multipart.put_part(T, "b1", "k", first.upload_id, 1, b"", md5=hashlib.md5(b"").digest(), checksums={})
    assert engine.budget.used - before == engine.config.part_overhead  # an empty part is not free
    # T's quota counts its uploads and parts; buckets count against the node's budget only (they are capped).
    uploads = engine.multipart.uploads.values()
    assert engine.budget.tenant_usage(T)[1] == sum(u.charge + u.charged for u in uploads) > 0
    engine.multipart.abort(T, "b1", "k", first.upload_id)
    engine.multipart.create(T, "b1", "k3", ttl=None, content_type="t", headers={}, user_meta={})  # room again
    engine.delete_bucket(T, "b3")
    engine.create_bucket(T, "b5")


def test_parts_count_against_the_tenant_quota(clock: FakeClock) -> None:
    engine = make_engine(clock)
    engine.create_bucket("other", "theirs")
    put(engine, "theirs-0", bucket="theirs", tenant="other")
    engine.set_tenant_quota(T, 250)
    upload = engine.multipart.create(T, B, "mp", ttl=None, content_type="x", headers={}, user_meta={})
    part = b"p" * 100
    for number in (1, 2):
        engine.multipart.put_part(T, B, "mp", upload.upload_id, number, part, md5=hashlib.md5(part).digest(),
                                  checksums={})
    # A third would pass the quota with this upload's own parts, which are never evicted: refused for good.
    with pytest.raises(errors.EntityTooLarge):
        engine.multipart.put_part(T, B, "mp", upload.upload_id, 3, part, md5=hashlib.md5(part).digest(), checksums={})
    # A second upload's part would fit once the first ends: InsufficientCapacity (SlowDown, retry later).
    other = engine.multipart.create(T, B, "mp2", ttl=None, content_type="x", headers={}, user_meta={})
    with pytest.raises(errors.InsufficientCapacity):
        engine.multipart.put_part(T, B, "mp2", other.upload_id, 1, part, md5=hashlib.md5(part).digest(), checksums={})
    assert keys_of(engine, "theirs", "other") == ["theirs-0"]
    check_accounting(engine)
