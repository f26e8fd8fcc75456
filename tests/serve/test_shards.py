"""What sharding can break, against one ``ctxstore serve --workers 2`` node started once for the module: which
shard a block goes to (rendezvous hashing over the shards' addresses) and that the other shard answers a miss
for it, S3 listing per shard, the per-shard budget, S3 multipart and SigV4 on a shard, the tenants file and the
pod view (``--peers`` naming the node's own range) reaching every shard, and a shard killed, restarted empty by
the parent while the other keeps its blocks.

The parent process itself (the settings each shard gets, ports, generated credentials, the flash tier's
directories) is tested in test_workers.py."""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest
import xxhash
from botocore.config import Config
from botocore.exceptions import ClientError
from support.nodes import (ACCESS_KEY, OTHER_ACCESS_KEY, OTHER_SECRET_KEY, SECRET_KEY, Node, free_port_run,
                           make_client, wait_ready)
from support.probes import ADMIN_TOKEN, Admin, wait_until
from workers_support import shard, shard_pids, start_workers

from ctxstore import ContextStore, Namespace, Timeouts
from ctxstore.admin.aggregate import summarize_stats
from ctxstore.admin.nodes import Pod, parse_nodes
from ctxstore.admin_schema import ADMIN_PREFIX
from ctxstore.buffers import Destinations

N = 2
MiB = 1 << 20
BLOCK = 4 << 10


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    tmp = tmp_path_factory.mktemp("shards")
    tenants = tmp / "tenants.json"
    tenants.write_text(json.dumps([{"tenant": "other", "access_key": OTHER_ACCESS_KEY,
                                    "secret_key": OTHER_SECRET_KEY}]))
    port = free_port_run(N)
    node = start_workers(tmp, N, "--memory", "64MiB", "--default-ttl", "1h", "--node-id", "box",
                         "--peers", f"127.0.0.1:{port}-{port + N - 1}", port=port,
                         env={"CTXSTORE_TENANTS_FILE": str(tenants)})
    yield node
    assert node.stop() == 0
    for i in range(N):  # the shards went with their parent
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", node.port + i), timeout=1).close()


def nodes_of(node: Node) -> str:
    return f"127.0.0.1:{node.port}-{node.port + N - 1}"


def store_of(nodes: str) -> ContextStore:
    return ContextStore(nodes, access_key=ACCESS_KEY, secret_key=SECRET_KEY,
                        timeouts=Timeouts(connect=1, read=5, total=10), probe_interval=0.1)


def owner(node: Node, key: str) -> int:
    """The shard that holds ``key``: the highest XXH3-64 weight of the key seeded by each shard's address, as
    ctxstore.pod places blocks (written out here so that a change of placement fails this suite)."""
    weights = [xxhash.xxh3_64_intdigest(key.encode(), seed=xxhash.xxh3_64_intdigest(f"127.0.0.1:{port}".encode()))
               for port in range(node.port, node.port + N)]
    return weights.index(max(weights))


def saved(store: ContextStore, n: int) -> tuple[Namespace, list[int], list[bytes]]:
    ns = store.namespace("shards-" + secrets.token_hex(4), model="test/shards")
    tokens = [secrets.randbelow(1 << 17) for _ in range(16 * n)]
    blocks = [os.urandom(BLOCK) for _ in range(n)]
    result = ns.save(tokens, blocks)
    assert (result.stored, result.failed) == (n, 0)
    return ns, tokens, blocks


def listed(s3: object, bucket: str) -> set[str]:
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket)  # type: ignore[attr-defined]
    return {o["Key"] for page in pages for o in page.get("Contents", [])}


def error_code(info: pytest.ExceptionInfo[ClientError]) -> str:
    return str(info.value.response["Error"]["Code"])


# ---------------------------------------------------------------------------------------- shards and budgets


def test_each_shard_is_a_node_with_its_share_of_the_budget_and_its_own_id(node: Node) -> None:
    stats = [Admin(shard(node, i)).stats() for i in range(N)]
    assert [s["budget"] for s in stats] == [32 * MiB] * N
    ids = [Admin(shard(node, i)).call("GET", "/info")["node_id"] for i in range(N)]
    assert ids == [f"box/shard-{i}" for i in range(N)]  # each its own node in stats and events
    settings = [Admin(shard(node, i)).call("GET", "/settings")["settings"] for i in range(N)]
    assert [(s["port"], s["workers"], s["default_ttl"]) for s in settings] == [
        (node.port + i, 1, 3600) for i in range(N)]


def test_a_shard_over_its_budget_evicts_its_own_blocks_only(node: Node) -> None:
    s3 = [make_client(shard(node, i).endpoint) for i in range(N)]
    for client in s3:
        client.create_bucket(Bucket="budget")
    s3[0].put_object(Bucket="budget", Key="kept", Body=b"k" * MiB)
    before = [Admin(shard(node, i)).stats() for i in range(N)]
    for k in range(40):  # 40 MiB into shard 1's 32 MiB
        s3[1].put_object(Bucket="budget", Key=f"k{k}", Body=bytes([k]) * MiB)
    after = [Admin(shard(node, i)).stats() for i in range(N)]
    assert after[1]["evictions"] - before[1]["evictions"] >= 8 and after[1]["used"] <= after[1]["budget"]
    assert after[0]["evictions"] == before[0]["evictions"]  # the other shard's budget is its own
    assert s3[0].get_object(Bucket="budget", Key="kept")["Body"].read() == b"k" * MiB
    assert s3[1].get_object(Bucket="budget", Key="k39")["Body"].read() == bytes([39]) * MiB
    with pytest.raises(ClientError) as info:
        s3[1].head_object(Bucket="budget", Key="k0")  # the oldest went
    assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == 404


# ---------------------------------------------------------------------------------------- routing


def test_a_block_lives_on_the_shard_rendezvous_hashing_names_and_the_other_shard_answers_a_miss(node: Node) -> None:
    with store_of(nodes_of(node)) as store:
        ns, tokens, blocks = saved(store, 64)
        keys = ns.block_hashes(tokens)
        places = [owner(node, k) for k in keys]
        assert min(places.count(i) for i in range(N)) > 10  # spread over the shards
        for i in range(N):  # S3 lists what the shard holds, and nothing of the other's: listing is per shard
            here = {k for k, p in zip(keys, places) if p == i}
            assert listed(make_client(shard(node, i).endpoint), ns.bucket) == here
            assert Admin(shard(node, i)).bucket(ns.bucket)["objects"] == places.count(i)
    for i in range(N):  # a client that knows one shard only: the other shard's blocks are misses, not errors
        with store_of(shard(node, i).endpoint) as alone:
            out = [bytearray(BLOCK) for _ in keys]
            views = alone.get_keys(ns.bucket, keys, Destinations(out, len(keys)))
            assert [v is not None for v in views] == [p == i for p in places]
            assert all(bytes(out[j]) == blocks[j] for j, p in enumerate(places) if p == i)
            assert [size == BLOCK for size in alone.lookup_keys(ns.bucket, keys)] == [p == i for p in places]


def test_saves_restores_and_lookups_through_the_shards_keep_the_prefix_rule(node: Node) -> None:
    with store_of(nodes_of(node)) as store:
        ns, tokens, blocks = saved(store, 64)
        assert ns.save(tokens, blocks).existed == 64
        assert ns.lookup(tokens) == 64
        out = bytearray(64 * BLOCK)
        assert ns.restore(tokens, out=out).n_blocks == 64 and out == b"".join(blocks)
        keys = ns.block_hashes(tokens)
        hole = next(j for j in range(20, 64) if owner(node, keys[j]) == 1)  # a block of the second shard
        assert store.keys_op(ns.bucket, "delete", [keys[hole]]) == 1
        assert ns.lookup(tokens) == hole
        result = ns.restore(tokens, out=bytearray(64 * BLOCK))
        assert result.n_blocks == hole
        assert ns.save(tokens, blocks).stored == 1  # only the hole is written again
        assert [bytes(b) for b in ns.restore(tokens).blocks] == blocks
        assert ns.delete(tokens) == 64
        assert [Admin(shard(node, i)).bucket(ns.bucket)["objects"] for i in range(N)] == [0] * N


# ---------------------------------------------------------------------------------------- S3 on a shard


def test_s3_tools_work_against_every_shard(node: Node) -> None:
    for i in range(N):
        s3 = make_client(shard(node, i).endpoint)
        name = f"s3-shard{i}-" + secrets.token_hex(4)
        s3.create_bucket(Bucket=name)
        s3.put_object(Bucket=name, Key="k", Body=b"hello")
        assert s3.get_object(Bucket=name, Key="k")["Body"].read() == b"hello"
        other = make_client(shard(node, 1 - i).endpoint)
        with pytest.raises(ClientError) as info:  # the other shard has never heard of the bucket
            other.head_bucket(Bucket=name)
        assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == 404
        s3.delete_object(Bucket=name, Key="k")
        s3.delete_bucket(Bucket=name)


def test_a_multipart_upload_completes_on_its_shard_and_is_unknown_to_the_other(node: Node) -> None:
    s3 = [make_client(shard(node, i).endpoint) for i in range(N)]
    name = "mp-" + secrets.token_hex(4)
    for client in s3:
        client.create_bucket(Bucket=name)
    upload = s3[1].create_multipart_upload(Bucket=name, Key="big")["UploadId"]
    bodies = [os.urandom(5 * MiB), os.urandom(1000)]
    etags = [s3[1].upload_part(Bucket=name, Key="big", UploadId=upload, PartNumber=n + 1, Body=body)["ETag"]
             for n, body in enumerate(bodies)]
    assert [u["UploadId"] for u in s3[1].list_multipart_uploads(Bucket=name).get("Uploads", [])] == [upload]
    assert s3[0].list_multipart_uploads(Bucket=name).get("Uploads", []) == []
    with pytest.raises(ClientError) as info:
        s3[0].upload_part(Bucket=name, Key="big", UploadId=upload, PartNumber=3, Body=b"x")
    assert error_code(info) == "NoSuchUpload"
    done = s3[1].complete_multipart_upload(Bucket=name, Key="big", UploadId=upload, MultipartUpload={
        "Parts": [{"PartNumber": n + 1, "ETag": etag} for n, etag in enumerate(etags)]})
    assert done["ETag"].endswith('-2"')
    assert s3[1].get_object(Bucket=name, Key="big")["Body"].read() == b"".join(bodies)
    with pytest.raises(ClientError) as info:
        s3[0].get_object(Bucket=name, Key="big")
    assert error_code(info) == "NoSuchKey"


def test_sigv4_and_the_tenants_file_hold_on_every_shard(node: Node) -> None:
    for i in range(N):
        endpoint = shard(node, i).endpoint
        s3 = make_client(endpoint)
        name = f"auth{i}-" + secrets.token_hex(4)
        s3.create_bucket(Bucket=name)
        s3.put_object(Bucket=name, Key="k", Body=b"mine")
        url = s3.generate_presigned_url("get_object", Params={"Bucket": name, "Key": "k"}, ExpiresIn=60)
        with urllib.request.urlopen(url, timeout=10) as answer:  # a presigned URL, signed for this shard
            assert answer.read() == b"mine"
        wrong = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=ACCESS_KEY,
                             aws_secret_access_key="not-the-secret", region_name="us-east-1",
                             config=Config(retries={"max_attempts": 1}))
        with pytest.raises(ClientError) as info:
            wrong.get_object(Bucket=name, Key="k")
        assert error_code(info) == "SignatureDoesNotMatch"
        other = make_client(endpoint, OTHER_ACCESS_KEY, OTHER_SECRET_KEY)  # the tenants file reached this shard
        assert name not in [b["Name"] for b in other.list_buckets()["Buckets"]]
        with pytest.raises(ClientError) as info:
            other.get_object(Bucket=name, Key="k")
        assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] in (403, 404)
        s3.delete_object(Bucket=name, Key="k")
        s3.delete_bucket(Bucket=name)


# ---------------------------------------------------------------------------------------- the admin view


def test_the_pod_view_and_ctxstore_admin_add_up_the_shards(node: Node) -> None:
    with store_of(nodes_of(node)) as store:
        saved(store, 32)
    per_shard = [Admin(shard(node, i)).stats() for i in range(N)]
    doc = Admin(shard(node, 1)).call("GET", "/pod")
    assert doc["nodes_total"] == N and doc["nodes_up"] == N
    assert [n["node_id"] for n in doc["nodes"]] == [f"box/shard-{i}" for i in range(N)]
    assert [n["self"] for n in doc["nodes"]] == [i == 1 for i in range(N)]  # recognised by its node id
    summary = summarize_stats(Pod(parse_nodes(nodes_of(node)), token=ADMIN_TOKEN).each("GET", ADMIN_PREFIX + "/stats"))
    assert summary["nodes_total"] == N and summary["nodes_up"] == N
    for key in ("budget", "objects", "bytes", "puts", "evictions"):  # nothing moves them meanwhile
        assert doc["total"][key] == summary["total"][key] == sum(s[key] for s in per_shard), key
    assert doc["total"]["budget"] == 64 * MiB


# ---------------------------------------------------------------------------------------- a shard that dies (last)


def shard_pid(node: Node, index: int) -> int:
    """The process of shard ``index`` (its environment says which shard it is)."""
    for pid in shard_pids(node):
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if f"CTXSTORE_SHARD={index}/{N}".encode() in environ:
            return pid
    raise AssertionError(f"no process for shard {index}")


def test_a_killed_shard_is_a_miss_then_is_started_again_empty_and_the_other_keeps_its_blocks(node: Node) -> None:
    with store_of(nodes_of(node)) as store:
        ns, tokens, blocks = saved(store, 32)
        keys = ns.block_hashes(tokens)
        first = [owner(node, k) for k in keys].index(1)  # the first block on shard 1
        on_zero = Admin(shard(node, 0)).bucket(ns.bucket)["objects"]
        victim = shard_pid(node, 1)
        os.kill(victim, signal.SIGKILL)
        started = time.monotonic()
        assert ns.restore(tokens, out=bytearray(32 * BLOCK)).n_blocks == first  # a miss from there on
        assert time.monotonic() - started < 5
    assert wait_until(lambda: len(shard_pids(node)) == N and victim not in shard_pids(node), timeout=15)
    wait_ready(shard(node, 1))
    assert node.proc.poll() is None
    assert Admin(shard(node, 1)).stats()["objects"] == 0  # its RAM blocks went with it
    assert Admin(shard(node, 0)).bucket(ns.bucket)["objects"] == on_zero
    with store_of(nodes_of(node)) as store:  # the bucket is made again on the new shard, and blocks land there
        again = store.namespace(ns.bucket, model="test/shards")
        assert again.restore(tokens).n_blocks == first
        assert again.save(tokens, blocks).stored == 32 - on_zero
        assert [bytes(b) for b in again.restore(tokens).blocks] == blocks


def test_a_shard_that_cannot_start_is_tried_less_and_less_often_while_the_other_serves(node: Node) -> None:
    # Its port taken while it was down: each start fails at once. It was tried every second, forever.
    port = node.port + 1
    victim = shard_pid(node, 1)
    taker = socket.socket()
    taker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while True:  # the port is free once the killed shard is gone; the supervisor waits a second
            try:
                taker.bind(("127.0.0.1", port))
                break
            except OSError:
                assert time.monotonic() < deadline, "the killed shard's port never came free"
                time.sleep(0.01)
        taker.listen()
        said = f"shard 1 (port {port}) exited with"
        assert node.log is not None

        def restarts() -> list[tuple[str, float]]:  # (exit status, seconds until the next start)
            lines = node.log.read_text().splitlines()  # type: ignore[union-attr]
            return [(line.split(said, 1)[1].split()[0], float(line.rsplit(" in ", 1)[1].removesuffix(" s")))
                    for line in lines if said in line and "starting it again in" in line]

        before = len(restarts())
        assert wait_until(lambda: len(restarts()) >= before + 2, timeout=20), node.log.read_text()[-3000:]
        (killed, first), (failed, second) = restarts()[before:before + 2]
        assert killed == "-9" and failed == "1"  # the kill, then a start that failed at once
        assert second == 2 * first  # which waits twice as long (1 s after a kill, or 2 s so soon after another)
        assert f"cannot listen on 127.0.0.1:{port}" in node.log.read_text()  # why, in the shard's own words
        s3 = make_client(shard(node, 0).endpoint)  # the other shard serves meanwhile
        s3.create_bucket(Bucket="while-down")
        s3.put_object(Bucket="while-down", Key="k", Body=b"served")
        assert s3.get_object(Bucket="while-down", Key="k")["Body"].read() == b"served"
        assert node.proc.poll() is None
    finally:
        taker.close()
    assert wait_until(lambda: ready(shard(node, 1)), timeout=15)  # back once its port is free


def ready(node: Node) -> bool:
    try:
        with urllib.request.urlopen(f"{node.endpoint}/_ctx/health/ready", timeout=1) as answer:
            return bool(answer.status == 200)
    except OSError:
        return False
