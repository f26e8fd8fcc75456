"""Why the protocol floor (request shell, authentication, body checks) refuses a request, in neutral terms.

:class:`RequestError` carries a :class:`Reject` kind; the S3 and bulk services map kinds onto their own error
codes in one table each (together with the engine's :class:`~ctxstore_server.engine.Kind`), and write the
error once in their own encoding (XML or msgpack). A test checks every table covers every kind.
"""

from __future__ import annotations

from enum import StrEnum


class Reject(StrEnum):
    """What is wrong with a request, independent of the protocol that carried it."""

    ACCESS_DENIED = "access-denied"  # unsigned, expired, or a header that must be signed is not
    UNKNOWN_ACCESS_KEY = "unknown-access-key"
    SIGNATURE_MISMATCH = "signature-mismatch"
    CLOCK_SKEW = "clock-skew"
    MALFORMED_AUTHORIZATION = "malformed-authorization"  # the Authorization header
    MALFORMED_PRESIGNED = "malformed-presigned"  # the query parameters of a presigned URL
    INVALID_ARGUMENT = "invalid-argument"
    INVALID_REQUEST = "invalid-request"
    INCOMPLETE_BODY = "incomplete-body"
    PAYLOAD_HASH_MISMATCH = "payload-hash-mismatch"  # x-amz-content-sha256 does not match the body
    BODY_TIMEOUT = "body-timeout"
    INTERNAL = "internal"


# Default messages, in AWS's wording where clients show it.
MESSAGES: dict[Reject, str] = {
    Reject.ACCESS_DENIED: "Access Denied",
    Reject.UNKNOWN_ACCESS_KEY: "The AWS Access Key Id you provided does not exist in our records.",
    Reject.SIGNATURE_MISMATCH: "The request signature we calculated does not match the signature you provided.",
    Reject.CLOCK_SKEW: "The difference between the request time and the server's time is too large.",
    Reject.MALFORMED_AUTHORIZATION: "The authorization header is malformed.",
    Reject.MALFORMED_PRESIGNED: "Error parsing the X-Amz-Credential parameter.",
    Reject.INVALID_ARGUMENT: "Invalid Argument",
    Reject.INVALID_REQUEST: "Invalid Request",
    Reject.INCOMPLETE_BODY: "You did not provide the number of bytes specified by the Content-Length HTTP header.",
    Reject.PAYLOAD_HASH_MISMATCH: "The provided 'x-amz-content-sha256' header does not match what was computed.",
    Reject.BODY_TIMEOUT: "Your socket connection to the server was not read from or written to within the "
                         "timeout period.",
    Reject.INTERNAL: "We encountered an internal error. Please try again.",
}


class RequestError(Exception):
    """A request refused by the protocol floor. ``extra``: facts for the answer (e.g. what the server
    signed, so a client author can diff it against their own); never a secret."""

    def __init__(self, kind: Reject, message: str | None = None, *, extra: dict[str, str] | None = None) -> None:
        self.kind = kind
        self.message = message or MESSAGES[kind]
        self.extra = dict(extra or {})
        super().__init__(f"{kind}: {self.message}")
