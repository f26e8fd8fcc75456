"""``ctxstore bench`` (ctxstore/bench.py) against a real 3-node pod, run as the installed command: every
operation runs and is counted, it stops at --count or --duration, it cleans up what it wrote (and only that),
--keep keeps it, failures are counted, and it refuses to run without an explicit --namespace."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from botocore.exceptions import ClientError

from ctxstore import AsyncContextStore, SaveResult
from ctxstore.bench import Bench, Config
from support.nodes import ACCESS_KEY, SECRET_KEY, Node, make_client, start_node

COMMAND = str(Path(sys.executable).parent / "ctxstore")  # the console script pyproject.toml installs
KiB = 1024


def bench(nodes: list[Node], *args: str, env: dict[str, str] | None = None,
          timeout: float = 120) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "CTXSTORE_NODES": ",".join(f"127.0.0.1:{n.port}" for n in nodes),
                "CTXSTORE_ACCESS_KEY": ACCESS_KEY, "CTXSTORE_SECRET_KEY": SECRET_KEY, **(env or {})}
    return subprocess.run([COMMAND, "bench", *args], env=full_env, capture_output=True, text=True,
                          timeout=timeout, check=False)


def report_of(out: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert out.stdout.strip(), out.stderr
    report: dict[str, Any] = json.loads(out.stdout)
    return report


def bucket_on(node: Node, bucket: str) -> list[str] | None:
    """The keys of ``bucket`` on one node, or None when it has no such bucket."""
    s3 = make_client(node.endpoint)
    try:
        s3.head_bucket(Bucket=bucket)
    except ClientError:
        return None
    return [o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket)
            for o in page.get("Contents", [])]


SMALL = ("--count", "6", "--blocks", "4", "--block-size", "16KiB", "--object-size", "64KiB", "--concurrency", "3")


def test_every_operation_runs_is_measured_and_cleaned_up(pod: list[Node]) -> None:
    out = bench(pod, "--namespace", "bench-all", *SMALL, "--json")
    assert out.returncode == 0, out.stderr
    report = report_of(out)
    ops = {op["op"]: op for op in report["operations"]}
    assert list(ops) == ["save", "lookup", "restore", "s3-put", "s3-get"]
    for op in ops.values():
        assert op["ops"] == 6 and op["failed"] == 0 and op["stopped_by"] == "count", op
        lat = op["latency_ms"]
        assert 0 < lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["max"], op
        assert op["ops_per_s"] > 0
    assert ops["save"]["bytes"] == ops["restore"]["bytes"] == 6 * 4 * 16 * KiB
    assert ops["s3-put"]["bytes"] == ops["s3-get"]["bytes"] == 6 * 64 * KiB
    assert ops["lookup"]["bytes"] == 0
    for name in ("lookup", "restore"):
        assert ops[name]["blocks_found"] == ops[name]["blocks_asked"] == 24 and ops[name]["found_ratio"] == 1.0
    assert sorted(report["nodes"]) == sorted(f"127.0.0.1:{n.port}" for n in pod)
    cleanup = report["cleanup"]
    assert cleanup["blocks_deleted"] == 24 and cleanup["objects_deleted"] == 6 and cleanup["errors"] == []
    assert sorted(cleanup["bucket_deleted_on"]) == sorted(report["nodes"])
    assert all(bucket_on(n, "bench-all") is None for n in pod)


def test_keep_leaves_what_it_wrote(pod: list[Node]) -> None:
    out = bench(pod, "--namespace", "bench-keep", *SMALL, "--ops", "save,s3-put", "--keep", "--json")
    assert out.returncode == 0, out.stderr
    assert report_of(out)["cleanup"]["kept"] is True
    keys = [k for n in pod for k in bucket_on(n, "bench-keep") or []]
    assert len(keys) == 6 * 4 + 6  # every block and every object, spread over the nodes
    assert sum(k.startswith("ctxstore-bench/") for k in keys) == 6
    for node in pod:
        s3 = make_client(node.endpoint)
        for key in bucket_on(node, "bench-keep") or []:
            s3.delete_object(Bucket="bench-keep", Key=key)
        s3.delete_bucket(Bucket="bench-keep")


def test_a_bucket_that_existed_keeps_what_others_wrote(pod: list[Node]) -> None:
    s3 = make_client(pod[0].endpoint)
    s3.create_bucket(Bucket="bench-shared")
    s3.put_object(Bucket="bench-shared", Key="somebody-elses", Body=b"x")
    try:
        out = bench(pod, "--namespace", "bench-shared", *SMALL, "--json")
        assert out.returncode == 0, out.stderr
        cleanup = report_of(out)["cleanup"]
        # Deleted where the bench created the bucket, left where it was before.
        assert sorted(cleanup["bucket_deleted_on"]) == sorted(f"127.0.0.1:{n.port}" for n in pod[1:])
        assert bucket_on(pod[0], "bench-shared") == ["somebody-elses"]
    finally:
        s3.delete_object(Bucket="bench-shared", Key="somebody-elses")
        s3.delete_bucket(Bucket="bench-shared")


def test_stops_at_the_duration_and_still_cleans_up(pod: list[Node]) -> None:
    out = bench(pod, "--namespace", "bench-time", "--ops", "save", "--count", "1000000", "--duration", "0.5s",
                "--blocks", "1", "--block-size", "1KiB", "--json")
    assert out.returncode == 0, out.stderr
    report = report_of(out)
    save = report["operations"][0]
    assert save["stopped_by"] == "duration" and 0 < save["ops"] < 1_000_000
    assert report["cleanup"]["blocks_deleted"] == save["ops"]  # all stored (room enough), all deleted
    assert all(bucket_on(n, "bench-time") is None for n in pod)


def test_the_table_and_the_progress(pod: list[Node]) -> None:
    out = bench(pod, "--namespace", "bench-table", *SMALL, env={"COLUMNS": "160"})
    assert out.returncode == 0, out.stderr
    for column in ("op", "requests", "req/s", "MB/s", "p50 ms", "p90 ms", "p99 ms", "max ms", "found"):
        assert column in out.stdout
    for op in ("save", "lookup", "restore", "s3-put", "s3-get"):
        assert f"\n {op} " in out.stdout, out.stdout
    assert "100.0%" in out.stdout
    assert "cleaned up: deleted 24 blocks" in out.stdout
    assert "ctxstore bench → 3 nodes, namespace bench-table" in out.stderr  # the progress goes to stderr
    assert "{" not in out.stdout


def test_failures_are_counted_not_hidden(tmp_path: Path) -> None:
    nodes = [start_node(tmp_path) for _ in range(2)]
    try:
        nodes[1].stop()
        out = bench(nodes, "--namespace", "bench-down", "--ops", "save,restore", "--count", "8", "--blocks", "4",
                    "--block-size", "4KiB", "--json")
        assert out.returncode == 1, out.stderr
        save, restore = report_of(out)["operations"]
        assert save["failed"] > 0 and "not stored" in next(iter(save["errors"]))
        assert restore["failed"] == 0 and restore["found_ratio"] < 1  # a worker's view: misses, no errors
    finally:
        for node in nodes:
            node.stop()


@pytest.mark.parametrize("args, message", [
    ((), "--namespace"),
    (("--namespace", "bench-usage", "--ops", "restore"), "restore reads what save wrote"),
    (("--namespace", "bench-usage", "--ops", "save,fly"), "--ops: fly"),
    (("--namespace", "bench-usage", "--count", "0"), "--count must be positive"),
    (("--namespace", "bench-usage", "--block-size", "lots"), "lots"),
])
def test_usage_errors(pod: list[Node], args: tuple[str, ...], message: str) -> None:
    out = bench(pod, *args)
    assert out.returncode == 2 and message in out.stderr, out.stderr
    assert all(bucket_on(n, "bench-usage") is None for n in pod)


def test_no_nodes_or_no_credentials_is_a_usage_error() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CTXSTORE_")}
    out = subprocess.run([COMMAND, "bench", "--namespace", "bench-usage"], env=env, capture_output=True, text=True,
                         timeout=60, check=False)
    assert out.returncode == 2 and "CTXSTORE_NODES" in out.stderr
    out = subprocess.run([COMMAND, "bench", "--namespace", "bench-usage", "--nodes", "127.0.0.1:1"], env=env,
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 2 and "CTXSTORE_ACCESS_KEY" in out.stderr


def test_without_rich_it_says_what_to_install_and_json_still_works(pod: list[Node]) -> None:
    code = ("import sys; sys.modules['rich'] = None\n"  # as if rich were not installed
            "from ctxstore.cli import main; sys.exit(main(sys.argv[1:]))\n")
    env = {**os.environ, "CTXSTORE_NODES": ",".join(f"127.0.0.1:{n.port}" for n in pod),
           "CTXSTORE_ACCESS_KEY": ACCESS_KEY, "CTXSTORE_SECRET_KEY": SECRET_KEY}
    run = [sys.executable, "-c", code, "bench", "--namespace", "bench-norich", "--ops", "save", "--count", "2",
           "--blocks", "1", "--block-size", "1KiB"]
    out = subprocess.run(run, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 2 and "pip install rich (the cli extra)" in out.stderr
    out = subprocess.run([*run, "--json"], env=env, capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    assert report_of(out)["operations"][0]["ops"] == 2


def test_ctrl_c_stops_it_and_it_still_cleans_up(pod: list[Node]) -> None:
    # PYTHONFAULTHANDLER: should it ever hang after Ctrl-C, SIGABRT makes it print where each thread is.
    env = {**os.environ, "CTXSTORE_NODES": ",".join(f"127.0.0.1:{n.port}" for n in pod),
           "CTXSTORE_ACCESS_KEY": ACCESS_KEY, "CTXSTORE_SECRET_KEY": SECRET_KEY, "PYTHONFAULTHANDLER": "1"}
    proc = subprocess.Popen([COMMAND, "bench", "--namespace", "bench-int", "--ops", "save", "--count", "1000000",
                             "--duration", "60s", "--blocks", "2", "--block-size", "4KiB", "--json"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            # As a terminal's Ctrl-C finds it: a suite run in the background of a shell inherits
                            # SIGINT ignored, and Python then leaves it ignored.
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 30
        while not any(bucket_on(n, "bench-int") for n in pod):  # wait until it writes
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.stderr else ""
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        try:
            stdout, stderr = proc.communicate(timeout=45)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)
            _, stderr = proc.communicate(timeout=15)
            pytest.fail(f"ctxstore bench still running 45 s after Ctrl-C:\n{stderr[-6000:]}")
    finally:
        proc.kill()
        proc.communicate()
    assert proc.returncode == 130, stderr
    report = json.loads(stdout)
    assert report["interrupted"] and report["operations"][0]["stopped_by"] == "interrupted"
    assert report["cleanup"]["blocks_deleted"] > 0
    assert all(bucket_on(n, "bench-int") is None for n in pod)


def test_a_save_that_lands_after_its_keys_were_deleted_is_cleaned_up_too(pod: list[Node]) -> None:
    # After a Ctrl-C a save already sent can still land once the cleanup deleted its keys: the bucket is then
    # not empty. Here that save lands right after the cleanup's first delete (as a cut-short request does).
    nodes = ",".join(f"127.0.0.1:{n.port}" for n in pod)
    landed: list[SaveResult] = []

    async def scenario() -> dict[str, Any]:
        store = AsyncContextStore(nodes, access_key=ACCESS_KEY, secret_key=SECRET_KEY)
        bench = Bench(Config(nodes=nodes, namespace="bench-late", ops=("save",), count=4, blocks=8,
                             block_size=4 * KiB, concurrency=2), store)
        delete_keys = store.keys_op

        async def keys_op(bucket: str, op: str, keys: Sequence[str], **kwargs: Any) -> int:
            n = await delete_keys(bucket, op, keys, **kwargs)
            if op == "delete" and not landed:
                assert bench.ns is not None
                landed.append(await bench.ns.save(bench.tokens(bench.saved - 1), bench.blocks))
            return n

        store.keys_op = keys_op  # type: ignore[method-assign]
        try:
            return await bench.run()
        finally:
            await store.aclose()

    report = asyncio.run(scenario())
    assert landed and landed[0].stored == 8
    cleanup = report["cleanup"]
    assert cleanup["errors"] == [] and cleanup["blocks_deleted"] == 4 * 8 + 8
    assert sorted(cleanup["bucket_deleted_on"]) == sorted(report["nodes"])
    assert all(bucket_on(n, "bench-late") is None for n in pod)
