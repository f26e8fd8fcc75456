"""The scheduler half of the vLLM connector (role SCHEDULER, in the engine core).

``on_new_request`` starts one bulk ``lookup`` per node for the request's full prompt blocks (keys from
``request.block_hashes``, :mod:`.keys`), followed by a prefetch of the matched prefix's blocks on a node's flash
tier (:func:`ctxstore.core.flash_resident`; none on RAM-only nodes, where nothing is started), so they are in RAM
when the load comes; the lookup's answer waits for the nodes to take the prefetch (they answer at once), not for
its reads. ``get_num_new_matched_tokens`` answers from the lookup: the longest prefix present on every rank, past
what vLLM already holds. A lookup still in flight after ``lookup_wait`` answers ``None`` (vLLM asks again next step);
one older than the call timeout counts as a miss. Loads are synchronous to the step that needs them (the worker
finishes them in ``start_load_kv``, before the forward pass). Saves: every step, each scheduled request's blocks
that became full (and have a hash) and that the lookup did not find, go into the step's metadata. The workers
report how many leading blocks of each load arrived (``update_connector_output``): only those count as hits, and
the failed blocks are saved again once vLLM recomputed them. ``request_finished`` keeps a request's blocks until
the workers say its saves went out.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.logger import init_logger

from ...core import flash_resident
from ...wire import ABSENT
from .common import ConnectorClient, ConnectorConfig, CtxStoreConnectorMetadata, CtxStoreWorkerMetadata, Transfer
from .keys import KeySpace
from .metrics import StatsCounter

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["CtxStoreScheduler"]

log = init_logger("vllm.ctxstore")  # under "vllm": vLLM configures that logger tree
# How long a lookup's answer waits for the nodes to take the prefetch that follows it: one round trip, so the
# load the answer leads to cannot overtake the prefetch; a node slower than this only loses the prefetch's head start.
PREFETCH_ORDER_WAIT = 0.25


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


# ---------------------------------------------------------------------------------------------- scheduler


class CtxStoreScheduler:
    """The connector's scheduler side: lookups, load and save planning, and what the workers report back."""

    def __init__(self, config: ConnectorConfig, keyspace: KeySpace, block_size: int, *, enabled: bool,
                 stats: StatsCounter) -> None:
        self.config = config
        self.keyspace = keyspace
        self.block_size = block_size
        self.enabled = enabled
        self.stats = stats
        self.client = ConnectorClient(config)
        self.kv_cache_manager: KVCacheManager | None = None  # bound by vLLM (the connector's bind_kv_cache_manager)
        self._requests: dict[str, _RequestState] = {}
        self._loads: list[Transfer] = []
        self._prefetches: set[asyncio.Task[int]] = set()  # started after lookups, on the client loop

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
        # Of the prefix every rank holds (each rank's keys), the blocks on a node's flash tier: none on RAM-only
        # nodes, where nothing is started.
        matched = [i for i in range(len(keys)) if i % n_blocks < prefix]
        cold = flash_resident([keys[i] for i in matched], [found[i] for i in matched]) if self.config.prefetch else []
        if cold:
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
            log.warning("ctxstore: lookup of %d blocks gave up after %.1f s: answered as a miss",
                        lookup.n_blocks, time.monotonic() - lookup.started)
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
        self._loads.append(Transfer(request.request_id, block_ids, hashes, request.cache_salt))
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
        if self.enabled and self.config.save and self.kv_cache_manager is not None:
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

    def _new_full_blocks(self, req_id: str, n_tokens: int) -> list[Transfer]:
        """The blocks of ``req_id`` that are full once this step ran, have a hash, and are not in ctxstore yet;
        and those whose stored copy failed to load and that vLLM recomputed by then (to replace that copy)."""
        state = self._requests.get(req_id)
        if state is None:
            return []
        request = state.request
        limit = n_tokens if self.config.save_decode else min(n_tokens, request.num_prompt_tokens)
        end = min(limit // self.block_size, len(request.block_hashes))
        transfers: list[Transfer] = []
        assert self.kv_cache_manager is not None
        block_ids = self.kv_cache_manager.get_block_ids(req_id)[0]
        # A failed load is reported (update_connector_output) before vLLM schedules its recompute, which starts
        # at the first failed block: a failed block below ``end`` holds recomputed KV once this step ran.
        recomputed = [i for i in state.resave if i < end]
        if recomputed:
            state.resave = [i for i in state.resave if i >= end]
            transfers.append(Transfer(req_id, [block_ids[i] for i in recomputed],
                                       [request.block_hashes[i] for i in recomputed], request.cache_salt,
                                       replace=True))
        if state.lookup is not None and state.lookup.prefix:
            state.saved_upto = max(state.saved_upto, state.lookup.prefix)  # found: already there
        if end > state.saved_upto:
            start, state.saved_upto = state.saved_upto, end
            transfers.append(Transfer(req_id, list(block_ids[start:end]), list(request.block_hashes[start:end]),
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
