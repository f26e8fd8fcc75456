"""S3 errors: one table of codes (HTTP status, message) and the exception that carries one.

Errors of the engine (:class:`~ctxstore_server.engine.Kind`) and of the protocol floor
(:class:`~ctxstore_server.protocol.errors.Reject`) become S3 codes in one table, :data:`CODES`;
handlers raise :class:`S3Error`, and the service writes every failure once as S3 error XML (headers only for
HEAD, ``Retry-After`` on 503).
"""

from __future__ import annotations

from ..engine import Kind, StorageError, errors as storage
from ..protocol.errors import Reject, RequestError

# code -> (HTTP status, default message). Messages follow AWS's wording where clients show them.
ERROR_CODES: dict[str, tuple[int, str]] = {
    "AccessDenied": (403, "Access Denied"),
    "AuthorizationHeaderMalformed": (400, "The authorization header is malformed."),
    "AuthorizationQueryParametersError": (400, "Error parsing the X-Amz-Credential parameter."),
    "BadDigest": (400, "The Content-MD5 or checksum you specified did not match what we received."),
    "BucketAlreadyExists": (409, "The requested bucket name is not available."),
    "BucketAlreadyOwnedByYou": (409, "Your previous request to create the named bucket succeeded and you already own it."),
    "BucketNotEmpty": (409, "The bucket you tried to delete is not empty."),
    "EntityTooLarge": (400, "Your proposed upload exceeds the maximum allowed object size."),
    "EntityTooSmall": (400, "Your proposed upload is smaller than the minimum allowed object size."),
    "ExpiredToken": (400, "The provided token has expired."),
    "IncompleteBody": (400, "You did not provide the number of bytes specified by the Content-Length HTTP header."),
    "InternalError": (500, "We encountered an internal error. Please try again."),
    "InvalidAccessKeyId": (403, "The AWS Access Key Id you provided does not exist in our records."),
    "InvalidArgument": (400, "Invalid Argument"),
    "InvalidBucketName": (400, "The specified bucket is not valid."),
    "InvalidDigest": (400, "The Content-MD5 or checksum you specified is not valid."),
    "InvalidPart": (400, "One or more of the specified parts could not be found."),
    "InvalidPartOrder": (400, "The list of parts was not in ascending order."),
    "InvalidRange": (416, "The requested range is not satisfiable"),
    "InvalidRequest": (400, "Invalid Request"),
    "KeyTooLongError": (400, "Your key is too long"),
    "MalformedXML": (400, "The XML you provided was not well-formed or did not validate against our published schema."),
    "MaxMessageLengthExceeded": (400, "Your request was too big."),
    "MetadataTooLarge": (400, "Your metadata headers exceed the maximum allowed metadata size."),
    "MethodNotAllowed": (405, "The specified method is not allowed against this resource."),
    "MissingContentLength": (411, "You must provide the Content-Length HTTP header."),
    "MissingSecurityHeader": (400, "Your request is missing a required header."),
    "NoSuchBucket": (404, "The specified bucket does not exist"),
    "NoSuchKey": (404, "The specified key does not exist."),
    "NoSuchUpload": (404, "The specified multipart upload does not exist."),
    "NotImplemented": (501, "A header or query you provided implies functionality that is not implemented."),
    "NotModified": (304, "Not Modified"),
    "PreconditionFailed": (412, "At least one of the pre-conditions you specified did not hold"),
    "RequestTimeout": (400, "Your socket connection to the server was not read from or written to within the timeout period."),
    "RequestTimeTooSkewed": (403, "The difference between the request time and the server's time is too large."),
    "SignatureDoesNotMatch": (403, "The request signature we calculated does not match the signature you provided."),
    "SlowDown": (503, "Please reduce your request rate."),
    "ServiceUnavailable": (503, "The service is unavailable. Please retry."),
    "XAmzContentSHA256Mismatch": (400, "The provided 'x-amz-content-sha256' header does not match what was computed."),
    "CORSResponse": (400, "CORS is not enabled for this bucket."),
    "ConditionalRequestConflict": (409, "A conflicting operation occurred. Please retry."),
}


class S3Error(Exception):
    """An S3 error response: ``code`` names a row of :data:`ERROR_CODES`."""

    def __init__(
        self,
        code: str,
        message: str | None = None,
        *,
        resource: str | None = None,
        headers: dict[str, str] | None = None,
        extra: dict[str, str] | None = None,
    ) -> None:
        if code not in ERROR_CODES:
            raise ValueError(f"unknown S3 error code {code!r}")
        self.code = code
        self.status, default = ERROR_CODES[code]
        self.message = message or default
        self.resource = resource
        self.headers = dict(headers or {})
        self.extra = dict(extra or {})  # additional XML elements (e.g. BucketName, Key, ArgumentName)
        super().__init__(f"{code}: {self.message}")


# Engine and protocol-floor error kinds -> S3 code: the one place they become S3 errors.
CODES: dict[Kind | Reject, str] = {
    Kind.NO_SUCH_BUCKET: "NoSuchBucket",
    Kind.NO_SUCH_KEY: "NoSuchKey",
    Kind.NO_SUCH_UPLOAD: "NoSuchUpload",
    Kind.BUCKET_NOT_EMPTY: "BucketNotEmpty",
    Kind.BUCKET_EXISTS: "BucketAlreadyExists",
    Kind.BUCKET_OWNED: "BucketAlreadyOwnedByYou",
    Kind.ACCESS_DENIED: "AccessDenied",
    Kind.PRECONDITION_FAILED: "PreconditionFailed",
    Kind.INSUFFICIENT_CAPACITY: "SlowDown",
    Kind.INVALID_PART: "InvalidPart",
    Kind.INVALID_PART_ORDER: "InvalidPartOrder",
    Kind.ENTITY_TOO_SMALL: "EntityTooSmall",
    Kind.ENTITY_TOO_LARGE: "EntityTooLarge",
    Kind.INVALID_ARGUMENT: "InvalidArgument",
    Reject.ACCESS_DENIED: "AccessDenied",
    Reject.UNKNOWN_ACCESS_KEY: "InvalidAccessKeyId",
    Reject.SIGNATURE_MISMATCH: "SignatureDoesNotMatch",
    Reject.CLOCK_SKEW: "RequestTimeTooSkewed",
    Reject.MALFORMED_AUTHORIZATION: "AuthorizationHeaderMalformed",
    Reject.MALFORMED_PRESIGNED: "AuthorizationQueryParametersError",
    Reject.INVALID_ARGUMENT: "InvalidArgument",
    Reject.INVALID_REQUEST: "InvalidRequest",
    Reject.INCOMPLETE_BODY: "IncompleteBody",
    Reject.PAYLOAD_HASH_MISMATCH: "XAmzContentSHA256Mismatch",
    Reject.BODY_TIMEOUT: "RequestTimeout",
    Reject.INTERNAL: "InternalError",
}


def as_s3_error(exc: Exception) -> S3Error:
    """Any failure the S3 service answers, as its S3 error."""
    if isinstance(exc, S3Error):
        return exc
    if isinstance(exc, RequestError):
        return S3Error(CODES[exc.kind], exc.message, extra=exc.extra)
    if isinstance(exc, StorageError):
        return _from_storage_error(exc)
    return S3Error("InternalError")


def _from_storage_error(exc: StorageError) -> S3Error:
    code = CODES[exc.kind]
    headers = {}
    if isinstance(exc, storage.InsufficientCapacity):
        headers["Retry-After"] = str(max(1, int(exc.retry_after)))
    extra = {}
    if exc.bucket is not None and code in ("NoSuchBucket", "BucketNotEmpty", "BucketAlreadyExists"):
        extra["BucketName"] = exc.bucket
    if exc.key is not None and code == "NoSuchKey":
        extra["Key"] = exc.key
    if isinstance(exc, storage.NoSuchUpload) and exc.upload_id:
        extra["UploadId"] = exc.upload_id
    return S3Error(code, str(exc.detail) if exc.detail else None, headers=headers, extra=extra)
