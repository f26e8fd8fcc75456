"""ctxstore as a secondary tier of vLLM's own KV offloading (``OffloadingConnector`` + ``TieringOffloadingSpec``).

vLLM keeps offloaded chunks in a CPU primary tier and cascades them to secondary tiers, which it loads out of tree
(``{"type": <class name>, "module_path": <module>}`` in ``secondary_tiers``; vLLM 0.32)::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 8589934592,
            "secondary_tiers": [{"type": "CtxStoreTier", "module_path": "ctxstore.integrations.vllm.tier",
                                 "nodes": "node-a:9000,node-b:9000", "bucket": "vllm-tier"}]}}'

:class:`CtxStoreTier` runs in the scheduler process, and none of its methods waits on the pod:

* ``lookup`` answers from batched lookups (vLLM's ``AsyncLookupManager``: the step's keys are flushed in
  ``on_schedule_end`` as one bulk ``lookup`` per node and request, on the manager's thread). Until the answer is
  in it says RETRY — for at most ``lookup_deadline`` seconds from the key's first lookup, after which the answer
  is MISS (the lookup thread stops waiting for the batch at that deadline too, keeping the answers of the nodes
  that were in time; the call runs on to the read timeout, which marks a hung node down): a slow or hung node
  costs a recompute of its chunks, never a stalled request.
* ``submit_store`` / ``submit_load`` hand a ``TransferJob`` to the client's event loop: one bulk ``put`` / ``get``
  per node between the job's primary-tier rows (``primary_kv_view``, no copy) and the pod. ``get_finished_jobs``
  reports each job once it ended: ``JobResult(success=False)`` for any chunk that was not stored, or did not come
  back whole and verified (XXH3-64), ``successful_keys`` naming the chunks that did. A chunk that failed to load
  counts as a miss for its request (``mark_miss``) so vLLM does not try it again; one the pod holds at another
  size than a chunk's is then deleted, so that the chunk vLLM recomputes replaces it.
* ``drain_jobs`` waits for every submitted job (each reports within ``call_timeout`` + 1 s; the check of a failed
  load's chunks takes at most ``call_timeout`` more); ``take_events`` gives the
  pod's ``stored`` (a store the pod acknowledged) and ``removed`` (a chunk held at the wrong size, deleted)
  as vLLM KV events when ``enable_kv_events`` is set and vLLM's KV events are on; ``get_stats`` gives the tier's
  counters (``vllm:kv_offload_ctxstore_*``).

Keys: ``<namespace>/<block hash hex>-<group index>`` from vLLM's ``OffloadKey`` (block hash + KV cache group), the
namespace a :class:`.keys.KeySpace` fingerprint as the connector's, over what the tier's chunk bytes depend on
(model, dtype, host layout, KV cache groups, chunk tokens and bytes, parallelism unless vLLM certifies the chunk
bytes topology-free, vLLM's prefix hash algorithm and seed). vLLM folds a request's ``cache_salt`` into its block
hashes, so tenants do not alias.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import queue
import threading
import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from vllm.logger import init_logger
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingHistogramMetadata,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
    get_offload_block_hash,
    get_offload_group_idx,
)
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import JobId, JobResult, SecondaryTierManager, TransferJob

from ...buffers import Destinations
from ...errors import ConfigurationError
from ...wire import ABSENT
from .common import ConnectorClient, ConnectorConfig
from .keys import KeySpace, hash_seed

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

__all__ = ["METRICS", "CtxStoreTier", "TierConfig", "tier_keyspace"]

log = init_logger("vllm.ctxstore")  # under "vllm": vLLM configures that logger tree

#: The tier's counters (Prometheus names) and their help texts; the lookup histogram is ``LOOKUP_SECONDS``.
METRICS: dict[str, str] = {
    "vllm:kv_offload_ctxstore_lookup_keys": "Chunk keys looked up in the pod (bulk lookups, one call per node).",
    "vllm:kv_offload_ctxstore_lookup_hits": "Chunk keys the pod holds at the expected size.",
    "vllm:kv_offload_ctxstore_lookup_deadline_misses": "Lookups answered MISS because the deadline passed.",
    "vllm:kv_offload_ctxstore_lookup_errors": "Bulk lookups that failed or were abandoned at the deadline.",
    "vllm:kv_offload_ctxstore_stored_chunks": "Chunks the pod stored or already held.",
    "vllm:kv_offload_ctxstore_store_failed_chunks": "Chunks whose store failed (their job reported failure).",
    "vllm:kv_offload_ctxstore_loaded_chunks": "Chunks loaded whole and verified into the primary tier.",
    "vllm:kv_offload_ctxstore_load_failed_chunks": "Chunks that did not load whole and verified.",
}
LOOKUP_SECONDS = "vllm:kv_offload_ctxstore_lookup_seconds"


@dataclass(frozen=True)
class TierConfig:
    """The tier's entry in ``secondary_tiers`` (besides ``type``, ``module_path``, ``backpressure``). Nodes and
    credentials fall back to ``CTXSTORE_NODES``, ``CTXSTORE_ACCESS_KEY`` and ``CTXSTORE_SECRET_KEY``; times are
    seconds."""

    nodes: str | list[str] | None = None
    access_key: str | None = None
    secret_key: str | None = None
    bucket: str = "vllm-tier"
    model: str | None = None  # the namespace's model id (default: vLLM's model name)
    revision: str = ""
    # vLLM's --prefix-caching-hash-algo: a tier sees only vLLM's offloading config, which does not carry it (default:
    # vLLM's config where it is current in this process, which in vLLM's engine it is not, else vLLM's default,
    # sha256). The tier checks it against the hash vLLM seeds its chains with before its first lookup or job.
    hash_algo: str | None = None
    ttl: float | None = None  # of stored chunks (default: the bucket's, else the node's)
    lookup_deadline: float = 0.5  # after this long from a key's first lookup the answer is MISS
    connect_timeout: float = 0.5
    read_timeout: float = 2.0
    call_timeout: float = 10.0  # one bulk call to one node; a job reports (failed) by this + 1 s after it started
    enable_kv_events: bool = False
    locality: str | None = "REMOTE"

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> TierConfig:
        unknown = set(options) - set(cls.__dataclass_fields__)
        if unknown:
            raise ConfigurationError(f"unknown options for the ctxstore tier: {sorted(unknown)}")
        config = cls(**options)
        if not config.lookup_deadline > 0 or not config.call_timeout > 0:
            raise ConfigurationError("lookup_deadline and call_timeout must be positive")
        return config

    def client_config(self) -> ConnectorConfig:
        return ConnectorConfig(nodes=self.nodes, access_key=self.access_key, secret_key=self.secret_key,
                               bucket=self.bucket, connect_timeout=self.connect_timeout,
                               read_timeout=self.read_timeout, call_timeout=self.call_timeout)


def _vllm_hash_algo() -> str | None:
    try:
        from vllm.config import get_current_vllm_config_or_none

        current = get_current_vllm_config_or_none()
    except Exception:  # noqa: BLE001  (not set outside an engine: the tier's option or the default)
        return None
    return None if current is None else str(current.cache_config.prefix_caching_hash_algo)


def _hash_mismatch(algo: str, seed: str) -> str | None:
    """Why vLLM's block hashes are not those of ``algo`` seeded with ``seed`` (None when they are, or while vLLM
    has not seeded its chains yet: its engine builds the tier before ``init_none_hash`` runs)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils

    none_hash = getattr(kv_cache_utils, "NONE_HASH", None)
    if none_hash is None:
        return None
    if bytes(none_hash) == get_hash_fn_by_name(algo)(seed):
        return ""
    return (f"vLLM's block hashes are not {algo} chains seeded with {seed!r}: set the tier's hash_algo to vLLM's "
            "--prefix-caching-hash-algo (and, for xxhash or xxhash_cbor, the same PYTHONHASHSEED in every "
            "instance); the tier answers MISS and fails every job until then")


def tier_keyspace(offloading_spec: OffloadingSpec, chunk_bytes: int, config: TierConfig) -> KeySpace:
    """The namespace of the tier's chunks, from vLLM's normalized offloading configuration."""
    oc = offloading_spec.config
    parallel = oc.parallel
    agnostic = bool(parallel.is_parallelism_agnostic or oc.replicated_layout)
    groups = ",".join(f"{g.group_id}:{g.tokens_per_block}x{len(g.layer_names)}" for g in oc.groups)
    layout = (f"vllm-tier:{oc.kv_cache_layout or 'default'}:canonical={bool(oc.canonical_layout)}:"
              f"replicated={bool(oc.replicated_layout)}:groups={groups}")
    if not agnostic:  # a worker's share of a chunk depends on the topology; topology-free chunks share one space
        layout += f":worker_bytes={oc.worker_kv_bytes_per_block}:pcp={parallel.pcp_size}:dcp={parallel.dcp_size}"
    algo = config.hash_algo or _vllm_hash_algo() or "sha256"
    return KeySpace(model=config.model or oc.model.name, revision=config.revision, kv_dtype=str(oc.model.dtype),
                    kv_layout=layout, block_size=oc.cache.tokens_per_hash * oc.cache.blocks_per_chunk,
                    block_bytes=chunk_bytes, hash_algo=algo, seed=hash_seed(algo),
                    tp_size=1 if agnostic else parallel.tp_size, pp_size=1 if agnostic else parallel.pp_size)


class _Lookups(AsyncLookupManager):
    """vLLM's batched lookups: one bulk lookup per node for a request's keys of a step, all misses if it has not
    answered by the tier's lookup deadline."""

    def __init__(self, tier: CtxStoreTier) -> None:
        self._tier = tier
        super().__init__(tier_type=tier.tier_type)

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        return self._tier._batch_lookup(keys)

    def mark_miss(self, keys: Collection[OffloadKey]) -> None:
        """vLLM's ``mark_miss``, for answered keys only: a key whose lookup is waiting for its batch or still out
        keeps its phase, since vLLM's ``flush`` and ``drain_results`` assert it (the assertion would drop the
        rest of that batch, leaving its keys waiting until the deadline); its answer comes on its own."""
        from vllm.v1.kv_offload.tiering.async_lookup import LookupPhase

        super().mark_miss([k for k in keys if (state := self._lookup_state.get(k)) is not None
                           and state.phase is LookupPhase.RESOLVED])


class CtxStoreTier(SecondaryTierManager):
    """A secondary tier of vLLM's ``TieringOffloadingSpec`` backed by a ctxstore pod."""

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(self, offloading_spec: OffloadingSpec, primary_kv_view: memoryview, tier_type: str,
                 backpressure_detector: BackpressureDetector | None = None, **options: Any) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.config = TierConfig.from_options(options)
        self.locality = Locality(self.config.locality) if self.config.locality else None
        self.keyspace = tier_keyspace(offloading_spec, self.block_size_bytes, self.config)
        self._namespace = self.keyspace.namespace()
        n_chunks = len(primary_kv_view)
        # Bytes, flat: vLLM's view is (chunks, chunk bytes) of int8.
        flat = primary_kv_view.ndim == 1 and primary_kv_view.format == "B"
        self._rows = primary_kv_view if flat else primary_kv_view.cast("B")
        if len(self._rows) < n_chunks * self.block_size_bytes:
            raise ConfigurationError("primary_kv_view is not one contiguous buffer of chunks")
        self.events: list[OffloadingEvent] | None = None
        if self.config.enable_kv_events:
            if offloading_spec.kv_events_config.enable_kv_cache_events:
                self.events = []
            else:
                log.warning("ctxstore tier: enable_kv_events is set but vLLM's KV cache events are off")
        self._stats_lock = threading.Lock()
        self._counts: dict[str, float] = {}
        self._lookup_times: list[float] = []
        self.client = ConnectorClient(self.config.client_config())
        try:
            self.client.run(self.client.store.create_bucket(self.config.bucket))
        except Exception as exc:  # noqa: BLE001  (a node down now gets it when it comes back: see put_keys)
            log.warning("ctxstore tier: bucket %s not created everywhere: %s", self.config.bucket, exc)
        self._finished: queue.SimpleQueue[JobResult] = queue.SimpleQueue()
        self._jobs_lock = threading.Lock()
        self._jobs: dict[JobId, concurrent.futures.Future[None]] = {}
        self._load_keys: dict[JobId, list[OffloadKey]] = {}  # scheduler thread only
        self._asked: dict[OffloadKey, float] = {}  # key -> when its lookup first said RETRY
        self._req_asked: dict[str, set[OffloadKey]] = {}
        self._lookups = _Lookups(self)
        self._hash_checked = False
        self._disabled: str | None = None  # why the tier answers MISS and fails every job
        log.info("ctxstore tier: bucket %s, namespace %s, %d KiB chunks, lookup deadline %g s",
                 self.config.bucket, self._namespace, self.block_size_bytes >> 10, self.config.lookup_deadline)

    # ------------------------------------------------------------------------------------------ keys, stats

    def _usable(self) -> bool:
        """Whether the tier's namespace is vLLM's: checked once vLLM has seeded its block hashes (scheduler
        thread)."""
        if not self._hash_checked:
            try:
                why = _hash_mismatch(self.keyspace.hash_algo, self.keyspace.seed)
            except Exception as exc:  # noqa: BLE001  (another vLLM: the namespace stays as configured)
                why = ""
                log.warning("ctxstore tier: vLLM's block hash seed not checked: %r", exc)
            if why is not None:
                self._hash_checked = True
                if why:
                    self._disabled = why
                    log.error("ctxstore tier: %s", why)
        return self._disabled is None

    def object_key(self, key: OffloadKey) -> str:
        return f"{self._namespace}/{get_offload_block_hash(key).hex()}-{get_offload_group_idx(key)}"

    def _row(self, chunk_id: int) -> memoryview:
        start = int(chunk_id) * self.block_size_bytes
        return self._rows[start:start + self.block_size_bytes]

    def _count(self, name: str, n: float = 1) -> None:
        with self._stats_lock:
            self._counts[name] = self._counts.get(name, 0) + n

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        metrics: dict[str, OffloadingMetricMetadata] = {
            name: OffloadingCounterMetadata(documentation=doc) for name, doc in METRICS.items()}
        metrics[LOOKUP_SECONDS] = OffloadingHistogramMetadata(
            documentation="Seconds from a bulk lookup's start to its answer (or its deadline).",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1))
        return metrics

    def get_stats(self) -> OffloadingConnectorStats | None:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats

        with self._stats_lock:
            counts, self._counts = self._counts, {}
            times, self._lookup_times = self._lookup_times, []
        if not counts and not times:
            return None
        stats = OffloadingConnectorStats()
        for name, value in counts.items():
            stats.increase_counter(f"vllm:kv_offload_ctxstore_{name}", value)
        for seconds in times:
            stats.observe_histogram(LOOKUP_SECONDS, seconds)
        return stats

    # ------------------------------------------------------------------------------------------ lookups

    def _batch_lookup(self, keys: list[OffloadKey]) -> list[bool]:
        """On the lookup manager's thread: one bulk lookup per node, waited for until the lookup deadline; the
        keys of a node that has not answered by then are misses (the others' answers count). A call given up is
        left to end on the client's loop: a node that does not answer within the read timeout is marked down
        there, and later lookups leave its keys out (misses) at once."""
        started = time.monotonic()
        names = [self.object_key(k) for k in keys]
        sizes = [ABSENT] * len(keys)  # each node's answer lands here as it comes
        future = self.client.submit(self.client.store.lookup_keys(self.config.bucket, names, sizes=sizes))
        try:
            future.result(self.config.lookup_deadline)
        except Exception as exc:  # noqa: BLE001  (timeout or failure: the late or failed nodes' keys miss)
            log.warning("ctxstore tier: lookup of %d keys failed: %r", len(keys), exc)
            self._count("lookup_errors")
        answered = list(sizes)  # now: a late node's answer is not this batch's
        hits = [size == self.block_size_bytes for size in answered]
        with self._stats_lock:
            self._lookup_times.append(time.monotonic() - started)
        self._count("lookup_keys", len(keys))
        self._count("lookup_hits", sum(hits))
        return hits

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if not self._usable():
            return LookupResult.MISS
        try:
            found = self._lookups.lookup(key, req_context)
        except Exception as exc:  # noqa: BLE001  (a miss, never an error in the scheduler)
            log.warning("ctxstore tier: lookup failed: %r", exc)
            return LookupResult.MISS
        now = time.monotonic()
        if found is not None:
            self._asked.pop(key, None)
            return LookupResult.HIT if found else LookupResult.MISS
        first = self._asked.setdefault(key, now)
        self._req_asked.setdefault(req_context.req_id, set()).add(key)
        if now - first >= self.config.lookup_deadline:
            # Kept until the answer comes: asked again meanwhile, the key is a MISS at once, not a new wait.
            self._count("lookup_deadline_misses")
            return LookupResult.MISS
        return LookupResult.RETRY

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        try:
            self._lookups.flush()
        except Exception as exc:  # noqa: BLE001
            log.warning("ctxstore tier: lookup flush failed: %r", exc)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        for key in self._req_asked.pop(req_context.req_id, ()):
            self._asked.pop(key, None)
        self._lookups.cleanup(req_context.req_id)

    # ------------------------------------------------------------------------------------------ jobs

    def submit_store(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        rows = [self._row(c) for c in job_metadata.chunk_ids]
        self._submit(job_metadata.job_id, self._store(job_metadata.job_id, keys, rows))

    def submit_load(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        self._load_keys[job_metadata.job_id] = keys
        rows = [self._row(c) for c in job_metadata.chunk_ids]
        self._submit(job_metadata.job_id, self._load(job_metadata.job_id, keys, rows))

    def _submit(self, job_id: JobId, job: Any) -> None:
        try:
            if not self._usable():
                raise ConfigurationError(self._disabled)
            future = self.client.submit(job)
        except Exception as exc:  # noqa: BLE001  (the client is closed, or the tier disabled: the job failed)
            job.close()
            log.warning("ctxstore tier: job %d not started: %r", job_id, exc)
            self._finished.put(JobResult(job_id=job_id, success=False))
            return
        with self._jobs_lock:
            self._jobs[job_id] = future
        future.add_done_callback(lambda f: self._forget(job_id))

    def _forget(self, job_id: JobId) -> None:
        with self._jobs_lock:
            self._jobs.pop(job_id, None)

    async def _bounded(self, call: Any) -> Any:
        """A bulk call given up (cancelled, its connections closed) past the call timeout: it ends before the
        job's result is reported, so no late byte reaches a primary row vLLM may have reused."""
        return await asyncio.wait_for(call, self.client.deadline)

    async def _store(self, job_id: JobId, keys: list[OffloadKey], rows: list[memoryview]) -> None:
        started = time.monotonic()
        result = JobResult(job_id=job_id, success=False)
        try:
            saved = await self._bounded(self.client.store.put_keys(
                self.config.bucket, [self.object_key(k) for k in keys], rows, ttl=self.config.ttl))
            done = saved.stored + saved.existed
            self._count("stored_chunks", done)
            self._count("store_failed_chunks", len(keys) - done)
            result = JobResult(job_id=job_id, success=saved.failed == 0 and done == len(keys),
                               transfer_time=time.monotonic() - started,
                               transfer_bytes=len(keys) * self.block_size_bytes)
            if result.success:
                self._event(keys, removed=False)
        except BaseException as exc:  # noqa: BLE001  (a store that failed is a future miss)
            log.warning("ctxstore tier: store of %d chunks failed: %r", len(keys), exc)
            self._count("store_failed_chunks", len(keys))
        finally:
            _release(rows)
            self._finished.put(result)

    async def _load(self, job_id: JobId, keys: list[OffloadKey], rows: list[memoryview]) -> None:
        started = time.monotonic()
        names = [self.object_key(k) for k in keys]
        good: list[bool] = [False] * len(keys)
        try:
            views = await self._bounded(self.client.store.get_keys(self.config.bucket, names,
                                                                   Destinations(rows, len(rows))))
            good = [v is not None and len(v) == self.block_size_bytes for v in views]
        except BaseException as exc:  # noqa: BLE001  (whatever happened, those chunks are recomputed)
            log.warning("ctxstore tier: load of %d chunks failed: %r", len(keys), exc)
        _release(rows)
        loaded = [k for k, ok in zip(keys, good) if ok]
        failed = [i for i, ok in enumerate(good) if not ok]
        self._count("loaded_chunks", len(loaded))
        self._count("load_failed_chunks", len(failed))
        self._finished.put(JobResult(
            job_id=job_id, success=not failed, successful_keys=tuple(loaded) if failed and loaded else None,
            transfer_time=time.monotonic() - started, transfer_bytes=len(loaded) * self.block_size_bytes))
        if failed:
            await self._drop_bad_copies([keys[i] for i in failed], [names[i] for i in failed])

    async def _drop_bad_copies(self, keys: list[OffloadKey], names: list[str]) -> None:
        """After the job's result: delete the chunks held at another size than a chunk's (a put leaves a live key
        alone, so the copy vLLM recomputes could not replace them). Chunks that were only slow or unreachable
        stay: they are good for every other instance."""
        try:
            sizes = await asyncio.wait_for(self.client.store.lookup_keys(self.config.bucket, names),
                                           self.config.call_timeout)
            bad = [i for i, size in enumerate(sizes) if size != ABSENT and size != self.block_size_bytes]
            if bad:
                await asyncio.wait_for(self.client.store.keys_op(self.config.bucket, "delete",
                                                                 [names[i] for i in bad]),
                                       self.config.call_timeout)
                self._event([keys[i] for i in bad], removed=True)
        except Exception as exc:  # noqa: BLE001  (the chunk stays a miss for its request; it expires by its TTL)
            log.warning("ctxstore tier: %d chunks that failed to load not checked: %r", len(keys), exc)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        results: list[JobResult] = []
        while True:
            try:
                result = self._finished.get_nowait()
            except queue.Empty:
                break
            results.append(result)
            load_keys = self._load_keys.pop(result.job_id, None)
            if load_keys is not None and not result.success:
                # A chunk that did not load is a miss for its request from now on (vLLM recomputes it).
                loaded = set(result.successful_keys or ())
                self._lookups.mark_miss([k for k in load_keys if k not in loaded])
        return results

    def has_pending_work(self) -> bool:
        with self._jobs_lock:
            return bool(self._jobs) or not self._finished.empty()

    def drain_jobs(self) -> None:
        """Wait for every submitted job: each ends (failed, its calls cancelled) within the call timeout."""
        with self._jobs_lock:
            pending = list(self._jobs.values())
        concurrent.futures.wait(pending)

    def _event(self, keys: list[OffloadKey], *, removed: bool) -> None:
        if self.events is not None:
            with self._stats_lock:
                self.events.append(OffloadingEvent(keys=keys, medium=Medium.STORAGE, removed=removed,
                                                   locality=self.locality))

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self.events is None:
            return ()
        with self._stats_lock:
            events, self.events = self.events, []
        return events

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        return  # the pod's own LRU sees the loads; a touch would be one more call per step

    def shutdown(self) -> None:
        self._lookups.shutdown()
        self.drain_jobs()
        self.client.close()
        if self._rows is not self._primary_kv_view:
            # vLLM closes the primary tier's shared memory after this: no view of ours may still export it.
            gc.collect()  # row slices a cancelled call left in reference cycles
            _release([self._rows])


def _release(views: list[memoryview]) -> None:
    """Let go of views over the primary tier (one still exported elsewhere is left to the garbage collector)."""
    for view in views:
        try:
            view.release()
        except BufferError:
            pass
