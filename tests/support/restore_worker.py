"""A restoring inference worker in its own process, for tests that must survive what the worker might not.

``python restore_worker.py '<json>'`` restores the same tokens ``repeat`` times from the nodes given (usually a
fault proxy in front of a real node), with the sync :class:`ctxstore.ContextStore` (which runs uvloop when it
is installed, as inference servers do) or, with ``"loop": "asyncio"``, the asyncio client on asyncio's own
loop. Before each restore it waits (up to 3 s) until the client sees every node up again, so restore ``i``
sends request ``i``. It prints one JSON line:

- ``loop``: ``uvloop`` or ``asyncio``;
- ``results``: blocks restored by each call (-1 where an exception escaped);
- ``wrong``: restored blocks whose bytes differ from ``expected`` (must always be 0);
- ``exceptions``: ``[class name, is a ContextStoreError, repr]`` of each exception that escaped a call;
- ``uncounted``: calls that returned fewer blocks than asked for without the client's failure counters
  (``errors``, ``checksum_failures``, ``skipped_down_node_keys``, ``oversized_blocks``) moving;
- ``longest``: the longest call, in seconds; ``metrics``: the client's final metrics snapshot.

Config keys: ``nodes``, ``access_key``, ``secret_key``, ``bucket``, ``model``, ``block_size``, ``tokens``,
``expected`` (hex XXH3-128 of each block, in order), ``repeat``, ``strict``, ``out`` (``"slots"``: one buffer
of ``slot`` bytes per block; ``"list"``: one ``slot``-byte buffer per block; ``"none"``: the client
allocates), ``slot``, ``loop``, ``timeouts`` ([connect, read, total]), ``threads`` (the client's; above 1 even
these tests' few-KiB calls are cut into parts, one per thread).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import xxhash

FAILURE_COUNTERS = ("errors", "checksum_failures", "skipped_down_node_keys", "oversized_blocks")


def main() -> int:
    config = json.loads(sys.argv[1])
    import ctxstore.core
    from ctxstore import AsyncContextStore, ContextStore, ContextStoreError, Timeouts

    connect, read, total = config.get("timeouts", [0.5, 1.0, 3.0])
    options: dict[str, Any] = {"access_key": config["access_key"], "secret_key": config["secret_key"],
                               "timeouts": Timeouts(connect=connect, read=read, total=total),
                               "strict": config.get("strict", False), "probe_interval": 0.05,
                               "threads": config.get("threads", 1)}
    if options["threads"] > 1:  # parts of a few KiB, so that the answers' faults land on every thread
        ctxstore.core.MIN_PART_BYTES = ctxstore.core.MIN_PART_KEYS = 1
    tokens: list[int] = config["tokens"]
    expected: list[str] = config["expected"]
    n = len(expected)
    slot = int(config.get("slot", 0))
    report: dict[str, Any] = {"results": [], "wrong": 0, "exceptions": [], "uncounted": 0, "longest": 0.0}

    def out_buffer() -> Any:
        kind = config.get("out", "slots")
        if kind == "slots":
            return bytearray(slot * n)
        if kind == "list":
            return [bytearray(slot) for _ in range(n)]
        return None

    def failures(snapshot: dict[str, Any]) -> int:
        return sum(int(snapshot.get(name, 0)) for name in FAILURE_COUNTERS)

    def all_up(snapshot: dict[str, Any]) -> bool:
        return all(state.get("up", True) for state in snapshot.get("nodes", {}).values())

    def record(call: Callable[[], Any], snapshot: Callable[[], dict[str, Any]]) -> None:
        before = failures(snapshot())
        started = time.monotonic()
        try:
            result = call()
        except Exception as exc:  # noqa: BLE001 - the point is to see what escapes
            report["exceptions"].append([type(exc).__name__, isinstance(exc, ContextStoreError), repr(exc)[:300]])
            report["results"].append(-1)
            return
        finally:
            report["longest"] = max(report["longest"], time.monotonic() - started)
        report["results"].append(result.n_blocks)
        for i, block in enumerate(result.blocks):
            if i >= n or xxhash.xxh3_128_hexdigest(bytes(block)) != expected[i]:
                report["wrong"] += 1
        if result.n_blocks < n and failures(snapshot()) == before:
            report["uncounted"] += 1

    if config.get("loop", "default") == "asyncio":
        async def run() -> dict[str, Any]:
            store = AsyncContextStore(config["nodes"], **options)
            try:
                ns = await store.namespace(config["bucket"], model=config["model"],
                                           block_size=config["block_size"], create=False)
                for _ in range(config.get("repeat", 1)):
                    deadline = time.monotonic() + 3
                    while not all_up(store.metrics_snapshot()) and time.monotonic() < deadline:
                        await asyncio.sleep(0.01)
                    before = failures(store.metrics_snapshot())
                    started = time.monotonic()
                    try:
                        result = await ns.restore(tokens, out=out_buffer())
                    except Exception as exc:  # noqa: BLE001
                        report["exceptions"].append([type(exc).__name__, isinstance(exc, ContextStoreError),
                                                     repr(exc)[:300]])
                        report["results"].append(-1)
                        continue
                    finally:
                        report["longest"] = max(report["longest"], time.monotonic() - started)
                    report["results"].append(result.n_blocks)
                    for i, block in enumerate(result.blocks):
                        if i >= n or xxhash.xxh3_128_hexdigest(bytes(block)) != expected[i]:
                            report["wrong"] += 1
                    if result.n_blocks < n and failures(store.metrics_snapshot()) == before:
                        report["uncounted"] += 1
                return store.metrics_snapshot()
            finally:
                await store.aclose()

        metrics = asyncio.run(run())
        report["loop"] = "asyncio"
    else:
        sync_store = ContextStore(config["nodes"], **options)
        try:
            sync_ns = sync_store.namespace(config["bucket"], model=config["model"], block_size=config["block_size"],
                                           create=False)
            # The sync client's own choice, made when its loop thread started (at the first call).
            report["loop"] = "uvloop" if type(sync_store._loop.loop).__module__.startswith("uvloop") else "asyncio"
            for _ in range(config.get("repeat", 1)):
                deadline = time.monotonic() + 3
                while not all_up(sync_store.metrics_snapshot()) and time.monotonic() < deadline:
                    time.sleep(0.01)
                record(lambda: sync_ns.restore(tokens, out=out_buffer()), sync_store.metrics_snapshot)
            metrics = sync_store.metrics_snapshot()
        finally:
            sync_store.close()
    report["metrics"] = metrics
    print(json.dumps(report, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
