"""Random sequences of every engine operation (hypothesis' stateful testing), checked against a small model after
each step.

Pure and fast: no HTTP, no sleeping. Every engine gets a fake clock that the test advances by hand."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from ctxstore_server.engine import REMOVAL_REASONS, Engine, EngineConfig, Reservation, errors
from ctxstore_server.engine.objects import OBJECT_OVERHEAD, StoredObject, object_charge
from support.inprocess import FakeClock

from engine_support import T, T0, check_pins, keys_of, md5_etag, payload, reserve, stored


KEYS = ["k0", "k1", "k2", "k3", "k4", "k5"]
BUCKETS = ["plain", "sliding"]
SIZES = st.integers(0, 2600).map(lambda n: 9000 if n > 2500 else n)  # now and then more than the budget
TTLS = st.one_of(st.none(), st.floats(1, 300), st.none(), st.floats(1, 100), st.sampled_from([0.0, -1.0]))
CONDITIONS = st.sampled_from(["none", "none", "none", "if_none_match", "if_match_current", "if_match_other",
                              "if_match_star"])


class EngineMachine(RuleBasedStateMachine):
    """Random sequences of every engine operation, checked against a small model after each step.

    The model holds, per (bucket, key), the object last committed there; removal listeners take objects
    out of it, and check the reason. Eviction must never take a pinned object, must only happen once nothing
    expired is left, and must stop as soon as the write fits."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock(T0)
        self.engine = Engine(EngineConfig(budget=8000, default_ttl=60.0, max_ttl=200.0, max_pin=50.0,
                                          max_object_size=3000, min_part_size=100, upload_ttl=150.0,
                                          bucket_overhead=0, upload_overhead=0, part_overhead=0,
                                          tenant_reserve_limit=8000),  # one tenant may reserve everything here
                             clock=self.clock)
        for name in BUCKETS:
            self.engine.create_bucket(T, name)
        self.engine.store.bucket(T, "sliding").sliding_ttl = True
        self.model: dict[tuple[str, str], StoredObject] = {}
        self.pins: dict[StoredObject, float] = {}  # pin end per object, as the model sees it
        self.reservations: list[Reservation] = []
        self.uploads: list[tuple[str, str, str]] = []
        self.events: list[tuple[str, StoredObject]] = []  # removals during the current step
        self.counter = 0
        self.engine.store.on_remove.append(self._removed)
        self.engine.store.on_store.append(self._stored)

    # ---------------------------------------------------------------- listeners

    def _stored(self, obj: StoredObject) -> None:
        assert self.engine.store.buckets[obj.bucket].objects.get(obj.key) is obj and obj.live

    def _removed(self, obj: StoredObject, reason: str) -> None:
        now = self.clock.now
        assert reason in REMOVAL_REASONS
        assert not obj.live
        if reason == "expired":
            assert obj.expired(now)
        else:
            assert not obj.expired(now), f"an expired object was reported {reason}"
        if reason == "evicted":
            assert self.pins.get(obj, 0.0) <= now, "a pinned object was evicted"
            assert not any(o.expired(now) for o in stored(self.engine)), "evicted while expired ones remain"
        if self.model.get((obj.bucket, obj.key)) is obj:
            del self.model[(obj.bucket, obj.key)]
        self.pins.pop(obj, None)
        self.events.append((reason, obj))

    # ---------------------------------------------------------------- helpers

    def _visible(self, bucket: str, key: str) -> StoredObject | None:
        obj = self.model.get((bucket, key))
        return obj if obj is not None and not obj.expired(self.clock.now) else None

    def _check_capacity_error(self, need: int, replacing: StoredObject | None = None) -> None:
        # Raised only if evicting everything not pinned (or reserved, or a part) could not have made room.
        now = self.clock.now
        unpinned = sum(o.charge for o in stored(self.engine)
                       if not self.pins.get(o, 0.0) > now and o is not replacing)
        credit = replacing.charge if replacing is not None else 0
        assert self.engine.config.budget - self.engine.budget.used + credit + unpinned < need

    def _check_evicted_only_what_was_needed(self) -> None:
        evicted = [obj for reason, obj in self.events if reason == "evicted"]
        if evicted:  # before the last eviction, the write did not fit yet
            assert self.engine.budget.used + evicted[-1].charge > self.engine.config.budget

    def _reserve(self, size: int) -> Reservation | None:
        try:
            return reserve(self.engine, size, bucket=BUCKETS[0])
        except errors.EntityTooLarge:
            config = self.engine.config
            assert size > config.max_object_size or size + OBJECT_OVERHEAD > config.budget
        except errors.InsufficientCapacity as exc:
            assert exc.retry_after > 0
            declared = self.engine.budget.tenant_declared.get(T, 0)
            if not (declared and declared + size + OBJECT_OVERHEAD > self.engine.config.tenant_reserve_limit):
                self._check_capacity_error(size + OBJECT_OVERHEAD)  # else: over what the tenant may have in flight
        return None

    def _put(self, bucket: str, key: str, size: int, ttl: float | None, cond: str, reserve: bool) -> None:
        engine = self.engine
        self.counter += 1
        data = payload(self.counter, size)
        reservation = None
        if reserve:  # as the protocol layer does: room first (this may evict or reap the current object)
            self.events.clear()  # only this reservation's evictions are judged below
            reservation = self._reserve(size)
            if reservation is None:
                return
            self._check_evicted_only_what_was_needed()
        self.events.clear()
        visible = self._visible(bucket, key)
        kwargs: dict[str, object] = {}
        if cond == "if_none_match":
            kwargs["if_none_match"] = True
        elif cond == "if_match_current":
            kwargs["if_match"] = visible.etag if visible is not None else '"gone"'
        elif cond == "if_match_other":
            kwargs["if_match"] = '"not-an-etag"'
        elif cond == "if_match_star":
            kwargs["if_match"] = "*"
        used_before = engine.budget.used - (reservation.nbytes if reservation else 0)
        charge = object_charge(key, data, {}, {}, {})
        try:
            obj = engine.put(T, bucket, key, data, etag=md5_etag(data), ttl=ttl, reservation=reservation,
                             **kwargs)  # type: ignore[arg-type]
        except errors.PreconditionFailed:
            assert visible is not None
            assert cond == "if_none_match" or (
                cond.startswith("if_match") and kwargs["if_match"] != visible.etag)
            assert engine.budget.used == used_before and self._visible(bucket, key) is visible
        except errors.NoSuchKey:
            assert cond.startswith("if_match") and visible is None
            assert engine.budget.used == used_before
        except errors.InvalidArgument:
            assert ttl is not None and ttl <= 0
            assert engine.budget.used == used_before and self._visible(bucket, key) is visible
        except errors.EntityTooLarge:
            assert charge > engine.config.budget
            assert engine.budget.used == used_before and self._visible(bucket, key) is visible
        except errors.InsufficientCapacity as exc:
            assert exc.retry_after > 0
            self._check_capacity_error(charge, replacing=visible)
            assert self._visible(bucket, key) is visible  # a failed write leaves the old value in place
        else:
            assert cond != "if_none_match" or visible is None
            assert not cond.startswith("if_match") or visible is not None
            assert ttl is None or ttl > 0
            expected_ttl = min(ttl, engine.config.max_ttl) if ttl is not None else engine.config.default_ttl
            assert obj.ttl == expected_ttl and obj.expires_at == self.clock.now + expected_ttl
            assert engine.store.buckets[bucket].objects[key] is obj and bytes(obj.data) == data
            replaced = [o for reason, o in self.events if reason == "replaced"]
            assert replaced == ([visible] if visible is not None else [])
            self.model[(bucket, key)] = obj
            self._check_evicted_only_what_was_needed()
        finally:
            if reservation is not None:
                assert reservation.nbytes == 0, "put did not release its reservation"

    # ---------------------------------------------------------------- rules (put twice: it is the main event)

    @rule(bucket=st.sampled_from(BUCKETS), key=st.sampled_from(KEYS), size=SIZES, ttl=TTLS, cond=CONDITIONS,
          reserve=st.booleans())
    def put(self, bucket: str, key: str, size: int, ttl: float | None, cond: str, reserve: bool) -> None:
        self._put(bucket, key, size, ttl, cond, reserve)

    @rule(bucket=st.sampled_from(BUCKETS), key=st.sampled_from(KEYS), size=SIZES, ttl=TTLS, cond=CONDITIONS,
          reserve=st.booleans())
    def put_again(self, bucket: str, key: str, size: int, ttl: float | None, cond: str,
                  reserve: bool) -> None:
        self._put(bucket, key, size, ttl, cond, reserve)

    @rule(bucket=st.sampled_from(BUCKETS), keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=3),
          mode=st.sampled_from(["get", "head", "lookup"]))
    def read(self, bucket: str, keys: list[str], mode: str) -> None:
        engine = self.engine
        if mode == "lookup":
            expected = [self._visible(bucket, k) for k in keys]
            before = [o.expires_at if o else None for o in expected]
            assert engine.store.lookup(T, bucket, keys) == expected
            for obj, was in zip(expected, before):
                if obj is not None and bucket == "sliding":
                    assert obj.expires_at == max(was, self.clock.now + obj.ttl)
            return
        key = keys[0]
        visible = self._visible(bucket, key)
        if visible is None:
            with pytest.raises(errors.NoSuchKey):
                engine.store.get(T, bucket, key, record=mode == "get")
            assert (bucket, key) not in self.model
            return
        before = visible.expires_at
        assert engine.store.get(T, bucket, key, record=mode == "get") is visible
        if mode == "get" and bucket == "sliding":
            assert visible.expires_at == max(before, self.clock.now + visible.ttl)
        else:
            assert visible.expires_at == before

    @rule(bucket=st.sampled_from(BUCKETS), key=st.sampled_from(KEYS))
    def delete(self, bucket: str, key: str) -> None:
        visible = self._visible(bucket, key)
        assert self.engine.store.delete(T, bucket, key) is (visible is not None)
        assert (bucket, key) not in self.model

    @rule(bucket=st.sampled_from(BUCKETS), keys=st.lists(st.sampled_from(KEYS), max_size=3, unique=True),
          seconds=st.one_of(st.floats(0.5, 100), st.sampled_from([1.0, 10.0])), unpin=st.booleans())
    def pin(self, bucket: str, keys: list[str], seconds: float, unpin: bool) -> None:
        now = self.clock.now
        if unpin:
            pinned = [o for o in (self.model.get((bucket, k)) for k in keys)
                      if o is not None and self.pins.get(o, 0.0) > now]
            assert self.engine.store.unpin(T, bucket, keys) == len(pinned)
            for obj in pinned:
                del self.pins[obj]
            return
        until = now + min(seconds, self.engine.config.max_pin)
        live = [o for o in (self._visible(bucket, k) for k in keys) if o is not None]
        assert self.engine.store.pin(T, bucket, keys, seconds) == len(live)
        for obj in live:
            self.pins[obj] = max(self.pins.get(obj, 0.0), until)
            assert obj.pinned_until == self.pins[obj]

    @rule(bucket=st.sampled_from(BUCKETS), keys=st.lists(st.sampled_from(KEYS), max_size=3, unique=True),
          ttl=st.one_of(st.none(), st.floats(1, 300)))
    def touch(self, bucket: str, keys: list[str], ttl: float | None) -> None:
        now = self.clock.now
        live = [o for o in (self._visible(bucket, k) for k in keys) if o is not None]
        before = {o: o.expires_at for o in live}
        assert self.engine.store.touch(T, bucket, keys, ttl) == len(live)
        for obj in live:
            life = min(ttl if ttl is not None else obj.ttl, self.engine.config.max_ttl)
            assert obj.expires_at == max(before[obj], now + life)

    @rule(seconds=st.one_of(st.floats(0, 80), st.sampled_from([1.0, 10.0, 50.0])))
    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)

    @rule(limit=st.integers(1, 5))
    def reap(self, limit: int) -> None:
        now = self.clock.now
        expired = sum(1 for o in stored(self.engine) if o.expired(now))
        upload_ttl = self.engine.config.upload_ttl
        stale = {uid for uid, u in self.engine.multipart.uploads.items() if u.created + upload_ttl <= now}
        assert self.engine.reap(limit) == min(limit, expired)
        assert sum(1 for o in stored(self.engine) if o.expired(now)) == expired - min(limit, expired)
        if len(stale) <= limit:
            assert not stale & set(self.engine.multipart.uploads)
        self.uploads = [u for u in self.uploads if u[2] in self.engine.multipart.uploads]

    @rule(size=st.integers(0, 3000), release=st.booleans(), data=st.data())
    def reservation(self, size: int, release: bool, data: st.DataObject) -> None:
        if release and self.reservations:
            reservation = self.reservations.pop(data.draw(st.integers(0, len(self.reservations) - 1)))
            used, nbytes = self.engine.budget.used, reservation.nbytes
            reservation.release()
            reservation.release()
            assert self.engine.budget.used == used - nbytes
            return
        self.events.clear()
        reservation = self._reserve(size)
        if reservation is not None:
            self.reservations.append(reservation)
            self._check_evicted_only_what_was_needed()

    @rule(action=st.sampled_from(["create", "part", "part", "part", "complete", "abort"]),
          bucket=st.sampled_from(BUCKETS), key=st.sampled_from(KEYS), number=st.integers(1, 3),
          size=st.integers(0, 1500), if_none_match=st.booleans(), data=st.data())
    def multipart(self, action: str, bucket: str, key: str, number: int, size: int, if_none_match: bool,
                  data: st.DataObject) -> None:
        engine = self.engine
        if action == "create" or not self.uploads:
            upload = engine.multipart.create(T, bucket, key, ttl=None, content_type="x", headers={},
                                          user_meta={})
            self.uploads.append((bucket, key, upload.upload_id))
            return
        bucket, key, uid = data.draw(st.sampled_from(self.uploads))
        upload = engine.multipart.uploads[uid]
        if action == "part":
            self.counter += 1
            body = payload(self.counter, size)
            try:
                part = engine.multipart.put_part(T, bucket, key, uid, number, body, md5=hashlib.md5(body).digest(),
                                       checksums={})
            except errors.InsufficientCapacity:
                self._check_capacity_error(size)
            else:
                assert upload.parts[number] is part
        elif action == "abort":
            parts, charged = engine.budget.parts, upload.charged
            engine.multipart.abort(T, bucket, key, uid)
            self.uploads.remove((bucket, key, uid))
            assert engine.budget.parts == parts - charged and uid not in engine.multipart.uploads
            with pytest.raises(errors.NoSuchUpload):
                engine.multipart.abort(T, bucket, key, uid)
        else:
            parts = [(n, p.etag) for n, p in sorted(upload.parts.items())]
            expected = b"".join(bytes(upload.parts[n].data) for n, _ in parts)
            etag = hashlib.md5(b"".join(upload.parts[n].md5 for n, _ in parts)).hexdigest()
            visible = self._visible(bucket, key)
            try:
                obj = engine.complete_upload(T, bucket, key, uid, parts, if_none_match=if_none_match)
            except (errors.InvalidPart, errors.EntityTooSmall, errors.EntityTooLarge,
                    errors.PreconditionFailed, errors.InsufficientCapacity) as exc:
                if isinstance(exc, errors.InvalidPart):
                    assert not parts
                if isinstance(exc, errors.EntityTooSmall):
                    assert any(upload.parts[n].size < 100 for n, _ in parts[:-1])
                if isinstance(exc, errors.EntityTooLarge):
                    assert len(expected) > engine.config.max_object_size
                if isinstance(exc, errors.PreconditionFailed):
                    assert if_none_match and visible is not None
                assert uid in engine.multipart.uploads, f"{type(exc).__name__} lost the upload"
            else:
                assert bytes(obj.data) == expected and obj.parts_count == len(parts)
                assert obj.etag == f'"{etag}-{len(parts)}"'
                self.model[(bucket, key)] = obj
                self.uploads.remove((bucket, key, uid))
                assert uid not in engine.multipart.uploads

    @rule()
    def drain_and_check_pins(self) -> None:
        # stats() drains ended pins; only then is pinned_bytes exact. Not an invariant on purpose: draining
        # after every step would hide miscounts that need an ended pin to linger undrained.
        check_pins(self.engine)
        now = self.clock.now
        for obj in stored(self.engine):
            assert obj.pinned(now) == (self.pins.get(obj, 0.0) > now)

    # ---------------------------------------------------------------- invariants

    @invariant()
    def consistent(self) -> None:
        engine = self.engine
        now = self.clock.now
        objs = stored(engine)
        parts = sum(p.charge for u in engine.multipart.uploads.values() for p in u.parts.values())
        assert engine.budget.used <= engine.config.budget
        assert engine.budget.used == sum(o.charge for o in objs) + parts + engine.budget.state + engine.budget.reserved
        assert engine.budget.reserved == sum(r.nbytes for r in self.reservations)
        assert engine.budget.parts == parts
        assert {(o.bucket, o.key): o for o in objs} == self.model
        for bucket in engine.store.buckets.values():
            assert bucket.stats.objects == len(bucket.objects)
            assert bucket.stats.bytes == sum(o.size for o in bucket.objects.values())
        for bucket in engine.store.buckets.values():  # each bucket's LRU list holds exactly its live objects
            assert set(bucket.lru) == set(bucket.objects.values()) and len(bucket.lru) == len(bucket.objects)
            assert bucket.stats.charged == sum(o.charge for o in bucket.objects.values())
        assert engine.budget.pinned >= sum(o.charge for o in objs if o.pinned(now))
        for name in BUCKETS:
            assert keys_of(engine, name) == sorted(
                k for (b, k), o in self.model.items() if b == name and not o.expired(now))

    def teardown(self) -> None:
        for reservation in self.reservations:
            reservation.release()
        check_pins(self.engine)


# No example database (no files written), no explain phase (it traces, slowly), one bug reported at a time: a
# failure shrinks to a short step list in seconds rather than minutes.
EngineMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None, database=None, report_multiple_bugs=False,
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestEngineStateful = EngineMachine.TestCase
