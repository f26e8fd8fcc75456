"""Upload checksums: known values, incremental feeding, header validation."""

from __future__ import annotations

import base64
import hashlib
import zlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ctxstore_server.s3.checksums import (
    ALGORITHMS,
    Checksum,
    parse_content_md5,
    requested_checksums,
    trailer_algorithm,
    verify,
)
from ctxstore_server.s3.errors import S3Error


def _reflected_crc(data: bytes, poly: int, width: int) -> int:
    """Bit-at-a-time reflected CRC with all-ones init and final xor: the textbook definition, used as an
    independent reference for awscrt (CRC-32C: poly 0x82F63B78; CRC-64/NVME: poly 0x9A6C9329AC4BC9B5)."""
    mask = (1 << width) - 1
    crc = mask
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (poly if crc & 1 else 0)
    return crc ^ mask


def _b64(value: int, size: int) -> str:
    return base64.b64encode(value.to_bytes(size, "big")).decode()


def _reference(algorithm: str, data: bytes) -> str:
    if algorithm == "crc32":
        return _b64(zlib.crc32(data), 4)
    if algorithm == "crc32c":
        return _b64(_reflected_crc(data, 0x82F63B78, 32), 4)
    if algorithm == "crc64nvme":
        return _b64(_reflected_crc(data, 0x9A6C9329AC4BC9B5, 64), 8)
    return base64.b64encode(hashlib.new(algorithm, data).digest()).decode()


def _checksum(algorithm: str, *pieces: bytes | memoryview) -> str:
    c = Checksum(algorithm)
    for piece in pieces:
        c.update(piece)
    return c.b64digest()


# The "check" values of the CRC catalogue (CRC of the ASCII string "123456789"): CRC-32 0xCBF43926,
# CRC-32C 0xE3069283, CRC-64/NVME 0xAE8B14860A799888.
@pytest.mark.parametrize(
    ("algorithm", "check"),
    [("crc32", 0xCBF43926), ("crc32c", 0xE3069283), ("crc64nvme", 0xAE8B14860A799888)],
)
def test_crc_catalogue_check_values(algorithm: str, check: int) -> None:
    size = 8 if algorithm == "crc64nvme" else 4
    assert _checksum(algorithm, b"123456789") == _b64(check, size)


def test_hello_world_known_values() -> None:
    assert _checksum("crc32", b"hello world") == _b64(0x0D4A1185, 4)
    assert _checksum("sha256", b"hello world") == base64.b64encode(
        bytes.fromhex("b94d27b9934d3e08a52e52d7da7dabfac484efe37a5380ee9088f7ace2efcde9")
    ).decode()
    assert _checksum("sha1", b"hello world") == base64.b64encode(
        bytes.fromhex("2aae6c35c94fcfb415dbe95f408b9ce91ee846ed")
    ).decode()


def test_crc32c_of_the_aws_trailer_example_payload() -> None:
    # AWS, "Signature calculations for trailing headers (chunked uploads)": 66560 bytes of 'a' carry the
    # trailer x-amz-checksum-crc32c:sOO8/Q==.
    assert _checksum("crc32c", b"a" * 65536, b"a" * 1024) == "sOO8/Q=="


def test_empty_payload() -> None:
    assert _checksum("crc32") == "AAAAAA=="
    assert _checksum("crc64nvme") == "AAAAAAAAAAA="


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@given(data=st.binary(max_size=300), cut=st.integers(min_value=0, max_value=300))
def test_incremental_matches_reference(algorithm: str, data: bytes, cut: int) -> None:
    cut = min(cut, len(data))
    view = memoryview(data)
    assert _checksum(algorithm, view[:cut], view[cut:]) == _reference(algorithm, data)


def test_unknown_algorithm() -> None:
    with pytest.raises(ValueError):
        Checksum("md5")


def test_content_md5() -> None:
    digest = hashlib.md5(b"hello").digest()
    assert parse_content_md5(base64.b64encode(digest).decode()) == digest
    too_short, too_long = base64.b64encode(b"short").decode(), base64.b64encode(digest + b"x").decode()
    for bad in ("", "not base64!", too_short, too_long):
        with pytest.raises(S3Error) as exc:
            parse_content_md5(bad)
        assert exc.value.code == "InvalidDigest"


def test_requested_checksums() -> None:
    crc = _checksum("crc32", b"x")
    headers = {"x-amz-checksum-crc32": crc, "x-amz-checksum-algorithm": "CRC32", "content-type": "a/b"}
    assert requested_checksums(headers) == {"crc32": crc}
    assert requested_checksums({}) == {}
    # Trailers use the same names, so a decoded body's trailers validate the same way.
    assert requested_checksums({"x-amz-checksum-crc32c": "sOO8/Q=="}) == {"crc32c": "sOO8/Q=="}


@pytest.mark.parametrize(("name", "value"), [("x-amz-checksum-sha1", ""), ("x-amz-checksum-crc32", "  ")])
def test_malformed_checksum_header(name: str, value: str) -> None:
    with pytest.raises(S3Error) as exc:
        requested_checksums({name: value})
    assert exc.value.code == "InvalidRequest"
    assert exc.value.message == f"Value for {name} header is invalid."


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("x-amz-checksum-crc32", "AAAAAAAA"),  # 6 bytes, not 4
        ("x-amz-checksum-crc64nvme", "AAAAAA=="),  # 4 bytes, not 8
        ("x-amz-checksum-sha256", base64.b64encode(b"x" * 20).decode()),
        ("x-amz-checksum-sha256", "ABCD"),
        ("x-amz-checksum-crc32", "not-base64"),
        ("x-amz-checksum-sha256", "bad"),
    ],
)
def test_a_value_that_cannot_be_a_digest_is_a_bad_digest(name: str, value: str) -> None:
    """Not base64, or base64 of no digest the body could have: the S3 conformance suites expect BadDigest."""
    with pytest.raises(S3Error) as exc:
        requested_checksums({name: value})
    assert exc.value.code == "BadDigest"


def test_two_checksums_rejected() -> None:
    with pytest.raises(S3Error) as exc:
        requested_checksums({"x-amz-checksum-crc32": "AAAAAA==", "x-amz-checksum-crc32c": "AAAAAA=="})
    assert exc.value.code == "InvalidRequest"


def test_trailer_algorithm() -> None:
    assert trailer_algorithm({}) is None
    assert trailer_algorithm({"x-amz-trailer": "x-amz-checksum-crc64nvme"}) == "crc64nvme"
    assert trailer_algorithm({"x-amz-trailer": " X-Amz-Checksum-SHA256 "}) == "sha256"
    for bad in ("x-amz-checksum-md5", "content-md5", ""):
        with pytest.raises(S3Error) as exc:
            trailer_algorithm({"x-amz-trailer": bad})
        assert exc.value.code == "InvalidRequest"


def test_verify() -> None:
    c = Checksum("crc32c")
    c.update(b"a" * 66560)
    verify(c, "sOO8/Q==")
    with pytest.raises(S3Error) as exc:
        verify(c, "AAAAAA==")
    assert exc.value.code == "BadDigest"
