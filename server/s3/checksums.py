"""Upload integrity: the ``x-amz-checksum-*`` algorithms, ``Content-MD5``, and their header validation.

S3 sends a checksum as base64 of the big-endian digest, in a header (``x-amz-checksum-crc32: ...``) or, for
aws-chunked bodies, in a trailer named by ``x-amz-trailer``. The CRCs come from ``awscrt`` (native, the same
code the AWS SDKs use), the SHAs from ``hashlib``.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from collections.abc import Callable, Mapping

from awscrt import checksums as _crt

from .errors import S3Error

ALGORITHMS = ("crc32", "crc32c", "crc64nvme", "sha1", "sha256")

# Digest size in bytes, per algorithm: a header value must decode to exactly this many bytes.
DIGEST_SIZES: dict[str, int] = {"crc32": 4, "crc32c": 4, "crc64nvme": 8, "sha1": 20, "sha256": 32}

_CRCS: dict[str, Callable[[bytes, int], int]] = {
    "crc32": _crt.crc32,
    "crc32c": _crt.crc32c,
    "crc64nvme": _crt.crc64nvme,
}

HEADER_PREFIX = "x-amz-checksum-"


def header_name(algorithm: str) -> str:
    """The header (or trailer) that carries ``algorithm``'s value, e.g. ``x-amz-checksum-crc32``."""
    return HEADER_PREFIX + algorithm


class Checksum:
    """A running checksum of one of :data:`ALGORITHMS`, fed incrementally."""

    __slots__ = ("_crc", "_hash", "algorithm")

    def __init__(self, algorithm: str) -> None:
        if algorithm not in DIGEST_SIZES:
            raise ValueError(f"unknown checksum algorithm {algorithm!r}")
        self.algorithm = algorithm
        self._crc = 0
        self._hash = None if algorithm in _CRCS else hashlib.new(algorithm)

    def update(self, data: bytes | bytearray | memoryview) -> None:
        """Add the next bytes of the payload (memoryviews are hashed in place, not copied)."""
        if self._hash is not None:
            self._hash.update(data)
        else:
            self._crc = _CRCS[self.algorithm](data, self._crc)  # type: ignore[arg-type]

    def digest(self) -> bytes:
        """The digest as S3 defines it: big-endian for the CRCs."""
        if self._hash is not None:
            return self._hash.digest()
        return self._crc.to_bytes(DIGEST_SIZES[self.algorithm], "big")

    def b64digest(self) -> str:
        """The digest in base64, as sent in ``x-amz-checksum-<algorithm>``."""
        return base64.b64encode(self.digest()).decode("ascii")


def _b64decode(value: str) -> bytes | None:
    if not value.strip():
        return None
    try:
        return base64.b64decode(value.strip(), validate=True)
    except (binascii.Error, ValueError):
        return None


def parse_content_md5(value: str) -> bytes:
    """The 16-byte MD5 a ``Content-MD5`` header carries; raises ``InvalidDigest`` if it is not one."""
    digest = _b64decode(value)
    if digest is None or len(digest) != 16:
        raise S3Error("InvalidDigest")
    return digest


def requested_checksums(headers: Mapping[str, str]) -> dict[str, str]:
    """The ``x-amz-checksum-<algorithm>`` values present: algorithm -> expected base64.

    Works on request headers and on the trailers an aws-chunked body ended with. A value that cannot be the
    algorithm's digest (not base64, the wrong size) can match no body: ``BadDigest``, like any other wrong value
    (what the S3 conformance suites expect); an empty value, or two checksums at once, is ``InvalidRequest``.
    Other ``x-amz-checksum-*`` names (``-algorithm``, ``-type``, ``-mode``) are not checksums: ignored.
    """
    found: dict[str, str] = {}
    for name, value in headers.items():
        if not name.startswith(HEADER_PREFIX):
            continue
        algorithm = name[len(HEADER_PREFIX) :]
        if algorithm not in DIGEST_SIZES:
            continue
        if not value.strip():
            raise S3Error("InvalidRequest", f"Value for {name} header is invalid.")
        digest = _b64decode(value)
        if digest is None or len(digest) != DIGEST_SIZES[algorithm]:
            raise S3Error("BadDigest", f"The {algorithm.upper()} you specified is not a {algorithm} digest.")
        found[algorithm] = value.strip()
    if len(found) > 1:
        raise S3Error(
            "InvalidRequest",
            "Expecting a single x-amz-checksum- header. Multiple checksum Types are not allowed.",
        )
    return found


def trailer_algorithm(headers: Mapping[str, str]) -> str | None:
    """The checksum algorithm the ``x-amz-trailer`` header announces, None if there is no such header.

    Raises ``InvalidRequest`` for a trailer that is not an ``x-amz-checksum-*`` of :data:`ALGORITHMS`.
    """
    value = headers.get("x-amz-trailer")
    if value is None:
        return None
    name = value.strip().lower()
    algorithm = name[len(HEADER_PREFIX) :] if name.startswith(HEADER_PREFIX) else ""
    if algorithm not in DIGEST_SIZES:
        raise S3Error("InvalidRequest", "The value specified in the x-amz-trailer header is not supported")
    return algorithm


def verify(checksum: Checksum, expected_b64: str) -> None:
    """Compare a finished checksum with the value the client sent; raises ``BadDigest`` if they differ."""
    if checksum.b64digest() != expected_b64.strip():
        raise S3Error(
            "BadDigest",
            f"The {checksum.algorithm.upper()} you specified did not match the calculated checksum.",
        )
