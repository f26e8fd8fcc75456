"""The flash store's settings, in one value: what FlashStore's constructor takes, validated, with what follows
from them (the metadata reserve, the largest record, the expiry window of a record)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .format import BLOCK, FOOTER_ENTRY, MAX_BUCKET, MAX_KEY, TRAILER, record_size

MiB = 1 << 20


@dataclass(frozen=True, slots=True)
class FlashOptions:
    """Sizes in bytes, times in seconds. See FlashStore for what each one does."""

    capacity_bytes: int
    segment_bytes: int = 64 * MiB
    batch_bytes: int = 8 * MiB  # the writer's buffers (two of them)
    queue_bytes: int = 256 * MiB  # records waiting for the writer
    max_open_segments: int = 4  # one per expiry window being written (clamped to what the capacity holds)
    seal_idle: float = 10.0  # an open segment nothing was written to for this long is sealed
    readers: int = 4  # reader threads
    max_read_bytes: int = 8 * MiB  # the longest coalesced read
    read_gap: int = 256 * 1024  # records at most this far apart are read with one call
    read_buffer_bytes: int = 64 * MiB  # read buffers kept for reuse
    window_divisor: float = 16.0  # an expiry window is about a sixteenth of the record's time to live ...
    min_window: int = 64  # ... and at least this long
    compact_below: float = 0.5  # a sealed segment less live than this fraction of its data is compacted
    compact_bytes: int | None = None  # live bytes moved per compaction (None: a segment's worth)
    rewrite_hot_bytes: int = 0  # hot bytes re-appended from an evicted segment
    expiry_sweep: int = 65536  # expired index entries removed per housekeep()
    direct_io: bool = True  # O_DIRECT where the file system takes it
    meta_reserve: int = field(init=False)  # capacity kept for the state file and the dead log
    max_record_bytes: int = field(init=False)  # the largest record (header, payload, footer entry) a segment holds

    def __post_init__(self) -> None:
        if self.segment_bytes % BLOCK or self.segment_bytes < 16 * BLOCK:
            raise ValueError("segment_bytes must be a multiple of 4 KiB and at least 64 KiB")
        capacity = int(self.capacity_bytes)
        reserve = max(MiB, capacity // 1024)
        slots = (capacity - reserve) // self.segment_bytes
        if slots < 3:
            raise ValueError("capacity_bytes must hold at least 3 segments plus 1 MiB for the manifest")
        setattr_ = object.__setattr__  # frozen: the derived fields are set once, here
        setattr_(self, "capacity_bytes", capacity)
        setattr_(self, "meta_reserve", reserve)
        setattr_(self, "max_open_segments", max(1, min(self.max_open_segments, slots - 2)))
        setattr_(self, "max_record_bytes", self.segment_bytes - 4 * BLOCK - TRAILER)

    def fits(self, bucket: bytes, key: bytes, meta: bytes, payload_len: int) -> bool:
        """Whether a segment can take this record (with its footer entry and the key and bucket it repeats)."""
        if len(bucket) > MAX_BUCKET or len(key) > MAX_KEY:
            return False
        _, rlen = record_size(bucket, key, meta, payload_len)
        return rlen + FOOTER_ENTRY.itemsize + len(key) + len(bucket) <= self.max_record_bytes

    @property
    def compact_budget(self) -> int:
        """Live bytes moved per compaction."""
        return self.segment_bytes if self.compact_bytes is None else self.compact_bytes

    def window(self, expires_at: float, now: float) -> tuple[int, int]:
        """(width, number) of a record's expiry window. Records expiring in the same window share segments, so
        most segments expire whole."""
        ttl = max(expires_at - now, 1.0)
        width = max(self.min_window, 1 << max(0, math.ceil(math.log2(ttl / self.window_divisor))))
        return width, int(expires_at // width)
