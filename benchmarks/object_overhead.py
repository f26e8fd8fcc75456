"""Per-object memory overhead of the engine: bytes held per stored object beyond its payload and key.

Command:  .venv/bin/python benchmarks/object_overhead.py [--objects 100000]

Method: tracemalloc measures the heap growth of inserting N objects (64-byte payloads, 32-hex-char keys, no
metadata) through Engine.put, minus the payload and key bytes themselves (their Python object headers count
as overhead). The figure is compared with OBJECT_OVERHEAD, the constant charged against the budget.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tracemalloc

from ctxstore_server.engine import OBJECT_OVERHEAD, Engine, EngineConfig


def measure(n: int, payload_size: int = 64) -> float:
    engine = Engine(EngineConfig(budget=1 << 40))
    engine.create_bucket("t", "b")
    keys = [os.urandom(16).hex() for _ in range(n)]
    payloads = [bytearray(os.urandom(payload_size)) for _ in range(n)]
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for key, data in zip(keys, payloads):
        engine.put("t", "b", key, data, etag='"0123456789abcdef0123456789abcdef"')
    gc.collect()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    # Keys and payloads were allocated before tracing started, so the growth is pure bookkeeping; the
    # Python object headers of the key string and the payload buffer are overhead too.
    headers = sys.getsizeof(keys[0]) - len(keys[0]) + sys.getsizeof(payloads[0]) - len(payloads[0])
    return (after - before) / n + headers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--objects", type=int, default=100_000)
    args = parser.parse_args()
    per_object = measure(args.objects)
    print(f"objects: {args.objects}")
    print(f"measured overhead per object: {per_object:.0f} bytes (beyond payload and key bytes)")
    print(f"charged per object (OBJECT_OVERHEAD): {OBJECT_OVERHEAD} bytes + key + metadata")


if __name__ == "__main__":
    main()
