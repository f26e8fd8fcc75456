"""Helpers of the engine's unit tests: a small engine on a fake clock, writes of known charge, and the checks that
its counters agree with what it holds (the ``clock`` fixture is in conftest.py)."""

from __future__ import annotations

import hashlib

from ctxstore_server.engine import Engine, EngineConfig, Reservation
from ctxstore_server.engine.objects import OBJECT_OVERHEAD, StoredObject
from support.inprocess import FakeClock

T = "alice"  # the tenant of most tests
B = "blocks"  # its bucket
T0 = 1_000_000.0  # the fake clock's start

# Keys of two characters with a payload of 398 bytes are charged exactly 1000 bytes each.
SIZE = 1000 - 2 - OBJECT_OVERHEAD


class Recorder:
    """Collects store and removal events: (reason, bucket, key, object)."""

    def __init__(self, engine: Engine) -> None:
        self.stored: list[StoredObject] = []
        self.removed: list[tuple[str, str, str, StoredObject]] = []
        engine.store.on_store.append(self.stored.append)
        engine.store.on_remove.append(lambda obj, reason: self.removed.append((reason, obj.bucket, obj.key, obj)))

    def reasons(self) -> list[tuple[str, str]]:
        return [(reason, key) for reason, _, key, _ in self.removed]


def md5_etag(data: bytes) -> str:
    return f'"{hashlib.md5(data).hexdigest()}"'


def payload(tag: str | int, size: int = SIZE) -> bytes:
    seed = hashlib.sha256(str(tag).encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


def make_engine(clock: FakeClock, **config: object) -> Engine:
    # Buckets, uploads and parts cost nothing beyond their bytes here, so the arithmetic below stays about
    # objects; test_tenant_and_bucket_quotas.py's test_buckets_uploads_and_parts_are_charged_and_capped covers
    # those charges.
    cfg = {"budget": 5000, "default_ttl": 100.0, "max_ttl": 1000.0, "max_pin": 300.0,
           "max_object_size": 4000, "min_part_size": 10, "upload_ttl": 500.0,
           "bucket_overhead": 0, "upload_overhead": 0, "part_overhead": 0}
    cfg.update(config)
    engine = Engine(EngineConfig(**cfg), clock=clock)  # type: ignore[arg-type]
    engine.create_bucket(T, B)
    return engine


def put(engine: Engine, key: str, data: bytes | None = None, bucket: str = B, tenant: str = T,
        **kw: object) -> StoredObject:
    data = payload(key) if data is None else data
    return engine.put(tenant, bucket, key, data, etag=md5_etag(data), **kw)  # type: ignore[arg-type]


def reserve(engine: Engine, nbytes: int, bucket: str = B, tenant: str = T) -> Reservation:
    """A reservation whose whole body has arrived (it holds the full charge)."""
    reservation = engine.store.capacity.reserve(tenant, bucket, nbytes)
    reservation.grow_all()
    return reservation


def keys_of(engine: Engine, bucket: str = B, tenant: str = T) -> list[str]:
    return [o.key for o in engine.store.iter_objects(tenant, bucket)]


def stored(engine: Engine) -> list[StoredObject]:
    return [o for b in engine.store.buckets.values() for o in b.objects.values()]


def check_accounting(engine: Engine) -> None:
    """The engine's counters agree with what it holds. Does not drain pins (see check_pins)."""
    objs = stored(engine)
    uploads = engine.multipart.uploads.values()
    parts = sum(p.charge for u in uploads for p in u.parts.values())
    assert all(o.live for o in objs)
    assert engine.budget.parts == parts
    assert all(u.charged == sum(p.charge for p in u.parts.values()) for u in uploads)
    assert engine.budget.state == sum(b.charge for b in engine.store.buckets.values()) + sum(u.charge for u in uploads)
    assert engine.budget.reserved >= 0
    assert engine.budget.used == sum(o.charge for o in objs) + parts + engine.budget.state + engine.budget.reserved
    assert engine.budget.used <= engine.config.budget
    for bucket in engine.store.buckets.values():
        assert bucket.stats.objects == len(bucket.objects)
        assert bucket.stats.bytes == sum(o.size for o in bucket.objects.values())
        assert all(o.bucket == bucket.name and o.key == k for k, o in bucket.objects.items())
    for bucket in engine.store.buckets.values():  # each bucket's LRU list holds exactly its live objects
        assert set(bucket.lru) == set(bucket.objects.values()) and len(bucket.lru) == len(bucket.objects)
        assert bucket.stats.charged == sum(o.charge for o in bucket.objects.values())
    st_ = engine.operator.stats()
    assert st_["objects"] == len(objs)
    assert st_["bytes"] == sum(o.size for o in objs)


def check_pins(engine: Engine) -> None:
    """After draining (stats() drains), pinned_bytes is exactly the charge of the objects pinned now."""
    now = engine.clock()
    assert engine.operator.stats()["pinned_bytes"] == sum(o.charge for o in stored(engine) if o.pinned(now))
