"""The client's exceptions. By default lookups and restores never raise them into the inference path (a
failed node is a miss); ``strict=True`` raises them. The tree::

    ContextStoreError
    ├── ConfigurationError          bad nodes, credentials or arguments (always raised)
    ├── NodeUnavailable             a node refused, timed out or is marked down
    │   └── NodeTimeout             connect or read timeout
    ├── ServerError                 the node answered an error frame (``code``, ``status``)
    │   ├── AuthenticationError     InvalidAccessKeyId, SignatureDoesNotMatch, AccessDenied, RequestTimeTooSkewed
    │   ├── NoSuchBucket
    │   ├── LimitExceeded           TooManyKeys, TooManyBytes
    │   ├── SlowDown                the node's budget is full of pinned data (retry later)
    │   └── ProtocolError           MalformedFrame, IncompleteBody, NoSuchOperation, InvalidArgument,
    │                               MethodNotAllowed; a response the client cannot parse
    └── IntegrityError              a block's checksum did not verify (counted, a miss; strict mode raises)

Server error codes map onto this tree in one table, :data:`ERROR_CODES`; an S3 error document (``<Error>``)
becomes its member through :func:`s3_error`.
"""

from __future__ import annotations

import http
import re
from xml.etree import ElementTree


class ContextStoreError(Exception):
    """Base of every ctxstore client error."""


class ConfigurationError(ContextStoreError, ValueError):
    """The client was configured or called wrongly."""


class NodeUnavailable(ContextStoreError):
    """A node could not be reached, or is marked down."""

    def __init__(self, node: str, reason: str) -> None:
        super().__init__(f"{node}: {reason}")
        self.node = node
        self.reason = reason


class NodeTimeout(NodeUnavailable):
    """A connect or read deadline passed."""


class ServerError(ContextStoreError):
    """The node answered with an error."""

    def __init__(self, node: str, status: int, code: str, message: str) -> None:
        super().__init__(f"{node}: {status} {code}: {message}")
        self.node = node
        self.status = status
        self.code = code
        self.message = message


class AuthenticationError(ServerError):
    """The node rejected the credentials or the signature."""


class NoSuchBucket(ServerError):
    """The namespace's bucket does not exist on that node."""


class LimitExceeded(ServerError):
    """A call exceeded the node's keys- or bytes-per-call limit."""


class SlowDown(ServerError):
    """The node cannot make room (its budget is full of pinned blocks or uploads in flight)."""


class ProtocolError(ServerError):
    """The node could not parse the request, or the client could not parse the answer."""


class IntegrityError(ContextStoreError):
    """A block's checksum did not match its bytes."""


ERROR_CODES: dict[str, type[ServerError]] = {
    "InvalidAccessKeyId": AuthenticationError,
    "SignatureDoesNotMatch": AuthenticationError,
    "AccessDenied": AuthenticationError,
    "RequestTimeTooSkewed": AuthenticationError,
    "NoSuchBucket": NoSuchBucket,
    "TooManyKeys": LimitExceeded,
    "TooManyBytes": LimitExceeded,
    "SlowDown": SlowDown,
    "MalformedFrame": ProtocolError,
    "IncompleteBody": ProtocolError,
    "NoSuchOperation": ProtocolError,
    "InvalidArgument": ProtocolError,
    "MethodNotAllowed": ProtocolError,
}


def server_error(node: str, status: int, code: str, message: str) -> ServerError:
    """The exception for an error frame, by code (ServerError for codes not in the table)."""
    return ERROR_CODES.get(code, ServerError)(node, status, code, message)


#: An S3 error document is a few hundred bytes; a longer body is cut here before it is parsed or quoted.
MAX_ERROR_BODY = 16 << 10
MAX_MESSAGE_CHARS = 300
# A DTD can declare entities that expand: S3 error documents never carry one, so a body with one is not parsed.
_DECLARATION = re.compile(rb"<!(DOCTYPE|ENTITY)", re.IGNORECASE)


def s3_error(node: str, status: int, body: bytes | bytearray | memoryview) -> ServerError:
    """The exception for an S3 error answer: the ``Code`` and ``Message`` of its ``<Error>`` document (the
    rest, such as the string a signature was computed over, stays out of the text). A body that is not such a
    document keeps the code ``HTTP`` and its first line, or the status's reason, as the message."""
    data = bytes(body[:MAX_ERROR_BODY])
    parsed = _error_document(data)
    if parsed is not None:
        code, message = parsed
        return server_error(node, status, code, _clip(message))
    lines = data.decode("utf-8", "replace").strip().splitlines()
    message = lines[0] if lines else _reason(status)
    return server_error(node, status, "HTTP", _clip(message))


def _error_document(data: bytes) -> tuple[str, str] | None:
    """(Code, Message) of ``<Error><Code>…</Code><Message>…</Message>…</Error>``, or None."""
    if b"<Error" not in data or _DECLARATION.search(data):
        return None
    try:
        root = ElementTree.fromstring(data)
    except ElementTree.ParseError:
        return None
    if root.tag.rpartition("}")[2] != "Error":
        return None
    fields = {child.tag.rpartition("}")[2]: (child.text or "").strip() for child in root}
    code = fields.get("Code", "")
    if not code:
        return None
    return code, " ".join(fields.get("Message", "").split())


def _clip(text: str) -> str:
    return text if len(text) <= MAX_MESSAGE_CHARS else text[:MAX_MESSAGE_CHARS - 1] + "…"


def _reason(status: int) -> str:
    try:
        return http.HTTPStatus(status).phrase
    except ValueError:
        return "no message"
