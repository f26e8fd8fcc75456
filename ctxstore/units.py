"""Sizes and durations as people write them (``4GiB``, ``512MB``, ``90s``, ``2h``), shared by the server's
settings and the admin CLI."""

from __future__ import annotations

import re

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "ki": 1 << 10, "kib": 1 << 10, "mi": 1 << 20, "mib": 1 << 20, "gi": 1 << 30, "gib": 1 << 30,
    "ti": 1 << 40, "tib": 1 << 40,
}


def parse_size(text: str) -> int:
    """``4GiB`` → 4294967296, ``512MB`` → 512000000, a bare number is bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"not a size: {text!r} (examples: 1048576, 512MiB, 4GiB)")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


_DURATION_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    """``90`` or ``90s`` → 90.0; ``5m``, ``2h``, ``7d``."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdSMHD]?)\s*", str(text))
    if not match:
        raise ValueError(f"not a duration: {text!r} (examples: 30, 30s, 5m, 2h, 7d)")
    return float(match.group(1)) * _DURATION_UNITS[match.group(2).lower()]


def format_duration(seconds: float) -> str:
    """The largest unit that writes ``seconds`` exactly: 604800 → ``7d``, 1800 → ``30m``, 90 → ``90s``."""
    for unit in ("d", "h", "m"):
        factor = _DURATION_UNITS[unit]
        if seconds >= factor and seconds % factor == 0:
            return f"{int(seconds // factor)}{unit}"
    return f"{seconds:g}s"


def format_size(n: int) -> str:
    """Binary units, with the decimal size beside them when that is how it was written: 1073741824 → ``1 GiB``,
    2000000000 → ``2 GB (1.86 GiB)``, 1536 → ``1.5 KiB``."""
    binary = f"{n} B"
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        factor = _SIZE_UNITS[unit.lower()]
        if n >= factor:
            binary = f"{n / factor:.3g} {unit}" if n % factor else f"{n // factor} {unit}"
            if n % factor == 0:
                return binary
            break
    for unit in ("TB", "GB", "MB", "KB"):
        factor = _SIZE_UNITS[unit.lower()]
        if n >= factor and n % factor == 0:
            return f"{n // factor} {unit} ({binary})"
    return binary


def plural(n: int, noun: str) -> str:
    """``1 node``, ``3 nodes``, ``1,024 blocks``."""
    return f"{n:,} {noun}" if n == 1 else f"{n:,} {noun}s"
