"""Typed storage errors raised by the engine. They carry the bucket and key they concern; the protocol
layers map them onto their own error codes in one table each."""

from __future__ import annotations


class StorageError(Exception):
    """Base of every error the engine raises on purpose."""

    def __init__(self, detail: str | None = None, *, bucket: str | None = None, key: str | None = None) -> None:
        self.detail = detail
        self.bucket = bucket
        self.key = key
        super().__init__(detail or type(self).__name__)


class NoSuchBucket(StorageError):
    """The bucket does not exist (or belongs to another tenant and is reported as absent)."""


class NoSuchKey(StorageError):
    """The object does not exist or has expired."""


class NoSuchUpload(StorageError):
    """The multipart upload does not exist, was completed, aborted or expired."""

    def __init__(self, detail: str | None = None, *, bucket: str | None = None, key: str | None = None,
                 upload_id: str | None = None) -> None:
        super().__init__(detail, bucket=bucket, key=key)
        self.upload_id = upload_id


class BucketNotEmpty(StorageError):
    """A bucket that still holds live objects cannot be deleted."""


class BucketAlreadyExists(StorageError):
    """Another tenant owns a bucket of that name."""


class BucketAlreadyOwnedByYou(StorageError):
    """Raised only where re-creating one's own bucket is an error (not by S3 CreateBucket, which answers 200)."""


class AccessDenied(StorageError):
    """The tenant may not touch this bucket."""


class PreconditionFailed(StorageError):
    """A conditional write or read (If-Match / If-None-Match) did not hold."""


class InsufficientCapacity(StorageError):
    """The byte budget cannot make room: everything left is pinned or reserved by uploads in flight."""

    def __init__(self, detail: str | None = None, *, bucket: str | None = None, key: str | None = None,
                 retry_after: float = 1.0) -> None:
        super().__init__(detail, bucket=bucket, key=key)
        self.retry_after = retry_after


class InvalidPart(StorageError):
    """A part named in CompleteMultipartUpload is missing or its ETag does not match."""


class InvalidPartOrder(StorageError):
    """Parts in CompleteMultipartUpload are not in ascending order."""


class EntityTooSmall(StorageError):
    """A non-final multipart part is below the minimum part size."""


class EntityTooLarge(StorageError):
    """An object exceeds the maximum object size."""


class InvalidArgument(StorageError):
    """A value passed to the engine is out of range (TTL, pin duration, part number...)."""
