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

Server error codes map onto this tree in one table, :data:`ERROR_CODES`.
"""

from __future__ import annotations


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
