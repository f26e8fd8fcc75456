"""LMCache on ctxstore's bulk API (``ctxstore.integrations.lmcache``), against a real 3-node pod.

LMCache 0.5.6 loads the backend as a remote-storage plugin, unpatched. One LMCache process stores a real KV
tensor (two full chunks of a three-chunk prompt); another one, with an empty local cache, looks the prompt up
(one bulk lookup per node, pinning the match) and retrieves it bit-exact (one bulk get per node, straight into
LMCache's memory objects). Skipped, with the reason, where LMCache is not installed (scripts/test installs it).
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
from support.nodes import ACCESS_KEY, SECRET_KEY, Node, make_client

if importlib.util.find_spec("lmcache") is None or importlib.util.find_spec("torch") is None:
    pytest.skip("lmcache (and torch) not installed: scripts/test installs them", allow_module_level=True)

import torch

WORKER = Path(__file__).resolve().parent / "lmcache_bulk_worker.py"
CHUNK, LAYERS, HEADS, HEAD_SIZE = 256, 4, 4, 64  # one chunk: 2*4*256*256 float32 = 2 MiB
CANNOT_RUN = 77

pytestmark = [pytest.mark.timeout(180), pytest.mark.real_engine]


def bulk_config(nodes: list[Node], bucket: str) -> str:
    """The LMCache config of docs/integrations.md ("LMCache on the bulk API") with this test's pod."""
    return f"""\
chunk_size: {CHUNK}
local_cpu: true
max_local_cpu_size: 0.1
remote_serde: "naive"
remote_storage_plugins: ["ctxstore"]
extra_config:
  remote_storage_plugin.ctxstore.module_path: "ctxstore.integrations.lmcache"
  remote_storage_plugin.ctxstore.class_name: "CtxStoreConnectorAdapter"
  ctxstore.nodes: "{','.join(n.endpoint for n in nodes)}"
  ctxstore.bucket: "{bucket}"
  ctxstore.ttl: 600
"""


def listing(node: Node, bucket: str) -> list[dict]:
    s3 = make_client(node.endpoint)
    try:
        return s3.list_objects_v2(Bucket=bucket).get("Contents", [])
    finally:
        s3.close()


def run_worker(mode: str, config: Path, data: Path, log_dir: Path) -> dict:
    log = log_dir / f"lmcache-bulk-{mode}.log"
    with log.open("w") as out:
        proc = subprocess.run([sys.executable, str(WORKER), mode, str(config), str(data)], check=False,
                              stdout=out, stderr=subprocess.STDOUT, timeout=120,
                              env={**os.environ, "PYTHONHASHSEED": "0", "LMCACHE_TRACK_USAGE": "false",
                                   "DO_NOT_TRACK": "1", "CTXSTORE_ACCESS_KEY": ACCESS_KEY,
                                   "CTXSTORE_SECRET_KEY": SECRET_KEY})
    text = log.read_text()
    if proc.returncode == CANNOT_RUN:
        pytest.skip(next(line for line in text.splitlines() if line.startswith("CANNOT RUN")))
    assert proc.returncode == 0, f"LMCache {mode} worker failed (exit {proc.returncode}):\n{text[-6000:]}"
    reports = [line for line in text.splitlines() if line.startswith("REPORT ")]
    assert reports, text[-6000:]
    return json.loads(reports[-1][len("REPORT "):])


def test_bulk_backend_store_then_lookup_and_retrieve_in_another_process(pod: list[Node], tmp_path: Path) -> None:
    bucket = "lmcache-bulk-" + secrets.token_hex(4)
    config = tmp_path / "lmcache-bulk.yaml"
    config.write_text(bulk_config(pod, bucket))
    gen = torch.Generator().manual_seed(20261201)
    total, stored = 3 * CHUNK, 2 * CHUNK  # the third chunk is never stored: the lookup must stop before it
    kv = torch.randn(2, LAYERS, total, HEADS * HEAD_SIZE, generator=gen, dtype=torch.float32)
    tokens = torch.randint(0, 32000, (total,), generator=gen).tolist()
    data = tmp_path / "kv.pt"
    torch.save({"tokens": tokens, "kv": kv, "stored": stored, "heads": HEADS, "model": "ctxstore/lmcache-bulk",
                "backend": "RemoteBackend-ctxstore"}, data)

    report = run_worker("store", config, data, tmp_path)
    assert report["remote_hit_tokens"] == stored

    chunk_bytes = 2 * LAYERS * CHUNK * HEADS * HEAD_SIZE * 4
    per_node = [listing(node, bucket) for node in pod]
    listed = [o for objects in per_node for o in objects]
    assert sorted(o["Size"] for o in listed) == [chunk_bytes] * 2  # one object per chunk, over the pod
    for obj in listed:  # LMCache's own key string, kept whole ("/" and "@" included)
        assert obj["Key"].startswith("ctxstore/lmcache-bulk@1@0@") and obj["Key"].endswith("@float"), obj["Key"]

    report = run_worker("retrieve", config, data, tmp_path)
    assert report["lookup_hit_tokens"] == stored
    assert report["retrieved_tokens"] == stored
    out = torch.load(str(data) + ".out")
    assert torch.equal(out[:, :, :stored], kv[:, :, :stored])  # bit-exact
    assert not out[:, :, stored:].any()

    # A node gone: its chunks are misses, the prefix before them still comes back (never an error).
    first_owner = next(node for node, objects in zip(pod, per_node) if objects)
    first_owner.proc.kill()
    first_owner.proc.wait()
    report = run_worker("retrieve", config, data, tmp_path)
    assert report["lookup_hit_tokens"] in (0, CHUNK)
    assert report["retrieved_tokens"] == report["lookup_hit_tokens"]
    out = torch.load(str(data) + ".out")
    n = report["retrieved_tokens"]
    assert torch.equal(out[:, :, :n], kv[:, :, :n]) and not out[:, :, n:].any()
