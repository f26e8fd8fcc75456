"""Helpers shared by the flash tests and the child processes they start (tests/flash/flash_child.py).

Payloads are self-describing: they start with ``key|version|size|`` and the rest is derived from that prefix,
so whoever reads a block back can tell exactly which write it came from and whether every byte is right."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import xxhash

from ctxstore_server.flash import FlashRecord, FlashStore

T = TypeVar("T")
HERE = Path(__file__).resolve().parent
CHILD = HERE / "flash_child.py"
MiB = 1 << 20


def make_payload(key: str, version: int, size: int) -> bytes:
    prefix = f"{key}|{version}|{size}|".encode()
    size = max(size, len(prefix))
    rng = np.random.default_rng(xxhash.xxh3_64_intdigest(prefix))
    return prefix + rng.bytes(size - len(prefix))


def check_payload(key: str, payload: bytes | memoryview) -> int:
    """The version a payload was written as; AssertionError if it is not exactly such a payload of ``key``."""
    raw = bytes(payload)
    parts = raw.split(b"|", 3)
    assert len(parts) == 4, f"{key}: not a test payload"
    assert parts[0].decode() == key, f"{key}: payload of another key {parts[0]!r}"
    version, size = int(parts[1]), int(parts[2])
    assert len(raw) == max(size, len(f"{key}|{version}|{size}|")), f"{key}: length {len(raw)} != {size}"
    assert raw == make_payload(key, version, size), f"{key}: bytes differ from version {version}"
    return version


def record(key: str, version: int = 0, size: int = 4096, *, bucket: str = "b", ttl: float = 3600.0,
           now: float | None = None) -> FlashRecord:
    now = time.time() if now is None else now
    return FlashRecord(bucket, key, make_payload(key, version, size), now + ttl, now, f"meta:{key}".encode())


def __getattr__(name: str) -> Any:
    """``Clock``: the suite's fake clock (``support.inprocess.FakeClock``) with ``t`` for its ``now``, the name
    these tests move it by. Made on first use: the child processes (flash_child.py) import this module without
    ``support`` on their path, and need no clock."""
    if name != "Clock":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from support.inprocess import FakeClock

    class Clock(FakeClock):
        @property
        def t(self) -> float:
            return self.now

        @t.setter
        def t(self, value: float) -> None:
            self.now = value

    globals()["Clock"] = Clock
    return Clock


def small_store(path: Path, capacity: int = 32 * MiB, **kw: Any) -> FlashStore:
    opts: dict[str, Any] = {"segment_bytes": 1 * MiB, "batch_bytes": 256 * 1024, "seal_idle": 0.5}
    opts.update(kw)
    return FlashStore(path, capacity, **opts)


def run(coro: Awaitable[T]) -> T:
    return asyncio.run(_wrap(coro))


async def _wrap(coro: Awaitable[T]) -> T:
    return await coro


async def append_all(store: FlashStore, records: list[FlashRecord]) -> list[Any]:
    """Append and wait until written; returns the WriteResults."""
    results: list[Any] = []
    refused = store.append(records, results.extend)
    assert refused == [None] * len(records), refused
    await store.flush()
    return results


def dir_bytes(path: Path) -> tuple[int, int]:
    """(sum of st_size, sum of allocated bytes) of the files in ``path``."""
    size = alloc = 0
    for entry in os.scandir(path):
        if entry.is_file():
            st = entry.stat()
            size += st.st_size
            alloc += st.st_blocks * 512
    return size, alloc


def unshare_works() -> bool:
    """Whether this machine lets us mount a tmpfs in a private mount namespace (root, unshare)."""
    if shutil.which("unshare") is None or os.geteuid() != 0:
        return False
    try:
        r = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                            "d=$(mktemp -d) && mount -t tmpfs -o size=1m tmpfs $d && umount $d && rmdir $d"],
                           check=False, capture_output=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


def wait_for(pred: Callable[[], bool], timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise TimeoutError("condition not met")
        time.sleep(0.02)
