"""Bulk API errors: the exception a handler raises with a code of :data:`ctxstore.wire.ERROR_STATUS`, and the
one table mapping the engine's and the protocol floor's error kinds onto those codes."""

from __future__ import annotations

from ctxstore import wire

from ..engine import Kind, StorageError, errors as storage
from ..protocol.errors import Reject, RequestError


class BulkError(Exception):
    """A bulk error response: ``code`` is a row of :data:`ctxstore.wire.ERROR_STATUS`."""

    def __init__(self, code: str, message: str, headers: dict[str, str] | None = None) -> None:
        if code not in wire.ERROR_STATUS:
            raise ValueError(f"unknown bulk error code {code!r}")
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.status = wire.ERROR_STATUS[code]
        self.headers = dict(headers or {})


# Engine and protocol-floor error kinds -> bulk code: the one place they become bulk errors.
CODES: dict[Kind | Reject, str] = {
    Kind.NO_SUCH_BUCKET: "NoSuchBucket",
    Kind.NO_SUCH_KEY: "InvalidArgument",  # ops never look one key up alone: absence is data, not an error
    Kind.NO_SUCH_UPLOAD: "InvalidArgument",
    Kind.BUCKET_NOT_EMPTY: "InvalidArgument",
    Kind.BUCKET_EXISTS: "AccessDenied",
    Kind.BUCKET_OWNED: "InvalidArgument",
    Kind.ACCESS_DENIED: "AccessDenied",
    Kind.PRECONDITION_FAILED: "InvalidArgument",
    Kind.INSUFFICIENT_CAPACITY: "SlowDown",
    Kind.INVALID_PART: "InvalidArgument",
    Kind.INVALID_PART_ORDER: "InvalidArgument",
    Kind.ENTITY_TOO_SMALL: "InvalidArgument",
    Kind.ENTITY_TOO_LARGE: "TooManyBytes",
    Kind.INVALID_ARGUMENT: "InvalidArgument",
    Reject.ACCESS_DENIED: "AccessDenied",
    Reject.UNKNOWN_ACCESS_KEY: "InvalidAccessKeyId",
    Reject.SIGNATURE_MISMATCH: "SignatureDoesNotMatch",
    Reject.CLOCK_SKEW: "RequestTimeTooSkewed",
    Reject.MALFORMED_AUTHORIZATION: "InvalidArgument",
    Reject.MALFORMED_PRESIGNED: "InvalidArgument",
    Reject.INVALID_ARGUMENT: "InvalidArgument",
    Reject.INVALID_REQUEST: "InvalidArgument",
    Reject.INCOMPLETE_BODY: "IncompleteBody",
    Reject.PAYLOAD_HASH_MISMATCH: "InvalidArgument",
    Reject.BODY_TIMEOUT: "RequestTimeout",
    Reject.INTERNAL: "InternalError",
}


def as_bulk_error(exc: Exception) -> BulkError:
    """Any failure the bulk service answers, as its bulk error."""
    if isinstance(exc, BulkError):
        return exc
    if isinstance(exc, wire.WireError):
        return BulkError(exc.code, str(exc))
    if isinstance(exc, RequestError):
        message = exc.message
        if exc.extra:  # e.g. what the server signed, so a client author can diff it against their own
            message += "".join(f"\n{name}: {value}" for name, value in exc.extra.items())
        return BulkError(CODES[exc.kind], message)
    if isinstance(exc, StorageError):
        headers = {}
        if isinstance(exc, storage.InsufficientCapacity):
            headers["retry-after"] = str(max(1, int(exc.retry_after)))
        return BulkError(CODES[exc.kind], str(exc), headers)
    return BulkError("InternalError", "see the server log")
