"""Small files beside the segments: the state file (manifest + bucket floors) and the dead log.

- ``state.json`` is replaced atomically: write a temporary file, fsync it, rename it over the old one, fsync
  the directory. A reader sees the old or the new content, never a mix.
- ``dead.log`` lists records that are still on disk but no longer valid (deleted, replaced, superseded), as
  (segment << 32 | offset) with a check word, 16 bytes each. Appended without fsync like the records; a torn
  last entry is ignored. Rewritten atomically without the entries of deleted segments when it grows.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

STATE_FILE = "state.json"
DEAD_LOG = "dead.log"
STATE_FORMAT = 1
_DEAD = np.dtype([("key", "<u8"), ("check", "<u8")])
_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def atomic_write(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data``: temp file, fsync, rename, fsync the directory."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def encode_state(manifest: dict[str, object] | None, floors: dict[str, int]) -> bytes:
    return json.dumps({"format": STATE_FORMAT, "manifest": manifest, "floors": floors},
                      separators=(",", ":"), sort_keys=True).encode()


def load_state(directory: Path) -> tuple[dict[str, object] | None, dict[str, int], bool]:
    """(manifest, bucket floors, whether the file was unreadable). A missing file is an empty state."""
    path = directory / STATE_FILE
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None, {}, False
    try:
        doc = json.loads(raw)
        if doc.get("format") != STATE_FORMAT:
            raise ValueError("state format")
        floors = {str(k): int(v) for k, v in doc.get("floors", {}).items()}
        manifest = doc.get("manifest")
        return (manifest if isinstance(manifest, dict) else None), floors, False
    except (ValueError, TypeError, AttributeError):
        return None, {}, True


def dead_keys(segments: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    return (segments.astype(np.uint64) << np.uint64(32)) | offsets.astype(np.uint64)


def encode_dead(keys: np.ndarray) -> bytes:
    out = np.empty(keys.size, _DEAD)
    out["key"] = keys
    out["check"] = ~keys.astype(np.uint64) & _MASK64
    return out.tobytes()


def load_dead(directory: Path) -> np.ndarray:
    """The valid entries of the dead log (uint64 keys), torn or garbled entries skipped."""
    try:
        raw = (directory / DEAD_LOG).read_bytes()
    except FileNotFoundError:
        return np.zeros(0, np.uint64)
    raw = raw[:len(raw) - len(raw) % _DEAD.itemsize]
    arr = np.frombuffer(raw, _DEAD)
    ok = arr["check"] == (~arr["key"] & _MASK64)
    keys: np.ndarray = arr["key"][ok].copy()  # a structured array's field is untyped to numpy's stubs
    return keys
