"""Typed storage errors raised by the engine.

Each error carries the bucket and key it concerns and a neutral :class:`Kind`; every protocol layer (S3, bulk,
admin) maps kinds onto its own error codes in one table, and a test checks each table covers every kind.
"""

from __future__ import annotations

from enum import StrEnum
from typing import ClassVar


class Kind(StrEnum):
    """What went wrong, independent of any protocol."""

    NO_SUCH_BUCKET = "no-such-bucket"
    NO_SUCH_KEY = "no-such-key"
    NO_SUCH_UPLOAD = "no-such-upload"
    BUCKET_NOT_EMPTY = "bucket-not-empty"
    BUCKET_EXISTS = "bucket-exists"
    BUCKET_OWNED = "bucket-owned"
    ACCESS_DENIED = "access-denied"
    PRECONDITION_FAILED = "precondition-failed"
    INSUFFICIENT_CAPACITY = "insufficient-capacity"
    INVALID_PART = "invalid-part"
    INVALID_PART_ORDER = "invalid-part-order"
    ENTITY_TOO_SMALL = "entity-too-small"
    ENTITY_TOO_LARGE = "entity-too-large"
    INVALID_ARGUMENT = "invalid-argument"
    TOO_MANY_BUCKETS = "too-many-buckets"
    TOO_MANY_UPLOADS = "too-many-uploads"


class StorageError(Exception):
    """Base of every error the engine raises on purpose."""

    kind: ClassVar[Kind] = Kind.INVALID_ARGUMENT

    def __init__(self, detail: str | None = None, *, bucket: str | None = None, key: str | None = None) -> None:
        self.detail = detail
        self.bucket = bucket
        self.key = key
        super().__init__(detail or type(self).__name__)


class NoSuchBucket(StorageError):
    """The bucket does not exist (or belongs to another tenant and is reported as absent)."""

    kind = Kind.NO_SUCH_BUCKET


class NoSuchKey(StorageError):
    """The object does not exist or has expired."""

    kind = Kind.NO_SUCH_KEY


class NoSuchUpload(StorageError):
    """The multipart upload does not exist, was completed, aborted or expired."""

    kind = Kind.NO_SUCH_UPLOAD

    def __init__(self, detail: str | None = None, *, bucket: str | None = None, key: str | None = None,
                 upload_id: str | None = None) -> None:
        super().__init__(detail, bucket=bucket, key=key)
        self.upload_id = upload_id


class BucketNotEmpty(StorageError):
    """A bucket that still holds live objects cannot be deleted."""

    kind = Kind.BUCKET_NOT_EMPTY


class BucketAlreadyExists(StorageError):
    """Another tenant owns a bucket of that name."""

    kind = Kind.BUCKET_EXISTS


class BucketAlreadyOwnedByYou(StorageError):
    """Raised only where re-creating one's own bucket is an error (not by S3 CreateBucket, which answers 200)."""

    kind = Kind.BUCKET_OWNED


class AccessDenied(StorageError):
    """The tenant may not touch this bucket."""

    kind = Kind.ACCESS_DENIED


class PreconditionFailed(StorageError):
    """A conditional write or read (If-Match / If-None-Match) did not hold."""

    kind = Kind.PRECONDITION_FAILED


class InsufficientCapacity(StorageError):
    """The byte budget cannot make room: everything left is pinned or reserved by uploads in flight."""

    kind = Kind.INSUFFICIENT_CAPACITY

    def __init__(self, detail: str | None = None, *, bucket: str | None = None, key: str | None = None,
                 retry_after: float = 1.0) -> None:
        super().__init__(detail, bucket=bucket, key=key)
        self.retry_after = retry_after


class FlashQueueFull(InsufficientCapacity):
    """Room needs a victim demoted, and the flash tier's write queue is full: the write waits for it to drain
    (:meth:`FlashTier.with_write_room`), then is refused (SlowDown). The victim is never dropped for this."""


class InvalidPart(StorageError):
    """A part named in CompleteMultipartUpload is missing or its ETag does not match."""

    kind = Kind.INVALID_PART


class InvalidPartOrder(StorageError):
    """Parts in CompleteMultipartUpload are not in ascending order."""

    kind = Kind.INVALID_PART_ORDER


class EntityTooSmall(StorageError):
    """A non-final multipart part is below the minimum part size."""

    kind = Kind.ENTITY_TOO_SMALL


class EntityTooLarge(StorageError):
    """An object exceeds the maximum object size."""

    kind = Kind.ENTITY_TOO_LARGE


class InvalidArgument(StorageError):
    """A value passed to the engine is out of range (TTL, pin duration, part number...)."""

    kind = Kind.INVALID_ARGUMENT


class TooManyBuckets(StorageError):
    """The tenant owns as many buckets as it may."""

    kind = Kind.TOO_MANY_BUCKETS


class TooManyUploads(StorageError):
    """The tenant has as many multipart uploads in progress as it may."""

    kind = Kind.TOO_MANY_UPLOADS
