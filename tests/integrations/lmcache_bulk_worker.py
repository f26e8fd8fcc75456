"""One LMCache process for tests/integrations/test_lmcache_bulk.py and benchmarks/lmcache_bulk_vs_s3.py.

Usage: ``python lmcache_bulk_worker.py MODE CONFIG.yaml DATA.pt [--rounds N] [HOSTS_LINE ...]``; MODE one of

* ``store``: an ``LMCacheEngine`` stores ``data["kv"][:, :, :stored]`` for ``data["tokens"][:stored]`` and waits
  until its remote backend (``data["backend"]``: ``RemoteBackend-ctxstore`` for the bulk plugin,
  ``RemoteBackend`` for ``remote_url: s3://...``) holds every chunk.
* ``retrieve``: a fresh engine (another OS process) looks up all of ``data["tokens"]`` with a pin, retrieves into
  a zero KV tensor and saves it to ``DATA.pt.out``.
* ``bench``: ``--rounds`` times: drop LMCache's local CPU copy, then look up and retrieve from the remote tier,
  timing each; reports the per-round seconds.

Each mode prints one ``REPORT {json}`` line; exit status 77 means "cannot run here" (the reason is printed).
HOSTS_LINEs are for the S3 path's virtual-hosted names (see tests/lmcache_helpers/worker.py, whose private
/etc/hosts helper this reuses). The GPU-connector stand-in copies token ranges between a CPU KV tensor
``[2, layers, tokens, hidden]`` and LMCache's ``KV_2LTD`` memory objects (LMCache 0.5.6 has none for CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

CANNOT_RUN = 77
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "lmcache_helpers"))


def engine_for(mode: str, config_path: str, data: dict[str, Any]) -> Any:
    import torch
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
    from lmcache.v1.metadata import LMCacheMetadata

    class CPUKVConnector(GPUConnectorInterface):
        def __init__(self, num_layers: int, hidden: int) -> None:
            self.num_layers, self.hidden = num_layers, hidden

        def get_shape(self, num_tokens: int) -> torch.Size:
            return torch.Size([2, self.num_layers, num_tokens, self.hidden])

        def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
            memory_obj.tensor.copy_(kwargs["kvcaches"][:, :, start:end, :])

        def to_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
            kwargs["kvcaches"][:, :, start:end, :].copy_(memory_obj.tensor)

        def batched_from_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kwargs: Any) -> None:
            for obj, start, end in zip(memory_objs, starts, ends):
                self.from_gpu(obj, start, end, **kwargs)

        def batched_to_gpu(self, memory_objs: Any = None, starts: Any = None, ends: Any = None,
                           **kwargs: Any) -> None:
            for obj, start, end in zip(memory_objs, starts, ends):
                self.to_gpu(obj, start, end, **kwargs)

    kv: torch.Tensor = data["kv"]
    _, layers, _, hidden = kv.shape
    heads = data["heads"]
    config = LMCacheEngineConfig.from_file(config_path)
    metadata = LMCacheMetadata(
        model_name=data["model"], world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
        kv_dtype=kv.dtype, kv_shape=(layers, 2, config.chunk_size, heads, hidden // heads),
        chunk_size=config.chunk_size)
    engine = LMCacheEngineBuilder.get_or_create(
        f"ctxstore-{mode}", config, metadata, CPUKVConnector(layers, hidden),
        broadcast_fn=lambda *args: None, broadcast_object_fn=lambda obj, *args: obj)
    engine.post_init()
    return engine


def run(mode: str, config_path: str, data_path: str, rounds: int) -> dict[str, Any]:
    import torch

    data = torch.load(data_path)
    tokens: list[int] = data["tokens"]
    kv: torch.Tensor = data["kv"]
    stored: int = data["stored"]
    backend: str = data["backend"]
    engine = engine_for(mode, config_path, data)
    report: dict[str, Any] = {"mode": mode}
    if mode == "store":
        t0 = time.perf_counter()
        engine.store(torch.tensor(tokens[:stored]), kvcaches=kv[:, :, :stored, :].contiguous())
        deadline, hit = time.monotonic() + 60, 0
        while time.monotonic() < deadline:  # uploads run in the background
            hit = engine.lookup(tokens=tokens[:stored], search_range=[backend])
            if hit == stored:
                break
            time.sleep(0.05)
        report["remote_hit_tokens"] = hit
        report["store_s"] = time.perf_counter() - t0
    elif mode == "retrieve":
        out = torch.zeros_like(kv)
        report["lookup_hit_tokens"] = engine.lookup(tokens=tokens, lookup_id="req-1", pin=True)
        mask = engine.retrieve(torch.tensor(tokens), kvcaches=out, req_id="req-1")
        engine.lookup_unpin("req-1")
        report["retrieved_tokens"] = int(mask.sum())
        torch.save(out, data_path + ".out")
    else:  # bench
        times, lookups, hits = [], [], []
        out = torch.zeros_like(kv)
        for r in range(rounds):
            engine.clear(locations=["LocalCPUBackend"])  # the remote tier must answer every round
            out.zero_()
            t0 = time.perf_counter()
            hit = engine.lookup(tokens=tokens[:stored], lookup_id=f"r{r}", pin=True)
            t1 = time.perf_counter()
            mask = engine.retrieve(torch.tensor(tokens[:stored]), kvcaches=out, req_id=f"r{r}")
            t2 = time.perf_counter()
            engine.lookup_unpin(f"r{r}")
            assert int(mask.sum()) == stored == hit, (int(mask.sum()), hit)
            times.append(t2 - t0)
            lookups.append(t1 - t0)
            hits.append(hit)
        report.update(total_s=times, lookup_s=lookups, exact=bool(torch.equal(out[:, :, :stored],
                                                                              kv[:, :, :stored])))
    # Like tests/lmcache_helpers/worker.py: no LMCacheEngineBuilder.destroy() (it hangs with an s3:// remote,
    # LMCache/LMCache#4489); main() leaves with os._exit once everything is confirmed.
    return report


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["store", "retrieve", "bench"])
    parser.add_argument("config")
    parser.add_argument("data")
    parser.add_argument("hosts", nargs="*")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if args.hosts:
        from worker import private_hosts  # tests/lmcache_helpers/worker.py

        try:
            private_hosts(args.hosts)
        except OSError as exc:
            print(f"CANNOT RUN: no private /etc/hosts for the virtual-hosted names ({exc})", flush=True)
            os._exit(CANNOT_RUN)
    try:
        import lmcache.v1.cache_engine  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        print(f"CANNOT RUN: lmcache does not import: {type(exc).__name__}: {exc}", flush=True)
        os._exit(CANNOT_RUN)
    report = run(args.mode, args.config, args.data, args.rounds)
    print("REPORT " + json.dumps(report), flush=True)
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
