"""A put that a node refuses with SlowDown is sent again after a short, growing pause (a few times), so a node
that is making room (its flash tier draining, pins running out) does not turn a save into lost blocks; past the
retries the blocks are reported as failed. Against a real node whose whole budget is pinned."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.nodes import ACCESS_KEY, SECRET_KEY, Node, start_node

from ctxstore import ContextStore
from ctxstore.core import SLOWDOWN_RETRIES

BLOCK = 64 << 10


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    started = start_node(tmp_path, "--memory", "1MiB")
    yield started
    started.stop()


def test_a_refused_put_is_sent_again_and_stored_once_the_node_has_room(node: Node) -> None:
    store = ContextStore(node.endpoint, access_key=ACCESS_KEY, secret_key=SECRET_KEY)
    try:
        ns = store.namespace("slow-down", model="m", block_size=4)
        parked = list(range(4 * 14))  # 14 blocks of 64 KiB, pinned: the 1 MiB budget has no room left
        assert ns.park(parked, [bytes([i]) * BLOCK for i in range(14)], ttl=600, pin=60).stored == 14
        tokens = [t + 1000 for t in range(8)]
        blocks = [b"x" * BLOCK, b"y" * BLOCK]

        # Nothing frees room: every retry is refused, and the blocks are reported as not stored.
        result = ns.save(tokens, blocks)
        assert (result.stored, result.failed) == (0, 2)
        assert store.metrics_snapshot()["slowdown_retries"] == SLOWDOWN_RETRIES

        # Room appears while the client waits between tries: the same save goes through, nothing lost.
        outcome: list[object] = []
        saver = threading.Thread(target=lambda: outcome.append(ns.save(tokens, blocks)))
        saver.start()
        deadline = time.monotonic() + 10
        while store.metrics_snapshot()["slowdown_retries"] == SLOWDOWN_RETRIES and time.monotonic() < deadline:
            time.sleep(0.002)  # the first refusal of this save: it is pausing now
        assert ns.unpin(parked) == 14
        saver.join(10)
        assert outcome and outcome[0].stored == 2  # type: ignore[attr-defined]
        assert ns.lookup(tokens) == 2
    finally:
        store.close()
