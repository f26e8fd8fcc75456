"""The zero-code route for vLLM's offloading tiers: vLLM's in-tree ``obj`` secondary tier (NIXL's OBJ plugin,
aws-sdk-cpp) against a ctxstore node, one S3 call shape at a time.

NIXL is not installable here (it needs its native plugin build), so the tier itself does not run: each call it
makes is sent by boto3 in the same shape, as read from the sources (vLLM 0.32 ``kv_offload/tiering/obj``,
NIXL ``src/plugins/obj/s3/client.cpp``):

* the connectivity probe at start-up and every lookup: ``HeadObject`` (a missing object must be 404 without a
  body; NIXL takes NoSuchKey or a bare 404 as "absent", anything else as an error);
* a store: ``PutObject`` of the whole chunk (offset 0), SigV4 with the payload signed on http and unsigned on
  https, and aws-sdk-cpp's default CRC32 integrity checksum;
* a load: ``GetObject`` with ``Range: bytes=0-<chunk bytes - 1>`` into the primary tier's row.

Keys are vLLM's ``FileMapper`` names, ``<prefix>/<model>_<digest>_r0/<hhh>/<hh>_g<group>/<hash>.bin``; path-style
addressing (NIXL's default, ``use_virtual_addressing`` false). The tier creates no bucket and neither expires nor
evicts what it wrote, so the node needs the bucket made beforehand, with a default TTL, under a tenant with a
quota: the test sets them up as docs/integrations.md says and checks both hold.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Iterator

import pytest
from support.nodes import Node, make_client
from support.probes import Admin, start_probed_node

CHUNK = 256 << 10
QUOTA = 8 * CHUNK + (64 << 10)  # room for 8 chunks and their keys and overhead
TTL = 600


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    n = start_probed_node(tmp_path_factory.mktemp("obj-tier"), "--memory", "64MiB", "--default-ttl", "1h")
    try:
        yield n
    finally:
        n.stop()


def file_name(block_hash: bytes, group: int = 0) -> str:
    """vLLM 0.32 ``FileMapper.get_file_name`` (prefix "kv", parallel-agnostic: rank 0)."""
    h = block_hash.hex()
    return f"kv/Qwen_Qwen3-0.6B_0123456789ab_r0/{h[:3]}/{h[3:5]}_g{group}/{h}.bin"


def test_every_s3_call_of_vllms_obj_tier_is_answered(node: Node) -> None:
    admin = Admin(node)
    access, secret = admin.create_tenant("vllm-obj", quota=QUOTA)
    # Path-style SigV4 as aws-sdk-cpp sends it; payload signed on http (RequestDependent).
    plain = make_client(node.endpoint, access, secret, s3={"addressing_style": "path"},
                        request_checksum_calculation="when_required")
    crc = make_client(node.endpoint, access, secret, s3={"addressing_style": "path"},
                      request_checksum_calculation="when_supported")
    seen: list[dict[str, str]] = []
    crc.meta.events.register("before-send.s3.PutObject", lambda request, **kw: seen.append(dict(request.headers)))
    plain.create_bucket(Bucket="vllm-obj")
    admin.call("PUT", "/buckets/vllm-obj/policy", {"default_ttl": TTL})

    # Start-up probe: absent, answered 404 with no body (HeadObject).
    with pytest.raises(plain.exceptions.ClientError) as probe:
        plain.head_object(Bucket="vllm-obj", Key="__nixl_probe__/connectivity_test")
    assert probe.value.response["ResponseMetadata"]["HTTPStatusCode"] == 404

    chunks = {file_name(hashlib.sha256(bytes([i])).digest()): os.urandom(CHUNK) for i in range(12)}
    names = list(chunks)
    for i, name in enumerate(names[:4]):  # stores, both checksum modes
        client = plain if i % 2 else crc
        assert client.put_object(Bucket="vllm-obj", Key=name, Body=chunks[name])["ResponseMetadata"][
            "HTTPStatusCode"] == 200
    assert any("x-amz-checksum-crc32" in {k.lower() for k in h} or
               "crc32" in h.get("x-amz-trailer", "").lower() for h in seen), seen

    # Lookups and loads: HeadObject, then a ranged GetObject of the whole chunk, byte for byte.
    for name in names[:4]:
        head = plain.head_object(Bucket="vllm-obj", Key=name)
        assert head["ContentLength"] == CHUNK
        expires = float(head["ResponseMetadata"]["HTTPHeaders"]["x-ctx-expires-at"])
        assert abs(expires - (time.time() + TTL)) < 30  # the bucket's default TTL, not the node's hour
        got = plain.get_object(Bucket="vllm-obj", Key=name, Range=f"bytes=0-{CHUNK - 1}")
        assert got["ResponseMetadata"]["HTTPStatusCode"] == 206
        assert got["Body"].read() == chunks[name]
    with pytest.raises(plain.exceptions.ClientError) as miss:
        plain.head_object(Bucket="vllm-obj", Key=names[-1])
    assert miss.value.response["ResponseMetadata"]["HTTPStatusCode"] == 404

    # The tenant's quota evicts its least recently used chunks: the tier keeps storing and never sees an error.
    for name in names[4:]:
        plain.put_object(Bucket="vllm-obj", Key=name, Body=chunks[name])
    held = [n for n in names if _present(plain, n)]
    assert names[-1] in held and len(held) <= 8 and names[0] not in held
    assert admin.bucket("vllm-obj")["bytes"] <= QUOTA


def _present(client: object, key: str) -> bool:
    try:
        client.head_object(Bucket="vllm-obj", Key=key)  # type: ignore[attr-defined]
        return True
    except client.exceptions.ClientError:  # type: ignore[attr-defined]
        return False
