"""Reads, run on a small pool of threads: one ``preadv`` per coalesced run, then verification.

Measured on this kind of VM: buffered reads of a cold file ran at ~1.5 GB/s where O_DIRECT reads of 1 MiB
ran at ~0.84 GB/s (the kernel's 8 MiB readahead overlaps the device with the copy), so reads go through the
page cache. Buffers come from ``numpy.empty`` (no zero-fill: the kernel's copy is the first touch).

A record is returned only if its header checksum (salted per segment), lengths, bucket and key match what
the index expected and its payload hashes to the XXH3-64 in its header. Anything else is a ``CORRUPT`` (the
store drops it from the index) or a ``MISMATCH`` (a fingerprint collision: a miss, the other key's block
stays).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import xxhash

from .format import FormatError, RecordHeader, parse_record_header

OK, CORRUPT, MISMATCH, IO_FAILED = 0, 1, 2, 3


@dataclass(slots=True)
class ReadItem:
    pos: int  # position in the caller's request
    offset: int
    header_len: int
    payload_len: int
    bucket: bytes
    key: bytes


@dataclass(slots=True)
class ReadOutcome:
    pos: int
    status: int
    header: RecordHeader | None = None
    payload: memoryview | None = None
    detail: str = ""


def plan_runs(items: list[ReadItem], with_payload: bool, max_gap: int, max_run: int) -> list[list[ReadItem]]:
    """Group items of one segment (sorted by offset) into runs read with one call each."""
    runs: list[list[ReadItem]] = []
    end = -1
    start = 0
    for it in sorted(items, key=lambda x: x.offset):
        length = it.header_len + (it.payload_len if with_payload else 0)
        if runs and it.offset - end <= max_gap and it.offset + length - start <= max_run:
            runs[-1].append(it)
            end = max(end, it.offset + length)
        else:
            runs.append([it])
            start, end = it.offset, it.offset + length
    return runs


def read_run(fd: int, salt: int, run: list[ReadItem], with_payload: bool,
             check_key: bool = True) -> tuple[list[ReadOutcome], int]:
    """Read one run and verify each record in it. Returns the outcomes and the bytes read from the file.

    ``check_key=False`` (compaction, listing) accepts whatever key the verified header holds."""
    start = run[0].offset
    stop = max(it.offset + it.header_len + (it.payload_len if with_payload else 0) for it in run)
    length = stop - start
    buf = np.empty(length, np.uint8)
    view = buf.data  # a writable memoryview of the array
    got = 0
    try:
        while got < length:
            n = os.preadv(fd, [view[got:]], start + got)
            if n == 0:
                break
            got += n
    except OSError as e:
        return [ReadOutcome(it.pos, IO_FAILED, detail=str(e)) for it in run], got
    out = []
    for it in run:
        rel = it.offset - start
        try:
            h = parse_record_header(view, rel, salt, got)
        except FormatError as e:
            out.append(ReadOutcome(it.pos, CORRUPT, detail=str(e)))
            continue
        if h.header_len != it.header_len or h.payload_len != it.payload_len:
            # a valid header of another shape: not the record the index points at
            out.append(ReadOutcome(it.pos, CORRUPT, detail="lengths differ from the index"))
            continue
        if check_key and (h.bucket != it.bucket or h.key != it.key):
            out.append(ReadOutcome(it.pos, MISMATCH, h, detail="another key (fingerprint collision)"))
            continue
        if not with_payload:
            out.append(ReadOutcome(it.pos, OK, h))
            continue
        body = rel + h.header_len
        if body + h.payload_len > got:
            out.append(ReadOutcome(it.pos, CORRUPT, detail="truncated payload"))
            continue
        payload = view[body:body + h.payload_len]
        if xxhash.xxh3_64_intdigest(payload) != h.payload_xxh3:
            out.append(ReadOutcome(it.pos, CORRUPT, detail="payload checksum mismatch"))
            continue
        out.append(ReadOutcome(it.pos, OK, h, payload))
    return out, got
