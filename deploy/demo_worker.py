#!/usr/bin/env python3
"""A stand-in inference worker: save a prompt's KV blocks to the pod, look them up, restore them, check them.

    CTXSTORE_NODES=ctxstore-0:9000,ctxstore-1:9000,ctxstore-2:9000 \
    CTXSTORE_ACCESS_KEY=... CTXSTORE_SECRET_KEY=... python3 deploy/demo_worker.py

It makes a random prompt and random bytes standing for the KV cache of each full block of 16 tokens (the
shape of a small model: 4 layers x 4 KV heads x head dim 64, bf16, i.e. 4 KiB per token and 64 KiB per block),
then does what a worker does around a prefill: save, lookup, restore into one buffer, and a lookup for a
follow-up prompt that shares the first blocks. Exit status 0 only when every block came back intact.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
import urllib.request

from ctxstore import ContextStore

BLOCK_TOKENS = 16
LAYERS, KV_HEADS, HEAD_DIM, DTYPE_BYTES = 4, 4, 64, 2
BLOCK_BYTES = BLOCK_TOKENS * 2 * LAYERS * KV_HEADS * HEAD_DIM * DTYPE_BYTES  # K and V: 64 KiB


def wait_ready(nodes: str, timeout: float) -> None:
    """Wait until every node of ``host:port,host:port`` answers its readiness endpoint (a real worker would not:
    a node that is not up yet is just a miss; this demo wants every block stored)."""
    deadline = time.monotonic() + timeout
    for item in filter(None, (n.strip() for n in nodes.split(","))):
        address = item.split("://", 1)[-1].rstrip("/")
        if not address.endswith("]") and ":" in address.rsplit("]", 1)[-1]:
            url = f"http://{address}/_ctx/health/ready"
        else:
            url = f"http://{address}:9000/_ctx/health/ready"
        while True:
            try:
                urllib.request.urlopen(url, timeout=2).close()
                break
            except OSError as exc:
                if time.monotonic() > deadline:
                    raise SystemExit(f"demo worker: {url} not ready after {timeout:g} s: {exc}") from None
                time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=32, help="full blocks in the prompt (default 32)")
    parser.add_argument("--bucket", default="demo-kv", help="namespace bucket (default demo-kv)")
    parser.add_argument("--wait", type=float, default=60, help="seconds to wait for every node (default 60)")
    args = parser.parse_args(argv)
    nodes = os.environ.get("CTXSTORE_NODES", "")
    if not nodes:
        raise SystemExit("demo worker: set CTXSTORE_NODES (and CTXSTORE_ACCESS_KEY, CTXSTORE_SECRET_KEY)")
    print(f"demo worker: nodes {nodes}", flush=True)
    wait_ready(nodes, args.wait)

    rng = random.Random()
    tokens = [rng.randrange(128_000) for _ in range(args.blocks * BLOCK_TOKENS + 5)]  # + a partial block
    blocks = [os.urandom(BLOCK_BYTES) for _ in range(args.blocks)]

    with ContextStore() as store:  # nodes and credentials from CTXSTORE_NODES / _ACCESS_KEY / _SECRET_KEY
        ns = store.namespace(args.bucket, model="demo/tiny-kv-model", kv_dtype="bfloat16",
                             block_size=BLOCK_TOKENS)
        start = time.perf_counter()
        saved = ns.save(tokens, blocks)
        print(f"save:    stored {saved.stored}, already held {saved.existed}, failed {saved.failed} "
              f"({args.blocks} blocks of {BLOCK_BYTES // 1024} KiB)", flush=True)

        cached = ns.lookup(tokens)
        print(f"lookup:  the pod holds {cached} of {args.blocks} leading blocks", flush=True)

        out = bytearray(args.blocks * BLOCK_BYTES)
        result = ns.restore(tokens, out=out)
        intact = sum(bytes(out[i * BLOCK_BYTES:(i + 1) * BLOCK_BYTES]) == blocks[i] for i in range(result.n_blocks))
        elapsed = time.perf_counter() - start
        print(f"restore: {result.n_blocks} blocks ({result.n_tokens} tokens), {intact} byte-identical, "
              f"{elapsed * 1000:.0f} ms for save+lookup+restore", flush=True)

        shared = args.blocks // 2
        follow_up = tokens[:shared * BLOCK_TOKENS] + [rng.randrange(128_000) for _ in range(8 * BLOCK_TOKENS)]
        hit = ns.lookup(follow_up)
        print(f"follow-up prompt sharing {shared} blocks: {hit} cached, prefill from token {hit * BLOCK_TOKENS}",
              flush=True)

        nodes_up = {name: info["up"] for name, info in store.metrics_snapshot()["nodes"].items()}
        print(f"nodes:   {nodes_up}", flush=True)

    ok = cached == result.n_blocks == intact == args.blocks and hit == shared
    print("restore OK: every block came back intact" if ok else "restore FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
