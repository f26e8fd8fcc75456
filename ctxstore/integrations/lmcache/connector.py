"""The LMCache remote connector on the bulk API, and the adapter LMCache's plugin loader instantiates.

LMCache (0.5.6) calls a remote connector's coroutines on its own event loop (a thread of the storage
manager); the :class:`~ctxstore.AsyncContextStore` here runs on that same loop. Its synchronous entry points
(``exists_sync``, ``batched_contains``, ``remove_sync``) hand the call to that loop and wait at most the call
timeout. Failures are misses, as LMCache's own policy wants (a failed retrieve is recomputed): a node that is
down, slow or answers garbage contributes absent chunks, never an exception into LMCache.

Objects are LMCache's chunk bytes as its serializer produced them (``remote_serde: naive``: the KV tensor's
bytes), one object per chunk, under LMCache's own key string (``CacheEngineKey.to_string()``: model, world
size, worker, chunk hash, dtype), in one bucket.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Coroutine
from typing import Any, TypeVar
from urllib.parse import urlparse

from lmcache.logging import init_logger
from lmcache.v1.storage_backend.connector import ConnectorAdapter, ConnectorContext
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from ...buffers import Destinations, byte_view
from ...core import AsyncContextStore, Timeouts, flash_resident
from ...errors import ConfigurationError
from ...wire import ABSENT, prefix_length

__all__ = ["CtxStoreConnectorAdapter", "CtxStoreRemoteConnector"]

logger = init_logger(__name__)
T = TypeVar("T")
PLUGIN = "ctxstore"


def _option(extra: dict[str, Any], name: str, default: Any = None) -> Any:
    return extra.get(f"{PLUGIN}.{name}", default)


class CtxStoreRemoteConnector(RemoteConnector):
    """LMCache ``RemoteConnector`` over a ctxstore pod's bulk API (see the module docstring)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, local_cpu_backend: Any, config: Any, metadata: Any,
                 url: str | None = None) -> None:
        super().__init__(config, metadata)
        extra = dict(config.extra_config or {})
        nodes = _option(extra, "nodes")
        bucket = _option(extra, "bucket", "lmcache")
        if url and url.startswith(f"{PLUGIN}://"):  # ctxstore://node-a:9000,node-b:9000/bucket also works
            parsed = urlparse(url)
            nodes = parsed.netloc or nodes
            bucket = parsed.path.strip("/") or bucket
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        self.bucket = str(bucket)
        self.ttl = float(_option(extra, "ttl")) if _option(extra, "ttl") else None
        self.pin_seconds = float(_option(extra, "pin_seconds", 30.0))
        timeouts = Timeouts(connect=float(_option(extra, "connect_timeout", 0.5)),
                            read=float(_option(extra, "read_timeout", 2.0)),
                            total=float(_option(extra, "call_timeout", 10.0)))
        self.deadline = timeouts.total + 1.0
        self.store = AsyncContextStore(nodes or os.environ.get("CTXSTORE_NODES"),
                                       access_key=_option(extra, "access_key"),
                                       secret_key=_option(extra, "secret_key"), timeouts=timeouts)
        self._bucket_ready = False
        self._prefetches: set[asyncio.Task[int]] = set()  # started by lookups, kept until they end
        logger.info("ctxstore remote connector: bucket %s, chunk %d bytes", self.bucket, self.full_chunk_size_bytes)

    # ------------------------------------------------------------------ helpers

    def _sync(self, coro: Coroutine[Any, Any, T], default: T) -> T:
        """Run on LMCache's loop from another thread, bounded; a failure is ``default``."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(self.deadline)
        except Exception as exc:  # noqa: BLE001  (a miss, never an error in LMCache)
            future.cancel()
            logger.warning("ctxstore: call failed: %s", exc)
            return default

    async def _ensure_bucket(self) -> None:
        if not self._bucket_ready:
            await self.store.create_bucket(self.bucket)
            self._bucket_ready = True

    def _usable(self, size: int) -> bool:
        return 0 < size <= self.full_chunk_size_bytes and size % self.single_token_size == 0

    # ------------------------------------------------------------------ lookups

    async def exists(self, key: Any) -> bool:
        sizes = await self.store.lookup_keys(self.bucket, [key.to_string()])
        return self._usable(sizes[0])

    def exists_sync(self, key: Any) -> bool:
        return self._sync(self.exists(key), False)

    async def _prefix(self, keys: list[Any], pin: bool) -> int:
        # With a pin, the matched chunks stay in the pod while the retrieve that follows is in flight: one
        # round trip per node either way (the node pins as it looks up).
        names = [k.to_string() for k in keys]
        found = await self.store.locate_keys(self.bucket, names, pin=self.pin_seconds if pin else 0.0)
        n = prefix_length([f[0] if f is not None and self._usable(f[0]) else ABSENT for f in found])
        cold = flash_resident(names[:n], found[:n])  # brought into RAM while LMCache gets ready to retrieve
        if cold:
            task = asyncio.get_running_loop().create_task(self.store.prefetch_keys(self.bucket, cold))
            self._prefetches.add(task)
            task.add_done_callback(self._prefetch_done)
        return n

    def _prefetch_done(self, task: asyncio.Task[int]) -> None:
        self._prefetches.discard(task)
        if not task.cancelled() and task.exception() is not None:  # advisory: a slower retrieve, no more
            logger.debug("ctxstore: prefetch failed: %s", task.exception())

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: list[Any]) -> int:
        return self._sync(self._prefix(list(keys), False), 0)

    def support_batched_async_contains(self) -> bool:
        return True

    async def batched_async_contains(self, lookup_id: str, keys: list[Any], pin: bool = False) -> int:
        try:
            return await self._prefix(list(keys), pin)
        except Exception as exc:  # noqa: BLE001
            logger.warning("ctxstore: lookup failed: %s", exc)
            return 0

    # ------------------------------------------------------------------ gets

    async def get(self, key: Any) -> Any:
        return (await self.batched_get([key]))[0]

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: list[Any]) -> list[Any]:
        objs = [self.local_cpu_backend.allocate(self.meta_shapes, self.meta_dtypes, self.meta_fmt) for _ in keys]
        live = [i for i, o in enumerate(objs) if o is not None]
        out: list[Any] = [None] * len(keys)
        if not live:
            return out
        try:
            views = await self.store.get_keys(
                self.bucket, [keys[i].to_string() for i in live],
                Destinations([byte_view(objs[i].tensor) for i in live], len(live)))
        except Exception as exc:  # noqa: BLE001  (strict mode is off: only a caller's mistake gets here)
            logger.warning("ctxstore: get failed: %s", exc)
            views = [None] * len(live)
        for i, view in zip(live, views):
            obj = objs[i]
            if view is None or not self._usable(len(view)):
                obj.ref_count_down()
                continue
            out[i] = self.reshape_partial_chunk(obj, len(view)) if len(view) != obj.get_size() else obj
        for i, obj in enumerate(objs):
            if obj is not None and i not in live:
                obj.ref_count_down()
        return out

    def support_batched_get_non_blocking(self) -> bool:
        return True

    async def batched_get_non_blocking(self, lookup_id: str, keys: list[Any]) -> list[Any]:
        """The leading chunks that arrived; every chunk after the first missing one is released."""
        got = await self.batched_get(list(keys))
        n = next((i for i, o in enumerate(got) if o is None), len(got))
        for obj in got[n:]:
            if obj is not None:
                obj.ref_count_down()
        return got[:n]

    # ------------------------------------------------------------------ puts

    async def put(self, key: Any, memory_obj: Any) -> None:
        await self.batched_put([key], [memory_obj])

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys: list[Any], memory_objs: list[Any]) -> None:
        try:
            await self._ensure_bucket()
            views = [byte_view(obj.tensor)[:obj.get_size()] for obj in memory_objs]
            result = await self.store.put_keys(self.bucket, [k.to_string() for k in keys], views, ttl=self.ttl)
            if result.failed:
                logger.warning("ctxstore: %d of %d chunks not stored", result.failed, len(keys))
        except Exception as exc:  # noqa: BLE001  (a dropped put is a future miss)
            logger.warning("ctxstore: put of %d chunks failed: %s", len(keys), exc)

    # ------------------------------------------------------------------ the rest

    def remove_sync(self, key: Any) -> bool:
        return self._sync(self.store.keys_op(self.bucket, "delete", [key.to_string()]), 0) > 0

    async def list(self) -> list[str]:
        raise NotImplementedError("listing is S3's job: ListObjectsV2 on the bucket")

    async def close(self) -> None:
        await self.store.aclose()


class CtxStoreConnectorAdapter(ConnectorAdapter):
    """What LMCache's plugin loader instantiates (``remote_storage_plugin.ctxstore.class_name``)."""

    def __init__(self) -> None:
        super().__init__(f"{PLUGIN}://")

    def can_parse(self, url: str) -> bool:
        return url.startswith(self.schema) or url == f"plugin://{PLUGIN}" or url.startswith(f"plugin://{PLUGIN}.")

    def create_connector(self, context: ConnectorContext) -> RemoteConnector:
        if context.local_cpu_backend is None:
            raise ConfigurationError("the ctxstore LMCache backend needs LMCache's local CPU backend as its buffer")
        return CtxStoreRemoteConnector(context.loop, context.local_cpu_backend, context.config, context.metadata,
                                       url=context.url)
