"""Multipart uploads: they own their parts, which count against the budget until the upload completes or
aborts; completing one commits a single object through the object store."""

from __future__ import annotations

import hashlib
import secrets

import xxhash

from . import errors
from .budget import Budget, Reservation
from .config import EngineConfig
from .objects import Part, Payload, StoredObject, Upload, etag_matches
from .store import Clock, ObjectStore


class Multipart:
    """The uploads in progress on one node."""

    def __init__(self, config: EngineConfig, budget: Budget, store: ObjectStore, clock: Clock) -> None:
        self.config = config
        self.budget = budget
        self.store = store
        self.clock = clock
        self.uploads: dict[str, Upload] = {}

    def create(
        self, tenant: str, bucket_name: str, key: str, *, ttl: float | None, content_type: str,
        headers: dict[str, str], user_meta: dict[str, str], checksum_algorithm: str | None = None,
    ) -> Upload:
        bucket = self.store.bucket(tenant, bucket_name)
        if ttl is not None:
            self.store.resolve_ttl(bucket, ttl)  # validate now, not at completion
        upload = Upload(
            upload_id=secrets.token_urlsafe(24), bucket=bucket_name, key=key, owner=tenant,
            created=self.clock(), ttl=ttl, content_type=content_type, headers=headers, user_meta=user_meta,
            checksum_algorithm=checksum_algorithm,
        )
        self.uploads[upload.upload_id] = upload
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
                    checksums=checksums)
        self.store.make_room(part.size)
        old = upload.parts.pop(number, None)
        if old is not None:
            self._charge(upload, -old.size)
        upload.parts[number] = part
        self._charge(upload, part.size)
        return part

    def _charge(self, upload: Upload, nbytes: int) -> None:
        upload.charged += nbytes
        self.budget.charge_parts(nbytes)

    def complete(
        self, tenant: str, bucket_name: str, key: str, upload_id: str, parts: list[tuple[int, str]], *,
        if_none_match: bool = False, if_match: str | None = None, checksums: dict[str, str] | None = None,
    ) -> StoredObject:
        """Assemble the listed parts (ascending numbers, matching ETags) into one object, atomically.

        ``checksums``: the composite checksums the protocol layer computed from the parts' own."""
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
        try:
            reservation = self.store.reserve(total)
        except errors.StorageError:
            self._charge(upload, charged)
            raise
        with reservation:
            data = bytearray(total)
            view = memoryview(data)
            pos = 0
            hasher = xxhash.xxh3_64()
            for part in chosen:
                view[pos:pos + part.size] = part.data
                hasher.update(part.data)
                pos += part.size
            etag = f'"{hashlib.md5(b"".join(p.md5 for p in chosen)).hexdigest()}-{len(chosen)}"'
            self.drop(upload)
            return self.store.put(
                tenant, bucket_name, key, data, etag=etag, ttl=upload.ttl, content_type=upload.content_type,
                headers=upload.headers, user_meta=upload.user_meta, checksums=checksums or {},
                parts_count=len(chosen), xxh3=hasher.intdigest(), reservation=reservation,
            )

    def abort(self, tenant: str, bucket_name: str, key: str, upload_id: str) -> None:
        self.drop(self.get(tenant, bucket_name, key, upload_id))

    def drop(self, upload: Upload) -> None:
        if self.uploads.pop(upload.upload_id, None) is not None:
            self._charge(upload, -upload.charged)
            upload.parts.clear()

    def drop_bucket(self, bucket_name: str) -> None:
        """Drop every upload into a bucket that is going away."""
        for upload in [u for u in self.uploads.values() if u.bucket == bucket_name]:
            self.drop(upload)

    def reap_stale(self, limit: int) -> None:
        """Drop up to ``limit`` uploads older than ``upload_ttl``."""
        now = self.clock()
        stale = [u for u in self.uploads.values() if u.created + self.config.upload_ttl <= now]
        for upload in stale[:limit]:
            self.drop(upload)
