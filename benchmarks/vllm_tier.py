"""vLLM secondary tier (``ctxstore.integrations.vllm.tier``): how long a scheduler waits for a lookup's answer,
on an idle node and on a node under bulk traffic.

Command (results go in docs/benchmarks.md; the vLLM venv is the one scripts/test installs)::

    .venv/bin/python benchmarks/vllm_tier.py            # --rounds 300 --keys 128 --load-tasks 4 (defaults)

Writes its figures to docs/img/vllm_tier.json (``--out ''``: nowhere).

Method: one node (``ctxstore serve --memory 2GiB``, pinned to the server core). A child process in the vLLM venv
makes the tier with vLLM's own ``SecondaryTierFactory`` (out-of-tree config) over a 64-chunk ``memoryview``
primary of 256 KiB chunks and stores those 64 chunks through the tier's own store jobs. Each round is a new
request looking up ``--keys`` chunk keys (half of them stored, at random places in the list) as vLLM's tiering
manager does: ``lookup`` per key, ``on_schedule_end`` (which flushes the step's keys as one bulk lookup on vLLM's
lookup thread), a 1 ms step, again, until no key says RETRY. Measured per round: the wait, from the first
``lookup`` to the step at which every key had its answer (so it includes up to one step of polling), and the
bulk lookup call itself (the tier's ``lookup_seconds`` histogram). Idle rounds first, then the same number with
``--load-tasks`` asyncio tasks in another process (pinned to the client core) putting and getting 8 × 1 MiB
blocks in a loop against the same node. Reported: median, p90, p99 (nearest rank), max, and how many keys
answered MISS at the tier's deadline (0.5 s, the default) instead of from the pod.

The machine is a shared 2-vCPU VM (the first output line records the load average).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import vllm_python  # noqa: E402

from ctxstore.bench import percentile  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CHUNK = 256 << 10
N_CHUNKS = 64
STEP = 0.001


def summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)  # nearest-rank percentiles, as everywhere in benchmarks/
    return {"median_ms": percentile(ordered, 0.5) * 1e3, "p90_ms": percentile(ordered, 0.9) * 1e3,
            "p99_ms": percentile(ordered, 0.99) * 1e3, "max_ms": ordered[-1] * 1e3, "n": len(values)}


# ---------------------------------------------------------------------------------------------- child: the tier


def probe(endpoint: str, rounds: int, n_keys: int) -> None:
    """In the vLLM venv: store the chunks, then answer ``idle`` / ``loaded`` commands on stdin with rounds."""
    import numpy as np
    from vllm.v1.kv_offload.base import LookupResult, OffloadingSpec, ReqContext, ScheduleEndContext, make_offload_key
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )
    from vllm.v1.kv_offload.tiering.base import TransferJob
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    class Spec(OffloadingSpec):
        def get_manager(self) -> Any:
            raise NotImplementedError

        def get_worker(self, kv_caches: Any) -> Any:
            raise NotImplementedError

    spec = Spec(OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("layer.0",), group_id=0),),
        worker_kv_bytes_per_block=CHUNK, enable_kv_cache_events=False, extra_config={}, engine_id="bench",
        model=OffloadingModelConfig(name="bench/tier", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1,
                                          data_parallel_rank_local=None, is_parallelism_agnostic=True)))
    raw = bytearray(os.urandom(N_CHUNKS * CHUNK))
    tier = SecondaryTierFactory.create_secondary_tier(
        {"type": "CtxStoreTier", "module_path": "ctxstore.integrations.vllm.tier", "nodes": endpoint,
         "bucket": "bench-tier"}, memoryview(raw).cast("B", (N_CHUNKS, CHUNK)), spec)
    stored = [make_offload_key(os.urandom(32), 0) for _ in range(N_CHUNKS)]
    tier.submit_store(TransferJob(job_id=1, keys=stored, chunk_ids=np.arange(N_CHUNKS), is_promotion=False,
                                  req_context=ReqContext(req_id="store")))
    tier.drain_jobs()
    assert all(r.success for r in tier.get_finished_jobs())
    rng = random.Random(7)
    end = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
    print("READY", flush=True)
    for line in sys.stdin:
        phase = line.strip()
        waits: list[float] = []
        wrong = 0
        tier.get_stats()  # reset
        for r in range(rounds):
            present = rng.sample(stored, n_keys // 2)
            keys = present + [make_offload_key(os.urandom(32), 0) for _ in range(n_keys - len(present))]
            rng.shuffle(keys)
            req = ReqContext(req_id=f"{phase}-{r}")
            started = time.perf_counter()
            while True:
                answers = [tier.lookup(k, req) for k in keys]
                if LookupResult.RETRY not in answers:
                    break
                tier.on_schedule_end(end)
                time.sleep(STEP)
            waits.append(time.perf_counter() - started)
            wrong += sum((a is LookupResult.HIT) != (k in present) for k, a in zip(keys, answers))
            tier.on_request_finished(req)
        stats = tier.get_stats()
        values = stats.data["data"] if stats is not None else {}
        calls = [s for series in values.get("vllm:kv_offload_ctxstore_lookup_seconds", {}).values() for s in series]
        deadline = sum(values.get("vllm:kv_offload_ctxstore_lookup_deadline_misses", {}).values())
        print("RESULT " + json.dumps({"phase": phase, "wait": summary(waits), "call": summary(calls),
                                      "wrong_answers": wrong, "deadline_misses": deadline}), flush=True)
    tier.shutdown()


# ---------------------------------------------------------------------------------------------- load generator


def load(endpoint: str, tasks: int) -> None:
    from ctxstore import AsyncContextStore
    from ctxstore.buffers import Destinations

    async def main() -> None:
        async with AsyncContextStore(endpoint, threads=1) as store:
            await store.create_bucket("bench-load")
            blocks = [memoryview(os.urandom(1 << 20)) for _ in range(8)]

            async def loop(t: int) -> None:
                i = 0
                while True:
                    keys = [f"load/{t}/{i % 32}/{j}" for j in range(8)]
                    await store.put_keys("bench-load", keys, blocks, if_absent=False)
                    await store.get_keys("bench-load", keys, Destinations(None, len(keys)))
                    i += 1

            print("LOADING", flush=True)
            await asyncio.gather(*(loop(t) for t in range(tasks)))

    asyncio.run(main())


# ---------------------------------------------------------------------------------------------- orchestration


def run(args: argparse.Namespace) -> dict[str, Any]:
    from _common import ACCESS, CLIENT_CORE, SECRET, Node, Processes

    procs = Processes()
    print(f"# load average {os.getloadavg()}", flush=True)
    try:
        node = Node(procs, "2GiB")
        env = {**os.environ, "CTXSTORE_ACCESS_KEY": ACCESS, "CTXSTORE_SECRET_KEY": SECRET,
               "PYTHONWARNINGS": "ignore", "VLLM_NO_USAGE_STATS": "1"}
        child = procs.start("tier", [vllm_python(), __file__, "probe", node.endpoint, "--rounds", str(args.rounds),
                                     "--keys", str(args.keys)], env, core=CLIENT_CORE,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert child.stdin is not None and child.stdout is not None

        def expect(prefix: str) -> str:
            assert child.stdout is not None
            for raw in child.stdout:
                line = raw.decode()
                if line.startswith(prefix):
                    return line[len(prefix):]
            raise RuntimeError(f"tier probe exited:\n{procs.log_tail(child)}")

        expect("READY")
        results: dict[str, Any] = {}
        for phase in ("idle", "loaded"):
            if phase == "loaded":
                gen = procs.start("load", [sys.executable, __file__, "load", node.endpoint, "--load-tasks",
                                           str(args.load_tasks)], env, core=CLIENT_CORE, stdout=subprocess.PIPE)
                assert gen.stdout is not None
                assert gen.stdout.readline().startswith(b"LOADING")
                time.sleep(1.0)
            child.stdin.write(f"{phase}\n".encode())
            child.stdin.flush()
            results[phase] = json.loads(expect("RESULT "))
            print(json.dumps(results[phase]), flush=True)
        results["config"] = {"rounds": args.rounds, "keys": args.keys, "load_tasks": args.load_tasks,
                             "chunk_bytes": CHUNK, "step_s": STEP, "loadavg_start": os.getloadavg()}
        return results
    finally:
        procs.stop()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", nargs="?", default="run", choices=("run", "probe", "load"))
    parser.add_argument("endpoint", nargs="?")
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--keys", type=int, default=128)
    parser.add_argument("--load-tasks", type=int, default=4)
    parser.add_argument("--out", default=str(ROOT / "docs" / "img" / "vllm_tier.json"))
    args = parser.parse_args()
    if args.mode == "probe":
        probe(args.endpoint, args.rounds, args.keys)
    elif args.mode == "load":
        load(args.endpoint, args.load_tasks)
    else:
        results = run(args)
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
