"""``CtxStoreConnector``: vLLM's paged KV cache saved to and restored from a ctxstore pod.

The class vLLM loads (``kv_connector_module_path: ctxstore.integrations.vllm``). vLLM instantiates it twice: with
role SCHEDULER in the engine core, with role WORKER in each worker; by role it makes the half that does the work
and forwards vLLM's calls to it, as vLLM's own connectors do:

- :class:`.scheduler.CtxStoreScheduler`: lookups (and the prefetch of the matched prefix from the nodes' flash
  tiers), how many tokens to load, the step's loads and saves, the workers' reports, finished requests;
- :class:`.worker.CtxStoreWorker`: the layout of the registered KV caches, loads into them before the forward
  pass, saves out of them in the background, load errors, finished saves.

What they share (the configuration, the client loop, the step metadata, the namespace) is in :mod:`.common`.

Failures never reach vLLM: every client call is bounded by the configured timeouts (plus a hard deadline, after
which the call is cancelled and its connections closed, so nothing writes into the cache afterwards), and any
error on the data path is a miss (lookup), a load error (recompute) or a dropped save (a future miss). vLLM must
run with ``kv_load_failure_policy: "recompute"`` (its default, ``"fail"``, would fail the request instead): the
connector sets it when it was left at the default and says so in the log.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.logger import init_logger

from .common import ConnectorConfig, CtxStoreConnectorMetadata, CtxStoreWorkerMetadata, keyspace_of, worker_ranks
from .metrics import CtxStoreConnectorStats, CtxStorePromMetrics, StatsCounter
from .scheduler import CtxStoreScheduler
from .worker import CtxStoreWorker

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
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["ConnectorConfig", "CtxStoreConnector", "CtxStoreConnectorMetadata", "CtxStoreWorkerMetadata"]

log = init_logger("vllm.ctxstore")  # under "vllm": vLLM configures that logger tree


class CtxStoreConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM KV connector backed by a ctxstore pod (see the module docstring and docs/integrations.md)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        config = ConnectorConfig.from_extra(dict(self._kv_transfer_config.kv_connector_extra_config))
        if self._kv_transfer_config.kv_load_failure_policy != "recompute":
            # A ctxstore block that fails to load is a cache miss; vLLM's default would fail the request.
            log.warning("ctxstore: setting kv_load_failure_policy to 'recompute' (was %r): a block that "
                        "cannot be loaded is recomputed", self._kv_transfer_config.kv_load_failure_policy)
            self._kv_transfer_config.kv_load_failure_policy = "recompute"
        groups = kv_cache_config.kv_cache_groups
        enabled = len(groups) == 1
        if not enabled:
            log.warning("ctxstore: %d KV cache groups (a hybrid model): the connector supports one full-attention "
                        "group and stays idle", len(groups))
        keyspace = keyspace_of(vllm_config, kv_cache_config)
        self.stats = StatsCounter()
        self.connector_scheduler: CtxStoreScheduler | None = None
        self.connector_worker: CtxStoreWorker | None = None
        ranks = (0, 0)
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = CtxStoreScheduler(config, keyspace, vllm_config.cache_config.block_size,
                                                         enabled=enabled, stats=self.stats)
        elif role == KVConnectorRole.WORKER:
            ranks = worker_ranks()
            self.connector_worker = CtxStoreWorker(config, keyspace, kv_cache_config.num_blocks, ranks,
                                                   enabled=enabled, stats=self.stats)
        log.info("ctxstore: %s connector, bucket %s, namespace %s", role.name.lower(), config.bucket,
                 keyspace.namespace(*ranks))

    @property
    def scheduler(self) -> CtxStoreScheduler:
        assert self.connector_scheduler is not None, "a scheduler call on the worker's connector"
        return self.connector_scheduler

    @property
    def worker(self) -> CtxStoreWorker:
        assert self.connector_worker is not None, "a worker call on the scheduler's connector"
        return self.connector_worker

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

    def shutdown(self) -> None:
        for half in (self.connector_scheduler, self.connector_worker):
            if half is not None:
                half.shutdown()

    # ------------------------------------------------------------------ scheduler side

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self.connector_scheduler is not None:
            self.connector_scheduler.kv_cache_manager = kv_cache_manager

    def on_new_request(self, request: Request) -> None:
        self.scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.scheduler.update_connector_output(connector_output)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished_all_groups(request, block_ids)

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self.worker.start_load_kv(self._connector_metadata)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        self.worker.save_kv_layer(layer_name, kv_layer, attn_metadata)

    def wait_for_save(self) -> None:
        self.worker.wait_for_save(self._connector_metadata)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.worker.get_finished(finished_req_ids)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self.connector_worker.build_connector_worker_meta() if self.connector_worker is not None else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors()
