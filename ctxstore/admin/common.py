"""What every part of ``ctxstore admin`` shares: names, defaults, exit codes, its errors (the admin API's
schema itself is :mod:`ctxstore.admin_schema`, shared with the node)."""

from __future__ import annotations

ENV_NODES = "CTXSTORE_NODES"
ENV_TOKEN = "CTXSTORE_ADMIN_TOKEN"
DEFAULT_NODES = "127.0.0.1:9000"
DEFAULT_TIMEOUT = 2.0

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2

# Rates of `top`: name -> the counters whose deltas it sums.
RATES: dict[str, tuple[str, ...]] = {
    "reads": ("hits", "misses"),
    "writes": ("puts",),
    "deletes": ("deletes",),
    "bytes_in": ("bytes_in",),
    "bytes_out": ("bytes_out",),
    "evictions": ("evictions",),
    "expirations": ("expirations",),
}


class UsageError(Exception):
    """Bad arguments, no token, no nodes: exit code 2."""


class NodeError(Exception):
    """One node did not do what was asked. ``kind`` is ``down`` (unreachable, timed out) or ``error``
    (it answered with an HTTP error); ``status`` is the HTTP status when there is one."""

    def __init__(self, kind: str, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.status = status
