"""The records the engine keeps: stored objects, buckets, multipart uploads and their counters."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Union

from sortedcontainers import SortedDict

# A payload as stored: written once when the upload completes, never mutated afterwards, so readers may send
# memoryview slices of it without copying. A block read back from flash is a view of the read's buffer.
Payload = Union[bytes, bytearray, memoryview]

# Fixed bytes charged per object on top of its payload, key and metadata: the Python objects that hold it
# (the record with its slots, the sorted-index and LRU entries, the expiry-heap tuple). Measured with
# tracemalloc by benchmarks/object_overhead.py (694 bytes measured; charged with headroom); see docs/architecture.md.
OBJECT_OVERHEAD = 700
# The same for what else a client can make a node hold (measured by benchmarks/object_overhead.py too): a
# bucket (its record, sorted index, LRU list and counters), an upload in progress, one part of it.
BUCKET_OVERHEAD = 2560
UPLOAD_OVERHEAD = 1024
PART_OVERHEAD = 256


class StoredObject:
    """One live object. Immutable once committed except for access bookkeeping (LRU, pins, TTL)."""

    __slots__ = (
        "bucket", "key", "data", "size", "etag", "xxh3", "created", "ttl", "expires_at", "pinned_until",
        "content_type", "headers", "user_meta", "checksums", "parts_count", "charge", "live", "tick", "tenant",
        "readers", "on_disk", "transient",
    )

    def __init__(
        self,
        *,
        bucket: str,
        key: str,
        data: Payload,
        etag: str,
        xxh3: int,
        created: float,
        ttl: float,
        content_type: str,
        headers: dict[str, str],
        user_meta: dict[str, str],
        checksums: dict[str, str],
        parts_count: int = 0,
        tenant: str = "",
    ) -> None:
        self.bucket = bucket
        self.tenant = tenant  # the bucket's owner
        self.key = key
        self.data = data
        self.size = len(data)
        self.etag = etag  # quoted S3 ETag, e.g. '"9b2cf535f27731c974343645a3985328"'
        self.xxh3 = xxh3  # XXH3-64 of the payload, computed by the engine on write
        self.created = created
        self.ttl = ttl  # seconds of life granted on write; sliding buckets re-grant it on read
        self.expires_at = created + ttl
        self.pinned_until = 0.0
        self.content_type = content_type
        self.headers = headers  # stored response headers: cache-control, content-disposition, ...
        self.user_meta = user_meta  # x-amz-meta-* without the prefix, lowercase names
        self.checksums = checksums  # algorithm -> base64 digest the client supplied (x-amz-checksum-*)
        self.parts_count = parts_count
        self.charge = object_charge(key, data, headers, user_meta, checksums)
        self.live = True  # False once removed: stale heap entries and lingering readers check it
        self.readers = 0  # responses sending this payload now: a removed object stays charged until they end
        self.tick = 0  # engine-wide access counter at the last write or read: compares recency across buckets
        self.on_disk = False  # the flash tier holds these very bytes (read back from it, unchanged since)
        self.transient = False  # read from flash and not (yet) in RAM's tables: charged only while being sent

    def expired(self, now: float) -> bool:
        return self.expires_at <= now

    def pinned(self, now: float) -> bool:
        return self.pinned_until > now


def object_charge(
    key: str, data: Payload, headers: dict[str, str], user_meta: dict[str, str], checksums: dict[str, str]
) -> int:
    """Bytes an object counts against the budget: payload, key, metadata and the fixed per-object overhead."""
    meta = sum(len(k) + len(v) for d in (headers, user_meta, checksums) for k, v in d.items()) if (
        headers or user_meta or checksums) else 0  # a bulk block has none: no generator per block
    return len(data) + len(key.encode()) + meta + OBJECT_OVERHEAD


@dataclass
class BucketStats:
    """Counters per bucket. ``objects`` and ``bytes`` are levels; the others only grow (until reset)."""

    objects: int = 0
    bytes: int = 0
    hits: int = 0
    misses: int = 0
    puts: int = 0
    deletes: int = 0
    evictions: int = 0
    expirations: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    disk_hits: int = 0  # of hits: read from the flash tier
    demotions: int = 0  # blocks RAM handed to the flash tier
    promotions: int = 0  # blocks read back from flash into RAM
    pinned_bytes: int = 0  # a level: charge of objects pinned (until the engine drains ended pins)
    charged: int = 0  # a level: bytes the bucket's objects count against budget and quotas
    disk_objects: int = 0  # a level: blocks the flash tier holds (filled in when stats are read)
    disk_bytes: int = 0  # a level: their payload bytes

    LEVELS = ("objects", "bytes", "pinned_bytes", "charged", "disk_objects", "disk_bytes")

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    def reset(self) -> None:
        """Zero the counters; levels stay."""
        for f in dataclasses.fields(self):
            if f.name not in self.LEVELS:
                setattr(self, f.name, 0)


@dataclass
class Bucket:
    """A namespace owned by one tenant; its keys are kept sorted (code-point order = UTF-8 byte order)."""

    name: str
    owner: str
    created: float
    default_ttl: float | None = None  # falls back to the server default
    sliding_ttl: bool = False  # reads push the expiry forward by the object's TTL class
    quota: int = 0  # bytes the bucket may hold (0 = no quota); over it, its own LRU objects go first
    objects: SortedDict[str, StoredObject] = field(default_factory=SortedDict)  # kept in key order
    lru: OrderedDict[StoredObject, None] = field(default_factory=OrderedDict)  # least recently used first
    stats: BucketStats = field(default_factory=BucketStats)
    heads: set[str] = field(default_factory=set)  # eviction heaps that hold an entry for this bucket
    charge: int = 0  # bytes the bucket itself counts against the budget and its owner's quota

    def policy(self) -> dict[str, object]:
        return {"default_ttl": self.default_ttl, "sliding_ttl": self.sliding_ttl, "quota": self.quota}


@dataclass
class Part:
    """One uploaded part of a multipart upload."""

    number: int
    data: Payload
    etag: str  # quoted MD5 hex
    md5: bytes
    last_modified: float
    checksums: dict[str, str]

    charge: int = 0  # bytes the part counts against the budget and its owner's quota

    @property
    def size(self) -> int:
        return len(self.data)


@dataclass
class Upload:
    """A multipart upload in progress. Its parts count against the budget until it completes or aborts."""

    upload_id: str
    bucket: str
    key: str
    owner: str
    created: float
    ttl: float | None
    content_type: str
    headers: dict[str, str]
    user_meta: dict[str, str]
    checksum_algorithm: str | None = None
    parts: dict[int, Part] = field(default_factory=dict)
    charged: int = 0  # bytes of parts counted in the engine's used total
    charge: int = 0  # bytes the upload itself (not its parts) counts against the budget and its owner's quota

    def metadata_bytes(self) -> int:
        return len(self.key.encode()) + len(self.content_type) + sum(
            len(k) + len(v) for d in (self.headers, self.user_meta) for k, v in d.items())


@dataclass(frozen=True)
class Completion:
    """What a completed multipart upload answered, kept a while so a retried CompleteMultipartUpload (SDKs
    retry it after a timeout) gets the same answer instead of NoSuchUpload."""

    upload_id: str
    bucket: str
    key: str
    owner: str
    etag: str
    checksums: dict[str, str]
    expires_at: float
    completed: float


def etag_matches(condition: str, etag: str) -> bool:
    """If-Match / If-None-Match semantics: a list of (possibly weak, quoted or not) ETags, or ``*``."""
    for candidate in condition.split(","):
        candidate = candidate.strip()
        if candidate == "*":
            return True
        if candidate.startswith("W/"):
            candidate = candidate[2:]
        if candidate.strip('"') == etag.strip('"'):
            return True
    return False
