"""The worker half of the vLLM connector (role WORKER, in each worker process).

``register_kv_caches`` learns the layout (:class:`.layout.PagedLayout`). ``start_load_kv`` fetches the step's
blocks with one bulk ``get`` per node, each object scattered straight into the KV cache's pieces of its block
(:class:`ctxstore.buffers.Scatter`) — or, for a cache on a GPU, through the client's staging pool (pinned chunks,
one copy per chunk, an ``index_copy_`` per layer on the device; :class:`.layout.PagedTarget`), the load complete
before the forward pass; every block that did not arrive whole and verified goes to
``get_block_ids_with_load_errors`` and vLLM recomputes from the first such block on. The worker tells the
scheduler how many leading blocks of each load arrived (:class:`.common.CtxStoreWorkerMetadata`), so that it
counts only those as hits and saves the failed blocks again once vLLM recomputed them, in place of the stored copy
that failed (it may be bad on its node, and a put leaves an existing key alone). ``wait_for_save`` copies the
step's new blocks out of the cache (one gather per layer, on the cache's device) and sends them with bulk ``put``
in the background (from a GPU through the staging pool); ``get_finished`` tells vLLM when a finished request's
saves are acknowledged, so that it frees the blocks the scheduler kept for them.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata
from vllm.logger import init_logger

from ...buffers import Destinations, Scatter, byte_view
from ...core import SaveResult
from ...staging import ready
from .common import ConnectorClient, ConnectorConfig, CtxStoreConnectorMetadata, CtxStoreWorkerMetadata, Transfer
from .keys import KeySpace
from .layout import PagedLayout
from .metrics import StatsCounter

if TYPE_CHECKING:
    from vllm.v1.attention.backend import AttentionMetadata

__all__ = ["CtxStoreWorker"]

log = init_logger("vllm.ctxstore")  # under "vllm": vLLM configures that logger tree


class CtxStoreWorker:
    """The connector's worker side: loads into and saves out of this worker's paged KV cache."""

    def __init__(self, config: ConnectorConfig, keyspace: KeySpace, num_blocks: int, ranks: tuple[int, int], *,
                 enabled: bool, stats: StatsCounter) -> None:
        self.config = config
        self.keyspace = keyspace
        self.num_blocks = num_blocks
        self.enabled = enabled
        self.stats = stats
        self.client = ConnectorClient(config)
        self.layout: PagedLayout | None = None
        self._staged = False  # loads and saves through the client's staging pool (a GPU cache)
        self._tp_rank, self._pp_rank = ranks
        self._lock = threading.Lock()
        self._load_errors: set[int] = set()
        self._loaded: dict[str, int] = {}  # this step's loads: req_id -> leading blocks that arrived
        self._pending_saves: dict[str, int] = {}  # req_id -> puts in flight
        self._saving: set[str] = set()  # requests with save state on this worker
        self._finished: set[str] = set()  # of those, finished by the scheduler (blocks held for us)
        self._pending_bytes = 0

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if not self.enabled:
            return
        try:
            layout = PagedLayout.from_kv_caches(kv_caches, self.num_blocks)
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

    def start_load_kv(self, meta: KVConnectorMetadata | None) -> None:
        if not isinstance(meta, CtxStoreConnectorMetadata) or not meta.loads:
            return
        arrived = {t.req_id: 0 for t in meta.loads}  # leading blocks per load; nothing until shown otherwise
        try:
            self._load(meta.loads, arrived)
        finally:
            with self._lock:
                self._loaded.update(arrived)

    def _load(self, transfers: list[Transfer], arrived: dict[str, int]) -> None:
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

    def wait_for_save(self, meta: KVConnectorMetadata | None) -> None:
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

    def _stage_save(self, transfer: Transfer, layout: PagedLayout) -> None:
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
        # A put leaves a live key as it is; ``replace``: these keys' stored copies failed to load (one may be bad
        # on its node, for every later request too), so the recomputed blocks replace them, each in one commit
        # on its node: no moment where another instance's lookup finds the key gone.
        if self._staged:
            return await store.put_keys_staged(bucket, keys, source, ttl=self.config.ttl, if_absent=not replace)
        return await store.put_keys(bucket, keys, source, ttl=self.config.ttl, if_absent=not replace)

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
