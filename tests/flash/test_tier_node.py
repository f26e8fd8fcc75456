"""Nodes with a flash tier, as real processes on real files, driven by boto3 and the ctxstore client: far more
than RAM holds reads back byte for byte over S3 and bulk, a SIGKILL loop during writes and demotions never
brings back a torn, foreign or stale block, corrupted records are misses, TTLs run while the node is down,
device faults degrade the tier while RAM serves, and a restarted node gives a client in another process its
blocks back.

The SIGKILL loop runs ``CTXSTORE_FLASH_SOAK`` rounds (3 by default). The full-disk test mounts a small tmpfs in a
private mount namespace (``unshare -m``, root only; skipped elsewhere)."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import msgpack
import pytest
import xxhash
from botocore.exceptions import ClientError
from flash_support import check_payload, make_payload, unshare_works

from ctxstore import ContextStore, Limits
from ctxstore import admin as admin_cli
from ctxstore.buffers import Destinations
from support.chaos import kill, restart
from support.nodes import ACCESS_KEY, SECRET_KEY, Node, free_port, make_client, wait_ready
from support.probes import ADMIN_TOKEN, Admin, http_request, log_text, start_probed_node, wait_until

KiB, MiB = 1 << 10, 1 << 20
SMALL_CALLS = Limits(bytes_per_call=2 * MiB)  # a save must fit in a small node's budget at once
ROUNDS = int(os.environ.get("CTXSTORE_FLASH_SOAK", "3"))
WORKER = Path(__file__).resolve().parent.parent / "support" / "restore_worker.py"


def flash_args(disk: Path, *extra: str, memory: str = "16MiB", size: str = "256MiB") -> list[str]:
    return ["--memory", memory, "--disk", str(disk), "--disk-size", size, "--disk-segment-size", "4MiB", *extra]


@pytest.fixture
def disk(tmp_path: Path) -> Path:
    return tmp_path / "flash"


def missing(s3: Any, bucket: str, key: str) -> bool:
    try:
        s3.head_object(Bucket=bucket, Key=key)
    except ClientError as exc:
        assert exc.response["Error"]["Code"] in ("404", "NoSuchKey")
        return True
    return False


# ---------------------------------------------------------------------------- three times RAM, both APIs


def test_three_times_ram_reads_back_byte_for_byte_over_s3_and_bulk(tmp_path: Path, disk: Path) -> None:
    node = start_probed_node(tmp_path, *flash_args(disk))
    admin = Admin(node)
    try:
        s3 = make_client(node.endpoint)
        s3.create_bucket(Bucket="objects")
        # Written at the pace of the disk, so that RAM and flash both hold blocks when the reads start (a save
        # that outruns the device waits for it: the next test).
        def settled() -> None:
            assert wait_until(lambda: admin.stats()["disk_queued_bytes"] == 0)

        keys = [f"obj/{i:03d}" for i in range(24)]
        for i, key in enumerate(keys):  # 24 MiB over S3 ...
            s3.put_object(Bucket="objects", Key=key, Body=make_payload(key, 0, MiB))
            if i % 4 == 3:
                settled()
        store = ContextStore(node.endpoint, access_key=ACCESS_KEY, secret_key=SECRET_KEY, limits=SMALL_CALLS)
        try:
            ns = store.namespace("prompts", model="flash-test", block_size=16)
            tokens = list(range(16 * 384))  # ... and 24 MiB of 64 KiB blocks over bulk: 48 MiB against 16 MiB
            blocks = [make_payload(f"block{i}", 0, 64 * KiB) for i in range(384)]
            hashes = ns.block_hashes(tokens)
            for start in range(0, 384, 64):  # 4 MiB at a time
                assert store.put_keys("prompts", hashes[start:start + 64], blocks[start:start + 64]).stored == 64
                settled()
            stats = admin.stats()
            assert stats["demotions"] > 0 and stats["evictions"] == 0
            assert stats["disk_objects"] > 0 and stats["used"] <= stats["budget"]
            tiers = ns.locate(tokens)
            assert set(tiers) == {"ram", "disk"}, "the newest blocks are in RAM, the oldest on flash"

            # The newest first (RAM hits), then everything: the oldest come from flash.
            assert check_payload(keys[-1], s3.get_object(Bucket="objects", Key=keys[-1])["Body"].read()) == 0
            for key in keys:
                assert check_payload(key, s3.get_object(Bucket="objects", Key=key)["Body"].read()) == 0
            ranged = s3.get_object(Bucket="objects", Key=keys[0], Range="bytes=1000-1999")["Body"].read()
            assert ranged == make_payload(keys[0], 0, MiB)[1000:2000]
            assert s3.head_object(Bucket="objects", Key=keys[1])["ContentLength"] == MiB
            # One bulk get reads at most half the node's budget from flash (docs/flash.md): a restore of a
            # prefix that fits, then every block by key, 64 at a time.
            restored = ns.restore(tokens[:16 * 96])
            assert restored.n_blocks == 96
            assert all(bytes(b) == blocks[i] for i, b in enumerate(restored.blocks))
            for start in range(0, 384, 64):
                got = store.get_keys("prompts", hashes[start:start + 64], Destinations(None, 64))
                assert [bytes(g) if g is not None else None for g in got] == blocks[start:start + 64]
            listed = [o["Key"] for o in s3.list_objects_v2(Bucket="objects")["Contents"]]
            assert listed == keys
        finally:
            store.close()
        stats = admin.stats()
        ram_hits = stats["hits"] - stats["disk_hits"]
        assert stats["disk_hits"] > 0 and ram_hits > 0, "reads were served by both tiers"
        assert stats["misses"] == 0 and stats["disk_corrupt"] == 0
        assert stats["buckets"]["prompts"]["disk_objects"] > 0
        shown = _admin_stats_cli(node)
        assert "flash tier" in shown and "demoted" in shown and "ok" in shown
    finally:
        node.stop()


def test_a_save_of_three_times_ram_at_full_speed_keeps_every_acknowledged_block(tmp_path: Path, disk: Path) -> None:
    # No settling between writes, and a demotion queue of 2 MiB: victims that found the queue full were dropped
    # while their writes answered "stored", so a prefix saved beyond RAM came back with holes (485 of 768).
    # Now the writes wait for the device, or are refused (SlowDown) and saved again; none is lost.
    node = start_probed_node(tmp_path, *flash_args(disk, "--disk-queue", "2MiB", "--disk-write-wait", "5s"))
    admin = Admin(node)
    try:
        s3 = make_client(node.endpoint)
        s3.create_bucket(Bucket="objects")
        keys = [f"obj/{i:03d}" for i in range(16)]
        for key in keys:  # 16 MiB over S3 as fast as boto3 sends them (it retries a SlowDown itself)
            s3.put_object(Bucket="objects", Key=key, Body=make_payload(key, 0, MiB))
        store = ContextStore(node.endpoint, access_key=ACCESS_KEY, secret_key=SECRET_KEY, limits=SMALL_CALLS)
        try:
            ns = store.namespace("prompts", model="flash-test", block_size=16)
            n = 512  # 32 MiB of 64 KiB blocks over bulk, in prefix order: 48 MiB against 16 MiB of RAM
            tokens = list(range(16 * n))
            blocks = [make_payload(f"block{i}", 0, 64 * KiB) for i in range(n)]
            hashes = ns.block_hashes(tokens)
            refused_calls = 0
            for start in range(0, n, 32):  # 2 MiB per call, no pause
                for _ in range(20):  # a refused call stores nothing; the client saves it again
                    result = store.put_keys("prompts", hashes[start:start + 32], blocks[start:start + 32])
                    if result.stored + result.existed == 32:
                        break
                    refused_calls += 1
                    time.sleep(0.2)
                else:
                    raise AssertionError(f"blocks {start}..{start + 31} were never stored")
            stats = admin.stats()
            assert stats["evictions"] == 0, "no victim dropped"
            assert stats["disk_dropped_short_ttl"] == stats["disk_dropped_not_writing"] == 0
            assert ns.lookup(tokens) == n, "every block of the chain is found: no hole"
            for start in range(0, n, 64):
                got = store.get_keys("prompts", hashes[start:start + 64], Destinations(None, 64))
                assert [bytes(g) if g is not None else None for g in got] == blocks[start:start + 64]
            for key in keys:
                assert check_payload(key, s3.get_object(Bucket="objects", Key=key)["Body"].read()) == 0
        finally:
            store.close()
        stats = admin.stats()  # how often the writes outran the device (machine-dependent: reported, not asserted)
        print(f"\n[flash] waits {stats['disk_write_waits']}, refusals {stats['disk_write_refusals']}, "
              f"calls saved again {refused_calls}")
    finally:
        node.stop()


def _admin_stats_cli(node: Node) -> str:
    """What ``ctxstore admin stats`` prints for the node (the operator's view of both tiers)."""
    env = {**os.environ, admin_cli.ENV_NODES: f"127.0.0.1:{node.port}", admin_cli.ENV_TOKEN: ADMIN_TOKEN,
           "COLUMNS": "240"}
    out = subprocess.run([sys.executable, "-m", "ctxstore.cli", "admin", "stats"], capture_output=True, text=True,
                         env=env, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_prefetch_promotes_the_cached_prefix_and_events_carry_the_medium(tmp_path: Path, disk: Path) -> None:
    node = start_probed_node(tmp_path, *flash_args(disk, memory="8MiB"))
    admin = Admin(node)
    store = ContextStore(node.endpoint, access_key=ACCESS_KEY, secret_key=SECRET_KEY, limits=SMALL_CALLS)
    try:
        ns = store.namespace("pre", model="flash-test", block_size=16)
        tokens = list(range(16 * 256))
        assert ns.save(tokens, [make_payload(f"p{i}", 0, 64 * KiB) for i in range(256)]).stored == 256
        assert wait_until(lambda: admin.stats()["disk_queued_bytes"] == 0)
        # RAM kept the chain's head and flash took its tail (a save's parts go last first, a call's keys are
        # ranked last first): in RAM, then on flash, never the other way round.
        tiers = ns.locate(tokens)
        in_ram = tiers.count("ram")
        assert 0 < in_ram < 256 and tiers == ["ram"] * in_ram + ["disk"] * (256 - in_ram)
        head = tokens[:16 * (in_ram + 32)]  # the head in RAM and the first 32 blocks on flash
        assert ns.prefetch(head + [9999] * 16) == in_ram + 32  # the cached prefix, whatever follows
        # The 32 come into RAM (making room sends as many of RAM's least recent blocks to flash).
        assert wait_until(lambda: ns.locate(head)[in_ram:] == ["ram"] * 32, timeout=10)
        stats = admin.stats()
        assert stats["prefetches"] == 32 and stats["promotions"] >= 32  # only the blocks on flash were read

        status, raw = http_request(node.port, "GET", "/_ctx/v1/events/snapshot?bucket=pre",
                                   headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
        assert status == 200
        snap = msgpack.unpackb(raw)
        assert len(snap["keys"]) == 256 and 0 < len(snap["disk_keys"]) < 256
        assert set(snap["disk_keys"]) <= set(snap["keys"])
    finally:
        store.close()
        node.stop()


def test_lowering_the_budget_at_run_time_demotes_instead_of_dropping(tmp_path: Path, disk: Path) -> None:
    """The admin API runs on the event loop (it used to run plain routes in a worker thread)."""
    # A queue that takes the whole cut at once (by default it holds memory/16: the rest would be dropped).
    node = start_probed_node(tmp_path, *flash_args(disk, "--disk-queue", "32MiB", memory="32MiB"))
    admin = Admin(node)
    try:
        s3 = make_client(node.endpoint)
        s3.create_bucket(Bucket="shrink")
        for i in range(20):
            s3.put_object(Bucket="shrink", Key=f"k{i}", Body=make_payload(f"k{i}", 0, MiB))
        assert admin.stats()["demotions"] == 0
        admin.call("PUT", "/settings", {"memory": "8MiB"})
        assert wait_until(lambda: admin.stats()["disk_queued_bytes"] == 0)
        stats = admin.stats()
        assert stats["used"] <= 8 * MiB and stats["demotions"] >= 12 and stats["evictions"] == 0
        for i in range(20):
            assert check_payload(f"k{i}", s3.get_object(Bucket="shrink", Key=f"k{i}")["Body"].read()) == 0
    finally:
        node.stop()


# ---------------------------------------------------------------------------- SIGKILL loop


def test_sigkill_during_writes_and_demotions_never_serves_a_wrong_block(tmp_path: Path, disk: Path) -> None:
    """Writers replace 64 KiB blocks (version = how many times written) while RAM (4 MiB) demotes to flash; the
    node is SIGKILLed at a random moment, restarted on its port, and every key ever written must be either
    absent or exactly one version of its own bytes, never expired; then the next round writes on."""
    rng = random.Random(7)
    args = flash_args(disk, memory="4MiB")
    node = start_probed_node(tmp_path, *args)
    s3 = make_client(node.endpoint, retries={"max_attempts": 1})
    s3.create_bucket(Bucket="soak")
    written: dict[str, int] = {}
    try:
        for round_ in range(ROUNDS):
            stop = threading.Event()
            versions = dict(written)

            def write() -> None:
                client = make_client(node.endpoint, retries={"max_attempts": 1})
                while not stop.is_set():
                    key = f"k{rng.randrange(400)}"
                    version = versions.get(key, -1) + 1
                    try:
                        client.put_object(Bucket="soak", Key=key, Body=make_payload(key, version, 64 * KiB))
                    except Exception:  # the node died under the request: that write may or may not be there
                        return
                    versions[key] = version

            writers = [threading.Thread(target=write) for _ in range(2)]
            for w in writers:
                w.start()
            time.sleep(rng.uniform(0.8, 2.0))
            kill(node)
            stop.set()
            for w in writers:
                w.join(10)
            written = versions
            node = restart(node, tmp_path, *args)
            s3 = make_client(node.endpoint, retries={"max_attempts": 1})
            present = 0
            for key, newest in written.items():
                try:
                    body = s3.get_object(Bucket="soak", Key=key)["Body"].read()
                except ClientError as exc:
                    assert exc.response["Error"]["Code"] == "NoSuchKey"
                    continue
                version = check_payload(key, body)  # its own bytes, whole, one of its versions
                assert 0 <= version <= newest + 1, (key, version, newest)
                present += 1
            assert present > 0, f"round {round_}: nothing came back from flash"
            stats = Admin(node).stats()
            assert stats["disk_corrupt"] == 0
    finally:
        node.stop()


# ---------------------------------------------------------------------------- corruption on disk


def _segments(disk: Path) -> list[Path]:
    return sorted(disk.glob("seg-*.dat"))


def _flip(path: Path, offset: int) -> None:
    with path.open("r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))


def test_records_corrupted_on_disk_are_counted_misses_never_served(tmp_path: Path, disk: Path) -> None:
    args = flash_args(disk, "--disk-direct-size", "1")  # every object straight to flash
    node = start_probed_node(tmp_path, *args)
    s3 = make_client(node.endpoint)
    s3.create_bucket(Bucket="rot")
    keys = [f"r{i}" for i in range(12)]
    for key in keys:
        s3.put_object(Bucket="rot", Key=key, Body=make_payload(key, 0, 200 * KiB))
    assert wait_until(lambda: Admin(node).stats()["disk_queued_bytes"] == 0)
    node.stop()  # a clean stop: every segment sealed
    data = b"".join(p.read_bytes() for p in _segments(disk))
    assert data.count(b"r3|0|") == 1
    segment = next(p for p in _segments(disk) if b"r3|0|" in p.read_bytes())
    payload_at = segment.read_bytes().index(b"r3|0|")
    _flip(segment, payload_at + 100 * KiB)  # bit rot inside r3's payload
    header_seg = next(p for p in _segments(disk) if b"r7|0|" in p.read_bytes())
    raw = header_seg.read_bytes()
    _flip(header_seg, raw.index(b"r7|0|") - 12)  # a byte of r7's record header (just before its payload)

    node = restart(node, tmp_path, *args)
    admin = Admin(node)
    s3 = make_client(node.endpoint)
    assert missing(s3, "rot", "r7")  # HEAD verifies the record header
    with pytest.raises(ClientError) as exc:  # GET verifies the payload too
        s3.get_object(Bucket="rot", Key="r3")
    assert exc.value.response["Error"]["Code"] == "NoSuchKey"
    assert missing(s3, "rot", "r3")  # dropped once found corrupt
    for key in keys:
        if key not in ("r3", "r7"):
            assert check_payload(key, s3.get_object(Bucket="rot", Key=key)["Body"].read()) == 0
    assert admin.stats()["disk_corrupt"] == 2
    node.stop()


def test_a_torn_tail_segment_after_sigkill_loses_only_what_was_torn(tmp_path: Path, disk: Path) -> None:
    args = flash_args(disk, "--disk-direct-size", "1")
    node = start_probed_node(tmp_path, *args)
    s3 = make_client(node.endpoint)
    s3.create_bucket(Bucket="torn")
    keys = [f"t{i}" for i in range(30)]
    for key in keys:
        s3.put_object(Bucket="torn", Key=key, Body=make_payload(key, 0, 100 * KiB))
    assert wait_until(lambda: Admin(node).stats()["disk_queued_bytes"] == 0)
    kill(node)  # the segment being written stays unsealed
    tail = max(_segments(disk), key=lambda p: p.stat().st_mtime)
    raw = tail.read_bytes()
    cut = raw.index(b"t20|0|") + 50 * KiB  # in the middle of t20's payload
    with tail.open("r+b") as f:
        f.truncate(cut)
    node = restart(node, tmp_path, *args)
    s3 = make_client(node.endpoint)
    present = 0
    for key in keys:
        try:
            body = s3.get_object(Bucket="torn", Key=key)["Body"].read()
        except ClientError:
            continue
        assert check_payload(key, body) == 0
        present += 1
    assert missing(s3, "torn", "t20")
    assert present >= 20  # what came before the cut is intact
    node.stop()


# ---------------------------------------------------------------------------- TTL while down


def test_blocks_that_expired_while_the_node_was_down_are_gone(tmp_path: Path, disk: Path) -> None:
    args = flash_args(disk, "--disk-direct-size", "1", "--disk-min-ttl", "1")
    node = start_probed_node(tmp_path, *args)
    s3 = make_client(node.endpoint)
    s3.create_bucket(Bucket="ttl")
    s3.put_object(Bucket="ttl", Key="short", Body=make_payload("short", 0, 64 * KiB), Metadata={"ctx-ttl": "2"})
    s3.put_object(Bucket="ttl", Key="long", Body=make_payload("long", 0, 64 * KiB))
    assert wait_until(lambda: Admin(node).stats()["disk_objects"] == 2)
    started = time.time()
    node.stop()
    time.sleep(max(0.0, started + 2.2 - time.time()))  # the short one's TTL runs out while it is down
    node = restart(node, tmp_path, *args)
    s3 = make_client(node.endpoint)
    assert missing(s3, "ttl", "short")
    assert check_payload("long", s3.get_object(Bucket="ttl", Key="long")["Body"].read()) == 0
    node.stop()


# ---------------------------------------------------------------------------- device faults


def _health(node: Node) -> dict[str, Any]:
    status, raw = http_request(node.port, "GET", "/_ctx/health/ready")
    assert status == 200
    return json.loads(raw)


def test_a_vanished_directory_degrades_the_tier_while_ram_serves(tmp_path: Path, disk: Path) -> None:
    node = start_probed_node(tmp_path, *flash_args(disk, memory="8MiB"))
    admin = Admin(node)
    try:
        s3 = make_client(node.endpoint)
        s3.create_bucket(Bucket="gone")
        for i in range(12):
            s3.put_object(Bucket="gone", Key=f"g{i}", Body=make_payload(f"g{i}", 0, MiB))
        shutil.rmtree(disk)
        assert wait_until(lambda: admin.stats()["disk_degraded"] == 1, timeout=10)
        assert "degraded" in _health(node).get("disk", "")
        assert "the flash tier is degraded" in log_text(node)
        for i in range(12, 30):  # writes go on in RAM; victims are dropped, not demoted
            s3.put_object(Bucket="gone", Key=f"g{i}", Body=make_payload(f"g{i}", 0, MiB))
        assert check_payload("g29", s3.get_object(Bucket="gone", Key="g29")["Body"].read()) == 0
        assert node.proc.poll() is None
    finally:
        node.stop()


@pytest.mark.skipif(not unshare_works(), reason="needs root and unshare -m (a private tmpfs mount)")
def test_a_full_device_degrades_the_tier_while_ram_serves(tmp_path: Path) -> None:
    mount = tmp_path / "small"
    mount.mkdir()
    port = free_port()
    log = tmp_path / "node.log"
    env = {**os.environ, "CTXSTORE_ACCESS_KEY": ACCESS_KEY, "CTXSTORE_SECRET_KEY": SECRET_KEY,
           "CTXSTORE_ADMIN_TOKEN": ADMIN_TOKEN}
    # A 24 MiB file system under a 64 MiB flash budget: the device fills long before the budget does.
    script = ('mount -t tmpfs -o size=24m tmpfs "$1" && shift && exec "$@"')
    cmd = ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh", str(mount), sys.executable,
           "-m", "ctxstore_server.serve", "--port", str(port), *flash_args(mount, memory="8MiB", size="64MiB")]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    node = Node(port=port, proc=proc, log=log, env=env)
    try:
        wait_ready(node)
        admin = Admin(node)
        s3 = make_client(node.endpoint)
        s3.create_bucket(Bucket="full")
        for i in range(48):
            s3.put_object(Bucket="full", Key=f"f{i}", Body=make_payload(f"f{i}", 0, MiB))
        assert wait_until(lambda: admin.stats()["disk_degraded"] == 1, timeout=10)
        assert "No space left" in _health(node).get("disk", "")
        present = 0
        for i in range(48):
            try:
                body = s3.get_object(Bucket="full", Key=f"f{i}")["Body"].read()
            except ClientError:
                continue
            assert check_payload(f"f{i}", body) == 0  # what is served is whole
            present += 1
        assert present >= 8 and proc.poll() is None
    finally:
        node.stop()


# ---------------------------------------------------------------------------- a client in another process


def _restore_elsewhere(node: Node, bucket: str, tokens: list[int], blocks: list[bytes]) -> dict[str, Any]:
    config = {"nodes": node.endpoint, "access_key": ACCESS_KEY, "secret_key": SECRET_KEY, "bucket": bucket,
              "model": "flash-restart", "block_size": 16, "tokens": tokens,
              "expected": [xxhash.xxh3_128_hexdigest(b) for b in blocks], "out": "none",
              "timeouts": [2.0, 5.0, 20.0]}
    proc = subprocess.run([sys.executable, str(WORKER), json.dumps(config)], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return report


@pytest.mark.parametrize("stop", ["sigterm", "sigkill", "sigkill-write-back"])
def test_a_restarted_node_gives_a_client_in_another_process_its_blocks_back(tmp_path: Path, disk: Path,
                                                                            stop: str) -> None:
    """SIGTERM (write-back off): the node writes what only RAM held before it exits. SIGKILL: what reached
    flash survives (here every block does: large blocks go straight to flash, and the test waits until they are
    written; the small demotion queue makes most of them wait in RAM for their turn, as a slow disk does).
    SIGKILL with write-back (the default): every block was copied to flash while it stayed in RAM; once the
    copies landed, a kill loses none (it lost all 200 without write-back: RAM held them all)."""
    extra: tuple[str, ...] = {
        "sigterm": ("--disk-write-back", "false"),
        "sigkill": ("--disk-direct-size", "32KiB", "--disk-queue", "1MiB"),
        "sigkill-write-back": ("--disk-queue", "1MiB"),
    }[stop]
    args = flash_args(disk, *extra, memory="64MiB")
    node = start_probed_node(tmp_path, *args)
    tokens = list(range(16 * 200))
    blocks = [make_payload(f"b{i}", 0, 64 * KiB) for i in range(200)]
    store = ContextStore(node.endpoint, access_key=ACCESS_KEY, secret_key=SECRET_KEY, limits=SMALL_CALLS)
    try:
        ns = store.namespace("restart", model="flash-restart", block_size=16)
        assert ns.save(tokens, blocks).stored == 200
    finally:
        store.close()
    if stop.startswith("sigkill"):
        assert wait_until(lambda: Admin(node).stats()["disk_objects"] == 200)
        if stop == "sigkill-write-back":
            stats = Admin(node).stats()
            assert stats["objects"] == 200 and stats["demotions"] == 0, "in RAM and on flash: inclusive tiers"
        kill(node)
    else:
        assert Admin(node).stats()["disk_objects"] == 0  # all in RAM until the shutdown
        node.stop()
        assert "200 blocks (12.5 MiB) written from RAM at shutdown in" in log_text(node)
    node = restart(node, tmp_path, *args)
    try:
        assert "recovered 200 blocks" in log_text(node)
        report = _restore_elsewhere(node, "restart", tokens, blocks)
        assert report["results"] == [200] and report["wrong"] == 0 and report["exceptions"] == []
        recovery = Admin(node).stats()["disk_recovery"]
        assert recovery["blocks"] == 200 and recovery["seconds"] >= 0
    finally:
        node.stop()

