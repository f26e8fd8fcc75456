"""The storage engine of a node: buckets, objects, byte budget, TTLs, pins, multipart uploads and the flash tier
below RAM.

No HTTP here (a test checks). The protocol layers, the admin API, events and metrics use what this package
exports: the :class:`Engine` facade, its configuration, the records it hands out and its typed errors.
"""

from . import errors
from .budget import Reservation
from .config import EngineConfig
from .engine import Engine
from .errors import Kind, StorageError
from .lower import DISK, RAM, BlockRef
from .objects import (
    BUCKET_OVERHEAD,
    OBJECT_OVERHEAD,
    PART_OVERHEAD,
    UPLOAD_OVERHEAD,
    Bucket,
    BucketStats,
    Completion,
    Part,
    Payload,
    StoredObject,
    Upload,
    etag_matches,
)
from .store import REMOVAL_REASONS, BlockWrite

__all__ = [
    "BUCKET_OVERHEAD", "DISK", "OBJECT_OVERHEAD", "PART_OVERHEAD", "RAM", "REMOVAL_REASONS", "UPLOAD_OVERHEAD",
    "BlockRef", "BlockWrite", "Bucket", "BucketStats", "Completion", "Engine", "EngineConfig", "Kind", "Part",
    "Payload", "Reservation", "StorageError", "StoredObject", "Upload", "errors", "etag_matches",
]
