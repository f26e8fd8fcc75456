"""Segment files: naming, reading footers, scanning an unsealed tail record by record, sealing.

These are plain functions over file descriptors, used by recovery (a worker thread during open()), by the
writer thread (sealing) and by housekeeping (reading the keys of a segment it removes).
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from .format import (
    BLOCK,
    FOOTER_ENTRY,
    RECORD_MAGIC,
    RECORD_OVERHEAD,
    TRAILER,
    FormatError,
    SegmentHeader,
    Trailer,
    align,
    bucket_seed,
    fingerprint,
    pack_footer,
    parse_record_header,
    unpack_footer_index,
)
from .reader import aligned_array, aligned_span, pread_into

_NAME = re.compile(r"^seg-([0-9a-f]{16})\.dat$")


def segment_path(directory: Path, segment_id: int) -> Path:
    return directory / f"seg-{segment_id:016x}.dat"


def list_segment_files(directory: Path) -> list[tuple[int, Path]]:
    """(id, path) of every segment file in ``directory``, oldest first."""
    found = []
    for entry in os.scandir(directory):
        m = _NAME.match(entry.name)
        if m:
            found.append((int(m.group(1), 16), Path(entry.path)))
    return sorted(found)


def open_reader(path: Path, direct: bool) -> int:
    """A descriptor for reading a segment: with O_DIRECT if ``direct`` and the file system takes it (reads
    then bypass the page cache), else buffered."""
    if direct:
        try:
            return os.open(path, os.O_RDONLY | os.O_DIRECT)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
    return os.open(path, os.O_RDONLY)


def pread_exact(fd: int, length: int, offset: int) -> bytearray:
    """``length`` bytes at ``offset``, fewer only at the end of the file. ``fd`` may be opened with O_DIRECT
    (:func:`open_reader`): whole aligned blocks are read then."""
    if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
        start, span = aligned_span(offset, offset + length)
        arr = aligned_array(span)
        got = pread_into(fd, arr.data, start)
        rel = offset - start
        return bytearray(arr.data[rel:max(rel, min(got, rel + length))])
    buf = bytearray(length)
    with memoryview(buf) as view:
        got = pread_into(fd, view, offset)
    if got < length:
        del buf[got:]
    return buf


def read_header(fd: int) -> SegmentHeader:
    return SegmentHeader.unpack(bytes(pread_exact(fd, BLOCK, 0)))


def read_trailer(fd: int, size: int) -> Trailer:
    if size < BLOCK + TRAILER:
        raise FormatError("segment too short to be sealed")
    trailer = Trailer.unpack(bytes(pread_exact(fd, TRAILER, size - TRAILER)))
    if trailer.footer_offset + trailer.index_len + trailer.keys_len + TRAILER > size:
        raise FormatError("footer outside the file")
    return trailer


def read_footer_index(fd: int, trailer: Trailer) -> tuple[list[str], np.ndarray]:
    raw = pread_exact(fd, trailer.index_len, trailer.footer_offset)
    if len(raw) != trailer.index_len or xxhash.xxh3_64_intdigest(raw) != trailer.index_xxh3:
        raise FormatError("footer checksum mismatch")
    buckets, entries = unpack_footer_index(raw)
    if entries.size != trailer.count:
        raise FormatError("footer entry count mismatch")
    return buckets, entries


def read_footer_keys(fd: int, trailer: Trailer, entries: np.ndarray) -> list[bytes]:
    """The key of every footer entry, in entry order."""
    raw = bytes(pread_exact(fd, trailer.keys_len, trailer.footer_offset + trailer.index_len))
    if len(raw) != trailer.keys_len or xxhash.xxh3_64_intdigest(raw) != trailer.keys_xxh3:
        raise FormatError("footer keys checksum mismatch")
    ends = np.cumsum(entries["key_len"], dtype=np.int64)
    starts = ends - entries["key_len"]
    return [raw[s:e] for s, e in zip(starts.tolist(), ends.tolist())]


def footer_bytes(header: SegmentHeader, data_end: int, buckets: list[str], entries: np.ndarray,
                 keys: bytes | bytearray) -> bytes:
    """Footer and trailer to write at ``data_end``, zero-padded so the trailer ends on a 4 KiB boundary."""
    index, key_blob = pack_footer(buckets, entries, keys)
    trailer = Trailer(header.segment_id, data_end, len(index), len(key_blob), entries.size,
                      xxhash.xxh3_64_intdigest(index), xxhash.xxh3_64_intdigest(key_blob)).pack()
    body = index + key_blob
    total = align(data_end + len(body) + TRAILER) - data_end  # the trailer ends the file on a 4 KiB boundary
    return body + bytes(total - len(body) - TRAILER) + trailer


@dataclass(slots=True)
class Scanned:
    """The valid records of an unsealed segment, as a footer would list them."""

    buckets: list[str]
    entries: np.ndarray
    keys: bytes
    data_end: int  # 4 KiB-aligned end of the last valid record
    discarded: int  # runs of invalid bytes (torn or corrupt records) skipped


def scan_records(fd: int, header: SegmentHeader, size: int) -> Scanned:
    """Walk the records of an unsealed segment, verifying each header and payload.

    After an invalid record the scan resynchronises on the next 4 KiB boundary, where every batch starts;
    zero bytes where a header should be are padding or never-written space, not damage."""
    buf = pread_exact(fd, size, 0)
    end = len(buf)
    mv = memoryview(buf)
    salt = header.salt
    bucket_ids: dict[bytes, int] = {}
    seeds: dict[bytes, int] = {}
    rows: list[tuple[int, int, float, int, int, int, int, int, int]] = []
    keys = bytearray()
    pos, data_end, discarded, bad_run = BLOCK, BLOCK, 0, False
    while pos + RECORD_OVERHEAD <= end:
        if mv[pos:pos + 4] != RECORD_MAGIC:
            if any(mv[pos:pos + 4]) and not bad_run:
                discarded, bad_run = discarded + 1, True
            pos = align(pos + 1)
            continue
        try:
            h = parse_record_header(mv, pos, salt, end)
            body = pos + h.header_len
            if body + h.payload_len > end:
                raise FormatError("truncated payload")
            if xxhash.xxh3_64_intdigest(mv[body:body + h.payload_len]) != h.payload_xxh3:
                raise FormatError("payload checksum mismatch")
        except FormatError:
            if not bad_run:
                discarded, bad_run = discarded + 1, True
            pos = align(pos + 1)
            continue
        bad_run = False
        bid = bucket_ids.setdefault(h.bucket, len(bucket_ids))
        seed = seeds.get(h.bucket)
        if seed is None:
            seed = seeds[h.bucket] = bucket_seed(h.bucket.decode())
        rows.append((fingerprint(seed, h.key), h.seq, h.expires_at, pos, h.payload_len, h.header_len, bid, 0,
                     len(h.key)))
        keys += h.key
        pos = (body + h.payload_len + 7) & ~7
        data_end = align(pos)
    del mv
    entries = np.array(rows, dtype=FOOTER_ENTRY) if rows else np.zeros(0, FOOTER_ENTRY)
    return Scanned([b.decode() for b in bucket_ids], entries, bytes(keys), data_end, discarded)


def seal_scanned(fd: int, header: SegmentHeader, scanned: Scanned) -> int:
    """Write the footer of a scanned segment after its last valid record, truncate, fsync. Returns the size."""
    footer = footer_bytes(header, scanned.data_end, scanned.buckets, scanned.entries, scanned.keys)
    view = memoryview(footer)
    pos = scanned.data_end
    while view:
        n = os.pwrite(fd, view, pos)
        view, pos = view[n:], pos + n
    os.ftruncate(fd, pos)
    os.fdatasync(fd)
    return pos


def footer_keys(fd: int, size: int, offsets: set[int]) -> dict[int, tuple[str, str]]:
    """offset -> (bucket, key) of the records at ``offsets`` of a sealed segment, from its footer."""
    trailer = read_trailer(fd, size)
    buckets, entries = read_footer_index(fd, trailer)
    keys = read_footer_keys(fd, trailer, entries)
    out = {}
    for off, b, k in zip(entries["offset"].tolist(), entries["bucket"].tolist(), keys):
        if off in offsets:
            out[off] = (buckets[b], k.decode())
    return out
