"""A node's flash reads, as a real process driven by the ctxstore client: a prefetch and the load that follows
it (what the vLLM connector does), and concurrent loads of the same blocks, read each record from the device
once; and after reads of far more than RAM holds, the node's RAM at rest is within ``--memory``.

How much the device read is the node's own counter (``disk_bytes_read`` in the admin stats): records are
read whole, in runs of adjacent records rounded to 4 KiB blocks, so reading each record once costs a little
more than its payload (about 0.3 % here), and every second read of it as much again."""

from __future__ import annotations

import asyncio
from pathlib import Path

from flash_support import make_payload

from ctxstore import AsyncContextStore, Limits
from ctxstore.buffers import Destinations
from support.nodes import ACCESS_KEY, SECRET_KEY
from support.probes import Admin, start_probed_node, wait_until

KiB, MiB = 1 << 10, 1 << 20
BLOCK = 64 * KiB


def flash_args(tmp: Path, *extra: str, memory: str) -> list[str]:
    return ["--memory", memory, "--disk", str(tmp / "flash"), "--disk-size", "256MiB", "--disk-segment-size", "4MiB",
            *extra]


def client(endpoint: str) -> AsyncContextStore:
    return AsyncContextStore(endpoint, access_key=ACCESS_KEY, secret_key=SECRET_KEY, threads=1,
                             limits=Limits(bytes_per_call=2 * MiB))


async def save(store: AsyncContextStore, admin: Admin, keys: list[str]) -> list[bytes]:
    """Blocks of ``keys``, written and settled on flash (nothing left queued for it)."""
    blocks = [make_payload(k, 0, BLOCK) for k in keys]
    for start in range(0, len(keys), 32):
        result = await store.put_keys("reads", keys[start:start + 32], [memoryview(b) for b in blocks[start:start + 32]])
        assert result.stored == len(keys[start:start + 32])
        assert wait_until(lambda: admin.stats()["disk_queued_bytes"] == 0)
    return blocks


def read_since(admin: Admin, before: int) -> int:
    return int(admin.stats()["disk_bytes_read"]) - before


def test_a_prefetch_then_a_load_and_concurrent_loads_read_each_record_once(tmp_path: Path) -> None:
    # Every block straight to flash; RAM (64 MiB) takes them all back when promoted.
    node = start_probed_node(tmp_path, *flash_args(tmp_path, "--disk-direct-size", "1", memory="64MiB"))
    admin = Admin(node)

    async def go() -> None:
        async with client(node.endpoint) as store:
            await store.create_bucket("reads")
            keys = [f"p{i:03d}" for i in range(200)]
            blocks = await save(store, admin, keys)
            assert wait_until(lambda: admin.stats()["objects"] == 0)
            payload = len(keys) * BLOCK

            # The connector's order: a prefetch of the prefix, then its load at once.
            before = admin.stats()["disk_bytes_read"]
            assert await store.prefetch_keys("reads", keys) == len(keys)
            got = await store.get_keys("reads", keys, Destinations(None, len(keys)))
            assert [bytes(g) if g is not None else None for g in got] == blocks
            assert wait_until(lambda: admin.stats()["promotions"] == len(keys))
            read = read_since(admin, before)
            assert payload <= read < 1.05 * payload, f"read amplification {read / payload:.2f}"

            # Four loads of the same blocks at once (promoted blocks sent to flash again first).
            others = [f"c{i:03d}" for i in range(200)]
            blocks = await save(store, admin, others)
            assert wait_until(lambda: admin.stats()["objects"] == len(keys))
            before = admin.stats()["disk_bytes_read"]
            loads = await asyncio.gather(*(store.get_keys("reads", others, Destinations(None, len(others)))
                                           for _ in range(4)))
            for got in loads:
                assert [bytes(g) if g is not None else None for g in got] == blocks
            read = read_since(admin, before)
            assert payload <= read < 1.05 * payload, f"read amplification {read / payload:.2f}"
            stats = admin.stats()
            assert stats["disk_corrupt"] == 0 and stats["misses"] == 0

    try:
        asyncio.run(go())
    finally:
        node.stop()


def test_ram_at_rest_is_within_the_budget_after_reading_three_times_ram_from_flash(tmp_path: Path) -> None:
    """The read buffers the flash store keeps are charged to the budget; charging them on a node that reads had
    filled with promoted blocks left it over its budget (109 % here) until the next write made room."""
    node = start_probed_node(tmp_path, *flash_args(tmp_path, memory="16MiB"))
    admin = Admin(node)

    async def go() -> None:
        async with client(node.endpoint) as store:
            await store.create_bucket("reads")
            keys = [f"k{i:03d}" for i in range(768)]  # 48 MiB against 16 MiB
            blocks = await save(store, admin, keys)
            assert admin.stats()["disk_objects"] >= 512
            for _ in range(2):
                for start in range(0, len(keys), 64):
                    got = await store.get_keys("reads", keys[start:start + 64], Destinations(None, 64))
                    assert [bytes(g) if g is not None else None for g in got] == blocks[start:start + 64]
                assert await store.prefetch_keys("reads", keys[:200]) > 0

    try:
        asyncio.run(go())
        # At rest: the node charges what reads left behind (kept read buffers) within a second or so.
        assert wait_until(lambda: admin.stats()["prefetches"] > 0 and admin.stats()["sending_bytes"] == 0)
        stats = admin.stats()
        assert stats["promotions"] > 0 and stats["disk_hits"] > 0
        # Node state beyond the flash index and kept payload buffers: the flash store's kept read buffers,
        # charged by the node's housekeeping about once a second.
        assert wait_until(lambda: (s := admin.stats())["state_bytes"] - s["disk_index_bytes"] - s["buffer_bytes"]
                          > 512 * KiB, timeout=5)
        for _ in range(3):  # and stays there
            stats = admin.stats()
            assert stats["used"] <= stats["budget"], f"RAM at rest {stats['used'] / stats['budget']:.3f} of the budget"
            assert stats["sending_bytes"] == 0 and stats["reserved"] == 0
            asyncio.run(asyncio.sleep(0.6))
    finally:
        node.stop()
