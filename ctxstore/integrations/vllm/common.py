"""What both halves of the vLLM connector share: its configuration (``kv_connector_extra_config``), the client
each half runs on a private event loop, the namespace (computed alike by the scheduler and every worker), and the
metadata the scheduler sends its workers each step and they send back.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from ...core import AsyncContextStore, Limits, Timeouts
from ...errors import ConfigurationError
from .keys import KeySpace, hash_seed

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["ConnectorClient", "ConnectorConfig", "CtxStoreConnectorMetadata", "CtxStoreWorkerMetadata", "Transfer",
           "keyspace_of", "worker_ranks"]

T = TypeVar("T")


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


class ConnectorClient:
    """An :class:`AsyncContextStore` on a private event-loop thread; calls return futures or bounded results."""

    def __init__(self, config: ConnectorConfig) -> None:
        # The client first: if its configuration is refused, no loop or thread is left behind.
        self.store = AsyncContextStore(config.nodes, access_key=config.access_key, secret_key=config.secret_key,
                                       timeouts=config.timeouts(), limits=Limits(), staging=config.staging,
                                       staging_bytes=config.staging_bytes)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="ctxstore-vllm", daemon=True)
        self._thread.start()
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
        if not self._thread.is_alive():
            self.loop.close()  # its selector and wake-up pipe


# ---------------------------------------------------------------------------------------------- metadata


@dataclass
class Transfer:
    """A request's blocks to load or save: their vLLM block ids beside their block hashes."""

    req_id: str
    block_ids: list[int]
    block_hashes: list[bytes]
    cache_salt: str | None
    replace: bool = False  # a save of blocks whose stored copies failed to load: it replaces them


@dataclass
class CtxStoreConnectorMetadata(KVConnectorMetadata):
    """Scheduler → worker, per step: the blocks to load before the forward pass and to save after it."""

    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)


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


# ---------------------------------------------------------------------------------------------- namespace


def worker_ranks() -> tuple[int, int]:
    from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank(), get_pp_group().rank_in_group


def keyspace_of(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> KeySpace:
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
