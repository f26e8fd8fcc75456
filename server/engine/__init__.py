"""The storage engine of a node: buckets, objects, byte budget, TTLs, pins and multipart uploads.

No HTTP here (a test checks). The protocol layers, the admin API, events and metrics use what this package
exports: the :class:`Engine` facade, its configuration, the records it hands out and its typed errors.
"""

from . import errors
from .budget import Reservation
from .config import EngineConfig
from .engine import Engine
from .errors import Kind, StorageError
from .objects import OBJECT_OVERHEAD, Bucket, BucketStats, Part, Payload, StoredObject, Upload, etag_matches
from .store import REMOVAL_REASONS

__all__ = [
    "OBJECT_OVERHEAD", "REMOVAL_REASONS", "Bucket", "BucketStats", "Engine", "EngineConfig", "Kind", "Part",
    "Payload", "Reservation", "StorageError", "StoredObject", "Upload", "errors", "etag_matches",
]
