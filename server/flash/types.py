"""The values the flash store takes and returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

Buffer = bytes | bytearray | memoryview

# Why the store removed a block on its own (the engine's own deletes and bucket drops are not reported).
EVICTED = "evicted"  # its segment was the oldest when the store needed room
EXPIRED = "expired"  # its expiry passed; reported when the index entry is swept or its segment dropped
CORRUPT = "corrupt"  # a read failed verification (header checksum, key, payload XXH3) or the read failed
REMOVAL_REASONS = (EVICTED, EXPIRED, CORRUPT)

# Why append() refused a record or a write did not make it to flash (WriteResult.reason).
QUEUE_FULL = "queue_full"  # the write queue's byte bound: the caller keeps or drops the block
TOO_LARGE = "too_large"  # larger than a segment can hold
ALREADY_EXPIRED = "expired"
DEGRADED = "degraded"  # the device failed (see FlashStats.degraded); no more writes
CLOSED = "closed"
SUPERSEDED = "superseded"  # deleted, dropped or appended again before the write finished
IO_ERROR = "io_error"  # the write itself failed (the store is degraded from then on)


@dataclass(slots=True)
class FlashRecord:
    """One block to write. ``payload`` must not change until the append's callback has run.

    ``metadata`` is opaque to the store (the engine's msgpack of etag, content type, headers, user metadata,
    checksums). ``xxh3`` is the payload's XXH3-64 (seed 0) if the caller already has it; else the writer
    thread computes it."""

    bucket: str
    key: str
    payload: Buffer
    expires_at: float
    created: float
    metadata: bytes = b""
    xxh3: int | None = None


class Location(NamedTuple):
    """Where a record lives: segment id, byte offset of its header, header and payload lengths."""

    segment: int
    offset: int
    header_len: int
    payload_len: int


class Entry(NamedTuple):
    """What the RAM index knows of a block (no key, no metadata: those are on flash). A flat tuple: cheap to
    make by the thousand in lookup_many."""

    size: int
    expires_at: float
    segment: int
    offset: int
    header_len: int

    @property
    def location(self) -> Location:
        return Location(self.segment, self.offset, self.header_len, self.size)


@dataclass(slots=True)
class WriteResult:
    """The outcome of one appended record, delivered to the append's callback on the event loop."""

    record: FlashRecord
    stored: bool  # True: readable from flash from now on (the caller may drop its RAM copy)
    reason: str | None = None  # why not, when not stored
    location: Location | None = None


@dataclass(slots=True)
class FlashMeta:
    """A block's header, verified (HEAD): everything but the payload."""

    bucket: str
    key: str
    size: int
    xxh3: int
    created: float
    expires_at: float  # from the index: includes touch()
    metadata: bytes


@dataclass(slots=True)
class FlashBlock(FlashMeta):
    """A block read back, verified: ``payload`` is a view into a buffer owned by this result."""

    payload: memoryview = field(default_factory=lambda: memoryview(b""))


@dataclass(slots=True, frozen=True)
class Removal:
    """A block the store removed on its own, for the engine's removal events."""

    bucket: str
    key: str
    reason: str  # one of REMOVAL_REASONS


@dataclass(slots=True)
class RecoveryReport:
    """What open() found on the device."""

    blocks: int = 0  # live blocks indexed
    bytes: int = 0  # their payload bytes
    seconds: float = 0.0
    segments: int = 0  # segment files kept
    sealed_segments: int = 0  # indexed from their footers
    tail_segments: int = 0  # unsealed: scanned record by record, then sealed
    tail_records: int = 0  # valid records found by those scans
    discarded_records: int = 0  # torn or corrupt records skipped by the scans
    corrupt_segments: int = 0  # unreadable header: removed; or bad footer: scanned instead
    expired: int = 0  # records skipped because they had expired
    superseded: int = 0  # older versions, deleted records, records of dropped buckets
    removed_segments: int = 0  # segment files deleted because nothing in them was live
    manifest: dict[str, object] | None = None  # the engine's manifest, if one was saved
    reset: bool = False


@dataclass(slots=True)
class BucketStats:
    """Per bucket: levels (blocks, bytes) and counters."""

    blocks: int = 0
    bytes: int = 0
    reads: int = 0  # blocks read (verified and returned)
    bytes_read: int = 0
    bytes_written: int = 0  # payload bytes
    corrupt: int = 0
    evicted: int = 0
    expired: int = 0


@dataclass(slots=True)
class FlashStats:
    """Totals for the store (FlashStore.stats())."""

    blocks: int = 0
    bytes: int = 0  # payload bytes of live blocks
    segments: int = 0
    open_segments: int = 0
    disk_bytes: int = 0  # charged against capacity: sealed file sizes + reserved open segments + manifest
    capacity_bytes: int = 0
    index_bytes: int = 0  # RAM of the index arrays
    buffer_bytes: int = 0  # RAM of the read buffers kept for reuse
    queued_bytes: int = 0  # waiting in the write queue
    reads: int = 0
    misses: int = 0
    bytes_read: int = 0  # payload bytes returned
    device_bytes_read: int = 0  # bytes read from the files (coalesced runs, headers)
    writes: int = 0  # records written
    bytes_written: int = 0  # bytes written to the files (records, padding, footers)
    refused: int = 0  # records append() refused
    corrupt: int = 0
    collisions: int = 0  # fingerprint matched, key did not: a miss, nothing dropped
    evicted: int = 0
    expired: int = 0
    dropped_segments: int = 0  # removed whole (expired, evicted or emptied)
    compactions: int = 0  # segments compacted
    compacted_bytes: int = 0  # live bytes re-appended by compaction
    read_errors: int = 0
    write_errors: int = 0
    degraded: str | None = None  # why writes stopped, if they did
    recovery: RecoveryReport | None = None
    buckets: dict[str, BucketStats] = field(default_factory=dict)
