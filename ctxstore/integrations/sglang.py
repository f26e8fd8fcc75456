"""SGLang HiCache's L3 storage on a ctxstore pod: ``CtxStoreHiCacheStorage``, a ``HiCacheStorage`` backend.

SGLang (tested with 0.5.23) loads it with ``--hicache-storage-backend dynamic`` and an extra config naming this
module and class (docs/integrations.md, "SGLang HiCache"), constructs it as ``cls(storage_config, kwargs)``,
hands it the host memory pool (``register_mem_pool_host``) and then calls it from its cache controller's
threads (loads and backups at most 128 pages, ``STORAGE_BATCH_SIZE``, a call; a hit query a request's whole
chain):

* ``batch_exists(keys)``: one bulk lookup per node, bounded by ``lookup_timeout`` (the pages of a node that has
  not answered by then are misses); the number of leading pages present with the size of a page of this pool.
* ``batch_get_v1(keys, host_indices)``: one bulk get per node straight into the host pool's page buffers
  (``mem_pool_host.get_page_buffer_meta``: two buffers per page in the page-first layouts, two per layer in
  the layer-first one), each page arriving whole and verified (XXH3-64) or not at all: a flag per page. The
  pages loaded have their TTL restarted (one ``touch``, not waited for).
* ``batch_set_v1(keys, host_indices)``: one bulk put per node of each page's buffers back to back, with the TTL.
  The copying interface (``batch_get``/``batch_set`` of flat pages) reads and writes the same object bytes.

Never raises on the data path: a failure there would cost SGLang the whole batch (or, in the calls it does not
guard, its thread). A node that is down, slow, or answers garbage contributes misses (``False``, a shorter
prefix) within the call's deadline; only construction and registration raise, for a configuration mistake.

Keys: SGLang's page keys are already its SHA-256 page chain, new chains seeded with the request's namespace
(``extra_key``, ``cache_salt``: :func:`ctxstore.hashing.sglang_namespace_seed`), so two tenants' chains never
share a key. Each object key is ``<fingerprint>/<page key>``, the fingerprint (:class:`~ctxstore.hashing.
Fingerprint`) holding the model, KV dtype (for fp8 caches, which SGLang keeps as bytes, the fp8 format), page
size, layout, TP, PP and CP coordinates (one shared TP coordinate for MLA, whose ranks hold the same KV and of
which only SGLang's storage writer stores), and the configured ``tenant``: deployments whose pages are not
interchangeable never meet (a page of another size under a key is a miss).
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolTransferResult,
)

from ..buckets import check_bucket
from ..buffers import Destinations, Scatter, Target, byte_view
from ..core import AsyncContextStore, Timeouts
from ..errors import ConfigurationError
from ..hashing import Fingerprint
from ..lanes import LoopThread
from ..wire import ABSENT, prefix_length

__all__ = ["CtxStoreHiCacheStorage", "DEFAULTS"]

log = logging.getLogger("ctxstore.sglang")
T = TypeVar("T")
#: Seconds past a call's deadline that its cancellation may take before the call is abandoned.
CANCEL_GRACE = 2.0
# The most pages clear() remembers to delete (~200 B each): past it the oldest are forgotten, left to their TTL
# and to eviction, so a long-running writer's memory stays bounded.
MAX_TRACKED_PAGES = 1 << 18
#: TTL refreshes of loaded pages in flight at most (past it a load's refresh is skipped: a slow pod gets no backlog).
MAX_TOUCHES = 8

#: Settings read from ``--hicache-storage-backend-extra-config`` (every other key is SGLang's or the factory's).
DEFAULTS: dict[str, Any] = {
    "nodes": None,             # "host:port,host:port" or a DNS name; default CTXSTORE_NODES
    "bucket": "sglang-hicache",
    "ttl": None,               # seconds a page lives unless read again; default: the bucket's / node's default TTL
    "tenant": "",              # namespace salt: tenants' pages never alias (quotas come with their access keys)
    "access_key": None,        # default CTXSTORE_ACCESS_KEY / AWS_ACCESS_KEY_ID
    "secret_key": None,
    "connect_timeout": 0.5,
    "read_timeout": 2.0,
    "lookup_timeout": 1.0,     # batch_exists: past it, the pages not yet known are misses
    "call_timeout": 10.0,      # a batch_get_v1 / batch_set_v1 / clear
    "kv_cache_dtype": None,    # fp8 caches (SGLang's host pool holds them as uint8): e.g. "fp8_e4m3"; default:
                               # SGLang's --kv-cache-dtype, where its server arguments can be read
}
# Keys of the extra config that SGLang or its backend factory read (the backend ignores them).
SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1", "tp_lcm_size",
                         "prefetch_threshold", "prefetch_timeout_base", "prefetch_timeout_per_ki_token",
                         "hicache_storage_pass_prefix_keys"})


def _settings(extra: dict[str, Any] | None) -> dict[str, Any]:
    extra = dict(extra or {})
    unknown = sorted(set(extra) - set(DEFAULTS) - SGLANG_KEYS)
    if unknown:  # a typo would otherwise fall back to the default without a word
        log.warning("ctxstore HiCache backend: unknown extra-config keys ignored: %s", ", ".join(unknown))
    if not extra.get("interface_v1"):
        log.warning("ctxstore HiCache backend: without \"interface_v1\": 1 in the extra config SGLang uses the "
                    "copying interface (each page copied once more); add it for the zero-copy one")
    return {name: extra.get(name, default) if extra.get(name) is not None else default
            for name, default in DEFAULTS.items()}


def _server_kv_cache_dtype() -> str | None:
    """SGLang's ``--kv-cache-dtype`` where this process runs SGLang's server (None elsewhere)."""
    try:
        from sglang.srt.runtime_context import get_server_args

        value = getattr(get_server_args(), "kv_cache_dtype", None)
    except Exception:  # noqa: BLE001  (not inside a server, or another SGLang)
        return None
    return str(value) if value else None


def _page_views(pointers: Sequence[int], sizes: Sequence[int]) -> list[memoryview]:
    """Writable views of raw host memory (the pool's page buffers), without copying."""
    return [memoryview((ctypes.c_char * n).from_address(p)).cast("B") for p, n in zip(pointers, sizes)]


class CtxStoreHiCacheStorage(HiCacheStorage):
    """SGLang HiCache L3 backend over a ctxstore pod's bulk API (see the module docstring)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        self.storage_config = storage_config
        cfg = _settings(storage_config.extra_config)
        if not storage_config.model_name:
            raise ConfigurationError("the ctxstore HiCache backend needs SGLang's model name (--served-model-name): "
                                     "it keeps one model's pages apart from another's")
        self.bucket = check_bucket(str(cfg["bucket"]))
        self.ttl = None if cfg["ttl"] is None else _number("ttl", cfg["ttl"])
        self.tenant = str(cfg["tenant"])
        self.lookup_timeout = _number("lookup_timeout", cfg["lookup_timeout"])
        self.call_timeout = _number("call_timeout", cfg["call_timeout"])
        self.kv_cache_dtype = cfg["kv_cache_dtype"]
        timeouts = Timeouts(connect=_number("connect_timeout", cfg["connect_timeout"]),
                            read=_number("read_timeout", cfg["read_timeout"]), total=self.call_timeout)
        nodes = cfg["nodes"] or os.environ.get("CTXSTORE_NODES")
        if not nodes:
            raise ConfigurationError("the ctxstore HiCache backend needs \"nodes\" in its extra config "
                                     "(or CTXSTORE_NODES)")
        self.store = AsyncContextStore(nodes, access_key=cfg["access_key"], secret_key=cfg["secret_key"],
                                       timeouts=timeouts)
        self.writer = bool(getattr(storage_config, "is_storage_writer", True))
        self._loop = LoopThread("ctxstore-hicache")
        self._bucket_ready = False
        self._lock = threading.Lock()
        # Object keys this backend stored, oldest first (an ordered set): what clear() deletes.
        self._stored: OrderedDict[str, None] = OrderedDict()
        self.prefix = ""
        self.page_bytes = 0
        # Object-ordered pieces of a flat page (the copying interface), where they differ from the flat order.
        self._flat_order: list[int] | None = None
        self._side_pools: set[str] = set()  # hybrid models' pools besides the KV pool (not stored)
        self._touches: set[asyncio.Task[None]] = set()  # TTL refreshes in flight (the loop's thread)
        self.counters: dict[str, float] = dict.fromkeys(
            ("lookups", "lookup_pages", "hit_pages", "get_pages", "got_pages", "set_pages", "stored_pages",
             "failed_calls", "timeouts", "bytes_in", "bytes_out"), 0)
        self._stats_lock = threading.Lock()
        self._prefetch_pgs: list[int] = []
        self._backup_pgs: list[int] = []
        self._prefetch_bandwidth: list[float] = []
        self._backup_bandwidth: list[float] = []
        if kwargs and kwargs.get("mem_pool_host") is not None:
            self.register_mem_pool_host(kwargs["mem_pool_host"])

    # ------------------------------------------------------------------ setup

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Bind the host pool: its dtype, layout and page geometry complete the namespace fingerprint."""
        super().register_mem_pool_host(mem_pool_host)
        self.fingerprint = self._fingerprint(mem_pool_host)
        self.prefix = self.fingerprint.hexdigest()
        pointers, sizes = mem_pool_host.get_page_buffer_meta(_first_page(mem_pool_host))
        sizes = [sizes] * len(pointers) if isinstance(sizes, int) else list(sizes)
        self.page_bytes = sum(sizes)
        layers = int(getattr(mem_pool_host, "layer_num", 0) or 0)
        if mem_pool_host.layout == "layer_first" and len(pointers) == 2 * layers > 2 and len(set(sizes)) == 1:
            # An MHA layer-first pool's flat page (get_data_page) is every layer's K, then every layer's V; its
            # page buffers, and so an object, are each layer's K and V in turn.
            self._flat_order = [piece for layer in range(layers) for piece in (layer, layers + layer)]
        else:  # the flat page is the buffers back to back (page-first layouts, MLA)
            self._flat_order = None
        log.info("ctxstore HiCache backend: bucket %s, namespace %s, %d-byte pages (%s), writer=%s",
                 self.bucket, self.prefix, self.page_bytes, mem_pool_host.layout, self.writer)

    def _fingerprint(self, pool: Any) -> Fingerprint:
        c = self.storage_config
        mla = bool(c.is_mla_model)
        extra = {"engine": "sglang-hicache", "mla": str(int(mla))}
        if c.attn_cp_size > 1:
            extra["cp"] = f"{c.attn_cp_rank}/{c.attn_cp_size}"
        if getattr(c, "dcp_size", 1) > 1:
            extra["dcp"] = f"{c.dcp_rank}/{c.dcp_size}/page{c.logical_page_size}"
        kv_dtype = str(pool.dtype).removeprefix("torch.")
        if kv_dtype in ("uint8", "int8"):
            # SGLang keeps fp8 KV (e4m3 or e5m2: same size, other numbers) as bytes: the format must be named.
            fp8 = self.kv_cache_dtype or _server_kv_cache_dtype()
            if not fp8:
                raise ConfigurationError(
                    f"the host pool holds {kv_dtype} KV: set \"kv_cache_dtype\" (SGLang's --kv-cache-dtype, "
                    "e.g. \"fp8_e4m3\") in the ctxstore backend's extra config, so pages of other fp8 formats "
                    "are never read as this one")
            kv_dtype = f"{kv_dtype}:{fp8}"
        return Fingerprint(
            model=c.model_name, kv_dtype=kv_dtype,
            kv_layout=str(pool.layout), block_size=int(pool.page_size),
            # MLA ranks hold the same latent KV: one shared coordinate (SGLang lets only its writer rank store).
            tp_rank=0 if mla else c.tp_rank, tp_size=1 if mla else c.tp_size,
            pp_rank=c.pp_rank, pp_size=c.pp_size, tenant_salt=self.tenant, extra=extra)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Hybrid models' pools (Mamba, SWA, indexer, draft...): noted, not stored (see :meth:`batch_exists_v2`)."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = str(host_pool_name)
        if name != "kv" and name not in self._side_pools:
            self._side_pools.add(name)
            log.warning("ctxstore HiCache backend: SGLang's %s pool is not stored; this model gets no L3 hits "
                        "and its pages are not backed up", name)

    def on_host_pools_registered(self) -> None:
        """Refuse a model that needs side pools in L3: SGLang would back up its KV for hits that never come."""
        if self._side_pools:
            raise ConfigurationError(
                "the ctxstore HiCache backend stores KV pages only, and this model also needs SGLang's "
                f"{', '.join(sorted(self._side_pools))} pool(s) in L3: run it without --hicache-storage-backend")

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}"

    # ------------------------------------------------------------------ plumbing

    def _run(self, coro: Coroutine[Any, Any, T], timeout: float, default: T) -> T:
        """Run on the client's loop thread, bounded; any failure or overrun is ``default`` (a miss).

        The deadline is enforced on the loop (``wait_for`` cancels the call and waits for it to end), so when this
        returns, nothing writes into the host pool's pages any more: SGLang may reuse a failed page's slot at once.
        Only a loop that does not answer at all is left behind, after :data:`CANCEL_GRACE` more seconds.
        """
        bounded = asyncio.wait_for(coro, timeout)
        try:
            future = asyncio.run_coroutine_threadsafe(bounded, self._loop.loop)
        except Exception as exc:  # noqa: BLE001  (closed: a miss)
            bounded.close()
            coro.close()
            log.warning("ctxstore HiCache: %s", exc)
            return default
        try:
            return future.result(timeout + CANCEL_GRACE)
        except TimeoutError:
            future.cancel()
            self.counters["timeouts"] += 1
            log.warning("ctxstore HiCache: call over its %.1f s deadline: misses", timeout)
        except Exception as exc:  # noqa: BLE001  (never an exception into SGLang's controller)
            future.cancel()
            self.counters["failed_calls"] += 1
            log.warning("ctxstore HiCache: call failed: %s", exc)
        return default

    async def _ensure_bucket(self) -> None:
        if not self._bucket_ready:
            await self.store.create_bucket(self.bucket)
            self._bucket_ready = True

    def _pages(self, n_keys: int, host_indices: Any) -> list[list[memoryview]] | None:
        """Each page's buffers in the host pool, in page order (None if the pool does not describe them)."""
        try:
            pointers, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
            if isinstance(sizes, int):
                sizes = [sizes] * len(pointers)
            if not n_keys or len(pointers) % n_keys:
                raise ValueError(f"{len(pointers)} buffers for {n_keys} pages")
            per = len(pointers) // n_keys
            views = _page_views(pointers, sizes)
            return [views[i * per:(i + 1) * per] for i in range(n_keys)]
        except Exception as exc:  # noqa: BLE001
            log.warning("ctxstore HiCache: no page buffers for %d pages: %s", n_keys, exc)
            return None

    # ------------------------------------------------------------------ lookups

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        if not keys or not self.prefix or self._side_pools:
            return 0
        self.counters["lookups"] += 1
        self.counters["lookup_pages"] += len(keys)
        names = [self._key(k) for k in keys]
        sizes = [ABSENT] * len(keys)  # past the deadline the nodes that answered in time still count
        self._run(self.store.lookup_keys(self.bucket, names, sizes=sizes), self.lookup_timeout, sizes)
        n = prefix_length([s if s == self.page_bytes else ABSENT for s in sizes])
        self.counters["hit_pages"] += n
        return n

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # ------------------------------------------------------------------ zero-copy pages (interface_v1)

    def batch_get_v1(self, keys: list[str], host_indices: Any,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        if not keys or not self.prefix:
            return [False] * len(keys)
        pages = self._pages(len(keys), host_indices)
        if pages is None:
            return [False] * len(keys)
        self.counters["get_pages"] += len(keys)
        start = time.perf_counter()
        try:
            destinations = Destinations([Scatter(p) if len(p) > 1 else p[0] for p in pages], len(keys))
        except Exception as exc:  # noqa: BLE001
            log.warning("ctxstore HiCache: unusable page buffers: %s", exc)
            return [False] * len(keys)
        missing: list[Target | None] = [None] * len(keys)
        got = self._run(self.store.get_keys(self.bucket, [self._key(k) for k in keys], destinations),
                        self.call_timeout, missing)
        ok = [v is not None and len(v) == self.page_bytes for v in got]
        self._account(self._prefetch_pgs, self._prefetch_bandwidth, "got_pages", "bytes_in", sum(ok), start)
        self._touch([self._key(k) for k, loaded in zip(keys, ok) if loaded])
        return ok

    def _touch(self, names: list[str]) -> None:
        """Restart the TTL of pages just loaded (a page in use lives on), without waiting: a failure, or a touch
        skipped while :data:`MAX_TOUCHES` are out, costs only that they expire on time."""
        if not names or len(self._touches) >= MAX_TOUCHES:
            return
        coro = self._touch_pages(names)
        try:
            asyncio.run_coroutine_threadsafe(coro, self._loop.loop)
        except Exception:  # noqa: BLE001  (closed)
            coro.close()

    async def _touch_pages(self, names: list[str]) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._touches.add(task)  # close() ends them before it closes the client
        try:
            await asyncio.wait_for(self.store.keys_op(self.bucket, "touch", names, ttl=self.ttl), self.call_timeout)
        except Exception as exc:  # noqa: BLE001
            log.debug("ctxstore HiCache: TTL refresh of %d loaded pages failed: %r", len(names), exc)
        finally:
            self._touches.discard(task)

    def batch_set_v1(self, keys: list[str], host_indices: Any,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        if not keys:
            return []
        if not self.writer:  # an MLA replica: the writer rank stores the pages all ranks share
            return [True] * len(keys)
        if not self.prefix or self._side_pools:
            return [False] * len(keys)
        pages = self._pages(len(keys), host_indices)
        if pages is None:
            return [False] * len(keys)
        self.counters["set_pages"] += len(keys)
        start = time.perf_counter()
        blocks = [p[0] if len(p) == 1 else memoryview(b"".join(p)) for p in pages]
        names = [self._key(k) for k in keys]
        return self._put(names, blocks, start)

    def _put(self, names: list[str], blocks: list[memoryview], start: float) -> list[bool]:
        async def put() -> list[bool]:
            await self._ensure_bucket()
            # if_absent=False: a page whose object is there but of another size (a stale format) is replaced.
            result = await self.store.put_keys(self.bucket, names, blocks, ttl=self.ttl, if_absent=False)
            if result.failed:  # which ones is not reported: check every page of the batch
                sizes = await self.store.lookup_keys(self.bucket, names)
                return [s == len(b) for s, b in zip(sizes, blocks)]
            return [True] * len(names)

        ok = self._run(put(), self.call_timeout, [False] * len(names))
        with self._lock:
            self._stored.update((n, None) for n, stored in zip(names, ok) if stored)
            for _ in range(len(self._stored) - MAX_TRACKED_PAGES):
                self._stored.popitem(last=False)
        self._account(self._backup_pgs, self._backup_bandwidth, "stored_pages", "bytes_out", sum(ok), start)
        return ok

    def _account(self, pages: list[int], bandwidth: list[float], counter: str, bytes_counter: str, n: int,
                 start: float) -> None:
        seconds = time.perf_counter() - start
        nbytes = n * self.page_bytes
        self.counters[counter] += n
        self.counters[bytes_counter] += nbytes
        with self._stats_lock:
            if len(pages) < 10_000:  # drained by get_stats; bounded when nobody asks
                pages.append(n)
                bandwidth.append(nbytes / seconds / 1e9 if seconds > 0 else 0.0)

    # ------------------------------------------------------------------ the generic (copying) interface

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        return self.batch_get([key], [target_location] if target_location is not None else None)[0]

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list[Any]:
        """Pages into the given flat tensors (SGLang's ``get_dummy_flat_data_page()``), None where missing."""
        if not keys or not self.prefix or target_locations is None or self._side_pools:
            return [None] * len(keys)
        try:
            views = [byte_view(t, writable=True) for t in target_locations]
            order = self._flat_order
            destinations = Destinations([Scatter(self._flat_pieces(v, order)) if order else v for v in views],
                                        len(keys))
        except Exception as exc:  # noqa: BLE001
            log.warning("ctxstore HiCache: unusable targets: %s", exc)
            return [None] * len(keys)
        missing: list[Target | None] = [None] * len(keys)
        got = self._run(self.store.get_keys(self.bucket, [self._key(k) for k in keys], destinations),
                        self.call_timeout, missing)
        ok = [v is not None and len(v) == len(view) == self.page_bytes for v, view in zip(got, views)]
        self._touch([self._key(k) for k, loaded in zip(keys, ok) if loaded])
        return [t if loaded else None for t, loaded in zip(target_locations, ok)]

    def _flat_pieces(self, flat: memoryview, order: list[int]) -> list[memoryview]:
        """A flat page's pieces in object order (``order``: which equal piece of the flat page comes next)."""
        size = len(flat) // len(order)
        return [flat[i * size:(i + 1) * size] for i in order]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value if value is not None else target_location])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        pages = values if values is not None else target_locations
        if not keys or not self.prefix or pages is None or self._side_pools:
            return False
        if not self.writer:
            return True
        try:
            blocks = [byte_view(p.contiguous() if hasattr(p, "contiguous") else p) for p in pages]
            if self._flat_order:
                blocks = [memoryview(b"".join(self._flat_pieces(b, self._flat_order))) for b in blocks]
        except Exception as exc:  # noqa: BLE001
            log.warning("ctxstore HiCache: unusable pages: %s", exc)
            return False
        return all(self._put([self._key(k) for k in keys], blocks, time.perf_counter()))

    # ------------------------------------------------------------------ hybrid models (interface v2)
    # Side pools (Mamba states, SWA, DeepSeek V4's compressed pools) are not stored: a hybrid model's requests
    # miss L3 and its backups report failure, rather than the base class's NotImplementedError ending SGLang's
    # controller thread.

    def batch_exists_v2(self, keys: list[str], pool_transfers: Any = None,
                        extra_info: HiCacheStorageExtraInfo | None = None) -> Any:
        if pool_transfers:
            return PoolTransferResult.empty()
        n = self.batch_exists(keys, extra_info)
        return PoolTransferResult(n, {"kv": n} if n else {}, list(range(1, n + 1)))

    def batch_get_v2(self, transfers: Any, extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        return {str(t.name): [False] * len(t.keys or []) for t in transfers}

    def batch_set_v2(self, transfers: Any, extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        return {str(t.name): [False] * len(t.keys or []) for t in transfers}

    # ------------------------------------------------------------------ the rest

    def clear(self) -> bool:
        """Delete the pages this backend stored, the last :data:`MAX_TRACKED_PAGES` of them (other ranks and
        instances clear their own; older pages, and what was stored before a restart, expire by their TTL or are
        evicted)."""
        with self._lock:
            names, self._stored = list(self._stored), OrderedDict()
        if not names:
            return True
        # A page a failed delete leaves behind expires by its TTL (or is evicted), as one this process forgot.
        deleted = self._run(self.store.keys_op(self.bucket, "delete", names), self.call_timeout, -1)
        return deleted >= 0

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` (pages and GB/s of each prefetch and backup since the last call), or None
        where SGLang's metrics module cannot be imported. :attr:`counters` has the running totals."""
        try:
            from sglang.srt.observability.metrics_collector import StorageMetrics
        except Exception:  # noqa: BLE001
            return None
        metrics = StorageMetrics()
        with self._stats_lock:
            for mine, theirs in ((self._prefetch_pgs, metrics.prefetch_pgs), (self._backup_pgs, metrics.backup_pgs),
                                 (self._prefetch_bandwidth, metrics.prefetch_bandwidth),
                                 (self._backup_bandwidth, metrics.backup_bandwidth)):
                theirs.extend(mine)
                mine.clear()
        return metrics

    def close(self) -> None:
        if self._loop.started:
            self._run(self._aclose(), self.call_timeout, None)
        self._loop.stop()

    async def _aclose(self) -> None:
        touches = list(self._touches)
        for task in touches:
            task.cancel()
        await asyncio.gather(*touches, return_exceptions=True)
        await self.store.aclose()


def _number(name: str, value: Any) -> float:
    """A setting that must be a positive number of seconds (0, negative or not a number: ConfigurationError)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = float("nan")
    if not 0 < number < float("inf"):
        raise ConfigurationError(f"the ctxstore HiCache backend's \"{name}\" must be a positive number of "
                                 f"seconds, not {value!r}")
    return number


def _first_page(pool: Any) -> Any:
    import torch  # SGLang's own dependency: present wherever this backend runs

    return torch.arange(int(pool.page_size), dtype=torch.int64)
