"""Client-side AWS Signature V4 for bulk calls (the same credentials a node accepts for S3).

Bodies are sent as ``UNSIGNED-PAYLOAD``: every block carries its own XXH3-64, and hashing hundreds of MiB
with SHA-256 would cost more than the transfer. The derived signing key is cached per day.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from urllib.parse import quote

UNSIGNED_PAYLOAD = "UNSIGNED-PAYLOAD"


class Signer:
    """Signs requests for one access key in one region."""

    def __init__(self, access_key: str, secret_key: str, region: str = "us-east-1") -> None:
        self.access_key = access_key
        self._secret = secret_key
        self.region = region
        self._day = ""
        self._key = b""

    def __repr__(self) -> str:  # never show the secret
        return f"Signer(access_key={self.access_key!r}, region={self.region!r})"

    def _signing_key(self, day: str) -> bytes:
        if day != self._day:
            k = hmac.new(("AWS4" + self._secret).encode(), day.encode(), hashlib.sha256).digest()
            for part in (self.region, "s3", "aws4_request"):
                k = hmac.new(k, part.encode(), hashlib.sha256).digest()
            self._day, self._key = day, k
        return self._key

    def headers(self, method: str, host: str, path: str, query: str = "", now: float | None = None
                ) -> list[tuple[str, str]]:
        """The headers that authenticate ``method host path?query`` (path already percent-encoded)."""
        t = time.gmtime(time.time() if now is None else now)
        amz_date = time.strftime("%Y%m%dT%H%M%SZ", t)
        day = amz_date[:8]
        canonical_query = "&".join(sorted(query.split("&"))) if query else ""
        signed = "host;x-amz-content-sha256;x-amz-date"
        canonical = "\n".join([
            method, quote(path, safe="/-_.~%"), canonical_query,
            f"host:{host}\nx-amz-content-sha256:{UNSIGNED_PAYLOAD}\nx-amz-date:{amz_date}\n",
            signed, UNSIGNED_PAYLOAD,
        ])
        scope = f"{day}/{self.region}/s3/aws4_request"
        to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(canonical.encode()).hexdigest()])
        signature = hmac.new(self._signing_key(day), to_sign.encode(), hashlib.sha256).hexdigest()
        return [
            ("x-amz-date", amz_date),
            ("x-amz-content-sha256", UNSIGNED_PAYLOAD),
            ("authorization", f"AWS4-HMAC-SHA256 Credential={self.access_key}/{scope}, "
                              f"SignedHeaders={signed}, Signature={signature}"),
        ]
