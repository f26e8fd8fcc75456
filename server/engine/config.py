"""The engine's limits, built from the node's settings (their defaults are the settings table's)."""

from __future__ import annotations

from dataclasses import dataclass

from ..settings import Settings
from .objects import BUCKET_OVERHEAD, PART_OVERHEAD, UPLOAD_OVERHEAD

_DEFAULTS = Settings()


@dataclass
class EngineConfig:
    """Engine limits. Byte figures are bytes, durations seconds."""

    budget: int = _DEFAULTS.memory
    default_ttl: float = _DEFAULTS.default_ttl
    max_ttl: float = _DEFAULTS.max_ttl
    max_pin: float = _DEFAULTS.max_pin
    max_object_size: int = _DEFAULTS.max_object_size
    min_part_size: int = _DEFAULTS.min_part_size
    upload_ttl: float = _DEFAULTS.upload_ttl  # an abandoned multipart upload is dropped after this
    max_buckets_per_tenant: int = _DEFAULTS.max_buckets_per_tenant
    max_uploads_per_tenant: int = _DEFAULTS.max_uploads_per_tenant
    tenant_reserve_limit: int = _DEFAULTS.tenant_reserve_limit  # 0: a quarter of the budget
    max_parts: int = 10000  # S3's limit on parts per upload
    # What a bucket, an upload and a part cost beyond their bytes (objects.py has the measured figures).
    bucket_overhead: int = BUCKET_OVERHEAD
    upload_overhead: int = UPLOAD_OVERHEAD
    part_overhead: int = PART_OVERHEAD
    max_pinned_scan: int = 10000  # pinned objects one write may step over before it gives up
    # The flash tier (docs/flash.md); no directory: RAM only.
    disk_path: str = _DEFAULTS.disk
    disk_size: int = _DEFAULTS.disk_size
    disk_reset: bool = _DEFAULTS.disk_reset
    disk_segment_size: int = _DEFAULTS.disk_segment_size
    disk_min_ttl: float = _DEFAULTS.disk_min_ttl
    disk_promote: bool = _DEFAULTS.disk_promote
    disk_direct_size: int = _DEFAULTS.disk_direct_size
    disk_queue: int = _DEFAULTS.disk_queue
    disk_write_wait: float = _DEFAULTS.disk_write_wait
    disk_write_back: bool = _DEFAULTS.disk_write_back
    disk_readers: int = _DEFAULTS.disk_readers

    @classmethod
    def from_settings(cls, settings: Settings) -> EngineConfig:
        return cls(
            budget=settings.memory,
            default_ttl=settings.default_ttl,
            max_ttl=settings.max_ttl,
            max_pin=settings.max_pin,
            max_object_size=settings.max_object_size,
            min_part_size=settings.min_part_size,
            upload_ttl=settings.upload_ttl,
            max_buckets_per_tenant=settings.max_buckets_per_tenant,
            max_uploads_per_tenant=settings.max_uploads_per_tenant,
            tenant_reserve_limit=settings.tenant_reserve_limit,
            disk_path=settings.disk,
            disk_size=settings.disk_size,
            disk_reset=settings.disk_reset,
            disk_segment_size=settings.disk_segment_size,
            disk_min_ttl=settings.disk_min_ttl,
            disk_promote=settings.disk_promote,
            disk_direct_size=settings.disk_direct_size,
            disk_queue=settings.disk_queue,
            disk_write_wait=settings.disk_write_wait,
            disk_write_back=settings.disk_write_back,
            disk_readers=settings.disk_readers,
        )
