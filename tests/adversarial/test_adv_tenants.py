"""Tenant isolation under attack: another tenant's blocks are never readable, writable, pinnable, touchable
or deletable, by any S3 operation, the bulk API, presigned URLs or the operator endpoints; and under quotas,
capacity is isolated too: nothing one tenant sends (objects, parts, uploads that never send their body, bulk
puts that fail their checksums) evicts another tenant's blocks beyond what its own quota allows.

Issue #4: an upload's reservation evicted other tenants' blocks before a byte arrived, and quotas were not
applied at that point (a 1 MiB-quota tenant sending only the headers of a near-budget PUT took another
tenant's objects from 41 to 7; a bulk put of 40 blocks that all failed their checksum evicted 27 of another
tenant's 50; without quotas one header-only request emptied a node).
"""

from __future__ import annotations

import os
import re
import secrets
import select
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import xxhash
from support.nodes import Node
from support.probes import Admin, MiB, alive, http_request, start_probed_node, wait_until
from support.raw import UNSIGNED, RawClient, bulk_frame, presign_v2, presign_v4, sign

BUDGET = 48 * MiB
BLOCK = 1 * MiB


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    started = start_probed_node(tmp_path_factory.mktemp("adv-tenants"), "--memory", "48MiB",
                                "--body-timeout", "5", "--min-part-size", "1KiB")
    yield started
    assert alive(started)
    started.stop()


@pytest.fixture(scope="module")
def admin(node: Node) -> Admin:
    return Admin(node)


@dataclass
class Tenant:
    name: str
    raw: RawClient
    buckets: list[str] = field(default_factory=list)

    def bucket(self, label: str) -> str:
        name = f"{label}-{secrets.token_hex(4)}"
        assert self.raw.s3("PUT", f"/{name}").status == 200
        self.buckets.append(name)
        return name

    def abort_uploads(self) -> None:
        """Multipart uploads hold budget for an hour: a failed test must not leave them to the next one."""
        for bucket in self.buckets:
            listing = self.raw.s3("GET", f"/{bucket}?uploads").body
            for chunk in listing.split(b"<Upload>")[1:]:
                key = chunk.split(b"<Key>")[1].split(b"</Key>")[0].decode()
                upload = chunk.split(b"<UploadId>")[1].split(b"</UploadId>")[0].decode()
                self.raw.s3("DELETE", f"/{bucket}/{key}?uploadId={upload}")


@pytest.fixture
def tenants(node: Node, admin: Admin) -> Iterator[tuple[Tenant, Tenant]]:
    """Tenants A (no quota) and B, fresh for each test, and an empty node when the test starts."""
    made = []
    for label in ("a", "b"):
        name = f"adv-{label}-{secrets.token_hex(3)}"
        access, secret = admin.create_tenant(name)
        made.append(Tenant(name, RawClient(node.port, access=access, secret=secret)))
    yield made[0], made[1]
    for tenant in made:
        tenant.abort_uploads()
        tenant.raw.close()
    for bucket in admin.stats()["buckets"]:
        admin.call("POST", "/flush", {"bucket": bucket})
    assert wait_until(lambda: admin.stats()["reserved"] == 0, timeout=10)
    assert admin.stats()["uploads"] == 0


def fill(tenant: Tenant, bucket: str, n: int) -> dict[str, bytes]:
    blocks = {f"k{i:03d}": os.urandom(BLOCK) for i in range(n)}
    for key, data in blocks.items():
        assert tenant.raw.s3("PUT", f"/{bucket}/{key}", data, payload_hash=UNSIGNED).status == 200
    return blocks


def objects(admin: Admin, bucket: str) -> int:
    return int(admin.bucket(bucket)["objects"])


def set_quota(admin: Admin, tenant: Tenant, quota: int) -> None:
    key = next(t["access_key"] for t in admin.call("GET", "/tenants") if t["tenant"] == tenant.name)
    admin.call("PATCH", f"/tenants/{key}", {"quota": quota})


def header_only_put(tenant: Tenant, target: str, length: int) -> socket.socket:
    """Send the headers of a PUT announcing ``length`` bytes, and no body."""
    headers = sign(tenant.raw.endpoint, "PUT", target, payload_hash=UNSIGNED,
                   headers={"Content-Length": str(length)}, access=tenant.raw.access,
                   secret=tenant.raw.secret).headers
    sock = socket.create_connection(("127.0.0.1", tenant.raw.port), timeout=10)
    sock.sendall(tenant.raw.head_bytes("PUT", target, headers))
    return sock


def early_answer(sock: socket.socket, within: float) -> bytes:
    """What the node answered (without the body having been sent) within ``within`` seconds."""
    ready, _, _ = select.select([sock], [], [], within)
    if not ready:
        return b""
    answer = b""
    try:
        # The whole answer: the status line may come before the error body does.
        while ready:
            piece = sock.recv(65536)
            if not piece:
                break
            answer += piece
            head, sep, body = answer.partition(b"\r\n\r\n")
            length = re.search(rb"(?im)^content-length:\s*(\d+)", head)
            if sep and length and len(body) >= int(length.group(1)):
                break
            ready, _, _ = select.select([sock], [], [], within)
    except OSError:
        pass
    return answer


# ---------------------------------------------------------------------------- #4: capacity isolation


def test_header_only_put_over_the_tenant_quota_is_refused_and_evicts_nothing(admin: Admin,
                                                                            tenants: tuple[Tenant, Tenant]) -> None:
    a, b = tenants
    a1 = a.bucket("a1")
    fill(a, a1, 40)
    set_quota(admin, b, 1 * MiB)
    b1 = b.bucket("b1")
    sock = header_only_put(b, f"/{b1}/huge", BUDGET - 8 * MiB)
    try:
        answer = early_answer(sock, 1.5)
        assert objects(admin, a1) == 40, "another tenant's blocks were evicted for a reservation"
        # It can never commit (over B's quota): refused at once, before a byte of the body.
        assert answer.startswith(b"HTTP/1.1 400") and b"<Code>EntityTooLarge</Code>" in answer, answer[:300]
    finally:
        sock.close()


def test_failed_bulk_put_evicts_no_more_than_the_tenants_quota(admin: Admin,
                                                               tenants: tuple[Tenant, Tenant]) -> None:
    a, b = tenants
    a1 = a.bucket("a1")
    fill(a, a1, 40)
    set_quota(admin, b, 2 * MiB)
    b1 = b.bucket("b1")
    blocks = [os.urandom(BLOCK) for _ in range(40)]
    head = {"v": 1, "keys": [f"x{i}" for i in range(40)], "sizes": [BLOCK] * 40,
            "xxh3": [(xxhash.xxh3_64_intdigest(x) + 1) % (1 << 64) for x in blocks], "ttl": None, "if_absent": True}
    reply = b.raw.bulk(b1, "put", bulk_frame(head, b"".join(blocks)))
    # B may use 2 MiB: at most 3 of A's 1 MiB blocks may go to make room for it, not 27.
    assert objects(admin, a1) >= 37, f"A kept {objects(admin, a1)} of 40 blocks"
    assert reply.status in (200, 400, 413, 503)
    if reply.status == 200:
        assert set(reply.frame["results"]) == {"rejected"}
    assert objects(admin, b1) == 0


def test_header_only_put_without_quotas_does_not_empty_the_node(admin: Admin, tenants: tuple[Tenant, Tenant]) -> None:
    """Without quotas one header-only request with a near-budget Content-Length emptied the node. Before any
    body byte arrives, requests that sent nothing may evict at most a quarter of the budget."""
    a, b = tenants
    a1 = a.bucket("a1")
    fill(a, a1, 40)
    b1 = b.bucket("b1")
    socks = [header_only_put(b, f"/{b1}/h{i}", 13 * MiB) for i in range(3)]
    try:
        for sock in socks:
            early_answer(sock, 0.5)
        assert objects(admin, a1) >= 30, f"A kept {objects(admin, a1)} of 40 blocks"
    finally:
        for sock in socks:
            sock.close()
    assert wait_until(lambda: admin.stats()["reserved"] == 0, timeout=10)


def test_multipart_parts_count_against_the_tenant_quota(admin: Admin, tenants: tuple[Tenant, Tenant]) -> None:
    """Parts are held outside the objects' accounting: a tenant with a 4 MiB quota uploading 30 MiB of parts
    must be stopped at its quota, never make the node evict another tenant's blocks."""
    a, b = tenants
    a1 = a.bucket("a1")
    fill(a, a1, 30)
    set_quota(admin, b, 4 * MiB)
    b1 = b.bucket("b1")
    reply = b.raw.s3("POST", f"/{b1}/big?uploads")
    upload = reply.body.split(b"<UploadId>")[1].split(b"</UploadId>")[0].decode()
    statuses = [b.raw.s3("PUT", f"/{b1}/big?partNumber={n}&uploadId={upload}", os.urandom(BLOCK),
                         payload_hash=UNSIGNED).status for n in range(1, 31)]
    assert objects(admin, a1) == 30, f"A kept {objects(admin, a1)} of 30 blocks"
    assert statuses.count(200) <= 5, f"B stored {statuses.count(200)} MiB of parts under a 4 MiB quota"


def test_writes_within_quotas_never_evict_another_tenant(admin: Admin, tenants: tuple[Tenant, Tenant]) -> None:
    """Both tenants under quotas that fit the budget: B writing 3x its quota (S3 and bulk) evicts only its own."""
    a, b = tenants
    set_quota(admin, a, 20 * MiB)
    set_quota(admin, b, 20 * MiB)
    a1 = a.bucket("a1")
    kept = fill(a, a1, 16)
    b1 = b.bucket("b1")
    fill(b, b1, 30)
    blocks = [os.urandom(BLOCK) for _ in range(30)]
    for start in range(0, 30, 10):
        batch = blocks[start:start + 10]
        head = {"v": 1, "keys": [f"y{i}" for i in range(start, start + 10)], "sizes": [BLOCK] * 10,
                "xxh3": [xxhash.xxh3_64_intdigest(x) for x in batch], "ttl": None, "if_absent": True}
        assert b.raw.bulk(b1, "put", bulk_frame(head, b"".join(batch))).status == 200
    assert objects(admin, a1) == 16
    for key, data in kept.items():
        assert a.raw.s3("GET", f"/{a1}/{key}").body == data


# ---------------------------------------------------------------------------- data isolation


def test_another_tenant_can_neither_read_nor_change_a_tenants_blocks(node: Node, admin: Admin,
                                                                     tenants: tuple[Tenant, Tenant]) -> None:
    a, b = tenants
    a1 = a.bucket("a1")
    secret = os.urandom(4096)
    assert a.raw.s3("PUT", f"/{a1}/k", secret, payload_hash=UNSIGNED).status == 200
    before = a.raw.s3("HEAD", f"/{a1}/k").headers
    upload = a.raw.s3("POST", f"/{a1}/mp?uploads").body.split(b"<UploadId>")[1].split(b"</UploadId>")[0].decode()
    b1 = b.bucket("b1")
    part = "<CompleteMultipartUpload><Part><PartNumber>1</PartNumber><ETag>x</ETag></Part></CompleteMultipartUpload>"
    delete = "<Delete><Object><Key>k</Key></Object></Delete>"
    attempts: list[tuple[str, str, bytes, dict[str, str]]] = [
        ("GET", f"/{a1}/k", b"", {}),
        ("HEAD", f"/{a1}/k", b"", {}),
        ("GET", f"/{a1}/k?response-content-type=text/plain", b"", {}),
        ("PUT", f"/{a1}/k", b"overwritten", {}),
        ("PUT", f"/{a1}/new", b"planted", {}),
        ("DELETE", f"/{a1}/k", b"", {}),
        ("POST", f"/{a1}?delete", delete.encode(), {}),
        ("GET", f"/{a1}", b"", {}),
        ("GET", f"/{a1}?list-type=2", b"", {}),
        ("GET", f"/{a1}?versions", b"", {}),
        ("GET", f"/{a1}?uploads", b"", {}),
        ("GET", f"/{a1}?location", b"", {}),
        ("HEAD", f"/{a1}", b"", {}),
        ("DELETE", f"/{a1}", b"", {}),
        ("PUT", f"/{a1}", b"", {}),
        ("POST", f"/{a1}/k2?uploads", b"", {}),
        ("PUT", f"/{a1}/mp?partNumber=1&uploadId={upload}", b"part", {}),
        ("GET", f"/{a1}/mp?uploadId={upload}", b"", {}),
        ("POST", f"/{a1}/mp?uploadId={upload}", part.encode(), {}),
        ("DELETE", f"/{a1}/mp?uploadId={upload}", b"", {}),
        ("PUT", f"/{b1}/mp?partNumber=1&uploadId={upload}", b"part", {}),
        ("POST", f"/{b1}/mp?uploadId={upload}", part.encode(), {}),
        ("PUT", f"/{b1}/copy", b"", {"x-amz-copy-source": f"/{a1}/k"}),
        ("PUT", f"/{a1}/copy", b"", {"x-amz-copy-source": f"/{b1}/nothing"}),
    ]
    for op in ("lookup", "get", "touch", "pin", "unpin", "delete"):
        head = {"v": 1, "keys": ["k"], "pin": 600.0, "ttl": 86400.0, "seconds": 600.0}
        attempts.append(("POST", f"/_ctx/v1/bulk/{a1}/{op}", bulk_frame(head), {}))
    put_head = {"v": 1, "keys": ["k"], "sizes": [3], "xxh3": [xxhash.xxh3_64_intdigest(b"bad")], "ttl": None,
                "if_absent": False}
    attempts.append(("POST", f"/_ctx/v1/bulk/{a1}/put", bulk_frame(put_head, b"bad"), {}))
    for method, target, body, extra in attempts:
        reply = b.raw.s3(method, target, body, headers=extra, payload_hash=UNSIGNED)
        assert reply.status in (403, 404, 409), (method, target, reply.status, reply.body[:200])
        assert secret not in reply.body and secret[:64] not in reply.body
    # Presigned by B, for A's block.
    for target in (presign_v4(b.raw.endpoint, "GET", f"/{a1}/k", access=b.raw.access, secret=b.raw.secret),
                   presign_v2(b.raw.endpoint, "GET", f"/{a1}/k", expires_at=2_000_000_000, access=b.raw.access,
                              secret=b.raw.secret)):
        reply = b.raw.exchange("GET", target, {})
        assert reply.status == 403 and secret not in reply.body
    # S3 keys open neither the admin API, nor the events stream, nor /metrics.
    for path in ("/_ctx/v1/admin/stats", "/_ctx/v1/events/snapshot", "/_ctx/metrics"):
        headers = sign(b.raw.endpoint, "GET", path, access=b.raw.access, secret=b.raw.secret).headers
        status, body = http_request(node.port, "GET", path, headers=headers)
        assert status in (401, 403), (path, status)
        assert a1.encode() not in body
    # A's block is exactly as it was: same bytes, same expiry, not pinned, nothing planted next to it.
    after = a.raw.s3("HEAD", f"/{a1}/k").headers
    assert a.raw.s3("GET", f"/{a1}/k").body == secret
    assert after["x-ctx-expires-at"] == before["x-ctx-expires-at"] and after["etag"] == before["etag"]
    assert admin.bucket(a1)["pinned_bytes"] == 0
    assert objects(admin, a1) == 1
    assert a.raw.s3("GET", f"/{a1}/mp?uploadId={upload}").status == 200  # A's upload is still there
