"""The prefetch of a matched prefix (``AsyncContextStore.prefetch_located``, which ``Namespace.prefetch`` uses;
the vLLM connector's scheduler and the LMCache connector pick the same blocks with ``flash_resident``): it asks
the nodes for the blocks a lookup placed on flash, and asks nothing when none is there. No node:
``prefetch_keys`` is recorded."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from ctxstore import AsyncContextStore

KEYS = ["k0", "k1", "k2", "k3"]
FOUND: list[tuple[int, str] | None] = [(64, "ram"), (64, "disk"), None, (64, "disk")]


def _store(asked: list[list[str]]) -> AsyncContextStore:
    store = AsyncContextStore("127.0.0.1:1", access_key="UNITACCESSKEY0001", secret_key="unit-test-secret-0001")

    async def prefetch_keys(bucket: str, keys: Sequence[str]) -> int:
        asked.append(list(keys))
        return len(keys)

    store.prefetch_keys = prefetch_keys  # type: ignore[method-assign]
    return store


def test_only_the_blocks_on_flash_are_asked_for() -> None:
    asked: list[list[str]] = []

    async def run(store: AsyncContextStore) -> tuple[int, int]:
        try:
            return (await store.prefetch_located("b", KEYS, FOUND),
                    await store.prefetch_located("b", KEYS[:1], FOUND[:1]))  # all in RAM: no call at all
        finally:
            await store.aclose()

    assert asyncio.run(run(_store(asked))) == (2, 0)
    assert asked == [["k1", "k3"]]
