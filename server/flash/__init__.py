"""ctxstore's flash tier: blocks in append-only segment files on NVMe, a compact index in RAM, recovery on restart.

Self-contained: imports nothing from the rest of the server (a test checks), only numpy and xxhash. The
on-disk format and the guarantees are in docs/flash.md.

Use (everything from one asyncio event loop; nothing here blocks it — I/O runs on a writer thread and a
small pool of reader threads)::

    store = FlashStore(path, capacity_bytes, segment_bytes=64 MiB, clock=time.time, on_remove=listener)
    report = await store.open(reset=False)      # RecoveryReport: blocks, bytes, seconds, torn/corrupt counts
    store.manifest                              # the engine's dict saved by save_manifest(), or None

    refused = store.append(records, done=cb)    # returns at once: per record None or a refusal reason
    # cb(list[WriteResult]) runs on the loop when the accepted records are written: stored=True means
    # "readable from flash now" (drop the RAM copy); until then keep serving them from RAM.

    store.lookup(bucket, key) -> Entry | None             # size, expires_at, location; no I/O
    store.lookup_many(bucket, keys) -> list[Entry | None]
    store.present_many(bucket, keys) -> (present: ndarray[bool], sizes: ndarray[int64])
    await store.read(bucket, key) -> FlashBlock | None     # verified payload (memoryview) + metadata
    await store.read_many(bucket, keys) -> list[FlashBlock | None]   # adjacent records coalesced
    await store.read_meta(bucket, key) / read_meta_many(...)         # header only (HEAD)
    store.delete(bucket, key) / delete_many(...)           # durable through the dead log
    store.drop_bucket(bucket)                              # durable through a bucket floor
    store.touch(bucket, key, expires_at) / touch_many(...) # index only
    await store.list_keys(bucket, start_after, limit)      # sorted, from the segment footers
    store.iter_keys(bucket, start_after)                   # async iterator over the same
    store.keys_by_segment(bucket)                          # async iterator: one segment's keys at a time
    store.buckets(); store.contains(bucket, key); store.stats() -> FlashStats; store.degraded
    await store.save_manifest(dict)                        # atomic replace + fsync
    await store.housekeep() -> HousekeepReport             # bounded: expiry, eviction, compaction
    await store.flush(); await store.close()

Records: ``FlashRecord(bucket, key, payload, expires_at, created, metadata=b"", xxh3=None)``; the metadata
is opaque bytes (the engine's msgpack). ``on_remove(list[Removal])`` reports blocks the store removed on
its own (``evicted``, ``expired``, ``corrupt``), never the engine's deletes.

Failure model: a block that fails verification is never returned (a miss; dropped, counted, reported as
``corrupt``); any OSError while writing (ENOSPC, EIO, EROFS, a vanished directory) marks the store
degraded (``stats().degraded`` says why, logged once): appends are refused from then on, reads continue.
"""

from .format import FormatError
from .housekeeping import HousekeepReport
from .index import FlashIndex
from .store import FlashStore
from .types import (
    ALREADY_EXPIRED,
    CLOSED,
    CORRUPT,
    DEGRADED,
    EVICTED,
    EXPIRED,
    IO_ERROR,
    QUEUE_FULL,
    REMOVAL_REASONS,
    SUPERSEDED,
    TOO_LARGE,
    BucketStats,
    Entry,
    FlashBlock,
    FlashMeta,
    FlashRecord,
    FlashStats,
    Location,
    RecoveryReport,
    Removal,
    WriteResult,
)

__all__ = [
    "ALREADY_EXPIRED", "CLOSED", "CORRUPT", "DEGRADED", "EVICTED", "EXPIRED", "IO_ERROR", "QUEUE_FULL",
    "REMOVAL_REASONS", "SUPERSEDED", "TOO_LARGE",
    "BucketStats", "Entry", "FlashBlock", "FlashIndex", "FlashMeta", "FlashRecord", "FlashStats", "FlashStore",
    "FormatError", "HousekeepReport", "Location", "RecoveryReport", "Removal", "WriteResult",
]
