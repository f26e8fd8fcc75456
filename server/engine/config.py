"""The engine's limits, built from the node's settings (their defaults are the settings table's)."""

from __future__ import annotations

from dataclasses import dataclass

from ..settings import Settings

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
    max_parts: int = 10000  # S3's limit on parts per upload
    max_pinned_scan: int = 10000  # pinned objects one write may step over before it gives up

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
        )
