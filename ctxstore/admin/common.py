"""What every part of ``ctxstore admin`` shares: names, defaults, the stable keys of its output, its errors."""

from __future__ import annotations

ENV_NODES = "CTXSTORE_NODES"
ENV_TOKEN = "CTXSTORE_ADMIN_TOKEN"
DEFAULT_NODES = "127.0.0.1:9000"
ADMIN_PREFIX = "/_ctx/v1/admin"
HEALTH_PREFIX = "/_ctx/health"
DEFAULT_TIMEOUT = 2.0

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2

MUTABLE_SETTINGS = ("memory", "default_ttl", "max_ttl")

# Keys of the per-node and total stats documents (stable: missing server fields count as 0).
LEVEL_KEYS = ("used", "budget", "objects", "bytes", "charged", "pinned_bytes", "reserved", "parts_bytes",
              "uploads")
COUNTER_KEYS = ("hits", "misses", "puts", "deletes", "evictions", "expirations", "bytes_in", "bytes_out")
STAT_KEYS = LEVEL_KEYS + COUNTER_KEYS
BUCKET_KEYS = ("objects", "bytes", "charged", "pinned_bytes") + COUNTER_KEYS
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
