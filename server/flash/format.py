"""The on-disk format of a flash segment: file header, records, footer and trailer. Pure encoding, no I/O.

A segment file (``seg-<id as 16 hex digits>.dat``)::

    [segment header: one 4 KiB block]
    [batch][batch]...        each batch starts on a 4 KiB boundary (O_DIRECT writes), padded with zeros
      batch = record record ... ; record = header + payload, padded to 8 bytes
    [footer: bucket table | entries | keys]       only once sealed
    [trailer: 72 bytes at the very end]           only once sealed

Record header (little-endian)::

    0  magic        4s   b"CXR1"
    4  version      u16  RECORD_VERSION
    6  flags        u16  reserved (0)
    8  seq          u64  store-wide sequence number (newer wins on recovery)
    16 created      f64  seconds since the epoch
    24 expires_at   f64
    32 payload_len  u64
    40 payload_xxh3 u64  XXH3-64 (seed 0) of the payload: the engine's own block checksum
    48 bucket_len   u16
    50 key_len      u16
    52 meta_len     u32
    56 bucket, key (UTF-8), metadata (opaque bytes)
    .. header_xxh3  u64  XXH3-64 of every header byte before it, seeded with the segment's random salt

The salt makes a header impossible to forge from inside a payload: recovery resynchronises on 4 KiB
boundaries after a torn record, and a tenant who stored bytes that look like a header cannot know the salt.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import xxhash

BLOCK = 4096  # alignment of the segment header, of every batch and of O_DIRECT transfers
RECORD_MAGIC = b"CXR1"
RECORD_VERSION = 1
SEGMENT_MAGIC = b"CXSEG\x00\x00\x01"
SEGMENT_VERSION = 1
TRAILER_MAGIC = b"CXSEAL01"

_RECORD_FIXED = struct.Struct("<4sHHQddQQHHI")  # 56 bytes
RECORD_FIXED = _RECORD_FIXED.size
_U64 = struct.Struct("<Q")
MAX_BUCKET = 0xFFFF
MAX_KEY = 0xFFFF
RECORD_OVERHEAD = RECORD_FIXED + 8  # fixed part + header checksum

_SEGMENT_HEADER = struct.Struct("<8sHHIQQdddQ")  # magic, version, 0, 0, id, salt, created, window lo/hi, seg bytes
# magic, segment id, footer offset, bucket table + entries length, keys length, count, their two XXH3-64s
_TRAILER = struct.Struct("<8sQQQQQQQ")
TRAILER = _TRAILER.size + 8  # + the trailer's own XXH3-64: 72 bytes at the very end of a sealed file

# One footer entry per record, in write order. Recovery reads only the bucket table and these entries.
FOOTER_ENTRY = np.dtype([
    ("fp", "<u8"),           # fingerprint of (bucket, key): see fingerprint()
    ("seq", "<u8"),
    ("expires", "<f8"),
    ("offset", "<u4"),       # of the record in the segment file
    ("payload_len", "<u4"),
    ("header_len", "<u4"),
    ("bucket", "<u4"),       # index into this footer's bucket table
    ("flags", "<u2"),
    ("key_len", "<u2"),
])
assert FOOTER_ENTRY.itemsize == 44


def align(n: int, to: int = BLOCK) -> int:
    """``n`` rounded up to a multiple of ``to``."""
    return (n + to - 1) // to * to


def bucket_seed(bucket: str) -> int:
    """The seed a bucket's fingerprints are computed with (stable across processes and releases)."""
    return xxhash.xxh3_64_intdigest(bucket.encode())


def fingerprint(seed: int, key: bytes) -> int:
    """The 64-bit index fingerprint of ``key`` in the bucket whose seed is ``seed``."""
    return xxhash.xxh3_64_intdigest(key, seed)


class FormatError(ValueError):
    """Bytes that are not a valid record, segment header, footer or trailer."""


# ---------------------------------------------------------------------------------------------- records


def record_size(bucket: bytes, key: bytes, meta: bytes, payload_len: int) -> tuple[int, int]:
    """(header length, record length padded to 8 bytes)."""
    header_len = RECORD_OVERHEAD + len(bucket) + len(key) + len(meta)
    return header_len, (header_len + payload_len + 7) & ~7


def pack_record_header(
    buf: memoryview, pos: int, salt: int, *, seq: int, created: float, expires_at: float, payload_len: int,
    payload_xxh3: int, bucket: bytes, key: bytes, meta: bytes,
) -> int:
    """Write a record header into ``buf`` at ``pos``; returns the header length."""
    _RECORD_FIXED.pack_into(buf, pos, RECORD_MAGIC, RECORD_VERSION, 0, seq, created, expires_at, payload_len,
                            payload_xxh3, len(bucket), len(key), len(meta))
    p = pos + RECORD_FIXED
    for part in (bucket, key, meta):
        buf[p:p + len(part)] = part
        p += len(part)
    _U64.pack_into(buf, p, xxhash.xxh3_64_intdigest(buf[pos:p], salt))
    return p + 8 - pos


@dataclass(slots=True)
class RecordHeader:
    """A decoded, checksum-verified record header."""

    seq: int
    created: float
    expires_at: float
    payload_len: int
    payload_xxh3: int
    bucket: bytes
    key: bytes
    meta: bytes
    header_len: int


def parse_record_header(buf: memoryview | bytes, pos: int, salt: int, limit: int) -> RecordHeader:
    """Decode and verify the header at ``pos`` (``limit`` = end of the valid bytes). Raises FormatError."""
    if pos + RECORD_OVERHEAD > limit:
        raise FormatError("truncated header")
    magic, version, _flags, seq, created, expires, plen, pxxh, blen, klen, mlen = _RECORD_FIXED.unpack_from(buf, pos)
    if magic != RECORD_MAGIC:
        raise FormatError("bad record magic")
    if version != RECORD_VERSION:
        raise FormatError(f"record format version {version}")
    end = pos + RECORD_FIXED + blen + klen + mlen
    if end + 8 > limit:
        raise FormatError("truncated header")
    mv = memoryview(buf)
    (stored,) = _U64.unpack_from(buf, end)
    if xxhash.xxh3_64_intdigest(mv[pos:end], salt) != stored:
        raise FormatError("header checksum mismatch")
    p = pos + RECORD_FIXED
    return RecordHeader(seq=seq, created=created, expires_at=expires, payload_len=plen, payload_xxh3=pxxh,
                        bucket=bytes(mv[p:p + blen]), key=bytes(mv[p + blen:p + blen + klen]),
                        meta=bytes(mv[p + blen + klen:end]), header_len=end + 8 - pos)


# --------------------------------------------------------------------------------------- segment header


@dataclass(slots=True)
class SegmentHeader:
    segment_id: int
    salt: int
    created: float
    window_lo: float  # records in this segment expire in [window_lo, window_hi)
    window_hi: float
    segment_bytes: int

    def pack(self) -> bytes:
        head = _SEGMENT_HEADER.pack(SEGMENT_MAGIC, SEGMENT_VERSION, 0, 0, self.segment_id, self.salt, self.created,
                                    self.window_lo, self.window_hi, self.segment_bytes)
        head += _U64.pack(xxhash.xxh3_64_intdigest(head))
        return head + bytes(BLOCK - len(head))

    @classmethod
    def unpack(cls, raw: bytes) -> SegmentHeader:
        size = _SEGMENT_HEADER.size
        if len(raw) < size + 8:
            raise FormatError("truncated segment header")
        magic, version, _a, _b, sid, salt, created, lo, hi, seg_bytes = _SEGMENT_HEADER.unpack_from(raw)
        if magic != SEGMENT_MAGIC:
            raise FormatError("not a ctxstore flash segment")
        if version != SEGMENT_VERSION:
            raise FormatError(f"segment format version {version}")
        if _U64.unpack_from(raw, size)[0] != xxhash.xxh3_64_intdigest(raw[:size]):
            raise FormatError("segment header checksum mismatch")
        return cls(sid, salt, created, lo, hi, seg_bytes)


# -------------------------------------------------------------------------------------- footer, trailer


@dataclass(slots=True)
class Trailer:
    segment_id: int
    footer_offset: int  # where the bucket table starts (= the end of the record data)
    index_len: int  # bucket table + entries
    keys_len: int
    count: int
    index_xxh3: int
    keys_xxh3: int

    def pack(self) -> bytes:
        raw = _TRAILER.pack(TRAILER_MAGIC, self.segment_id, self.footer_offset, self.index_len, self.keys_len,
                            self.count, self.index_xxh3, self.keys_xxh3)
        return raw + _U64.pack(xxhash.xxh3_64_intdigest(raw))

    @classmethod
    def unpack(cls, raw: bytes) -> Trailer:
        if len(raw) != TRAILER:
            raise FormatError("truncated trailer")
        magic, sid, off, ilen, klen, count, ixxh, kxxh = _TRAILER.unpack_from(raw)
        if magic != TRAILER_MAGIC:
            raise FormatError("no trailer (segment not sealed)")
        if _U64.unpack_from(raw, _TRAILER.size)[0] != xxhash.xxh3_64_intdigest(raw[:_TRAILER.size]):
            raise FormatError("trailer checksum mismatch")
        return cls(sid, off, ilen, klen, count, ixxh, kxxh)


def pack_footer(buckets: list[str], entries: np.ndarray, keys: bytes | bytearray) -> tuple[bytes, bytes]:
    """(bucket table + entries, keys) for a footer; the bucket table is u32 count then (u16 len, UTF-8)..."""
    table = bytearray(struct.pack("<I", len(buckets)))
    for name in buckets:
        raw = name.encode()
        table += struct.pack("<H", len(raw)) + raw
    table += bytes(-len(table) % 8)  # entries start 8-aligned within the footer
    return bytes(table) + entries.tobytes(), bytes(keys)


def unpack_footer_index(raw: bytes | bytearray | memoryview) -> tuple[list[str], np.ndarray]:
    """Bucket table and entries from the first part of a footer (checksum verified by the caller)."""
    mv = memoryview(raw)
    if len(mv) < 4:
        raise FormatError("truncated footer")
    (n,) = struct.unpack_from("<I", mv, 0)
    p = 4
    buckets = []
    for _ in range(n):
        if p + 2 > len(mv):
            raise FormatError("truncated footer bucket table")
        (blen,) = struct.unpack_from("<H", mv, p)
        buckets.append(bytes(mv[p + 2:p + 2 + blen]).decode())
        p += 2 + blen
    p += -p % 8
    body = mv[p:]
    if len(body) % FOOTER_ENTRY.itemsize:
        raise FormatError("footer entries misaligned")
    entries = np.frombuffer(body, dtype=FOOTER_ENTRY)
    if entries.size and int(entries["bucket"].max()) >= max(n, 1):
        raise FormatError("footer entry names an unknown bucket")
    return buckets, entries
