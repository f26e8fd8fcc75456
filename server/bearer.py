"""The one bearer-token check of the node's own APIs (admin, metrics, events): ``Authorization: Bearer
<admin token>``, compared in constant time. An empty expected token (the admin API is off) matches nothing."""

from __future__ import annotations

import hmac


def token_of(authorization: str | bytes | None) -> bytes | None:
    """The token of an ``Authorization: Bearer <token>`` header value, or None for anything else."""
    if authorization is None:
        return None
    raw = authorization.encode("latin-1") if isinstance(authorization, str) else authorization
    scheme, _, token = raw.strip().partition(b" ")
    if scheme.lower() != b"bearer":
        return None
    return token.strip()


def matches(authorization: str | bytes | None, expected: str) -> bool:
    """Whether the header value carries exactly the ``expected`` token."""
    token = token_of(authorization)
    return bool(expected) and bool(token) and hmac.compare_digest(token or b"", expected.encode())
