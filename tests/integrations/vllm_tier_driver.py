"""The ctxstore secondary tier driven directly, for tests/integrations/test_vllm_tier.py; run by the vLLM venv's
python. vLLM's tiering spec refuses CPU workers, so no engine is started: the tier is made by vLLM's own
``SecondaryTierFactory`` from its out-of-tree config, over a primary tier's ``memoryview`` made by vLLM's own
``SharedOffloadRegion``, with a real ``OffloadingSpec`` of a real ``OffloadingConfig``, and fed synthetic
``TransferJob``\\ s as vLLM's ``TieringOffloadingManager`` would.

``python vllm_tier_driver.py NODES BUCKET --hang-pid PID --direct NODE --proxied PROXY``
    Runs every case against the pod at NODES (comma-separated), SIGSTOPs PID (one of the nodes) for the hang
    case and SIGCONTs it after, and loads through PROXY (NODE behind a proxy that flips a get's bytes); prints
    ``REPORT {json}``: per case what was observed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import time
from typing import Any

import numpy as np
from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadingSpec,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.base import SecondaryTierManager, TransferJob
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

CHUNK = 64 << 10
N_CHUNKS = 16
STEP = 0.005  # seconds between scheduler steps


class Spec(OffloadingSpec):
    """vLLM's OffloadingSpec over a real OffloadingConfig (its manager and worker are vLLM's, not needed here)."""

    def get_manager(self) -> Any:
        raise NotImplementedError

    def get_worker(self, kv_caches: Any) -> Any:
        raise NotImplementedError


def make_spec(model: str = "ctxstore-test/tier") -> Spec:
    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("layer.0", "layer.1"), group_id=0),),
        worker_kv_bytes_per_block=CHUNK, enable_kv_cache_events=True, extra_config={}, engine_id="driver",
        model=OffloadingModelConfig(name=model, dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1,
                                          data_parallel_rank_local=None, is_parallelism_agnostic=True))
    return Spec(config)


REGIONS: list[Any] = []  # every primary's shared-memory region, removed at the end


def make_primary(seed: int | None) -> tuple[memoryview, memoryview]:
    """A primary tier's view as vLLM makes it (``SharedOffloadRegion.create_kv_memoryview``: (chunks, chunk
    bytes) of int8 over a /dev/shm mapping) and a flat byte view of it; random rows, or zeros."""
    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

    region = SharedOffloadRegion(engine_id=f"ctxstore-tier-test-{os.getpid()}-{len(REGIONS)}", num_chunks=N_CHUNKS,
                                 rank=None, kv_bytes_per_chunk=CHUNK, cpu_page_size=CHUNK)
    REGIONS.append(region)
    view = region.create_kv_memoryview()
    flat = view.cast("B")
    if seed is not None:
        flat[:] = random.Random(seed).randbytes(N_CHUNKS * CHUNK)
    return flat, view


def make_tier(nodes: str, bucket: str, primary: memoryview, **options: Any) -> SecondaryTierManager:
    config = {"type": "CtxStoreTier", "module_path": "ctxstore.integrations.vllm.tier", "nodes": nodes,
              "bucket": bucket, "enable_kv_events": True, "connect_timeout": 0.5, "read_timeout": 1.0,
              "call_timeout": 2.0, **options}
    return SecondaryTierFactory.create_secondary_tier(config, primary, make_spec())


def keys_of(tag: str, n: int) -> list[Any]:
    return [make_offload_key(f"{tag}-{i}".encode().ljust(32, b"."), 0) for i in range(n)]


def resolve(tier: SecondaryTierManager, keys: list[Any], req: ReqContext, limit: float = 10.0,
            also: tuple[list[Any], ReqContext] | None = None) -> tuple[list[str], float, int]:
    """Scheduler steps until no key says RETRY: the answers, the seconds it took, and the steps. ``also``: a
    second request's keys, looked up in the same steps (its answers follow the first one's)."""
    started, steps = time.monotonic(), 0
    while True:
        answers = [tier.lookup(k, req) for k in keys]
        if also is not None:
            answers += [tier.lookup(k, also[1]) for k in also[0]]
        if LookupResult.RETRY not in answers or time.monotonic() - started > limit:
            return [a.name for a in answers], time.monotonic() - started, steps
        tier.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
        steps += 1
        time.sleep(STEP)


def finish(tier: SecondaryTierManager, job_ids: set[int], limit: float = 10.0) -> dict[int, Any]:
    """Poll get_finished_jobs, as the scheduler does each step, until those jobs reported."""
    results: dict[int, Any] = {}
    deadline = time.monotonic() + limit
    while not job_ids <= set(results) and time.monotonic() < deadline:
        for r in tier.get_finished_jobs():
            results[r.job_id] = r
        time.sleep(STEP)
    return results


def job(job_id: int, keys: list[Any], chunks: list[int], req: ReqContext, *, load: bool) -> TransferJob:
    return TransferJob(job_id=job_id, keys=keys, chunk_ids=np.array(chunks, dtype=np.int64), is_promotion=load,
                       req_context=req)


def rows(raw: memoryview, chunks: list[int]) -> list[bytes]:
    return [bytes(raw[c * CHUNK:(c + 1) * CHUNK]) for c in chunks]


def run(nodes: str, bucket: str, hang_pid: int) -> dict[str, Any]:
    report: dict[str, Any] = {}
    raw_a, primary_a = make_primary(1)
    raw_b, primary_b = make_primary(None)
    a = make_tier(nodes, bucket, primary_a)
    b = make_tier(nodes, bucket, primary_b)  # another vLLM: its own primary, the same pod
    report["tier_class"] = type(a).__module__ + "." + type(a).__name__
    report["metric_definitions"] = sorted(type(a).build_metric_definitions({}))
    report["same_namespace"] = a.keyspace.namespace() == b.keyspace.namespace()  # type: ignore[attr-defined]
    other = SecondaryTierFactory.create_secondary_tier(
        {"type": "CtxStoreTier", "module_path": "ctxstore.integrations.vllm.tier", "nodes": nodes,
         "bucket": bucket}, make_primary(None)[1], make_spec("another/model"))
    report["other_model_namespace_differs"] = (
        other.keyspace.namespace() != a.keyspace.namespace())  # type: ignore[attr-defined]
    other.shutdown()
    refused: dict[str, str] = {}
    threads_before = client_threads()
    for name, where, options in (("unknown option", nodes, {"nodez": nodes}),
                                 ("random hash seed", nodes, {"hash_algo": "xxhash"}),
                                 ("bad nodes", "bad:port:x", {})):
        try:
            make_tier(where, bucket, make_primary(None)[1], **options).shutdown()
            refused[name] = ""
        except Exception as exc:  # noqa: BLE001
            refused[name] = f"{type(exc).__name__}: {exc}"
    report["refused"] = refused
    report["refusals_left_threads"] = client_threads() - threads_before  # the client's loop thread, if started
    req = ReqContext(req_id="r1")

    # Round trip: A stores 8 chunks; B finds them by lookup and loads them into other rows, byte for byte.
    keys = keys_of("prefix", 8)
    src, dst = [1, 3, 5, 7, 9, 11, 13, 15], [0, 2, 4, 6, 8, 10, 12, 14]
    a.submit_store(job(1, keys, src, req, load=False))
    stored = finish(a, {1})
    report["store"] = {"success": stored[1].success if 1 in stored else None,
                       "events": [(len(e.keys), e.removed, e.medium.name) for e in a.take_events()]}
    answers, took, steps = resolve(b, keys, req)
    report["lookup"] = {"answers": answers, "seconds": took, "steps": steps}
    b.submit_load(job(2, keys, dst, req, load=True))
    loaded = finish(b, {2})
    before = bytes(raw_b)
    report["load"] = {"success": loaded[2].success if 2 in loaded else None,
                      "bytes": loaded[2].transfer_bytes if 2 in loaded else None,
                      "exact": rows(raw_b, dst) == rows(raw_a, src),
                      "rest_untouched": all(before[c * CHUNK:(c + 1) * CHUNK] == bytes(CHUNK)
                                            for c in range(N_CHUNKS) if c not in dst)}
    b.on_request_finished(req)

    # Absent keys are misses; a load of present and absent chunks fails, naming the ones that arrived, and
    # the absent ones become misses for the request (mark_miss).
    req2 = ReqContext(req_id="r2")
    absent = keys_of("absent", 3)
    answers, took, _ = resolve(b, absent, req2)
    report["absent_lookup"] = answers
    mixed = keys[:2] + absent[:1]
    b.submit_load(job(3, mixed, [1, 3, 5], req2, load=True))
    got = finish(b, {3}).get(3)
    report["partial_load"] = {
        "success": got.success if got else None,
        "successful_keys": sorted(mixed.index(k) for k in (got.successful_keys or ())) if got else None,
        "events": [(len(e.keys), e.removed) for e in b.take_events()],
        "absent_after": b.lookup(absent[0], req2).name}
    b.on_request_finished(req2)

    # A stored copy that is not whole (a short object under the chunk's key): a failed load, and the copy is
    # deleted, so the chunk vLLM recomputes and stores again replaces it.
    from ctxstore import ContextStore

    bad = keys_of("short", 1)
    with ContextStore(nodes, threads=1) as store:
        store.put_keys(bucket, [b.object_key(bad[0])], [memoryview(b"x" * (CHUNK // 2))])  # type: ignore[attr-defined]
        b.submit_load(job(4, bad, [0], ReqContext(req_id="r3"), load=True))
        got = finish(b, {4}).get(4)
        b.drain_jobs()  # the bad copy is deleted after the job's result
        left = store.lookup_keys(bucket, [b.object_key(bad[0])])[0]  # type: ignore[attr-defined]
        a.submit_store(job(5, bad, [0], ReqContext(req_id="r3"), load=False))
        restored = finish(a, {5}).get(5)
        b.submit_load(job(6, bad, [2], ReqContext(req_id="r3"), load=True))
        again = finish(b, {6}).get(6)
    report["short_copy"] = {"success": got.success if got else None, "size_after": left,
                            "restored_store": restored.success if restored else None,
                            "reload": again.success if again else None,
                            "exact": rows(raw_b, [2]) == rows(raw_a, [0])}

    # A hung node (SIGSTOP): lookups of keys on it answer MISS once the deadline passed (RETRY until then,
    # never longer); a load from it fails within the call timeout; drain_jobs waits for it.
    c = make_tier(nodes, bucket, make_primary(None)[1], lookup_deadline=0.3)
    d = make_tier(nodes, bucket, make_primary(None)[1], lookup_deadline=0.3)  # lookups only
    fresh = keys_of("hang", 32)
    a.submit_store(job(7, fresh, list(range(16)) * 2, req, load=False))
    report["hang_store_before"] = finish(a, {7})[7].success
    a.take_events()
    req4 = ReqContext(req_id="r4")
    os.kill(hang_pid, signal.SIGSTOP)
    try:
        # Two requests in one step: vLLM's lookup thread takes their batches one after the other, so the
        # second waits behind the first: the tier's own deadline answers it.
        req4b = ReqContext(req_id="r4b")
        answers, took, steps = resolve(c, fresh[:16], req4, also=(fresh[16:], req4b))
        # Asked again while its batch is still out: a MISS at once, not a new wait.
        again = [c.lookup(k, req4b).name for k in fresh[16:]]
        hung_port = int(nodes.split(",")[-1].rsplit(":", 1)[1])
        owners = c.client.store.pod.group([c.object_key(k) for k in fresh])  # type: ignore[attr-defined]
        on_hung = {i for node, idx in owners.items() if node.port == hung_port for i in idx}
        report["hang_lookup"] = {"answers": sorted(set(answers)), "seconds": took, "steps": steps,
                                 "deadline": 0.3, "asked_again": sorted(set(again)),
                                 "hung_node_answers": sorted({answers[i] for i in on_hung})}
        # A load of keys whose lookups are still out (their batch waits behind the hung one): the failed
        # chunks' mark_miss must leave those lookups to their own answers.
        c.submit_load(job(8, fresh[:16], list(range(16)), req4, load=True))
        # It returned with the job still running: it cannot end before the hung node's read timeout. (Stores and
        # loads are both handed to the client's loop the same way: the scheduler never waits for one.)
        pending_at_return = c.has_pending_work()
        t0 = time.monotonic()
        c.drain_jobs()
        drained = time.monotonic() - t0
        results = {r.job_id: r for r in c.get_finished_jobs()}
        report["hang_load"] = {"pending_at_return": pending_at_return, "drain_s": drained,
                               "reported_after_drain": 8 in results,
                               "success": results[8].success if 8 in results else None,
                               "pending_after": c.has_pending_work()}
        later = keys_of("hang-later", 8)
        answers, took, _ = resolve(c, later, ReqContext(req_id="r5"))
        report["hang_second_lookup"] = {"answers": sorted(set(answers)), "seconds": took}
        # The lookups given up at the deadline ran on to the read timeout and marked the hung node down: the
        # other node's chunks are HITs again, at once (c: after its failed load too; d: lookups alone).
        for r in (req4, req4b):
            c.on_request_finished(r)
        d_first = resolve(d, fresh, ReqContext(req_id="d1"))[0]
        d.on_request_finished(ReqContext(req_id="d1"))
        # Until each client has marked the hung node (the last one) down and only it (the read timeout: about
        # 1.5 s here, later on a loaded machine, where a slow answer may also have marked the other down until
        # its probe), for at most 10 s.
        # The scheduler steps meanwhile, as vLLM's does: each step drains the lookup answers that came back
        # (those of the batches given up at the deadline too; left undrained, vLLM would hand such a stale
        # MISS to the next request asking for the same keys).
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(
                any(n.up == (n.port == hung_port) for n in tier.client.store.pod.nodes) for tier in (c, d)):
            time.sleep(0.1)
        for tier in (c, d):
            tier.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
        for name, tier in (("", c), ("lookups_only_", d)):
            answers, took, _ = resolve(tier, fresh, ReqContext(req_id="r6"))
            report[f"hang_node_down_{name}lookup"] = {
                "hits": answers.count("HIT"), "misses": answers.count("MISS"), "seconds": took,
                "nodes": [(n.port, n.up, n.last_error) for n in tier.client.store.pod.nodes],
                "waited": round(time.monotonic() - deadline + 10, 2)}
        report["hang_node_down_lookups_only_lookup"]["first"] = sorted(set(d_first))
        report["hang_node_down_lookups_only_lookup"]["first_on_hung_node"] = sorted({d_first[i] for i in on_hung})
    finally:
        os.kill(hang_pid, signal.SIGCONT)
    # The load that failed on the hung node deleted nothing: its chunks are good for every other instance.
    with ContextStore(nodes, threads=1) as store:
        sizes = store.lookup_keys(bucket, [c.object_key(k) for k in fresh])  # type: ignore[attr-defined]
    report["hang_chunks_kept"] = sum(size == CHUNK for size in sizes)
    stats = c.get_stats()
    report["stats"] = stats.reduce() if stats is not None else {}
    for tier in (a, b, c, d):
        tier.shutdown()
    report["loops_closed"] = all(t.client.loop.is_closed() for t in (a, b, c, d))  # type: ignore[attr-defined]
    return report


def client_threads() -> int:
    import threading

    return sum(t.name == "ctxstore-vllm" for t in threading.enumerate())


def pending_mark_miss(nodes: str, bucket: str) -> list[str]:
    """A load fails for a key whose lookup still waits for its step's flush (pending): the failed chunk's
    mark_miss must leave it pending, or vLLM's flush asserts and drops the whole batch, the other key with it."""
    tier = make_tier(nodes, bucket, make_primary(3)[1])
    present, absent = keys_of("pending-present-" + os.urandom(4).hex(), 1), keys_of("pending-absent", 1)
    tier.submit_store(job(40, present, [0], ReqContext(req_id="p0"), load=False))
    finish(tier, {40})
    req = ReqContext(req_id="p1")
    assert [tier.lookup(k, req) for k in present + absent] == [LookupResult.RETRY] * 2  # pending: no flush yet
    tier.submit_load(job(41, absent, [1], req, load=True))
    finish(tier, {41})  # get_finished_jobs: the failed chunk marked a miss
    answers = resolve(tier, present + absent, req)[0]
    tier.shutdown()
    return answers


def flipped_load(direct: str, proxied: str, bucket: str) -> dict[str, Any]:
    """A chunk whose bytes are flipped on the wire (a fault proxy in front of the node) fails its load, and stays
    in the pod: the copy there is whole, and good for every other instance."""
    from ctxstore import ContextStore

    writer = make_tier(direct, bucket, make_primary(5)[1])
    reader = make_tier(proxied, bucket, make_primary(None)[1])
    keys, req = keys_of("flipped-" + os.urandom(4).hex(), 1), ReqContext(req_id="f1")
    writer.submit_store(job(50, keys, [0], req, load=False))
    stored = finish(writer, {50}).get(50)
    reader.submit_load(job(51, keys, [0], req, load=True))
    loaded = finish(reader, {51}).get(51)
    reader.drain_jobs()  # the check of the failed chunk, after the job's result
    with ContextStore(direct, threads=1) as store:
        size = store.lookup_keys(bucket, [reader.object_key(keys[0])])[0]  # type: ignore[attr-defined]
    out = {"stored": stored.success if stored else None, "loaded": loaded.success if loaded else None,
           "kept": size == CHUNK, "removed": [e.removed for e in reader.take_events() if e.removed]}
    for tier in (writer, reader):
        tier.shutdown()
    return out


def offloading_config(engine: str, nodes: str, bucket: str, *, tp: int = 1, agnostic: bool = True,
                      worker_bytes: int = CHUNK, world: int = 1) -> OffloadingConfig:
    """An OffloadingConfig whose secondary tier is this one, as vLLM's scheduler builds it from --kv-transfer-config
    (a primary of four chunks)."""
    tier = {"type": "CtxStoreTier", "module_path": "ctxstore.integrations.vllm.tier", "nodes": nodes,
            "bucket": bucket, "enable_kv_events": True, "locality": "REMOTE", "connect_timeout": 0.5,
            "read_timeout": 1.0, "call_timeout": 2.0}
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("layer.0", "layer.1"), group_id=0),),
        worker_kv_bytes_per_block=worker_bytes, enable_kv_cache_events=True, engine_id=engine,
        extra_config={"cpu_bytes_to_use": 4 * CHUNK * world, "secondary_tiers": [tier]},
        model=OffloadingModelConfig(name="ctxstore-test/tier", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(rank=0, world_size=world, tp_size=tp, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1,
                                          data_parallel_rank_local=None, is_parallelism_agnostic=agnostic))


def real_manager(nodes: str, bucket: str) -> dict[str, Any]:
    """vLLM's own TieringOffloadingManager (scheduler side; it runs on CPU, only the workers need a GPU) over
    two instances: A's chunk goes GPU -> primary -> cascaded to the pod, B looks it up, promotes it into its
    primary and finds it byte-exact; both shut down and vLLM closes their shared memory."""
    import logging

    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    class Capture(logging.Handler):
        def __init__(self) -> None:
            super().__init__(logging.WARNING)
            self.messages: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.messages.append(record.getMessage())

    capture = Capture()
    logging.getLogger("vllm").addHandler(capture)
    end = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
    managers = [TieringOffloadingSpec(offloading_config(f"{name}-{os.getpid()}", nodes, bucket)).get_manager()
                for name in ("a", "b")]
    a, b = managers
    keys = keys_of("manager-" + os.urandom(4).hex(), 3)
    out: dict[str, Any] = {}
    req_a = ReqContext(req_id="ma")
    a.on_new_request(req_a)
    prepared = a.prepare_store(keys, req_a)
    assert prepared is not None
    view_a = memoryview(a.primary_tier.get_kv_memoryview()).cast("B")
    for chunk in prepared.store_spec.chunk_ids:
        view_a[int(chunk) * CHUNK:(int(chunk) + 1) * CHUNK] = bytes([int(chunk) + 7]) * CHUNK  # GPU -> primary
    written = {k: bytes([int(c) + 7]) * CHUNK for k, c in zip(keys, prepared.store_spec.chunk_ids)}
    del view_a
    a.complete_store(keys, req_a)
    deadline = time.monotonic() + 10
    while a.has_pending_work() and time.monotonic() < deadline:  # the cascade to the pod
        a.on_schedule_end(end)
        time.sleep(STEP)
    out["cascaded"] = not a.has_pending_work()
    out["stored_events"] = sum(len(e.keys) for e in a.take_events() if e.medium.name == "STORAGE" and not e.removed)
    a.on_request_finished(req_a)
    req_b = ReqContext(req_id="mb")
    b.on_new_request(req_b)
    answers: list[Any] = []
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # B's lookups: RETRY, then the pod's answer promotes the chunks
        answers = [b.lookup(k, req_b) for k in keys]
        if all(x is LookupResult.HIT for x in answers):
            break
        b.on_schedule_end(end)
        time.sleep(STEP)
    out["answers"] = [x.name if x is not None else None for x in answers]
    spec = b.prepare_load(keys, req_b)
    view_b = memoryview(b.primary_tier.get_kv_memoryview()).cast("B")
    out["exact"] = all(bytes(view_b[int(c) * CHUNK:(int(c) + 1) * CHUNK]) == written[k]
                       for k, c in zip(keys, spec.chunk_ids))
    del view_b
    b.complete_load(keys, req_b)
    b.on_request_finished(req_b)
    regions = [m.primary_tier._mmap_region for m in managers]  # vLLM's shared memory, which shutdown closes
    for m in managers:
        m.shutdown()
    out["shared_memory_closed"] = all(r.mmap_obj is None for r in regions)
    out["close_warnings"] = [m for m in capture.messages if "mmap" in m or "fd" in m]
    logging.getLogger("vllm").removeHandler(capture)
    return out


def namespaces(nodes: str, bucket: str) -> dict[str, Any]:
    """The tier's namespace across topologies: one for chunks vLLM certifies topology-free, one each otherwise."""
    from ctxstore.integrations.vllm.tier import TierConfig, tier_keyspace

    def namespace(tp: int, agnostic: bool) -> str:
        config = offloading_config("ns", nodes, bucket, tp=tp, agnostic=agnostic, worker_bytes=CHUNK // tp)
        return tier_keyspace(Spec(config), CHUNK, TierConfig()).namespace()

    return {"agnostic": len({namespace(tp, True) for tp in (1, 2, 4)}),
            "per_topology": len({namespace(tp, False) for tp in (1, 2, 4)})}


def hash_check(nodes: str, bucket: str) -> dict[str, Any]:
    """vLLM seeds its block hashes with another algorithm than the tier's (last: NONE_HASH is process-wide)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import init_none_hash

    init_none_hash(get_hash_fn_by_name("sha256_cbor"))  # vLLM's --prefix-caching-hash-algo sha256_cbor
    wrong = make_tier(nodes, bucket, make_primary(None)[1])  # the default: sha256
    right = make_tier(nodes, bucket, make_primary(None)[1], hash_algo="sha256_cbor")
    keys, req = keys_of("hash-check", 2), ReqContext(req_id="h1")
    out = {"wrong_lookup": [wrong.lookup(k, req).name for k in keys]}
    wrong.submit_store(job(20, keys, [0, 1], req, load=False))
    result = finish(wrong, {20}).get(20)
    out["wrong_store"] = result.success if result else None
    out["right_lookup"] = resolve(right, keys, req)[0]  # asked, answered: the chunks were never stored
    right.submit_store(job(21, keys, [0, 1], req, load=False))
    result = finish(right, {21}).get(21)
    out["right_store"] = result.success if result else None
    for tier in (wrong, right):
        tier.shutdown()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("nodes")
    parser.add_argument("bucket")
    parser.add_argument("--hang-pid", type=int, required=True)
    parser.add_argument("--direct", required=True, help="one node, directly")
    parser.add_argument("--proxied", required=True, help="the same node through a proxy that flips a get's bytes")
    args = parser.parse_args()
    try:
        report = run(args.nodes, args.bucket, args.hang_pid)
        report["real_manager"] = real_manager(args.nodes, args.bucket)
        report["namespaces"] = namespaces(args.nodes, args.bucket)
        report["pending_mark_miss"] = pending_mark_miss(args.nodes, args.bucket)
        report["flipped_load"] = flipped_load(args.direct, args.proxied, args.bucket)
        report["hash_check"] = hash_check(args.nodes, args.bucket)
        print("REPORT " + json.dumps(report), flush=True)
    finally:
        for region in REGIONS:
            region.cleanup()


if __name__ == "__main__":
    main()
