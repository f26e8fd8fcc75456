"""Child processes for the flash tests: ``python flash_child.py MODE DIR [ARGS]``.

- ``churn DIR SEED``: heavy appends, replacements, deletes and short-lived blocks until killed.
- ``full DIR``: run inside a private mount namespace on a small tmpfs: append until the device is full,
  then check that everything acknowledged reads back, restart, check again. Prints one JSON line.
- ``readonly DIR``: inside a private mount namespace: write, make the directory read-only under the store
  (a read-only bind mount), keep going; then reopen on the read-only directory. Prints one JSON line.
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from flash_support import MiB, check_payload, make_payload, small_store

from ctxstore_server.flash import FlashRecord, FlashStore

CHURN_KEYS = 1500
SHORT_TTL = 0.5


def churn_store(path: Path) -> FlashStore:
    return small_store(path, 40 * MiB, segment_bytes=2 * MiB, batch_bytes=1 * MiB, queue_bytes=8 * MiB,
                       seal_idle=0.3)


async def churn(path: Path, seed: int) -> None:
    rng = random.Random(seed)
    store = churn_store(path)
    await store.open()
    print("ready", flush=True)
    version = seed * 10_000_000
    n = 0
    while True:
        now = time.time()
        batch = []
        for _ in range(rng.randint(8, 48)):
            version += 1
            if rng.random() < 0.1:
                key, ttl = f"s{rng.randrange(200):03d}", SHORT_TTL
            else:
                key, ttl = f"k{rng.randrange(CHURN_KEYS):04d}", 3600.0
            size = rng.choice((1000, 65536, 65536, 65536, 200_000))
            batch.append(FlashRecord("b", key, make_payload(key, version, size), now + ttl, now,
                                     b"meta:" + key.encode()))
        refused = store.append(batch)
        if rng.random() < 0.2:
            store.delete_many("b", [f"k{rng.randrange(CHURN_KEYS):04d}" for _ in range(4)])
        n += 1
        if n % 8 == 0:
            await store.housekeep()
        await asyncio.sleep(0.002 if any(refused) else 0)


async def full(path: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    store = small_store(path, 64 * MiB, segment_bytes=1 * MiB, batch_bytes=256 * 1024)
    await store.open()
    stored: list[str] = []
    now = time.time()
    for i in range(400):  # 400 × 64 KiB = 25 MiB onto a 6 MiB file system
        key = f"f{i:04d}"
        results: list[Any] = []
        store.append([FlashRecord("b", key, make_payload(key, 1, 65536), now + 3600, now, b"m")], results.extend)
        await store.flush()
        stored.extend(r.record.key for r in results if r.stored)
        if store.degraded:
            break
        await store.housekeep()
    out["degraded"] = store.degraded
    out["stored"] = len(stored)
    out["refused_after"] = store.append([FlashRecord("b", "late", b"x", now + 60, now)])[0]
    blocks = await store.read_many("b", stored)
    out["verified"] = sum(1 for k, b in zip(stored, blocks) if b is not None and check_payload(k, b.payload) == 1)
    out["write_errors"] = store.stats().write_errors
    await store.close()
    store = small_store(path, 64 * MiB, segment_bytes=1 * MiB)
    report = await store.open()
    keys = [f"f{i:04d}" for i in range(400)]
    blocks = await store.read_many("b", keys)
    out["recovered"] = report.blocks
    out["recovered_verified"] = sum(1 for k, b in zip(keys, blocks) if b is not None and check_payload(k, b.payload))
    await store.close()
    return out


async def readonly(path: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    store = small_store(path, 64 * MiB, segment_bytes=1 * MiB, batch_bytes=256 * 1024)
    await store.open()
    now = time.time()
    keys = [f"r{i:03d}" for i in range(40)]
    await _append(store, [FlashRecord("b", k, make_payload(k, 1, 30000), now + 3600, now) for k in keys])
    await asyncio.to_thread(subprocess.run, ["mount", "--bind", str(path), str(path)], check=True)
    await asyncio.to_thread(subprocess.run, ["mount", "-o", "remount,bind,ro", str(path)], check=True)
    await store.housekeep()
    out["degraded"] = store.degraded
    out["refused"] = store.append([FlashRecord("b", "late", b"x", now + 60, now)])[0]
    blocks = await store.read_many("b", keys)
    out["verified"] = sum(1 for k, b in zip(keys, blocks) if b is not None and check_payload(k, b.payload) == 1)
    await store.close()
    store = small_store(path, 64 * MiB, segment_bytes=1 * MiB)
    report = await store.open()
    out["reopened_degraded"] = store.degraded
    blocks = await store.read_many("b", keys)
    out["recovered"] = report.blocks
    out["recovered_verified"] = sum(1 for k, b in zip(keys, blocks) if b is not None and check_payload(k, b.payload))
    out["manifest_saved"] = await store.save_manifest({"x": 1})
    await store.close()
    return out


async def _append(store: FlashStore, recs: list[FlashRecord]) -> None:
    assert store.append(recs) == [None] * len(recs)
    await store.flush()


def main() -> None:
    mode, path = sys.argv[1], Path(sys.argv[2])
    if mode == "churn":
        asyncio.run(churn(path, int(sys.argv[3])))
    elif mode == "full":
        print(json.dumps(asyncio.run(full(path))), flush=True)
    elif mode == "readonly":
        print(json.dumps(asyncio.run(readonly(path))), flush=True)
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
