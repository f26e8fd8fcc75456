"""The client's query (``AsyncContextStore.query``, ``Namespace.query`` and their sync twins) against a pod of three
real nodes with flash tiers: every block answered in the tier that holds it, on whichever node owns it, the
pod's prefixes per tier combined from the nodes' answers, the same as a lookup's tiers but not counted as reads;
a node down is a miss for the blocks it owns, never an error, within the client's timeouts; another tenant's
bucket is a miss (an error in strict mode).

Blocks of 32 KiB go to flash as they are written (``--disk-direct-size 16KiB``), blocks of 1 KiB stay in RAM,
so which tier holds each block is known before the query."""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.nodes import ACCESS_KEY, OTHER_ACCESS_KEY, OTHER_SECRET_KEY, SECRET_KEY, Node, serving, start_node
from support.probes import ADMIN_TOKEN, Admin, wait_until

from ctxstore import AsyncContextStore, ContextStore, QueryResult, Timeouts
from ctxstore.errors import ContextStoreError

KiB = 1 << 10
BS = 4
N = 24
FLASH_ARGS = ("--memory", "32MiB", "--disk-size", "64MiB", "--disk-segment-size", "4MiB", "--disk-direct-size",
              "16KiB", "--default-ttl", "1h")


def start_flash_node(tmp: Path, i: int) -> Node:
    tenants = tmp / "tenants.json"
    tenants.write_text(json.dumps([{"tenant": "other", "access_key": OTHER_ACCESS_KEY,
                                    "secret_key": OTHER_SECRET_KEY}]))
    return start_node(tmp, *FLASH_ARGS, "--disk", str(tmp / f"flash-{i}"), wait=False,
                      env={"CTXSTORE_ADMIN_TOKEN": ADMIN_TOKEN, "CTXSTORE_TENANTS_FILE": str(tenants)})


@pytest.fixture(scope="module")
def flash_pod(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Node]]:
    tmp = tmp_path_factory.mktemp("query-pod")
    with serving([start_flash_node(tmp, i) for i in range(3)]) as nodes:
        yield nodes


def endpoints(nodes: list[Node]) -> str:
    return ",".join(f"127.0.0.1:{n.port}" for n in nodes)


def a_prompt() -> tuple[list[int], list[str | None]]:
    """Tokens of N blocks and where each block is to be: RAM, flash, or not saved (block 17, and the last two)."""
    tokens = [secrets.randbelow(1 << 32) for _ in range(N * BS + 1)]
    layout: list[str | None] = ["ram" if i % 3 else "disk" for i in range(N)]
    layout[0] = "ram"
    layout[17] = layout[22] = layout[23] = None
    return tokens, layout


def blocks_for(layout: list[str | None]) -> list[bytes]:
    return [secrets.token_bytes(32 * KiB if where == "disk" else KiB) for where in layout]


def expected(layout: list[str | None]) -> tuple[int, int, int]:
    """(n_blocks, ram_blocks, disk_blocks) of a layout."""
    n = next((i for i, where in enumerate(layout) if where is None), len(layout))
    ram = next((i for i, where in enumerate(layout) if where != "ram"), len(layout))
    return n, ram, layout[:n].count("disk")


def settled(nodes: list[Node]) -> bool:
    return all(Admin(node).stats()["disk_queued_bytes"] == 0 for node in nodes)


def hits(nodes: list[Node]) -> int:
    return sum(int(Admin(node).stats()["hits"]) + int(Admin(node).stats()["misses"]) for node in nodes)


def test_the_pods_prefix_per_tier_is_combined_from_every_nodes_answer(flash_pod: list[Node]) -> None:
    tokens, layout = a_prompt()

    async def go() -> tuple[QueryResult, list[str | None], int]:
        async with AsyncContextStore(endpoints(flash_pod), access_key=ACCESS_KEY, secret_key=SECRET_KEY) as store:
            ns = await store.namespace("query-" + secrets.token_hex(4), model="m", block_size=BS, scheme="dynamo")
            blocks = blocks_for(layout)
            saved = [i for i, where in enumerate(layout) if where is not None]
            keys = ns.block_hashes(tokens)
            owners = {store.pod.owner(keys[i]).port for i in saved}
            assert len(owners) == 3  # every node holds some of the prompt
            views = [memoryview(blocks[i]) for i in saved]
            assert (await store.put_keys(ns.bucket, [keys[i] for i in saved], views)).stored == len(saved)
            assert wait_until(lambda: settled(flash_pod))
            before = hits(flash_pod)
            answer = await ns.query(tokens)
            assert hits(flash_pod) == before  # a question, not a read
            assert await store.query(ns.bucket, keys, block_size=BS) == answer
            return answer, await ns.locate(tokens), before

    answer, located, _ = asyncio.run(go())
    assert answer.tiers == layout == located  # the lookup (a read) agrees
    n, ram, disk = expected(layout)
    assert (answer.n_blocks, answer.ram_blocks, answer.disk_blocks) == (n, ram, disk) == (17, 3, 5)
    assert (answer.n_tokens, answer.ram_tokens, answer.block_size) == (17 * BS, 3 * BS, BS)


def test_the_sync_twin_answers_the_same(flash_pod: list[Node]) -> None:
    tokens, layout = a_prompt()
    with ContextStore(endpoints(flash_pod), access_key=ACCESS_KEY, secret_key=SECRET_KEY) as store:
        ns = store.namespace("query-" + secrets.token_hex(4), model="m", block_size=BS)
        assert ns.query(tokens) == QueryResult([None] * N, 0, 0, 0, BS)
        first = layout.index(None)
        assert ns.save(tokens, blocks_for(layout)[:first]).stored == first
        assert wait_until(lambda: settled(flash_pod))
        answer = ns.query(tokens)
        assert answer.tiers == layout[:first] + [None] * (N - first)
        assert answer == store.query(ns.bucket, ns.block_hashes(tokens), block_size=BS)
        assert store.query(ns.bucket, []) == QueryResult()


def test_another_tenants_bucket_is_a_miss_or_in_strict_mode_an_error(flash_pod: list[Node]) -> None:
    tokens, layout = a_prompt()
    with ContextStore(endpoints(flash_pod), access_key=ACCESS_KEY, secret_key=SECRET_KEY) as store:
        ns = store.namespace("query-" + secrets.token_hex(4), model="m", block_size=BS)
        ns.save(tokens, blocks_for(layout)[:10])
        keys = ns.block_hashes(tokens)
    with ContextStore(endpoints(flash_pod), access_key=OTHER_ACCESS_KEY, secret_key=OTHER_SECRET_KEY) as other:
        assert other.query(ns.bucket, keys).tiers == [None] * N
    with ContextStore(endpoints(flash_pod), access_key=OTHER_ACCESS_KEY, secret_key=OTHER_SECRET_KEY,
                      strict=True) as other, pytest.raises(ContextStoreError, match="AccessDenied"):
        other.query(ns.bucket, keys)


def test_a_node_down_is_a_miss_for_its_blocks_never_an_error(tmp_path: Path) -> None:
    tokens, layout = a_prompt()
    with serving([start_flash_node(tmp_path, i) for i in range(3)]) as nodes:

        async def go() -> None:
            timeouts = Timeouts(connect=0.5, read=1.0, total=2.0)
            async with AsyncContextStore(endpoints(nodes), access_key=ACCESS_KEY, secret_key=SECRET_KEY,
                                         timeouts=timeouts) as store:
                ns = await store.namespace("query-" + secrets.token_hex(4), model="m", block_size=BS)
                saved = [i for i, where in enumerate(layout) if where is not None]
                keys = ns.block_hashes(tokens)
                blocks = blocks_for(layout)
                await store.put_keys(ns.bucket, [keys[i] for i in saved], [memoryview(blocks[i]) for i in saved])
                assert wait_until(lambda: settled(nodes))
                assert (await ns.query(tokens)).tiers == layout

                down = store.pod.owner(keys[5])  # a node that owns a block inside the prefix
                next(n for n in nodes if n.port == down.port).stop()
                without = [None if store.pod.owner(key) is down else where
                           for key, where in zip(keys, layout, strict=True)]
                assert without != layout
                for attempt in range(2):  # the call that finds it down, then one that skips it
                    started = time.monotonic()
                    answer = await ns.query(tokens)
                    assert time.monotonic() - started < timeouts.total + 1
                    assert answer.tiers == without, attempt
                    n, ram, disk = expected(without)
                    assert (answer.n_blocks, answer.ram_blocks, answer.disk_blocks) == (n, ram, disk)
                    assert answer.n_blocks <= 5
                assert not down.up

        asyncio.run(go())
