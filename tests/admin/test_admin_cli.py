"""``ctxstore admin`` against a real three-node pod: the CLI runs in the test process (its ``main``, as the
command runs it; a few invocations run the real ``python -m ctxstore.cli admin`` process, see :func:`cli`), S3
traffic comes from boto3, and every aggregate is checked against what each node holds."""

from __future__ import annotations

import functools
import json
import os
import secrets
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from botocore.exceptions import ClientError

from support.cli import run_in_process
from support.nodes import Node, make_client, start_node, wait_ready
from ctxstore import admin

TOKEN = "admin-cli-token-" + secrets.token_hex(8)
MIB = 1 << 20


@pytest.fixture(scope="module")
def pod(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Node]]:
    tmp = tmp_path_factory.mktemp("pod")
    nodes = [start_node(tmp, "--memory", "64MiB", wait=False,
                        env={"CTXSTORE_ADMIN_TOKEN": TOKEN, "CTXSTORE_NODE_ID": f"node-{i}"})
             for i in range(3)]
    try:
        for node in nodes:
            wait_ready(node)
        yield nodes
    finally:
        for node in nodes:  # stop them together, not one drain after the other
            if node.proc.poll() is None:
                node.proc.terminate()
        for node in nodes:
            node.stop()


@functools.lru_cache(maxsize=None)
def s3_client(endpoint: str, access: str | None = None, secret: str | None = None) -> Any:
    """boto3 clients are costly to build: one per node and key pair."""
    return make_client(endpoint, access, secret) if access else make_client(endpoint)


def names(nodes: list[Node]) -> str:
    return ",".join(f"127.0.0.1:{n.port}" for n in nodes)


def cli(*args: str, nodes: list[Node] | str | None = None, token: str | None = TOKEN,
        env: dict[str, str] | None = None, process: bool = False) -> subprocess.CompletedProcess[str]:
    """``ctxstore admin ARGS`` with ``nodes``, ``token`` and ``env`` as its only admin environment, 220 columns.

    By default in this process (``support.cli.run_in_process``): it spares the ~0.25 s of imports a process
    costs, for each of the file's invocations. The admin CLI keeps no state between runs (a new ``Pod``, opener
    and rich ``Console`` each time, no logging), and a captured stream is no TTY, so rich draws the same plain
    tables, at COLUMNS wide, as into a pipe. An exception escaping ``main`` fails the test here, where the
    process would print a traceback and exit 1.

    ``process=True`` runs the installed module as a process, for what only a process shows: the exit status
    and streams the interpreter gives, for a usage error returned by ``main`` and for an argparse error exiting
    through the interpreter (both tests check that the in-process run says the same), and ``top`` streaming
    its frames into a pipe."""
    variables = {"COLUMNS": "220"}
    if nodes is not None:
        variables[admin.ENV_NODES] = nodes if isinstance(nodes, str) else names(nodes)
    if token is not None:
        variables[admin.ENV_TOKEN] = token
    variables.update(env or {})
    drop = (admin.ENV_NODES, admin.ENV_TOKEN)
    if process:
        full_env = {k: v for k, v in os.environ.items() if k not in drop} | variables
        return subprocess.run([sys.executable, "-m", "ctxstore.cli", "admin", *args], capture_output=True,
                              text=True, env=full_env, timeout=60)
    return run_in_process(["admin", *args], drop=drop, env=variables)


def cli_json(*args: str, expect: int = 0, **kwargs: Any) -> dict[str, Any]:
    result = cli(*args, "--json", **kwargs)
    assert result.returncode == expect, (result.returncode, result.stdout, result.stderr)
    return json.loads(result.stdout)


def by_node(payload: dict[str, Any], node: Node) -> dict[str, Any]:
    return next(n for n in payload["nodes"] if n["node"] == f"127.0.0.1:{node.port}")


# ----------------------------------------------------------------------------------------------- units

def test_node_list_parsing() -> None:
    assert admin.parse_nodes("a:9000, b:9001,,http://c:9002/ https://d:9443 a:9000") == [
        "http://a:9000", "http://b:9001", "http://c:9002", "https://d:9443"]
    assert admin.node_name("http://a:9000") == "a:9000"
    for bad in ("", "ftp://a:1", "a:notaport"):
        with pytest.raises(admin.UsageError):
            admin.parse_nodes(bad)
    assert admin.parse_size("4GiB") == 4 << 30 and admin.parse_size("512MB") == 512_000_000
    assert admin.parse_duration("10m") == 600


def test_rates_survive_a_counter_reset() -> None:
    zero = admin.node_stats({})
    before = admin.Sample(10.0, {**zero, "hits": 100, "misses": 20, "puts": 50, "evictions": 4})
    after = admin.Sample(12.0, {**zero, "hits": 140, "misses": 20, "puts": 60, "evictions": 10})
    rates = admin.rates_between(before, after)
    assert rates["reads"] == 20 and rates["writes"] == 5 and rates["evictions"] == 3
    assert admin.interval_hit_ratio(before, after) == 1.0
    reset = admin.Sample(14.0, {**zero, "hits": 3})
    assert admin.rates_between(after, reset)["reads"] is None  # reset or restart: unknown, not negative
    assert admin.rates_between(None, after)["reads"] is None
    assert admin.rates_between(admin.Sample(1.0, None), after)["writes"] is None


# ----------------------------------------------------------------------------------------------- commands

def test_missing_token_is_a_clear_usage_error(pod: list[Node]) -> None:
    result = cli("stats", nodes=pod, token=None, process=True)  # the command itself
    assert result.returncode == admin.EXIT_USAGE
    assert admin.ENV_TOKEN in result.stderr and "--token" in result.stderr
    assert "Traceback" not in result.stderr
    in_process = cli("stats", nodes=pod, token=None)  # what every other test runs says the same
    assert (in_process.returncode, in_process.stdout, in_process.stderr) == (
        result.returncode, result.stdout, result.stderr)
    result = cli("settings", "set", "port=1", nodes=pod)
    assert result.returncode == admin.EXIT_USAGE and "memory, default_ttl, max_ttl" in result.stderr
    result = cli("settings", "set", "memory=lots", nodes=pod)
    assert result.returncode == admin.EXIT_USAGE and "not a size" in result.stderr


def test_no_nodes_and_nothing_at_the_default_is_a_usage_error() -> None:
    # It used to try 127.0.0.1:9000 silently and exit 1 as if a configured node were down.
    try:
        socket.create_connection(("127.0.0.1", 9000), timeout=1.0).close()
        pytest.skip("a node listens at 127.0.0.1:9000 here: the default would answer")
    except OSError:
        pass
    result = cli("stats")
    assert result.returncode == admin.EXIT_USAGE, result
    assert "no nodes given" in result.stderr and admin.ENV_NODES in result.stderr and "--nodes" in result.stderr


def test_a_mistyped_option_is_said_first_with_the_one_meant(pod: list[Node]) -> None:
    result = cli("stats", "--nodess", names(pod), process=True)  # argparse exits through the interpreter
    assert result.returncode == admin.EXIT_USAGE
    assert result.stderr.startswith("ctxstore admin: error: unrecognized arguments: --nodess")
    assert "did you mean --nodes?" in result.stderr and "usage:" not in result.stderr
    in_process = cli("stats", "--nodess", names(pod))  # its SystemExit(2) read as the interpreter does
    assert (in_process.returncode, in_process.stdout, in_process.stderr) == (
        result.returncode, result.stdout, result.stderr)


def test_health_of_every_node(pod: list[Node]) -> None:
    data = cli_json("health", nodes=pod, token=None)  # health needs no token
    assert data["nodes_total"] == data["nodes_live"] == data["nodes_ready"] == 3
    assert all(n["node_id"] is None for n in data["nodes"])
    data = cli_json("health", nodes=pod)  # with the token: node id, version, uptime
    assert [n["node_id"] for n in data["nodes"]] == ["node-0", "node-1", "node-2"]
    assert all(n["live"] and n["ready"] and n["uptime"] > 0 for n in data["nodes"])
    table = cli("health", nodes=pod)
    assert table.returncode == 0, table.stderr
    assert table.stdout.count("ready") >= 4 and "node-2" in table.stdout


def test_stats_and_buckets_aggregate_over_the_pod(pod: list[Node]) -> None:
    for i, node in enumerate(pod):
        s3 = s3_client(node.endpoint)
        s3.create_bucket(Bucket="kv-aggregate")
        for k in range(2 * (i + 1)):  # 2, 4, 6 objects of 1000 bytes
            s3.put_object(Bucket="kv-aggregate", Key=f"block/{k}", Body=b"k" * 1000)
            s3.get_object(Bucket="kv-aggregate", Key=f"block/{k}")
        with pytest.raises(ClientError):
            s3.get_object(Bucket="kv-aggregate", Key="absent")

    buckets = cli_json("buckets", nodes=pod)
    assert buckets["nodes_up"] == 3
    bucket = next(b for b in buckets["buckets"] if b["name"] == "kv-aggregate")
    assert bucket["nodes"] == 3 and bucket["owners"] == ["default"]
    assert (bucket["objects"], bucket["bytes"], bucket["puts"]) == (12, 12_000, 12)
    assert (bucket["hits"], bucket["misses"]) == (12, 3)
    assert bucket["hit_ratio"] == pytest.approx(12 / 15)
    assert [d["objects"] for d in bucket["per_node"]] == [2, 4, 6]
    assert [d["node"] for d in bucket["per_node"]] == [f"127.0.0.1:{n.port}" for n in pod]

    stats = cli_json("stats", nodes=pod)
    assert stats["nodes_total"] == stats["nodes_up"] == 3
    per_node = [by_node(stats, n)["stats"] for n in pod]
    total = stats["total"]
    for key in admin.STAT_KEYS:
        assert total[key] == sum(s[key] for s in per_node), key
    assert total["budget"] == 3 * 64 * MIB
    assert total["objects"] >= 12 and total["hits"] >= 12 and total["misses"] >= 3
    assert total["hit_ratio"] == pytest.approx(total["hits"] / (total["hits"] + total["misses"]))
    assert [s["objects"] >= 2 * (i + 1) for i, s in enumerate(per_node)] == [True] * 3

    table = cli("stats", nodes=pod)
    assert table.returncode == 0, table.stderr
    assert all(f"127.0.0.1:{n.port}" in table.stdout for n in pod)
    assert "total" in table.stdout and "hit ratio" in table.stdout and "3/3" in table.stdout
    table = cli("buckets", "--per-node", nodes=pod)
    assert table.returncode == 0, table.stderr
    assert "kv-aggregate" in table.stdout and "80.0%" in table.stdout
    assert all(f"127.0.0.1:{n.port}" in table.stdout for n in pod)


def test_tenant_created_on_every_node_then_revoked(pod: list[Node]) -> None:
    created = cli_json("tenants", "create", "acme", "--quota", "1MiB", nodes=pod)
    access, secret = created["access_key"], created["secret_key"]
    assert created["created_on"] == 3 and created["quota"] == MIB and len(secret) >= 32
    for i, node in enumerate(pod):  # the same pair works on every node
        s3 = s3_client(node.endpoint, access, secret)
        s3.create_bucket(Bucket=f"acme-{i}")
        s3.put_object(Bucket=f"acme-{i}", Key="k", Body=b"acme")
        assert s3.get_object(Bucket=f"acme-{i}", Key="k")["Body"].read() == b"acme"

    listed = cli_json("tenants", "list", nodes=pod)
    entry = next(t for t in listed["tenants"] if t["access_key"] == access)
    assert entry["tenant"] == "acme" and entry["enabled"] and entry["present_on"] == 3
    assert entry["quota"] == MIB and entry["charged"] > 0
    assert secret not in json.dumps(listed)

    revoked = cli_json("tenants", "revoke", access, nodes=pod)
    assert revoked["applied_on"] == 3 and revoked["action"] == "revoked"
    for node in pod:
        with pytest.raises(ClientError) as info:
            s3_client(node.endpoint, access, secret).list_buckets()
        assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403
    entry = next(t for t in cli_json("tenants", "list", nodes=pod)["tenants"] if t["access_key"] == access)
    assert entry["enabled"] is False and entry["enabled_on"] == 0

    deleted = cli_json("tenants", "revoke", access, "--delete", nodes=pod)
    assert deleted["applied_on"] == 3 and deleted["action"] == "deleted"
    assert access not in [t["access_key"] for t in cli_json("tenants", "list", nodes=pod)["tenants"]]
    unknown = cli("tenants", "revoke", access, nodes=pod)
    assert unknown.returncode == admin.EXIT_FAILED and "no node knows" in unknown.stderr


def test_tenant_secret_is_printed_once(pod: list[Node]) -> None:
    result = cli("tenants", "create", "printed", nodes=pod)
    assert result.returncode == 0, result.stderr
    line = next(x for x in result.stdout.splitlines() if "AWS_SECRET_ACCESS_KEY=" in x)
    secret = line.split("=", 1)[1].strip()
    assert "created on 3/3 nodes" in result.stdout and "CTXSTORE_TENANTS_FILE" in result.stdout
    listing = cli("tenants", "list", nodes=pod)
    assert listing.returncode == 0 and "printed" in listing.stdout and secret not in listing.stdout


def test_the_printed_tenants_file_entry_keeps_the_quota_across_a_restart(pod: list[Node], tmp_path: Path) -> None:
    # Following the CLI's advice: the entry it prints goes into the tenants file. It left the quota out (and a
    # "quota" added by hand was ignored), so a restarted RAM-only node let the tenant fill the whole node.
    result = cli("tenants", "create", "capped", "--quota", "1MiB", nodes=pod[:1])
    assert result.returncode == 0, result.stderr
    entry = json.loads(next(x for x in result.stdout.splitlines() if x.strip().startswith("{")))
    assert entry["tenant"] == "capped" and entry["quota"] == MIB
    tenants = tmp_path / "tenants.json"
    tenants.write_text(json.dumps([entry]))
    env = {"CTXSTORE_ADMIN_TOKEN": TOKEN, "CTXSTORE_TENANTS_FILE": str(tenants)}
    node = start_node(tmp_path, "--memory", "16MiB", env=env)
    try:
        for start in range(2):  # a fresh node, then the same node restarted: the file gives the quota each time
            listed = cli_json("tenants", "list", nodes=[node])
            assert next(t for t in listed["tenants"] if t["tenant"] == "capped")["quota"] == MIB
            s3 = make_client(node.endpoint, entry["access_key"], entry["secret_key"])
            s3.create_bucket(Bucket=f"capped-{start}")
            for i in range(4):
                s3.put_object(Bucket=f"capped-{start}", Key=f"k{i}", Body=secrets.token_bytes(400 << 10))
            held = sum(o["Size"] for o in s3.list_objects_v2(Bucket=f"capped-{start}").get("Contents", []))
            assert 0 < held <= MIB  # its own oldest blocks went; 1.6 MiB were written
            if start == 0:
                node.stop()
                node = start_node(tmp_path, "--memory", "16MiB", env=env, port=node.port)
    finally:
        node.stop()


def test_a_tenants_file_field_it_does_not_know_is_refused(tmp_path: Path) -> None:
    tenants = tmp_path / "tenants.json"
    tenants.write_text(json.dumps([{"tenant": "t", "access_key": "CTXTYPO1", "secret_key": "s" * 32,
                                    "qouta": "1MiB"}]))
    node = start_node(tmp_path, wait=False, env={"CTXSTORE_TENANTS_FILE": str(tenants)})
    try:
        assert node.proc.wait(20) != 0
        out = node.log.read_text()  # type: ignore[union-attr]
        assert "unknown field 'qouta'" in out and "Traceback" not in out, out
    finally:
        node.stop()


def test_flush_prefix_then_expire(pod: list[Node]) -> None:
    for node in pod:
        s3 = s3_client(node.endpoint)
        s3.create_bucket(Bucket="kv-flush")
        for key in ("a/0", "a/1", "a/2", "b/0", "b/1"):
            s3.put_object(Bucket="kv-flush", Key=key, Body=b"x")
    flushed = cli_json("flush", "kv-flush", "--prefix", "a/", nodes=pod)
    assert (flushed["mode"], flushed["removed"], flushed["present_on"]) == ("flush", 9, 3)
    assert [n["removed"] for n in flushed["nodes"]] == [3, 3, 3]
    for node in pod:
        listing = s3_client(node.endpoint).list_objects_v2(Bucket="kv-flush")
        keys = [o["Key"] for o in listing.get("Contents", [])]
        assert keys == ["b/0", "b/1"]
    expired = cli_json("flush", "kv-flush", "--expire", nodes=pod)
    assert (expired["mode"], expired["removed"]) == ("expire", 6)
    for node in pod:
        assert s3_client(node.endpoint).list_objects_v2(Bucket="kv-flush")["KeyCount"] == 0
    bucket = next(b for b in cli_json("buckets", nodes=pod)["buckets"] if b["name"] == "kv-flush")
    assert bucket["objects"] == 0 and bucket["expirations"] == 6

    text = cli("flush", "kv-flush", nodes=pod)
    assert text.returncode == 0 and "flushed 0 objects" in text.stdout
    missing = cli("flush", "no-such-bucket", nodes=pod)
    assert missing.returncode == admin.EXIT_FAILED and "no node has bucket" in missing.stderr


def test_settings_set_and_get(pod: list[Node]) -> None:
    result = cli_json("settings", "set", "memory=48MiB", "default_ttl=10m", nodes=pod)
    assert result["requested"] == {"memory": "48MiB", "default_ttl": "10m"} and result["nodes_up"] == 3
    got = cli_json("settings", "get", nodes=pod)
    assert got["consistent"] and set(got["mutable"]) == {"memory", "default_ttl", "max_ttl"}
    for n in got["nodes"]:
        assert (n["settings"]["memory"], n["settings"]["default_ttl"]) == (48 * MIB, 600)
    assert cli_json("stats", nodes=pod)["total"]["budget"] == 3 * 48 * MIB
    table = cli("settings", "get", nodes=pod)
    assert table.returncode == 0 and table.stdout.count("48.0 MiB") == 3 and "10m" in table.stdout

    refused = cli("settings", "set", "default_ttl=30d", nodes=pod)  # over max_ttl (7d): every node refuses
    assert refused.returncode == admin.EXIT_FAILED
    assert "default_ttl 30d exceeds max_ttl 7d" in refused.stderr and "failed on every node" in refused.stderr
    cli_json("settings", "set", "memory=64MiB", "default_ttl=1h", nodes=pod)


def test_top_renders_and_streams_json(pod: list[Node]) -> None:
    result = cli("top", "--iterations", "2", "--interval", "0.3", nodes=pod, process=True)  # frames into a pipe
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("ctxstore top") == 2
    assert all(result.stdout.count(f"127.0.0.1:{n.port}") == 2 for n in pod)
    for column in ("used / budget", "hit ratio", "reads/s", "evictions/s", "expirations/s"):
        assert column in result.stdout
    assert "/s" in result.stdout.split("ctxstore top")[2]  # the second frame has rates

    result = cli("top", "--json", "--iterations", "2", "--interval", "0.3", nodes=pod)
    assert result.returncode == 0, result.stderr
    frames = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(frames) == 2 and all(f["nodes_up"] == 3 for f in frames)
    assert all(v is None for n in frames[0]["nodes"] for v in n["rates"].values())
    assert all(v is not None and v >= 0 for n in frames[1]["nodes"] for v in n["rates"].values())
    assert frames[1]["total"]["rates"]["reads"] is not None
    # No node has a flash tier: no flash columns, and the frames say so.
    assert not any(f["flash"] for f in frames)
    assert "flash" not in cli("top", "--iterations", "1", nodes=pod).stdout


def test_top_shows_the_flash_tier_of_a_restarted_node(tmp_path: Path) -> None:
    # A flash node stopped and started again: RAM is empty, flash holds every block (top used to show 0
    # objects). The flash columns come with any node that has a flash tier.
    args = ("--memory", "16MiB", "--disk", str(tmp_path / "flash"), "--disk-size", "64MiB",
            "--disk-segment-size", "4MiB")
    env = {"CTXSTORE_ADMIN_TOKEN": TOKEN, "CTXSTORE_NODE_ID": "flash-0"}
    node = start_node(tmp_path, *args, env=env)
    try:
        s3 = make_client(node.endpoint)
        s3.create_bucket(Bucket="tiers")
        for i in range(7):
            s3.put_object(Bucket="tiers", Key=f"block-{i}", Body=os.urandom(256 << 10))
        assert node.stop() == 0  # a clean stop writes what only RAM holds to flash
        node = start_node(tmp_path, *args, env=env, port=node.port)
        s3 = make_client(node.endpoint)
        assert len(s3.get_object(Bucket="tiers", Key="block-0")["Body"].read()) == 256 << 10  # a flash hit

        frames = [json.loads(line) for line in cli("top", "--json", "--iterations", "2", "--interval", "0.3",
                                                   nodes=[node]).stdout.splitlines()]
        assert len(frames) == 2 and all(f["flash"] for f in frames)
        stats = frames[1]["nodes"][0]["stats"]
        assert stats["disk_objects"] == 7 and stats["objects"] == 1  # the one read back, promoted
        assert stats["disk_budget"] == 64 * MIB and 7 * (256 << 10) <= stats["disk_used"] <= stats["disk_budget"]
        assert stats["disk_hits"] == 1 and stats["disk_bytes_read"] >= 256 << 10
        assert frames[1]["total"]["disk_objects"] == 7
        rates = frames[1]["nodes"][0]["rates"]
        assert all(rates[k] is not None and rates[k] >= 0 for k in ("flash_hits", "flash_bytes_read", "demotions"))

        table = cli("top", "--iterations", "1", nodes=[node])
        assert table.returncode == 0, table.stderr
        lines = table.stdout.splitlines()
        tiers = next(line for line in lines if "flash" in line and "ctxstore top" not in line)
        header = lines[lines.index(tiers) + 1]  # the tier over the first column of its group, then the columns
        row = next(line for line in lines if line.lstrip().startswith(f"127.0.0.1:{node.port}"))

        def cell(end: int) -> str:  # rich right-aligns numbers under their header
            return row[:end].rsplit("  ", 1)[-1].strip()

        assert tiers.index("RAM") < tiers.index("flash")
        ram_objects, flash_objects = header.index("objects"), header.rindex("objects")
        assert ram_objects < tiers.index("flash") < flash_objects
        assert cell(ram_objects + len("objects")) == "1", table.stdout
        assert cell(flash_objects + len("objects")) == "7", table.stdout
        assert cell(tiers.index("flash") + len("flash")).endswith("/ 64.0 MiB"), table.stdout  # used / size
        for column in ("used / size", "hits/s", "read/s", "demotions/s"):
            assert column in header
        assert "flash" in next(line for line in lines if "ctxstore top" in line)  # both tiers' levels on top
    finally:
        node.stop()


def test_wrong_token_fails_every_node(pod: list[Node]) -> None:
    result = cli("stats", "--json", nodes=pod, token="not-the-token")
    assert result.returncode == admin.EXIT_FAILED
    data = json.loads(result.stdout)
    assert data["nodes_up"] == 0
    assert all(n["status"] == "error" and "401" in n["error"] for n in data["nodes"])
    assert "401" in result.stderr and "wrong admin token" in result.stderr


def test_a_stopped_node_is_shown_and_the_others_still_answer(pod: list[Node]) -> None:
    # Last test of the module: it stops one node of the pod (the fixture's teardown copes).
    victim = pod[2]
    victim.stop()
    stats = cli_json("stats", nodes=pod)  # exit 0: some nodes answered
    assert (stats["nodes_total"], stats["nodes_up"]) == (3, 2)
    dead = by_node(stats, victim)
    assert dead["ok"] is False and dead["status"] == "down" and "refused" in dead["error"]
    assert dead["stats"] is None and all(by_node(stats, n)["ok"] for n in pod[:2])
    assert stats["total"]["budget"] == 2 * 64 * MIB

    table = cli("top", "--iterations", "1", nodes=pod)
    assert table.returncode == 0, table.stderr
    assert "down" in table.stdout and "connection refused" in table.stdout and "2/3" in table.stdout
    assert all(f"127.0.0.1:{n.port}" in table.stdout for n in pod)
    health = cli("health", nodes=pod)
    assert health.returncode == 0 and "2/3 live" in health.stdout
    assert cli("stats", "--strict", nodes=pod).returncode == admin.EXIT_FAILED

    created = cli_json("tenants", "create", "partial", nodes=pod)
    assert created["created_on"] == 2 and by_node(created, victim)["status"] == "down"

    everything_down = cli("stats", nodes=[victim])
    assert everything_down.returncode == admin.EXIT_FAILED
    assert "failed on every node" in everything_down.stderr and "connection refused" in everything_down.stderr
