"""The node's ASGI application: S3 at the root, ctxstore's own APIs under the reserved ``/_ctx/`` prefix
(``_`` cannot start a bucket name, so no bucket can shadow them), and the background housekeeping."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time

from ctxstore import wire

from .admin.api import PREFIX as ADMIN_PREFIX
from .admin.api import create_admin_app
from .asgi import Receive, Scope, Send, send_response
from .bulk import BulkService
from .engine.store import Engine, EngineConfig
from .events import EVENTS_PATH, EventHub
from .metrics import METRICS_PATH, RESERVED_METRICS_PATH, Metrics, is_scrape
from .s3.service import S3Service
from .settings import Settings
from .tenants import TenantRegistry

log = logging.getLogger("ctxstore")

RESERVED_PREFIX = "/_ctx/"
BULK_PREFIX = wire.PREFIX + "/"  # the bulk API (server/bulk.py)
HOUSEKEEPING_INTERVAL = 0.25  # seconds between bounded reaping passes
HOUSEKEEPING_BATCH = 5000  # expired objects dropped per pass at most


def engine_config(settings: Settings) -> EngineConfig:
    return EngineConfig(
        budget=settings.memory,
        default_ttl=settings.default_ttl,
        max_ttl=settings.max_ttl,
        max_pin=settings.max_pin,
        max_object_size=settings.max_object_size,
        min_part_size=settings.min_part_size,
        upload_ttl=settings.upload_ttl,
    )


class App:
    """One ctxstore node."""

    def __init__(self, settings: Settings, tenants: TenantRegistry, engine: Engine | None = None) -> None:
        self.settings = settings
        self.tenants = tenants
        self.engine = engine or Engine(engine_config(settings))
        self.s3 = S3Service(self.engine, tenants.lookup, settings)
        self.bulk = BulkService(self.engine, tenants.lookup, settings)
        self.started = time.time()
        self.draining = False
        self.node_id = settings.node_id or f"{socket.gethostname()}:{settings.port}"
        self.admin_token: str = settings.admin_token
        self.admin = create_admin_app(self)
        self.events = EventHub(self)  # store events for routers (docs/events.md)
        self.metrics = Metrics(self)  # this node's own Prometheus registry (docs/metrics.md)
        self.s3.metrics = self.bulk.metrics = self.metrics.requests
        self._housekeeper: asyncio.Task[None] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            if scope["path"].startswith(BULK_PREFIX):
                await self.bulk(scope, receive, send)
            elif scope["path"].startswith(ADMIN_PREFIX):
                if not self.admin_token:
                    await send_response(send, 403, [("content-type", "application/json")],
                                        b'{"detail":"admin API disabled: set CTXSTORE_ADMIN_TOKEN"}')
                    return
                await self.admin(scope, receive, send)
            elif scope["path"].startswith(RESERVED_PREFIX):
                await self._reserved(scope, receive, send)
            elif scope["path"] == METRICS_PATH and is_scrape(scope):  # else S3 (a bucket named "metrics")
                await self.metrics.serve(scope, send)
            else:
                await self.s3(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    async def _reserved(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"]
        if path == EVENTS_PATH or path.startswith(EVENTS_PATH + "/"):
            await self.events.serve(scope, receive, send)
            return
        if path == RESERVED_METRICS_PATH:
            await self.metrics.serve(scope, send)
            return
        if path in ("/_ctx/health/live", "/_ctx/health/ready") and scope["method"] in ("GET", "HEAD"):
            ok = path.endswith("live") or not self.draining
            body = b'{"status":"ok"}' if ok else b'{"status":"draining"}'
            await send_response(send, 200 if ok else 503, [("content-type", "application/json")], body,
                                head=scope["method"] == "HEAD")
            return
        await send_response(send, 404, [("content-type", "application/json")], b'{"error":"no such endpoint"}')

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await self.events.start()
                self._housekeeper = asyncio.create_task(self._housekeeping())
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                self.draining = True
                if self._housekeeper is not None:
                    self._housekeeper.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await self._housekeeper
                await self.events.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _housekeeping(self) -> None:
        """Reclaim expired objects and stale uploads in bounded passes."""
        while True:
            await asyncio.sleep(HOUSEKEEPING_INTERVAL)
            try:
                self.engine.reap(HOUSEKEEPING_BATCH)
            except Exception:  # never let housekeeping die silently
                log.exception("housekeeping pass failed")
