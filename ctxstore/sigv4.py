"""Client-side AWS Signature V4 for bulk calls (the same credentials a node accepts for S3).

Bodies are sent as ``UNSIGNED-PAYLOAD``: every block carries its own XXH3-64, and hashing hundreds of MiB
with SHA-256 would cost more than the transfer. :func:`signing_key` is the one SigV4 key derivation of the
project: the server verifies with it too.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import time
from urllib.parse import quote

UNSIGNED_PAYLOAD = "UNSIGNED-PAYLOAD"


@functools.lru_cache(maxsize=256)
def signing_key(secret: str, day: str, region: str, service: str = "s3") -> bytes:
    """The SigV4 signing key (four chained HMACs); cached because every request of the day needs it."""
    key = hmac.digest(("AWS4" + secret).encode("utf-8"), day.encode("utf-8"), "sha256")
    for part in (region, service, "aws4_request"):
        key = hmac.digest(key, part.encode("utf-8"), "sha256")
    return key


class Signer:
    """Signs requests for one access key in one region."""

    def __init__(self, access_key: str, secret_key: str, region: str = "us-east-1") -> None:
        self.access_key = access_key
        self._secret = secret_key
        self.region = region

    def __repr__(self) -> str:  # never show the secret
        return f"Signer(access_key={self.access_key!r}, region={self.region!r})"

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
        signature = hmac.new(signing_key(self._secret, day, self.region), to_sign.encode(), hashlib.sha256).hexdigest()
        return [
            ("x-amz-date", amz_date),
            ("x-amz-content-sha256", UNSIGNED_PAYLOAD),
            ("authorization", f"AWS4-HMAC-SHA256 Credential={self.access_key}/{scope}, "
                              f"SignedHeaders={signed}, Signature={signature}"),
        ]
