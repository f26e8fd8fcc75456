"""SIGKILL a writer process during heavy appends, again and again: after every recovery each key is absent or
byte-identical to one of its writes, never torn, never another key's bytes, never expired.

CI runs a few rounds; ``CTXSTORE_FLASH_SOAK=<rounds>`` runs a longer soak."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from flash_child import CHURN_KEYS, SHORT_TTL, churn_store
from flash_support import CHILD, check_payload, run

ROUNDS = int(os.environ.get("CTXSTORE_FLASH_SOAK", "4"))


def _start(path: Path, seed: int, log: Path) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(CHILD.parent), os.environ.get("PYTHONPATH", "")]))
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, str(CHILD), "churn", str(path), str(seed)], stdout=subprocess.PIPE,
                                stderr=err, text=True, env=env)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if line.strip() != "ready":
        proc.kill()
        proc.wait()
        proc.stdout.close()
        raise AssertionError(f"child did not start: {line!r} {log.read_text()}")
    return proc


async def _verify(path: Path) -> tuple[int, int]:
    store = churn_store(path)
    report = await store.open()
    try:
        keys = [f"k{i:04d}" for i in range(CHURN_KEYS)]
        shorts = [f"s{i:03d}" for i in range(200)]
        blocks = await store.read_many("b", keys + shorts)
        now = time.time()
        present = 0
        for key, block in zip(keys + shorts, blocks):
            if block is None:
                continue
            present += 1
            check_payload(key, block.payload)  # this key's bytes, exactly one of its versions
            assert block.key == key and block.metadata == b"meta:" + key.encode()
            assert block.expires_at > now
            assert not key.startswith("s"), f"{key} had expired before the restart and came back"
        assert report.blocks == present, (report, present)
        listed = await store.list_keys("b", "", 10_000)
        assert set(listed) <= set(keys) and len(listed) == present
        return present, report.discarded_records
    finally:
        await store.close()


def test_sigkill_during_heavy_appends_never_leaves_torn_or_foreign_bytes(tmp_path: Path) -> None:
    rng = random.Random(7)
    seen = 0
    store_dir, log = tmp_path / "flash", tmp_path / "child.log"
    for round_ in range(ROUNDS):
        proc = _start(store_dir, round_ + 1, log)
        time.sleep(rng.uniform(0.3, 1.5))
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        assert proc.stdout is not None
        proc.stdout.close()
        assert proc.returncode == -signal.SIGKILL, log.read_text()
        time.sleep(SHORT_TTL + 0.1)  # every short-lived block written before the kill has now expired
        present, _discarded = run(_verify(store_dir))
        seen = max(seen, present)
    assert seen > 0  # the rounds did recover something, so the checks above checked something
