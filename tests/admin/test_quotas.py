"""Byte quotas against the node's application in-process: a tenant (or a bucket) over its quota loses its own
least recently used blocks, never another tenant's (nor another bucket's); an object larger than a quota is
refused whole.

Quotas are set through the admin API; blocks are written and read through S3 (boto3). The node's budget is
far above every quota here, so every eviction seen is a quota's.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from typing import Any

import pytest
from botocore.exceptions import ClientError

from support.inprocess import InProcessNode
from test_admin_api import TOKEN, Admin, bulk_pin, keys_of

SIZE = 2000  # payload of every ordinary block here; keys have equal lengths so every block costs the same


@pytest.fixture(scope="module")
def node() -> Iterator[InProcessNode]:
    started = InProcessNode(memory=64 << 20, admin_token=TOKEN, keep_time=True)
    yield started
    started.close()


@pytest.fixture(scope="module")
def admin(node: InProcessNode) -> Admin:
    return Admin(node)


class Tenant:
    """A tenant created through the admin API, with its S3 client."""

    def __init__(self, node: InProcessNode, admin: Admin, label: str) -> None:
        self.name = f"{label}-{secrets.token_hex(3)}"
        created = admin.ok("POST", "/tenants", {"tenant": self.name}, status=201)
        self.access, self.secret = created["access_key"], created["secret_key"]
        self.s3 = node.client(self.access, self.secret,
                              retries={"mode": "standard", "total_max_attempts": 1})
        self.admin = admin

    def bucket(self, label: str) -> str:
        name = f"{label}-{secrets.token_hex(4)}"
        self.s3.create_bucket(Bucket=name)
        return name

    def put(self, bucket: str, key: str, size: int = SIZE) -> bytes:
        data = os.urandom(size)
        self.s3.put_object(Bucket=bucket, Key=key, Body=data)
        return data

    def read(self, bucket: str, key: str) -> bytes:
        return self.s3.get_object(Bucket=bucket, Key=key)["Body"].read()

    def entry(self) -> dict[str, Any]:
        return next(t for t in self.admin.ok("GET", "/tenants") if t["access_key"] == self.access)

    def set_quota(self, quota: int) -> None:
        assert self.admin.ok("PATCH", f"/tenants/{self.access}", {"quota": quota})["quota"] == quota


def bucket_stats(admin: Admin, name: str) -> dict[str, Any]:
    return admin.stats()["buckets"][name]


def refused_as_too_large(call: Any) -> None:
    with pytest.raises(ClientError) as info:
        call()
    assert info.value.response["Error"]["Code"] == "EntityTooLarge"
    assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == 400


def assert_intact(tenant: Tenant, bucket: str, blocks: dict[str, bytes]) -> None:
    assert keys_of(tenant.s3, bucket) == sorted(blocks)
    for key, data in blocks.items():
        assert tenant.read(bucket, key) == data, key


def test_a_tenant_over_its_quota_loses_its_own_lru_blocks_only(node: InProcessNode, admin: Admin) -> None:
    a, b = Tenant(node, admin, "quota-a"), Tenant(node, admin, "quota-b")
    b1 = b.bucket("b1")
    b_blocks = {f"k{i}": b.put(b1, f"k{i}") for i in range(5)}  # the node's least recently used blocks
    a1, a2 = a.bucket("a1"), a.bucket("a2")
    a.put(a1, "k0")
    charge = a.entry()["charged"]
    assert charge > SIZE
    quota = int(4.5 * charge)  # four blocks fit
    a.set_quota(quota)
    a.put(a2, "k1")
    a.put(a1, "k2")
    a.put(a2, "k3")
    assert a.read(a1, "k0")  # k0 becomes A's most recently used
    a.put(a1, "k4")  # evicts k1, A's least recently used
    a.put(a2, "k5")  # evicts k2
    assert (keys_of(a.s3, a1), keys_of(a.s3, a2)) == (["k0", "k4"], ["k3", "k5"])
    assert a.entry()["charged"] <= quota
    assert_intact(b, b1, b_blocks)
    stats = admin.stats()["buckets"]
    assert stats[a1]["evictions"] + stats[a2]["evictions"] == 2
    assert stats[b1]["evictions"] == 0

    # Replacing a block at the quota frees its own bytes first: nothing else goes.
    a.put(a2, "k5")
    assert (keys_of(a.s3, a1), keys_of(a.s3, a2)) == (["k0", "k4"], ["k3", "k5"])

    # A lower quota evicts A's least recently used blocks down to it at once.
    a.set_quota(int(2.5 * charge))
    assert (keys_of(a.s3, a1), keys_of(a.s3, a2)) == (["k4"], ["k5"])
    assert a.entry()["charged"] <= int(2.5 * charge)

    # B has no quota: it keeps growing, and A's quota never touches it.
    for i in range(10):
        b_blocks[f"n{i}"] = b.put(b1, f"n{i}")
    assert_intact(b, b1, b_blocks)
    assert b.entry()["quota"] == 0
    # Lifting A's quota (0) lets it grow again.
    a.set_quota(0)
    for i in range(6, 10):
        a.put(a1, f"k{i}")
    assert len(keys_of(a.s3, a1)) == 5


def test_a_tenant_quota_set_at_creation(node: InProcessNode, admin: Admin) -> None:
    name = f"created-with-quota-{secrets.token_hex(3)}"
    created = admin.ok("POST", "/tenants", {"tenant": name, "quota": 2 * (SIZE + 1000)}, status=201)
    assert created["quota"] == 2 * (SIZE + 1000)
    s3 = node.client(created["access_key"], created["secret_key"])
    s3.create_bucket(Bucket=name)
    for i in range(6):
        s3.put_object(Bucket=name, Key=f"k{i}", Body=os.urandom(SIZE))
    assert keys_of(s3, name) == ["k4", "k5"]  # a block costs SIZE + key, metadata and ~700: two fit


def test_a_bucket_over_its_quota_loses_its_own_lru_blocks_only(node: InProcessNode, admin: Admin) -> None:
    owner, other = Tenant(node, admin, "bq-owner"), Tenant(node, admin, "bq-other")
    plain, quota_bucket = owner.bucket("plain"), owner.bucket("limited")
    theirs = other.bucket("theirs")
    plain_blocks = {f"k{i}": owner.put(plain, f"k{i}") for i in range(4)}  # older than everything below
    their_blocks = {f"k{i}": other.put(theirs, f"k{i}") for i in range(4)}
    owner.put(quota_bucket, "k0")
    charge = bucket_stats(admin, quota_bucket)["charged"]
    quota = int(3.5 * charge)
    admin.ok("PUT", f"/buckets/{quota_bucket}/policy", {"quota": quota})
    owner.put(quota_bucket, "k1")
    owner.put(quota_bucket, "k2")
    assert owner.read(quota_bucket, "k0")
    owner.put(quota_bucket, "k3")  # evicts k1
    owner.put(quota_bucket, "k4")  # evicts k2
    assert keys_of(owner.s3, quota_bucket) == ["k0", "k3", "k4"]
    assert bucket_stats(admin, quota_bucket)["charged"] <= quota
    assert bucket_stats(admin, quota_bucket)["evictions"] == 2
    assert_intact(owner, plain, plain_blocks)
    assert_intact(other, theirs, their_blocks)
    # The same bucket quota through a multipart upload (the assembled object is a write like any other).
    upload = owner.s3.create_multipart_upload(Bucket=quota_bucket, Key="k5")["UploadId"]
    part = owner.s3.upload_part(Bucket=quota_bucket, Key="k5", UploadId=upload, PartNumber=1,
                                Body=os.urandom(SIZE))
    owner.s3.complete_multipart_upload(Bucket=quota_bucket, Key="k5", UploadId=upload,
                                       MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": part["ETag"]}]})
    assert len(keys_of(owner.s3, quota_bucket)) <= 3 and "k5" in keys_of(owner.s3, quota_bucket)
    assert bucket_stats(admin, quota_bucket)["charged"] <= quota
    assert_intact(owner, plain, plain_blocks)
    assert_intact(other, theirs, their_blocks)


def test_an_object_larger_than_the_bucket_quota_is_refused_whole(node: InProcessNode, admin: Admin) -> None:
    owner = Tenant(node, admin, "big-b")
    name = owner.bucket("limited")
    blocks = {f"k{i}": owner.put(name, f"k{i}") for i in range(3)}
    charge = bucket_stats(admin, name)["charged"] // 3
    admin.ok("PUT", f"/buckets/{name}/policy", {"quota": 3 * charge})
    before = bucket_stats(admin, name)
    refused_as_too_large(lambda: owner.put(name, "huge", size=3 * charge))
    refused_as_too_large(lambda: owner.put(name, "k0", size=3 * charge))  # not even as a replacement
    with pytest.raises(ClientError) as info:
        owner.s3.head_object(Bucket=name, Key="huge")
    assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == 404
    assert_intact(owner, name, blocks)
    after = bucket_stats(admin, name)
    assert (after["objects"], after["charged"], after["evictions"], after["puts"]) == (
        before["objects"], before["charged"], before["evictions"], before["puts"])


def test_an_object_larger_than_the_tenant_quota_is_refused_whole(node: InProcessNode, admin: Admin) -> None:
    owner = Tenant(node, admin, "big-t")
    name = owner.bucket("t")
    blocks = {f"k{i}": owner.put(name, f"k{i}") for i in range(3)}
    charge = owner.entry()["charged"] // 3
    owner.set_quota(3 * charge)
    refused_as_too_large(lambda: owner.put(name, "huge", size=3 * charge))
    assert_intact(owner, name, blocks)
    assert owner.entry()["charged"] == 3 * charge
    assert bucket_stats(admin, name)["evictions"] == 0


def test_a_write_refused_by_the_tenant_quota_evicts_nothing_for_the_bucket_quota(node: InProcessNode,
                                                                                 admin: Admin) -> None:
    # The new object fits the bucket's quota only after evicting the bucket's blocks, but it is larger than
    # the tenant's quota: it is refused, and the blocks that would have made room for it are all still there.
    owner = Tenant(node, admin, "both")
    name = owner.bucket("both")
    blocks = {f"k{i}": owner.put(name, f"k{i}", size=500) for i in range(3)}
    charge = owner.entry()["charged"] // 3
    base = charge - 500  # key, metadata and fixed overhead of one block
    owner.set_quota(3 * charge + 100)
    admin.ok("PUT", f"/buckets/{name}/policy", {"quota": 3 * charge + 1000})
    refused_as_too_large(lambda: owner.put(name, "big", size=3 * charge + 500 - base))
    assert_intact(owner, name, blocks)
    assert bucket_stats(admin, name)["evictions"] == 0


def test_quota_with_every_own_block_pinned_refuses_rather_than_evicting_others(node: InProcessNode,
                                                                               admin: Admin) -> None:
    owner, other = Tenant(node, admin, "pinned"), Tenant(node, admin, "bystander")
    theirs = other.bucket("theirs")
    their_blocks = {f"k{i}": other.put(theirs, f"k{i}") for i in range(3)}
    name = owner.bucket("pinned")
    owner.put(name, "k0")
    charge = owner.entry()["charged"]
    owner.set_quota(int(2.5 * charge))
    owner.put(name, "k1")
    assert bulk_pin(node, name, ["k0", "k1"], access=owner.access, secret=owner.secret) == 2
    with pytest.raises(ClientError) as info:
        owner.put(name, "k2")
    assert info.value.response["Error"]["Code"] == "SlowDown"
    assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == 503
    assert keys_of(owner.s3, name) == ["k0", "k1"]
    assert_intact(other, theirs, their_blocks)
