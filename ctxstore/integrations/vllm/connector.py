"""``CtxStoreConnector``: vLLM's paged KV cache saved to and restored from a ctxstore pod.

One class, instantiated by vLLM twice: with role SCHEDULER in the engine core, with role WORKER in each worker.

Scheduler side
    ``on_new_request`` starts one bulk ``lookup`` per node for the request's full prompt blocks (keys from
    ``request.block_hashes``, :mod:`.keys`); ``get_num_new_matched_tokens`` answers from it: the longest prefix
    present on every rank, past what vLLM already holds. A lookup still in flight after ``lookup_wait`` answers
    ``None`` (vLLM asks again next step); one older than the call timeout counts as a miss. Loads are
    synchronous to the step that needs them (the worker finishes them in ``start_load_kv``, before the forward
    pass). Saves: every step, each scheduled request's blocks that became full (and have a hash) and that the
    lookup did not find, go into the step's metadata.

Worker side
    ``register_kv_caches`` learns the layout (:class:`.layout.PagedLayout`). ``start_load_kv`` fetches the step's
    blocks with one bulk ``get`` per node, each object scattered straight into the KV cache's pieces of its
    block (:class:`ctxstore.buffers.Scatter`) — or, for a cache on a GPU, through the client's staging pool
    (pinned chunks, one copy per chunk, an ``index_copy_`` per layer on the device; :class:`.layout.PagedTarget`),
    the load complete before the forward pass; every block that did not arrive whole and verified goes to
    ``get_block_ids_with_load_errors`` and vLLM recomputes from the first such block on. The worker tells the
    scheduler how many leading blocks of each load arrived (:class:`CtxStoreWorkerMetadata`): the scheduler counts
    only those as hits, and saves the failed blocks again once vLLM recomputed them, in place of the stored copy
    that failed (it may be bad on its node, and a put leaves an existing key alone). ``wait_for_save`` copies the
    step's new blocks out of the cache (one gather per layer, on the cache's device) and sends them with bulk
    ``put`` in the background (from a GPU through the staging pool); ``request_finished`` keeps a request's
    blocks until its saves are acknowledged (``get_finished``).

Failures never reach vLLM: every client call is bounded by the configured timeouts (plus a hard deadline, after
which the call is cancelled and its connections closed, so nothing writes into the cache afterwards), and any
error on the data path is a miss (lookup), a load error (recompute) or a dropped save (a future miss). vLLM must
run with ``kv_load_failure_policy: "recompute"`` (its default, ``"fail"``, would fail the request instead): the
connector sets it when it was left at the default and says so in the log.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.logger import init_logger

from ...buffers import Destinations, Scatter, byte_view
from ...core import AsyncContextStore, Limits, SaveResult, Timeouts
from ...errors import ConfigurationError
from ...staging import ready
from ...wire import ABSENT
from .keys import KeySpace, hash_seed
from .layout import PagedLayout
from .metrics import CtxStoreConnectorStats, CtxStorePromMetrics, StatsCounter

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["ConnectorConfig", "CtxStoreConnector", "CtxStoreConnectorMetadata", "CtxStoreWorkerMetadata"]

log = init_logger("vllm.ctxstore")  # under "vllm": vLLM configures that logger tree
T = TypeVar("T")
# How long a lookup's answer waits for the nodes to take the prefetch that follows it: one round trip, so the
# load the answer leads to cannot overtake the prefetch; a node slower than this only loses the prefetch's head start.
PREFETCH_ORDER_WAIT = 0.25


# ---------------------------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class ConnectorConfig:
    """``kv_connector_extra_config``. Nodes and credentials fall back to ``CTXSTORE_NODES``,
    ``CTXSTORE_ACCESS_KEY`` and ``CTXSTORE_SECRET_KEY``; times are seconds."""

    nodes: str | list[str] | None = None
    access_key: str | None = None
    secret_key: str | None = None
    bucket: str = "vllm-kv"
    model: str | None = None  # the namespace's model id (default: vLLM's model name or path)
    revision: str | None = None
    ttl: float | None = None  # of saved blocks (default: the bucket's, else the node's)
    connect_timeout: float = 0.5
    read_timeout: float = 2.0
    call_timeout: float = 10.0  # one bulk call to one node; also the hard deadline of a load
    lookup_wait: float = 0.002  # how long get_num_new_matched_tokens waits for a lookup before answering None
    load: bool = True
    save: bool = True
    prefetch: bool = True  # after a lookup, ask nodes with a flash tier to bring the matched prefix into RAM
    save_decode: bool = True  # also save blocks filled by generated tokens
    max_pending_save_bytes: int = 1 << 30  # staged saves in flight beyond this are dropped (a future miss)
    # The client's staging pool: GPU caches always go through it; "host" sends a CPU cache through it too (a
    # diagnostic: the GPU path's every step, in host memory).
    staging: str = "auto"
    staging_bytes: int = 1 << 30

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> ConnectorConfig:
        known = set(cls.__dataclass_fields__)
        unknown = set(extra) - known
        if unknown:
            raise ConfigurationError(f"unknown kv_connector_extra_config keys for ctxstore: {sorted(unknown)}")
        return cls(**extra)

    def timeouts(self) -> Timeouts:
        return Timeouts(connect=self.connect_timeout, read=self.read_timeout, total=self.call_timeout)


class _Client:
    """An :class:`AsyncContextStore` on a private event-loop thread; calls return futures or bounded results."""

    def __init__(self, config: ConnectorConfig) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="ctxstore-vllm", daemon=True)
        self._thread.start()
        self.store = AsyncContextStore(config.nodes, access_key=config.access_key, secret_key=config.secret_key,
                                       timeouts=config.timeouts(), limits=Limits(), staging=config.staging,
                                       staging_bytes=config.staging_bytes)
        self.deadline = config.call_timeout + 1.0  # the client's own per-call timeouts come first

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run to completion within the hard deadline; past it, cancel (closing the call's connections, so no
        late byte lands in a caller's buffer) and raise TimeoutError."""
        done = threading.Event()

        async def guarded() -> T:
            try:
                return await coro
            finally:
                done.set()

        future = self.submit(guarded())
        try:
            return future.result(self.deadline)
        except concurrent.futures.TimeoutError:
            future.cancel()
            done.wait(5.0)
            raise TimeoutError(f"ctxstore call exceeded {self.deadline:g} s") from None

    def close(self) -> None:
        try:
            self.submit(self.store.aclose()).result(5.0)
        except Exception:  # noqa: BLE001  (closing is best effort)
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5.0)


# ---------------------------------------------------------------------------------------------- metadata


@dataclass
class _Transfer:
    req_id: str
    block_ids: list[int]
    block_hashes: list[bytes]
    cache_salt: str | None
    replace: bool = False  # a save of blocks whose stored copies failed to load: delete those first


@dataclass
class CtxStoreConnectorMetadata(KVConnectorMetadata):
    """Scheduler → worker, per step: the blocks to load before the forward pass and to save after it."""

    loads: list[_Transfer] = field(default_factory=list)
    saves: list[_Transfer] = field(default_factory=list)


@dataclass
class CtxStoreWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker → scheduler, per step: for each request whose blocks the step loaded, how many of its leading
    blocks arrived whole and verified. vLLM recomputes from the first block that failed on any rank, so the
    ranks' reports aggregate by the minimum."""

    loaded: dict[str, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, CtxStoreWorkerMetadata)
        for req_id, n in other.loaded.items():
            self.loaded[req_id] = min(n, self.loaded.get(req_id, n))
        return self


@dataclass
class _Lookup:
    future: concurrent.futures.Future[list[int]] | None
    n_blocks: int
    started: float
    prefix: int | None = None  # blocks present on every rank, once known


@dataclass
class _Load:
    """A load handed to the workers, until they say how much of it arrived."""

    first: int  # the request's block index of block_ids[0]
    block_ids: list[int]
    skip_tokens: int  # tokens of the first block that vLLM already held
    tokens: int  # the external tokens vLLM was promised


@dataclass
class _RequestState:
    request: Request
    lookup: _Lookup | None = None
    saved_upto: int = 0  # blocks [0, saved_upto) are in ctxstore or scheduled for saving
    saves_scheduled: bool = False
    local_tokens: int = 0  # what vLLM itself held when the load was decided
    load: _Load | None = None
    resave: list[int] = field(default_factory=list)  # block indexes whose stored copy failed to load


# ---------------------------------------------------------------------------------------------- connector


class CtxStoreConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM KV connector backed by a ctxstore pod (see the module docstring and docs/integrations.md)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.config = ConnectorConfig.from_extra(dict(self._kv_transfer_config.kv_connector_extra_config))
        if self._kv_transfer_config.kv_load_failure_policy != "recompute":
            # A ctxstore block that fails to load is a cache miss; vLLM's default would fail the request.
            log.warning("ctxstore: setting kv_load_failure_policy to 'recompute' (was %r): a block that "
                        "cannot be loaded is recomputed", self._kv_transfer_config.kv_load_failure_policy)
            self._kv_transfer_config.kv_load_failure_policy = "recompute"
        cache = vllm_config.cache_config
        groups = kv_cache_config.kv_cache_groups
        self.enabled = len(groups) == 1
        if not self.enabled:
            log.warning("ctxstore: %d KV cache groups (a hybrid model): the connector supports one full-attention "
                        "group and stays idle", len(groups))
        self.block_size = cache.block_size
        self.keyspace = _keyspace(vllm_config, kv_cache_config)
        self.stats = StatsCounter()
        self.client = _Client(self.config)
        # scheduler side
        self._requests: dict[str, _RequestState] = {}
        self._prefetches: set[asyncio.Task[int]] = set()  # started after lookups, on the client loop
        self._loads: list[_Transfer] = []
        # worker side
        self.layout: PagedLayout | None = None
        self._staged = False  # loads and saves through the client's staging pool (a GPU cache)
        self._tp_rank, self._pp_rank = _ranks() if role == KVConnectorRole.WORKER else (0, 0)
        self._lock = threading.Lock()
        self._load_errors: set[int] = set()
        self._loaded: dict[str, int] = {}  # this step's loads: req_id -> leading blocks that arrived
        self._pending_saves: dict[str, int] = {}  # req_id -> puts in flight
        self._saving: set[str] = set()  # requests with save state on this worker
        self._finished: set[str] = set()  # of those, finished by the scheduler (blocks held for us)
        self._pending_bytes = 0
        log.info("ctxstore: %s connector, bucket %s, namespace %s", role.name.lower(), self.config.bucket,
                 self.keyspace.namespace(self._tp_rank, self._pp_rank))

    # ------------------------------------------------------------------ properties vLLM asks

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # best effort: a dropped save is a future miss

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return CtxStoreConnectorStats(data=data) if data is not None else CtxStoreConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type[PromMetric], type[PromMetricT]],
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVConnectorPromMetrics | None:
        return CtxStorePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        data = self.stats.take()
        return CtxStoreConnectorStats(data=data) if data else None

    # ------------------------------------------------------------------ scheduler side

    def on_new_request(self, request: Request) -> None:
        # Enqueue time: the lookup runs while the request waits, followed (without waiting for it) by a prefetch
        # of the matched prefix, so blocks on a node's flash tier are in RAM when the load comes.
        state = _RequestState(request)
        self._requests[request.request_id] = state
        if self.enabled and self.config.load:
            try:
                state.lookup = self._start_lookup(request)
            except Exception as exc:  # noqa: BLE001  (nothing from the data path reaches the scheduler)
                log.warning("ctxstore: lookup not started: %s", exc)
                state.lookup = _Lookup(None, 0, time.monotonic(), prefix=0)

    def _start_lookup(self, request: Request) -> _Lookup:
        # The last prompt token is always computed by vLLM itself, so a block holding it is never loaded.
        n_blocks = min(max(request.num_prompt_tokens - 1, 0) // self.block_size, len(request.block_hashes))
        started = time.monotonic()
        if n_blocks == 0:
            return _Lookup(None, 0, started, prefix=0)
        ranks = self.keyspace.all_rank_keys(request.block_hashes[:n_blocks], request.cache_salt)
        keys = [k for rank in ranks for k in rank]
        try:
            future = self.client.submit(self._lookup(ranks, n_blocks))
        except Exception as exc:  # noqa: BLE001  (a miss, never an error in the scheduler)
            log.warning("ctxstore: lookup not started: %s", exc)
            return _Lookup(None, n_blocks, started, prefix=0)
        self.stats.add("lookups")
        return _Lookup(future, n_blocks, started)

    async def _lookup(self, ranks: list[list[str]], n_blocks: int) -> list[int]:
        """One lookup of every rank's keys; then, if asked, a prefetch of the prefix every rank holds. The answer
        waits for the nodes to take the prefetch (they answer at once; at most ``PREFETCH_ORDER_WAIT``), so the
        load that follows the answer never reaches a node before its prefetch; its failure is only a slower load."""
        store, bucket = self.client.store, self.config.bucket
        keys = [k for rank in ranks for k in rank]
        found = await store.locate_keys(bucket, keys)
        sizes = [ABSENT if f is None else f[0] for f in found]
        prefix = _common_prefix(sizes, n_blocks, self.keyspace.block_bytes)
        cold = [k for i, (k, f) in enumerate(zip(keys, found))  # within every rank's matched prefix
                if i % n_blocks < prefix and f is not None and f[1] == "disk"] if self.config.prefetch else []
        if cold:  # only blocks on a node's flash tier: nothing to ask of RAM-only nodes
            task = asyncio.get_running_loop().create_task(store.prefetch_keys(bucket, cold))
            self._prefetches.add(task)
            task.add_done_callback(self._prefetch_done)
            await asyncio.wait({task}, timeout=PREFETCH_ORDER_WAIT)
        return sizes

    def _prefetch_done(self, task: asyncio.Task[int]) -> None:
        self._prefetches.discard(task)
        if not task.cancelled() and task.exception() is None and task.result():
            self.stats.add("prefetched_blocks", task.result())

    def _lookup_prefix(self, lookup: _Lookup) -> int | None:
        if lookup.prefix is not None:
            return lookup.prefix
        assert lookup.future is not None
        try:
            sizes = lookup.future.result(self.config.lookup_wait)
        except concurrent.futures.TimeoutError:
            if time.monotonic() - lookup.started < self.client.deadline:
                return None  # still in flight: vLLM asks again next step
            lookup.future.cancel()
            sizes = []
            self.stats.add("lookup_errors")
        except Exception as exc:  # noqa: BLE001
            log.warning("ctxstore: lookup failed: %s", exc)
            sizes = []
            self.stats.add("lookup_errors")
        lookup.prefix = _common_prefix(sizes, lookup.n_blocks, self.keyspace.block_bytes)
        self.stats.add("lookup_ms", (time.monotonic() - lookup.started) * 1e3)
        return lookup.prefix

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        try:
            return self._matched_tokens(request, num_computed_tokens)
        except Exception as exc:  # noqa: BLE001  (a miss, never an error in the scheduler)
            log.warning("ctxstore: lookup answer failed: %s", exc)
            return 0, False

    def _matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        state = self._requests.get(request.request_id)
        if state is None:  # not seen at enqueue (should not happen): look up now
            state = self._requests[request.request_id] = _RequestState(request)
        state.request = request
        if not (self.enabled and self.config.load):
            return 0, False
        if state.lookup is None:
            state.lookup = self._start_lookup(request)
        prefix = self._lookup_prefix(state.lookup)
        if prefix is None:
            return None, False
        state.local_tokens = num_computed_tokens
        return max(0, prefix * self.block_size - num_computed_tokens), False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        state = self._requests.get(request.request_id)
        if state is None or num_external_tokens <= 0:
            return
        first = state.local_tokens // self.block_size
        last = (state.local_tokens + num_external_tokens) // self.block_size
        block_ids = list(blocks.get_block_ids()[0][first:last])
        # Counted once the workers report how much of it arrived (update_connector_output).
        state.load = _Load(first, block_ids, state.local_tokens - first * self.block_size, num_external_tokens)
        try:
            hashes = list(request.block_hashes[first:last])
        except Exception as exc:  # noqa: BLE001
            # vLLM now counts those tokens as computed: the blocks must come back as load errors (recomputed).
            log.warning("ctxstore: load not planned: %s", exc)
            hashes = []
        self._loads.append(_Transfer(request.request_id, block_ids, hashes, request.cache_salt))
        state.saved_upto = max(state.saved_upto, last)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        if not isinstance(meta, CtxStoreWorkerMetadata):
            return
        for req_id, loaded in meta.loaded.items():
            state = self._requests.get(req_id)
            if state is None or state.load is None:
                continue
            try:
                self._settle_load(state, state.load, loaded, connector_output.invalid_block_ids)
            except Exception as exc:  # noqa: BLE001  (nothing from the data path reaches the scheduler)
                log.warning("ctxstore: load outcome not recorded: %s", exc)
            state.load = None

    def _settle_load(self, state: _RequestState, load: _Load, loaded: int, invalid: set[int]) -> None:
        """Count what vLLM reuses of a load: up to its first block that failed on any rank (vLLM recomputes
        from there, the blocks after it included). The failed blocks are saved again once recomputed."""
        n = len(load.block_ids)
        loaded = max(0, min(loaded, n))
        self.stats.add("hit_tokens", min(load.tokens, max(0, loaded * self.block_size - load.skip_tokens)))
        objects = loaded * self.keyspace.tp_size * self.keyspace.pp_size  # every rank loads its own
        self.stats.add("loaded_blocks", objects)
        self.stats.add("loaded_bytes", objects * self.keyspace.block_bytes)
        if loaded == n:
            return
        first_failed = load.first + loaded
        if state.lookup is not None and state.lookup.prefix is not None:
            state.lookup.prefix = min(state.lookup.prefix, first_failed)  # a preempted request asks again
        # The blocks after the first failed one that arrived on every rank are stored and sound.
        failed = [load.first + i for i in range(loaded, n) if load.block_ids[i] in invalid]
        for index in failed or range(first_failed, load.first + n):
            if index not in state.resave:
                state.resave.append(index)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = CtxStoreConnectorMetadata(loads=self._loads)
        self._loads = []
        if self.enabled and self.config.save and self._kv_cache_manager is not None:
            computed = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
            cached = scheduler_output.scheduled_cached_reqs
            computed.update(zip(cached.req_ids, cached.num_computed_tokens))
            for req_id, n_computed in computed.items():
                try:
                    meta.saves += self._new_full_blocks(
                        req_id, n_computed + scheduler_output.num_scheduled_tokens.get(req_id, 0))
                except Exception as exc:  # noqa: BLE001  (a save not made is a future miss)
                    log.warning("ctxstore: save not planned: %s", exc)
        return meta

    def _new_full_blocks(self, req_id: str, n_tokens: int) -> list[_Transfer]:
        """The blocks of ``req_id`` that are full once this step ran, have a hash, and are not in ctxstore yet;
        and those whose stored copy failed to load and that vLLM recomputed by then (to replace that copy)."""
        state = self._requests.get(req_id)
        if state is None:
            return []
        request = state.request
        limit = n_tokens if self.config.save_decode else min(n_tokens, request.num_prompt_tokens)
        end = min(limit // self.block_size, len(request.block_hashes))
        transfers: list[_Transfer] = []
        assert self._kv_cache_manager is not None
        block_ids = self._kv_cache_manager.get_block_ids(req_id)[0]
        # A failed load is reported (update_connector_output) before vLLM schedules its recompute, which starts
        # at the first failed block: a failed block below ``end`` holds recomputed KV once this step ran.
        recomputed = [i for i in state.resave if i < end]
        if recomputed:
            state.resave = [i for i in state.resave if i >= end]
            transfers.append(_Transfer(req_id, [block_ids[i] for i in recomputed],
                                       [request.block_hashes[i] for i in recomputed], request.cache_salt,
                                       replace=True))
        if state.lookup is not None and state.lookup.prefix:
            state.saved_upto = max(state.saved_upto, state.lookup.prefix)  # found: already there
        if end > state.saved_upto:
            start, state.saved_upto = state.saved_upto, end
            transfers.append(_Transfer(req_id, list(block_ids[start:end]), list(request.block_hashes[start:end]),
                                       request.cache_salt))
        state.saves_scheduled |= bool(transfers)
        return transfers

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        state = self._requests.pop(request.request_id, None)
        if state is not None and state.lookup is not None and state.lookup.future is not None:
            state.lookup.future.cancel()
        # Keep the blocks until the worker says the saves went out (it reports every request it saved for).
        return (state is not None and state.saves_scheduled), None

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, block_ids[0] if block_ids else [])

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if not self.enabled:
            return
        try:
            layout = PagedLayout.from_kv_caches(kv_caches, self._kv_cache_config.num_blocks)
        except (ValueError, NotImplementedError) as exc:
            log.warning("ctxstore: KV cache layout not supported (%s): the connector stays idle", exc)
            self.enabled = False
            return
        if layout.block_bytes != self.keyspace.block_bytes:
            log.warning("ctxstore: a block is %d bytes in the registered caches but %d by the KV cache spec: "
                        "the connector stays idle", layout.block_bytes, self.keyspace.block_bytes)
            self.enabled = False
            return
        try:
            self.client.run(self.client.store.create_bucket(self.config.bucket))  # on every node that is up
        except Exception as exc:  # noqa: BLE001  (a node down now gets it when it comes back: see put_keys)
            log.warning("ctxstore: bucket %s not created everywhere: %s", self.config.bucket, exc)
        self.layout = layout
        self._staged = layout.device.type != "cpu" or self.config.staging == "host"
        log.info("ctxstore: %d layers, %d blocks, %d KiB per block object (%s on %s, %d pieces%s)",
                 layout.num_layers, layout.num_blocks, layout.block_bytes >> 10, layout.describe(), layout.device,
                 layout.pieces_per_block, ", through the staging pool" if self._staged else "")

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, CtxStoreConnectorMetadata) or not meta.loads:
            return
        arrived = {t.req_id: 0 for t in meta.loads}  # leading blocks per load; nothing until shown otherwise
        try:
            self._load(meta.loads, arrived)
        finally:
            with self._lock:
                self._loaded.update(arrived)

    def _load(self, transfers: list[_Transfer], arrived: dict[str, int]) -> None:
        unplanned = [b for t in transfers if len(t.block_hashes) != len(t.block_ids) for b in t.block_ids]
        if unplanned:
            self._fail_loads(unplanned)
        loads = [t for t in transfers if len(t.block_hashes) == len(t.block_ids)]
        block_ids = [b for t in loads for b in t.block_ids]
        if not block_ids:
            return
        if self.layout is None:
            self._fail_loads(block_ids)
            return
        started = time.monotonic()
        failed: list[int] = []
        try:
            keys = [k for t in loads for k in self.keyspace.keys(
                t.block_hashes, tp_rank=self._tp_rank, pp_rank=self._pp_rank, cache_salt=t.cache_salt)]
            if self._staged:  # per request: its leading blocks that arrived whole and verified, copied by now
                start = 0
                for t in loads:
                    ids, part = t.block_ids, keys[start:start + len(t.block_ids)]
                    start += len(ids)
                    sizes = self.client.run(self.client.store.get_keys_staged(
                        self.config.bucket, part, ready(self.layout.target(ids))))
                    failed += ids[len(sizes):]
                    arrived[t.req_id] = len(sizes)
            else:
                pieces = [Scatter(self.layout.block_pieces(b)) for b in block_ids]
                views = self.client.run(self.client.store.get_keys(self.config.bucket, keys,
                                                                   Destinations(pieces, len(pieces))))
                good = [v is not None and len(v) == self.layout.block_bytes for v in views]
                failed = [b for b, ok in zip(block_ids, good) if not ok]
                start = 0
                for t in loads:
                    mine = good[start:start + len(t.block_ids)]
                    start += len(t.block_ids)
                    arrived[t.req_id] = mine.index(False) if False in mine else len(mine)
        except Exception as exc:  # noqa: BLE001  (whatever happened, those blocks are recomputed)
            log.warning("ctxstore: load of %d blocks failed: %s", len(block_ids), exc)
            arrived.update(dict.fromkeys(arrived, 0))
            self._fail_loads(block_ids)
            return
        # loaded_blocks and hit_tokens are the scheduler's to count: vLLM reuses a load only up to the first
        # block that failed on any rank, and only the scheduler hears from every rank.
        self.stats.add("load_ms", (time.monotonic() - started) * 1e3)
        if failed:
            log.info("ctxstore: %d of %d blocks did not load: vLLM recomputes from the first one on", len(failed),
                     len(block_ids))
            self._fail_loads(failed)

    def _fail_loads(self, block_ids: Sequence[int]) -> None:
        self.stats.add("load_errors", len(block_ids))
        with self._lock:
            self._load_errors.update(block_ids)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete in start_load_kv: one object holds every layer of a block

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        return  # saves are gathered once all layers are written, in wait_for_save

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, CtxStoreConnectorMetadata) or not meta.saves:
            return
        for transfer in meta.saves:
            with self._lock:
                self._saving.add(transfer.req_id)
            if self.layout is None:
                continue
            try:
                self._stage_save(transfer, self.layout)
            except Exception as exc:  # noqa: BLE001  (a dropped save is a future miss)
                log.warning("ctxstore: save of %d blocks dropped: %s", len(transfer.block_ids), exc)
                self.stats.add("save_errors", len(transfer.block_ids))

    def _stage_save(self, transfer: _Transfer, layout: PagedLayout) -> None:
        size = len(transfer.block_ids) * layout.block_bytes
        with self._lock:
            if self._pending_bytes + size > self.config.max_pending_save_bytes:
                self.stats.add("save_dropped", len(transfer.block_ids))
                return
            self._pending_bytes += size
            self._pending_saves[transfer.req_id] = self._pending_saves.get(transfer.req_id, 0) + 1
        # A copy now, while vLLM cannot reuse the blocks (the step is not over): the put may outlive them. On a
        # GPU the copy stays on the device (ordered after this step's kernels) and goes out through the pool.
        staged = layout.gather(transfer.block_ids)
        keys = self.keyspace.keys(transfer.block_hashes, tp_rank=self._tp_rank, pp_rank=self._pp_rank,
                                  cache_salt=transfer.cache_salt)
        started = time.monotonic()
        # Marked here, on the worker's stream: the put runs on the client's thread, with another current stream.
        source = ready(staged) if self._staged else [byte_view(row) for row in staged]
        future = self.client.submit(self._put(keys, source, replace=transfer.replace))

        def done(f: concurrent.futures.Future[SaveResult]) -> None:
            try:
                result = f.result()
                self.stats.add("saved_blocks", result.stored)
                self.stats.add("saved_bytes", result.stored * layout.block_bytes)
                self.stats.add("save_existing", result.existed)
                self.stats.add("save_errors", result.failed)
                if transfer.replace:
                    self.stats.add("resaved_blocks", result.stored)
            except BaseException as exc:  # noqa: BLE001
                log.warning("ctxstore: save failed: %s", exc)
                self.stats.add("save_errors", len(keys))
            self.stats.add("save_ms", (time.monotonic() - started) * 1e3)
            with self._lock:
                self._pending_bytes -= size
                self._pending_saves[transfer.req_id] -= 1

        future.add_done_callback(done)

    async def _put(self, keys: list[str], source: Any, *, replace: bool) -> SaveResult:
        """``source``: the staged copy marked ready (through the staging pool), or one byte view per block."""
        store, bucket = self.client.store, self.config.bucket
        if replace:
            # A put leaves a live key as it is, and this key's stored copy failed to load (it may be bad on its
            # node, for every later request too): it goes first. One delete for the few blocks of a failed load.
            try:
                await store.keys_op(bucket, "delete", keys)
            except Exception as exc:  # noqa: BLE001  (the put then keeps the old copy: a future load error)
                log.warning("ctxstore: the copies of %d blocks that failed to load were not deleted: %s",
                            len(keys), exc)
        if self._staged:
            return await store.put_keys_staged(bucket, keys, source, ttl=self.config.ttl)
        return await store.put_keys(bucket, keys, source, ttl=self.config.ttl)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        with self._lock:
            self._finished.update(r for r in finished_req_ids if r in self._saving)
            done = {r for r in self._finished if not self._pending_saves.get(r)}
            for r in done:
                self._finished.discard(r)
                self._saving.discard(r)
                self._pending_saves.pop(r, None)
        return (done or None), None

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        with self._lock:
            loaded, self._loaded = self._loaded, {}
        return CtxStoreWorkerMetadata(loaded) if loaded else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        self.client.close()


# ---------------------------------------------------------------------------------------------- helpers


def _common_prefix(sizes: Sequence[int], n_blocks: int, block_bytes: int) -> int:
    """Leading blocks present, at the expected size, on every rank (``sizes`` holds the ranks one after another)."""
    if not n_blocks or len(sizes) % n_blocks:
        return 0
    prefix = n_blocks
    for start in range(0, len(sizes), n_blocks):
        for i in range(prefix):
            size = sizes[start + i]
            if size == ABSENT or size != block_bytes:
                prefix = i
                break
    return prefix


def _ranks() -> tuple[int, int]:
    from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank(), get_pp_group().rank_in_group


def _keyspace(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> KeySpace:
    """The namespace, computed the same way by the scheduler and every worker (from the configs alone)."""
    from vllm.platforms import current_platform

    model, cache, parallel = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    extra = vllm_config.kv_transfer_config.kv_connector_extra_config if vllm_config.kv_transfer_config else {}
    group = kv_cache_config.kv_cache_groups[0]
    spec: Any = group.kv_cache_spec
    n_layers = len(group.layer_names)
    dtype = str(getattr(spec, "dtype", model.dtype)).removeprefix("torch.")
    quant = getattr(getattr(spec, "kv_quant_mode", None), "name", "NONE")
    kv_dtype = f"{cache.cache_dtype}:{dtype}:scales={quant}"
    if quant != "NONE":
        kv_dtype += f":calculated={bool(getattr(cache, 'calculate_kv_scales', False))}"
    layout = (f"{current_platform.device_type}:{kv_cache_config.kv_cache_layout or 'default'}:"
              f"{type(spec).__name__}:heads={getattr(spec, 'num_kv_heads', '?')}:"
              f"head={getattr(spec, 'head_size', '?')}+{getattr(spec, 'head_size_v', '?')}:layers={n_layers}")
    # A padded page's padding is in neither the cache's per-layer views nor the objects.
    block_bytes = int(getattr(spec, "real_page_size_bytes", spec.page_size_bytes)) * n_layers
    algo = str(cache.prefix_caching_hash_algo)
    hash_block = kv_cache_config.hash_block_size or cache.block_size
    if hash_block != cache.block_size:
        raise ConfigurationError(f"vLLM hashes blocks of {hash_block} tokens but caches blocks of "
                                 f"{cache.block_size}: not supported by the ctxstore connector")
    return KeySpace(
        model=str(extra.get("model") or model.model), revision=str(extra.get("revision") or model.revision or ""),
        kv_dtype=kv_dtype, kv_layout=layout, block_size=cache.block_size, block_bytes=block_bytes,
        hash_algo=algo, seed=hash_seed(algo, dict(os.environ)), tp_size=parallel.tensor_parallel_size,
        pp_size=parallel.pipeline_parallel_size)
