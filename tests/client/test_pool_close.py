"""A connection pool closed while requests are under way keeps none of their connections (a client's lane pools
are closed when a node is marked down, while other parts' requests to it still run): each is closed when its
request ends, whether the request was running or only made, and the pool serves later requests afresh."""

from __future__ import annotations

import asyncio
from pathlib import Path

from support.nodes import start_node

from ctxstore.pod import READY_PATH
from ctxstore.transport import BytesReader, Pool, request_head


def _ready(pool: Pool, port: int):  # noqa: ANN202  (a coroutine of the pool's request)
    head = request_head("GET", f"127.0.0.1:{port}", READY_PATH, [], 0)
    return pool.request(head, (), lambda status, n: BytesReader(n))


def test_requests_made_or_running_when_the_pool_closes_keep_no_connection(tmp_path: Path) -> None:
    node = start_node(tmp_path, "--memory", "64MiB")
    try:
        async def scenario() -> None:
            pool = Pool("127.0.0.1", node.port, limit=4, connect_timeout=5, read_timeout=5)
            made = _ready(pool, node.port)  # made, not yet run: a lane's task waiting for its first turn
            running = asyncio.ensure_future(_ready(pool, node.port))
            await asyncio.sleep(0)  # the running one is connecting
            pool.close()
            assert (await made).status == 200 and (await running).status == 200
            assert pool._idle == []  # before: both connections kept, in a pool its owner had let go
            assert (await _ready(pool, node.port)).status == 200  # afterwards: pooled as usual
            assert len(pool._idle) == 1
            pool.close()

        asyncio.run(scenario())
    finally:
        node.stop()
