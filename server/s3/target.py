"""Where an S3 request points: bucket and key from the path (path-style) or the Host header (virtual-hosted
style), decoded once, and S3's rule for key lengths (bucket names: ctxstore.buckets, which the client checks too)."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import unquote

from .errors import S3Error

SERVICE, BUCKET, OBJECT = "service", "bucket", "object"

MAX_KEY_BYTES = 1024


@dataclass(frozen=True)
class Target:
    bucket: str | None
    key: str | None
    virtual: bool = False  # the bucket came from the Host header (virtual-hosted style)

    @property
    def kind(self) -> str:
        if self.bucket is None:
            return SERVICE
        return BUCKET if self.key is None else OBJECT


def split_target(raw_path: str, host: str | None, domain: str) -> Target:
    """Bucket and key from the raw path (path-style) or the Host header (virtual-hosted-style).

    The key is percent-decoded exactly once; ``+`` is a literal plus."""
    path = raw_path.split("?", 1)[0]
    bucket: str | None = None
    if domain and host:
        hostname = host.rsplit(":", 1)[0] if not host.endswith("]") else host
        hostname = hostname.lower().rstrip(".")
        if hostname.endswith("." + domain):
            bucket = hostname[: -len(domain) - 1]
    if bucket is None:
        stripped = path[1:] if path.startswith("/") else path
        if not stripped:
            return Target(None, None)
        first, slash, rest = stripped.partition("/")
        bucket = _decode(first)
        return Target(bucket, _decode_key(rest) if slash and rest else None)
    rest = path[1:] if path.startswith("/") else path
    return Target(bucket, _decode_key(rest) if rest else None, virtual=True)


def _decode(text: str) -> str:
    try:
        return unquote(text, encoding="utf-8", errors="strict")
    except UnicodeDecodeError:
        raise S3Error("InvalidArgument", "The path is not valid UTF-8.") from None


def _decode_key(text: str) -> str:
    key = _decode(text)
    if len(key.encode("utf-8")) > MAX_KEY_BYTES:
        raise S3Error("KeyTooLongError", extra={"MaxSizeAllowed": str(MAX_KEY_BYTES)})
    return key
