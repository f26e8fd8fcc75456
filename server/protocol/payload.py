"""``x-amz-content-sha256: <hex digest>``: the body a request carries must hash to what it signed.

Shared by every body reader (S3 objects and parts, S3 XML bodies, bulk frames); nothing a body carries may be
committed before :meth:`PayloadHash.verify` passed."""

from __future__ import annotations

import hashlib
import hmac

from .errors import Reject, RequestError
from .signing import AuthContext


class PayloadHash:
    """Hashes a body as it is read, if the request signed its SHA-256 (a no-op otherwise)."""

    __slots__ = ("_expected", "_hasher")

    def __init__(self, auth: AuthContext) -> None:
        self._hasher = hashlib.sha256() if auth.payload == "sha256" else None
        self._expected = (auth.content_sha256 or "").lower()

    @property
    def active(self) -> bool:
        return self._hasher is not None

    def update(self, data: bytes | bytearray | memoryview) -> None:
        if self._hasher is not None:
            self._hasher.update(data)

    def verify(self) -> None:
        """RequestError(PAYLOAD_HASH_MISMATCH) unless the body hashed to the signed digest."""
        if self._hasher is None:
            return
        actual = self._hasher.hexdigest()
        if not hmac.compare_digest(actual, self._expected):
            raise RequestError(Reject.PAYLOAD_HASH_MISMATCH,
                               extra={"ClientComputedContentSHA256": self._expected,
                                      "S3ComputedContentSHA256": actual})
