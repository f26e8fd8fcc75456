"""Device faults for real: a full file system, a directory made read-only under the store, a vanished directory.

The full and read-only cases run a child process in a private mount namespace (``unshare -m``) on a small
tmpfs, which needs root; they are skipped where that is not allowed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from flash_support import CHILD, append_all, check_payload, record, run, small_store, unshare_works

from ctxstore_server.flash import DEGRADED, FlashRecord

needs_unshare = pytest.mark.skipif(not unshare_works(), reason="needs root and unshare -m (private tmpfs mounts)")


def _in_namespace(mode: str, path: Path, tmpfs_size: str) -> dict[str, object]:
    path.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(CHILD.parent), os.environ.get("PYTHONPATH", "")]))
    script = f'mount -t tmpfs -o size={tmpfs_size} tmpfs "$1" && exec "$2" "$3" {mode} "$1"'
    out = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh", str(path),
                          sys.executable, str(CHILD)], check=False, capture_output=True, text=True, timeout=90,
                         env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return dict(json.loads(out.stdout.strip().splitlines()[-1]), log=out.stderr)


@needs_unshare
def test_a_full_file_system_degrades_the_store_and_everything_acknowledged_reads_back(tmp_path: Path) -> None:
    res = _in_namespace("full", tmp_path / "mnt", "6m")
    assert res["degraded"] and "No space left on device" in str(res["degraded"])
    assert res["refused_after"] == DEGRADED
    stored, recovered = res["stored"], res["recovered"]
    assert isinstance(stored, int) and isinstance(recovered, int) and 20 <= stored < 400
    assert res["verified"] == stored  # nothing acknowledged was lost or served partially
    assert res["write_errors"] == 1
    # after the restart everything comes back verified; the segment that could not be sealed on the full
    # device is scanned record by record
    assert recovered == res["recovered_verified"] == stored
    assert "degraded" in str(res["log"])  # the log line an operator sees
    assert str(res["log"]).count("the flash tier is degraded") == 1  # logged once


@needs_unshare
def test_a_directory_made_read_only_keeps_serving_reads_and_reopens(tmp_path: Path) -> None:
    res = _in_namespace("readonly", tmp_path / "mnt", "64m")
    assert res["degraded"] and "read-only" in str(res["degraded"]).lower()
    assert res["refused"] == DEGRADED
    assert res["verified"] == 40
    assert res["reopened_degraded"] and res["recovered"] == 40 and res["recovered_verified"] == 40
    assert res["manifest_saved"] is False


def test_a_vanished_directory_degrades_and_reads_of_what_was_open_continue(tmp_path: Path) -> None:
    path = tmp_path / "flash"

    async def go() -> None:
        store = small_store(path)
        await store.open()
        await append_all(store, [record(f"v{i}", 1, 20000) for i in range(30)])
        shutil.rmtree(path)
        await store.housekeep()
        assert store.degraded and "No such file" in store.degraded
        assert store.append([record("late")]) == [DEGRADED]
        blocks = await store.read_many("b", [f"v{i}" for i in range(30)])
        assert all(b is not None and check_payload(f"v{i}", b.payload) == 1 for i, b in enumerate(blocks))
        assert not await store.save_manifest({"x": 1})
        await store.close()

    run(go())


def test_writes_failing_under_the_store_are_failed_not_acknowledged(tmp_path: Path) -> None:
    """The directory vanishes while the writer needs a new segment: the records are reported not stored."""
    path = tmp_path / "flash"

    async def go() -> None:
        store = small_store(path)
        await store.open()
        await append_all(store, [record("a")])
        shutil.rmtree(path)
        now = time.time()
        results: list = []
        big = [FlashRecord("b", f"w{i}", bytes(200_000), now + 60, now) for i in range(20)]  # > one segment
        store.append(big, results.extend)
        await store.flush()
        assert store.degraded
        assert any(not r.stored for r in results)
        for r in results:
            if not r.stored:
                assert store.lookup("b", r.record.key) is None
        await store.close()

    run(go())
