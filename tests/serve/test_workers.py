"""``ctxstore serve --workers N`` (server/shards.py), the parent process: N shard processes on consecutive ports,
each an independent node with 1/N of the budget, that the client reaches as ``host:FIRST-LAST``; the parent
hands its (generated) credentials to every shard, refuses a bad ``--workers`` or a port in use, and gives each
shard its share of the flash tier. Also the per-shard split of the settings and the port-range syntax of node
lists. What goes through the shards of a running node (placement, budgets, S3, the pod view, a shard that dies
and is restarted) is in test_shards.py."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from support.nodes import ACCESS_KEY, SECRET_KEY, free_port_run, make_client
from support.probes import Admin, wait_until
from workers_support import shard, start_workers

from ctxstore.endpoints import parse_endpoints
from ctxstore_server import shards
from ctxstore_server.settings import Settings

MiB = 1 << 20


def test_a_run_of_free_ports_skips_a_taken_one_and_leaks_no_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    # The port after a free one is taken: that try fails, and the socket it opened must be closed too (it
    # leaked, and its ResourceWarning failed a later test's setup once in a full run).
    import gc

    import support.nodes

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        offers = iter([port - 1])
        real = support.nodes.free_port
        monkeypatch.setattr(support.nodes, "free_port", lambda: next(offers, None) or real())
        first = support.nodes.free_port_run(2)
        assert first != port - 1 and port not in (first, first + 1)
        gc.collect()  # a leaked socket warns here, and the suite's warnings are errors


def test_generated_credentials_are_the_same_on_every_shard(tmp_path: Path) -> None:
    node = start_workers(tmp_path, 2, "--memory", "16MiB", credentials=False)
    try:
        assert node.log is not None
        text = node.log.read_text()
        access = re.search(r"AWS_ACCESS_KEY_ID=(\S+)", text)
        secret = re.search(r"AWS_SECRET_ACCESS_KEY=(\S+)", text)
        assert access and secret and text.count("AWS_ACCESS_KEY_ID=") == 1  # printed once, by the parent
        assert re.search(rf"2 shards on http://127.0.0.1:{node.port}-{node.port + 1}", text)
        for i in range(2):
            s3 = make_client(shard(node, i).endpoint, access.group(1), secret.group(1))
            assert s3.list_buckets()["Buckets"] == []
    finally:
        assert node.stop() == 0


def test_shard_settings_divide_the_budget_and_give_each_shard_its_own_names() -> None:
    settings = Settings().with_values({"port": 9000, "memory": 10 * MiB, "workers": 4, "node_id": "box-7",
                                       "tenant_reserve_limit": 0, "events_zmq_pub": "tcp://0.0.0.0:5557",
                                       "events_zmq_replay": ">tcp://collector:5558"})
    split = [shards.shard_settings(settings, i, 4) for i in range(4)]
    assert [s["port"] for s in split] == [9000, 9001, 9002, 9003]
    assert {s["memory"] for s in split} == {10 * MiB // 4}
    assert "tenant_reserve_limit" not in split[0]  # 0: automatic, a quarter of the shard's own budget
    assert [s["node_id"] for s in split] == [f"box-7/shard-{i}" for i in range(4)]
    assert split[3]["events_zmq_pub"] == "tcp://0.0.0.0:5560"  # a bound address: one port per shard
    assert "events_zmq_replay" not in split[3] or split[3]["events_zmq_replay"] == ">tcp://collector:5558"
    assert all(s["workers"] == 1 for s in split)
    # Every name the lists declare is a setting (the flash tier's names join once the table has them).
    names = set(Settings().as_dict(redact=False))
    assert set(shards.DIVIDED) | set(shards.SUFFIXED) | set(shards.PORTED) <= names
    assert shards.shard_argv({"memory": 5, "node_id": "a/shard-1"}) == ["--memory", "5", "--node-id", "a/shard-1"]


def test_node_lists_take_port_ranges() -> None:
    assert [(e.host, e.port) for e in parse_endpoints("10.0.0.5:9000-9002, b:7")] == [
        ("10.0.0.5", 9000), ("10.0.0.5", 9001), ("10.0.0.5", 9002), ("b", 7)]
    assert [e.port for e in parse_endpoints("http://[::1]:9000-9001")] == [9000, 9001]
    for bad in ("a:9001-9000", "a:9000-", "a:1-5000", "a:-9000", "a:9000-9x"):
        with pytest.raises(ValueError):
            parse_endpoints(bad)


def test_workers_must_be_positive(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "ctxstore_server.serve", "--workers", "0"], capture_output=True,
                          text=True, timeout=30, env={**os.environ, "CTXSTORE_ACCESS_KEY": ACCESS_KEY,
                                                      "CTXSTORE_SECRET_KEY": SECRET_KEY})
    assert done.returncode == 2 and "--workers" in done.stderr


def test_a_shard_port_in_use_is_one_line_and_exit_1() -> None:
    # It used to start the other shards and restart the one that could not bind, forever.
    port = free_port_run(2)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port + 1))
        done = subprocess.run([sys.executable, "-m", "ctxstore_server.serve", "--workers", "2", "--port", str(port)],
                              capture_output=True, text=True, timeout=30,
                              env={**os.environ, "CTXSTORE_ACCESS_KEY": ACCESS_KEY, "CTXSTORE_SECRET_KEY": SECRET_KEY})
    out = done.stdout + done.stderr
    assert done.returncode == 1 and f"cannot listen on 127.0.0.1:{port + 1}: Address already in use" in out, out
    assert "shards on" not in out and "Traceback" not in out, out


def test_each_shard_has_its_own_share_of_the_flash_tier(tmp_path: Path) -> None:
    """``--disk D --disk-size S`` with two workers: shard i keeps its flash tier in ``D/shard-i`` with S/2, and
    what each shard demotes comes back from its own directory."""
    disk = tmp_path / "flash"
    node = start_workers(tmp_path, 2, "--memory", "16MiB", "--disk", str(disk), "--disk-size", "64MiB",
                         "--disk-segment-size", "4MiB")
    try:
        for i in range(2):
            stats = Admin(shard(node, i)).stats()
            assert stats["disk_budget"] == 32 * MiB and stats["budget"] == 8 * MiB
        s3 = [make_client(shard(node, i).endpoint) for i in range(2)]
        for i, client in enumerate(s3):
            client.create_bucket(Bucket=f"flash{i}")
            for k in range(16):  # 16 MiB into 8 MiB of RAM: half of it demoted
                client.put_object(Bucket=f"flash{i}", Key=f"k{k}", Body=bytes([i, k]) * (MiB // 2))
        for i, client in enumerate(s3):
            assert wait_until(lambda: Admin(shard(node, i)).stats()["disk_objects"] >= 8)
            for k in range(16):
                assert client.get_object(Bucket=f"flash{i}", Key=f"k{k}")["Body"].read() == bytes([i, k]) * (MiB // 2)
        assert sorted(p.name for p in disk.iterdir()) == ["shard-0", "shard-1"]
        assert all(list((disk / f"shard-{i}").glob("seg-*.dat")) for i in range(2))
    finally:
        node.stop()


def test_a_shard_that_keeps_failing_at_start_waits_longer_each_time() -> None:
    delay, seen = 0.0, []
    for _ in range(9):
        delay = shards.restart_delay(delay, ran=0.5)
        seen.append(delay)
    assert seen == [1, 2, 4, 8, 16, 32, 60, 60, 60]
    assert shards.restart_delay(60, ran=shards.STABLE_AFTER) == shards.RESTART_DELAY  # it had been running well
