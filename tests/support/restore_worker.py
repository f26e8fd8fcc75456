"""A restoring inference worker in its own process, for tests that must survive what the worker might not.

``python restore_worker.py '<json>'`` restores the same tokens ``repeat`` times from the nodes given (usually a
fault proxy), with the sync :class:`ctxstore.ContextStore` (uvloop when installed, as inference servers run it)
or with the asyncio client on asyncio's own loop (``"loop": "asyncio"``), and prints one JSON line:
``{"loop": ..., "results": [n_blocks per restore], "wrong": blocks that differ from the expected bytes,
"exceptions": [repr of each exception that escaped a call], "metrics": the client's metrics snapshot}``.

Config keys: ``nodes``, ``access_key``, ``secret_key``, ``bucket``, ``model``, ``block_size``, ``tokens``,
``expected`` (hex XXH3-128 of each block, in order), ``repeat``, ``strict``, ``out`` (``"slots"``: one buffer
of ``slot`` bytes per block; ``"none"``: let the client allocate), ``slot``, ``loop``, ``timeouts``
([connect, read, total]).
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import xxhash


def _check(blocks: list[Any], expected: list[str]) -> int:
    wrong = 0
    for i, block in enumerate(blocks):
        if i >= len(expected) or xxhash.xxh3_128_hexdigest(bytes(block)) != expected[i]:
            wrong += 1
    return wrong


def main() -> int:
    config = json.loads(sys.argv[1])
    from ctxstore import AsyncContextStore, ContextStore, Timeouts

    connect, read, total = config.get("timeouts", [0.5, 1.0, 3.0])
    options = dict(access_key=config["access_key"], secret_key=config["secret_key"],
                   timeouts=Timeouts(connect=connect, read=read, total=total), strict=config.get("strict", False),
                   probe_interval=0.05)
    tokens: list[int] = config["tokens"]
    expected: list[str] = config["expected"]
    n = len(expected)
    slot = int(config.get("slot", 0))
    results: list[int] = []
    exceptions: list[str] = []
    wrong = 0

    def out_buffer() -> Any:
        return bytearray(slot * n) if config.get("out", "slots") == "slots" else None

    if config.get("loop", "default") == "asyncio":
        async def run() -> dict[str, object]:
            nonlocal wrong
            with_store = AsyncContextStore(config["nodes"], **options)  # type: ignore[arg-type]
            try:
                ns = await with_store.namespace(config["bucket"], model=config["model"],
                                                block_size=config["block_size"], create=False)
                for _ in range(config.get("repeat", 1)):
                    try:
                        result = await ns.restore(tokens, out=out_buffer())
                    except Exception as exc:  # noqa: BLE001 - the point is to see what escapes
                        exceptions.append(repr(exc)[:300])
                        continue
                    results.append(result.n_blocks)
                    wrong += _check(result.blocks, expected)
                return with_store.metrics_snapshot()
            finally:
                await with_store.aclose()

        metrics = asyncio.run(run())
        loop_name = "asyncio"
    else:
        store = ContextStore(config["nodes"], **options)  # type: ignore[arg-type]
        loop_name = "uvloop" if "uvloop" in sys.modules else "asyncio"  # the sync client's choice
        try:
            ns = store.namespace(config["bucket"], model=config["model"], block_size=config["block_size"],
                                 create=False)
            for _ in range(config.get("repeat", 1)):
                try:
                    result = ns.restore(tokens, out=out_buffer())
                except Exception as exc:  # noqa: BLE001
                    exceptions.append(repr(exc)[:300])
                    continue
                results.append(result.n_blocks)
                wrong += _check(result.blocks, expected)
            metrics = store.metrics_snapshot()
        finally:
            store.close()
    print(json.dumps({"loop": loop_name, "results": results, "wrong": wrong, "exceptions": exceptions,
                      "metrics": metrics}, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
