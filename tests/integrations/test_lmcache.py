"""LMCache's S3 remote backend against an unchanged ctxstore (docs/integrations.md, "LMCache").

LMCache is not a dependency of ctxstore: these tests skip, with the reason, where ``lmcache`` (and the torch
it runs on) is not installed. Each LMCache side runs in its own OS process (tests/integrations/lmcache_helpers/worker.py):

* ``LMCacheEngine`` with ``remote_url: s3://<bucket>.localhost:<port>``: one process stores a real KV tensor
  (two 12 MiB chunks: over awscrt's 8 MiB part size, so multipart uploads); another one, with an empty local
  cache, looks it up and retrieves it, bit-exact, through HEAD and ranged GETs.
* LMCache's multiprocess-mode ``S3L2Adapter``: PUT and multipart, HEAD, ranged GET, ``ListObjectsV2`` by
  model prefix and DELETE.

Addressing is virtual-hosted style, as LMCache requires: ctxstore runs with ``--domain localhost`` and awscrt
resolves ``<bucket>.localhost`` itself; where the resolver does not map ``*.localhost`` to loopback, the
worker gives itself a private /etc/hosts (see the worker's docstring): nothing on the machine changes.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import secrets
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path

import pytest
from support.nodes import ACCESS_KEY, SECRET_KEY, Node, make_client, start_node

if importlib.util.find_spec("lmcache") is None or importlib.util.find_spec("torch") is None:
    pytest.skip("lmcache (and torch) not installed: see docs/integrations.md for the install commands",
                allow_module_level=True)

import torch

WORKER = Path(__file__).resolve().parent / "lmcache_helpers" / "worker.py"
DOMAIN = "localhost"
ADMIN_TOKEN = "lmcache-test-admin-token"
CHUNK, LAYERS, HEADS, HEAD_SIZE = 256, 6, 8, 128  # one chunk: 2*6*256*1024 float32 = 12 MiB
CANNOT_RUN = 77

pytestmark = [pytest.mark.timeout(180), pytest.mark.real_engine]


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("lmcache-node")
    node = start_node(tmp, "--memory", "256MiB", "--default-ttl", "1h",
                      env={"CTXSTORE_DOMAIN": DOMAIN, "CTXSTORE_ADMIN_TOKEN": ADMIN_TOKEN})
    yield node
    node.stop()


def admin(node: Node, method: str, path: str, body: dict | None = None) -> dict:
    req = urllib.request.Request(
        f"{node.endpoint}/_ctx/v1/admin{path}", method=method,
        data=json.dumps(body).encode() if body is not None else None,
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


def s3_requests(node: Node) -> Counter:
    """ctxstore_requests_total by (operation, status), from the node's Prometheus endpoint."""
    req = urllib.request.Request(f"{node.endpoint}/_ctx/metrics",
                                 headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        text = resp.read().decode()
    counts: Counter = Counter()
    series = r'^ctxstore_requests_total\{api="s3",operation="(\w+)",status="(\d+)"\} (\S+)$'
    for m in re.finditer(series, text, re.MULTILINE):
        counts[(m.group(1), int(m.group(2)))] = int(float(m.group(3)))
    return counts


def run_worker(mode: str, config: Path, data: Path, bucket: str, log_dir: Path) -> dict:
    log = log_dir / f"lmcache-{mode}.log"
    with log.open("w") as out:
        proc = subprocess.run(
            [sys.executable, str(WORKER), mode, str(config), str(data), f"127.0.0.1 {bucket}.{DOMAIN}"],
            check=False, stdout=out, stderr=subprocess.STDOUT, timeout=120,
            env={**os.environ, "PYTHONHASHSEED": "0", "LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1"},
        )
    text = log.read_text()
    if proc.returncode == CANNOT_RUN:
        pytest.skip(next(line for line in text.splitlines() if line.startswith("CANNOT RUN")))
    assert proc.returncode == 0, f"LMCache {mode} worker failed (exit {proc.returncode}):\n{text[-6000:]}"
    reports = [line for line in text.splitlines() if line.startswith("REPORT ")]
    assert reports, text[-6000:]
    return json.loads(reports[-1][len("REPORT "):])


def lmcache_engine_config(node: Node, bucket: str) -> str:
    """The LMCache config of docs/integrations.md, with this test's bucket, port and keys."""
    return f"""\
chunk_size: {CHUNK}
local_cpu: true
max_local_cpu_size: 0.1          # GB
remote_url: "s3://{bucket}.{DOMAIN}:{node.port}"
remote_serde: "naive"
extra_config:
  s3_region: "us-east-1"
  disable_tls: true
  s3_prefer_http2: false
  s3_num_io_threads: 4
  aws_access_key_id: "{ACCESS_KEY}"
  aws_secret_access_key: "{SECRET_KEY}"
"""


def test_engine_store_then_lookup_and_retrieve_in_another_process(node: Node, tmp_path: Path) -> None:
    s3 = make_client(node.endpoint)
    bucket = "lmcache-" + secrets.token_hex(4)
    s3.create_bucket(Bucket=bucket)
    # LMCache sends no TTL of its own (no x-ctx-ttl, no metadata): the bucket's policy gives one.
    admin(node, "PUT", f"/buckets/{bucket}/policy", {"default_ttl": 600, "sliding_ttl": True})
    config = tmp_path / "lmcache.yaml"
    config.write_text(lmcache_engine_config(node, bucket))

    gen = torch.Generator().manual_seed(20261130)
    total, stored = 3 * CHUNK, 2 * CHUNK  # the third chunk is never stored: lookup must stop before it
    kv = torch.randn(2, LAYERS, total, HEADS * HEAD_SIZE, generator=gen, dtype=torch.float32)
    tokens = torch.randint(0, 32000, (total,), generator=gen).tolist()
    data = tmp_path / "kv.pt"
    torch.save({"tokens": tokens, "kv": kv, "stored": stored, "heads": HEADS,
                "model": "ctxstore/lmcache-test"}, data)
    before = s3_requests(node)
    t0 = time.time()

    report = run_worker("store", config, data, bucket, tmp_path)
    assert report["remote_hit_tokens"] == stored

    objects = s3.list_objects_v2(Bucket=bucket).get("Contents", [])
    chunk_bytes = 2 * LAYERS * CHUNK * HEADS * HEAD_SIZE * 4
    assert [o["Size"] for o in objects] == [chunk_bytes] * 2
    for obj in objects:
        # LMCache's key, "/" flattened to "_": <model>@<world size>@<worker>@<chunk hash>@<dtype>
        assert re.fullmatch(r"ctxstore_lmcache-test@1@0@-?[0-9a-f]+@float", obj["Key"]), obj["Key"]
        head = s3.head_object(Bucket=bucket, Key=obj["Key"])
        assert head["ETag"].strip('"').endswith("-2")  # a two-part multipart upload (8 MiB parts)
        expires = float(head["ResponseMetadata"]["HTTPHeaders"]["x-ctx-expires-at"])
        assert t0 + 600 - 5 <= expires <= time.time() + 600 + 5

    report = run_worker("retrieve", config, data, bucket, tmp_path)
    assert report["lookup_hit_tokens"] == stored
    assert report["retrieved_tokens"] == stored
    out = torch.load(str(data) + ".out")
    assert torch.equal(out[:, :, :stored], kv[:, :, :stored])  # bit-exact
    assert not out[:, :, stored:].any()

    used = s3_requests(node) - before
    for op in ("CreateMultipartUpload", "CompleteMultipartUpload"):
        assert used[(op, 200)] == 2, used
    assert used[("UploadPart", 200)] == 4, used
    # HEAD: the stored chunks' hits, then the miss on the chunk that was never stored
    assert used[("HeadObject", 200)] >= 2 and used[("HeadObject", 404)] >= 1, used
    assert used[("GetObject", 206)] >= 2, used  # awscrt splits each 12 MiB GET into ranged part GETs
    failures = {k: n for k, n in used.items() if k[1] >= 400 and k != ("HeadObject", 404)}
    assert not failures, failures


def test_l2_adapter_put_get_list_delete(node: Node, tmp_path: Path) -> None:
    s3 = make_client(node.endpoint)
    bucket = "lmcache-l2-" + secrets.token_hex(4)
    s3.create_bucket(Bucket=bucket)
    config = tmp_path / "l2.yaml"
    config.write_text(f"""\
s3_endpoint: "s3://{bucket}.{DOMAIN}:{node.port}"
s3_region: "us-east-1"
disable_tls: true
s3_prefer_http2: false
s3_num_io_threads: 4
aws_access_key_id: "{ACCESS_KEY}"
aws_secret_access_key: "{SECRET_KEY}"
""")
    gen = torch.Generator().manual_seed(7)
    blobs = {"aa" * 16: torch.randint(0, 256, (9 << 20,), generator=gen, dtype=torch.uint8),  # multipart
             "bb" * 16: torch.randint(0, 256, (300_001,), generator=gen, dtype=torch.uint8)}  # single PUT
    data = tmp_path / "l2.pt"
    model = "org/model-x"  # this adapter keeps the "/" in the key
    torch.save({"blobs": blobs, "model": model}, data)
    before = s3_requests(node)

    report = run_worker("l2", config, data, bucket, tmp_path)

    assert report["store_ok"]
    assert report["lookup"] == [True, True]
    assert report["load"] == [True, True]
    assert report["equal"] == [True, True]
    assert report["listed"] == [300_001, 9 << 20]
    assert report["lookup_after_delete"] == [False, True]
    assert report["listed_after_delete"] == [300_001]
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket).get("Contents", [])]
    assert keys == [f"{model}@00000000@0@{'bb' * 16}"]
    used = s3_requests(node) - before
    for op, status in (("PutObject", 200), ("CreateMultipartUpload", 200), ("UploadPart", 200),
                       ("CompleteMultipartUpload", 200), ("GetObject", 206), ("ListObjectsV2", 200),
                       ("DeleteObject", 204), ("HeadObject", 404)):
        assert used[(op, status)] >= 1, (op, status, used)
