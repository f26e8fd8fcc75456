"""Multipart uploads: they own their parts, which count against the budget and their tenant's quota until the
upload completes or aborts, as does each upload's own record; completing one commits a single object through
the object store. A tenant may have at most ``max_uploads_per_tenant`` uploads at once."""

from __future__ import annotations

import hashlib
import secrets
from collections import OrderedDict

import xxhash

from . import errors
from .budget import Budget, Reservation
from .config import EngineConfig
from .objects import Completion, Part, Payload, StoredObject, Upload, etag_matches

COMPLETIONS_KEPT = 10000  # completed uploads remembered for retried completions (each for upload_ttl at most)
from .store import Clock, ObjectStore


class Multipart:
    """The uploads in progress on one node."""

    def __init__(self, config: EngineConfig, budget: Budget, store: ObjectStore, clock: Clock) -> None:
        self.config = config
        self.budget = budget
        self.store = store
        self.clock = clock
        self.uploads: dict[str, Upload] = {}
        self._owned: dict[str, int] = {}  # tenant -> uploads in progress
        self.completed: OrderedDict[str, Completion] = OrderedDict()  # oldest first

    def create(
        self, tenant: str, bucket_name: str, key: str, *, ttl: float | None, content_type: str,
        headers: dict[str, str], user_meta: dict[str, str], checksum_algorithm: str | None = None,
    ) -> Upload:
        bucket = self.store.bucket(tenant, bucket_name)
        if ttl is not None:
            self.store.resolve_ttl(bucket, ttl)  # validate now, not at completion
        if self._owned.get(tenant, 0) >= self.config.max_uploads_per_tenant:
            raise errors.TooManyUploads(f"a tenant may have at most {self.config.max_uploads_per_tenant} uploads in "
                                 "progress; complete or abort some")
        upload = Upload(
            upload_id=secrets.token_urlsafe(24), bucket=bucket_name, key=key, owner=tenant,
            created=self.clock(), ttl=ttl, content_type=content_type, headers=headers, user_meta=user_meta,
            checksum_algorithm=checksum_algorithm,
        )
        upload.charge = self.config.upload_overhead + upload.metadata_bytes()
        self.store.capacity.make_state_room(tenant, upload.charge)
        self.budget.charge(tenant, upload.charge, "state")
        self.uploads[upload.upload_id] = upload
        self._owned[tenant] = self._owned.get(tenant, 0) + 1
        return upload

    def get(self, tenant: str, bucket_name: str, key: str, upload_id: str) -> Upload:
        self.store.bucket(tenant, bucket_name)
        upload = self.uploads.get(upload_id)
        if upload is None or upload.bucket != bucket_name or upload.key != key or upload.owner != tenant:
            raise errors.NoSuchUpload(bucket=bucket_name, key=key, upload_id=upload_id)
        return upload

    def in_bucket(self, bucket_name: str, prefix: str = "") -> list[Upload]:
        """Uploads of a bucket whose keys start with ``prefix``, by key then age."""
        return sorted((u for u in self.uploads.values() if u.bucket == bucket_name and u.key.startswith(prefix)),
                      key=lambda u: (u.key, u.created))

    def put_part(
        self, tenant: str, bucket_name: str, key: str, upload_id: str, number: int, data: Payload, *,
        md5: bytes, checksums: dict[str, str], reservation: Reservation | None = None,
    ) -> Part:
        if reservation is not None:
            reservation.release()  # first: a part that fails must not keep the budget
        if not 1 <= number <= self.config.max_parts:
            raise errors.InvalidArgument(f"part number must be an integer between 1 and {self.config.max_parts}")
        upload = self.get(tenant, bucket_name, key, upload_id)
        part = Part(number=number, data=data, etag=f'"{md5.hex()}"', md5=md5, last_modified=self.clock(),
                    checksums=checksums, charge=len(data) + self.config.part_overhead)
        old = upload.parts.pop(number, None)
        if old is not None:  # replaced: its bytes are free for the new one
            self._charge(upload, -old.charge)
        try:
            self._check_fits(upload, len(data))
            self.store.capacity.make_state_room(tenant, part.charge)
        except errors.StorageError:
            if old is not None:
                upload.parts[number] = old
                self._charge(upload, old.charge)
            raise
        upload.parts[number] = part
        self._charge(upload, part.charge)
        return part

    def check_part(self, tenant: str, bucket_name: str, key: str, upload_id: str, number: int,
                   nbytes: int) -> Upload:
        """The upload, if a part ``number`` of ``nbytes`` could ever join it (checked before its body is read)."""
        upload = self.get(tenant, bucket_name, key, upload_id)
        old = upload.parts.get(number)
        self._check_fits(upload, nbytes, old.charge if old is not None else 0)
        return upload

    def _check_fits(self, upload: Upload, nbytes: int, freed_charge: int = 0) -> None:
        """Parts cannot be evicted: an upload whose parts outgrow the budget or its tenant's quota could never be
        held, and the room a SlowDown promises would never come. EntityTooLarge, so the client stops retrying.
        (Their sum may pass the object size limit: a completion may name only some of them.)"""
        held = upload.charge + upload.charged - freed_charge + nbytes + self.config.part_overhead
        quota, _ = self.budget.tenant_usage(upload.owner)
        for cap, what in ((self.budget.limit, "the node's budget"), (quota, "the tenant's quota")):
            if cap and held > cap:
                raise errors.EntityTooLarge(f"with this part the upload would hold {held} bytes, more than {what} "
                                            f"of {cap}; its parts cannot be evicted, so it could never complete")

    def _charge(self, upload: Upload, nbytes: int) -> None:
        upload.charged += nbytes
        self.budget.charge(upload.owner, nbytes, "part")

    def completion(self, tenant: str, bucket_name: str, key: str, upload_id: str) -> Completion | None:
        """What completing ``upload_id`` answered, if it was completed (recently) into this tenant's key."""
        done = self.completed.get(upload_id)
        if done is None or upload_id in self.uploads:
            return None
        self.store.bucket(tenant, bucket_name)
        return done if (done.bucket, done.key, done.owner) == (bucket_name, key, tenant) else None

    def complete(
        self, tenant: str, bucket_name: str, key: str, upload_id: str, parts: list[tuple[int, str]], *,
        if_none_match: bool | str = False, if_match: str | None = None, checksums: dict[str, str] | None = None,
    ) -> StoredObject | Completion:
        """Assemble the listed parts (ascending numbers, matching ETags) into one object, atomically.

        ``checksums``: the composite checksums the protocol layer computed from the parts' own. An upload
        completed before (a retried completion) answers what it answered then, as a :class:`Completion`."""
        done = self.completion(tenant, bucket_name, key, upload_id)
        if done is not None:
            return done
        upload = self.get(tenant, bucket_name, key, upload_id)
        if not parts:
            raise errors.InvalidPart("you must specify at least one part")
        chosen: list[Part] = []
        last = 0
        for number, etag in parts:
            if number <= last:
                raise errors.InvalidPartOrder()
            last = number
            part = upload.parts.get(number)
            if part is None or not etag_matches(etag, part.etag):
                raise errors.InvalidPart(f"part {number} is missing or its ETag does not match")
            chosen.append(part)
        for part in chosen[:-1]:
            if part.size < self.config.min_part_size:
                raise errors.EntityTooSmall(f"part {part.number} is smaller than {self.config.min_part_size} bytes")
        total = sum(p.size for p in chosen)
        bucket = self.store.bucket(tenant, bucket_name)
        self.store.check_conditions(bucket, key, self.clock(), if_none_match, if_match)
        # The listed parts become the object: stop counting them as parts before reserving its room, so an
        # upload larger than half the budget can still complete. If there is no room, they count again.
        charged = upload.charged
        self._charge(upload, -charged)
        reservation: Reservation | None = None
        try:
            reservation = self.store.capacity.reserve(tenant, bucket_name, total)
            reservation.grow_all()
        except errors.StorageError:
            if reservation is not None:
                reservation.release()
            self._charge(upload, charged)
            raise
        with reservation:
            data = self.store.buffers.take(total)  # every byte of it is copied from a part below
            view = memoryview(data)
            pos = 0
            hasher = xxhash.xxh3_64()
            for part in chosen:
                view[pos:pos + part.size] = part.data
                hasher.update(part.data)
                pos += part.size
            etag = f'"{hashlib.md5(b"".join(p.md5 for p in chosen)).hexdigest()}-{len(chosen)}"'
            self.drop(upload)
            obj = self.store.put(
                tenant, bucket_name, key, data, etag=etag, ttl=upload.ttl, content_type=upload.content_type,
                headers=upload.headers, user_meta=upload.user_meta, checksums=checksums or {},
                parts_count=len(chosen), xxh3=hasher.intdigest(), reservation=reservation,
            )
        self.completed[upload_id] = Completion(upload_id, bucket_name, key, tenant, obj.etag, dict(obj.checksums),
                                               obj.expires_at, self.clock())
        while len(self.completed) > COMPLETIONS_KEPT:
            self.completed.popitem(last=False)
        return obj

    def abort(self, tenant: str, bucket_name: str, key: str, upload_id: str) -> None:
        self.drop(self.get(tenant, bucket_name, key, upload_id))

    def drop(self, upload: Upload) -> None:
        if self.uploads.pop(upload.upload_id, None) is not None:
            self._charge(upload, -upload.charged)
            self.budget.charge(upload.owner, -upload.charge, "state")
            self._owned[upload.owner] -= 1
            upload.parts.clear()

    def drop_bucket(self, bucket_name: str) -> None:
        """Drop every upload into a bucket that is going away."""
        for upload in [u for u in self.uploads.values() if u.bucket == bucket_name]:
            self.drop(upload)

    def reap_stale(self, limit: int) -> None:
        """Drop up to ``limit`` uploads older than ``upload_ttl``, and the completions remembered that long."""
        now = self.clock()
        while self.completed:
            oldest = next(iter(self.completed.values()))
            if oldest.completed + self.config.upload_ttl > now:
                break
            self.completed.popitem(last=False)
        stale = [u for u in self.uploads.values() if u.created + self.config.upload_ttl <= now]
        for upload in stale[:limit]:
            self.drop(upload)
