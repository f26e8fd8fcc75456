"""The node's ASGI application: S3 at the root, ctxstore's own APIs under the reserved ``/_ctx/`` prefix
(``_`` cannot start a bucket name, so no bucket can shadow them), and the background housekeeping.

Where a request goes, by path:

=================================  ===========================================================================
``/_ctx/v1/bulk/<bucket>/<op>``    :class:`~.bulk.service.BulkService` through the request shell
``/_ctx/v1/admin/...``             the admin API (:mod:`.admin`, FastAPI, bearer token)
``/_ctx/v1/events[/snapshot]``     :class:`~.events.EventStream`
``/_ctx/health/live|ready``        :func:`health` (no token)
``/_ctx/metrics``, ``GET /metrics`` Prometheus (:class:`~.metrics.Metrics`, bearer token)
anything else                      :class:`~.s3.service.S3Service` through the request shell
=================================  ===========================================================================
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from functools import partial

from ctxstore import wire
from ctxstore.admin_schema import ADMIN_PREFIX, HEALTH_LIVE, HEALTH_READY, METRICS_PATH, RESERVED_METRICS_PATH

from . import allocator
from .admin.api import create_admin_app
from .bulk.service import BulkService
from .engine import Engine
from .events import EVENTS_PATH, EventHub, EventStream
from .metrics import Metrics, is_scrape
from .node import NodeState
from .protocol import shell
from .protocol.asgi import Receive, Scope, Send, send_response
from .s3.service import S3Service
from .settings import Settings
from .tenants import TenantRegistry

log = logging.getLogger("ctxstore")

RESERVED_PREFIX = "/_ctx/"
BULK_PREFIX = wire.PREFIX + "/"
HOUSEKEEPING_INTERVAL = 0.25  # seconds between bounded reaping passes
HOUSEKEEPING_BATCH = 5000  # expired objects dropped per pass at most
DISK_HOUSEKEEPING_EVERY = 4  # passes between the flash tier's (bounded) housekeeping: about once a second
_JSON = ("content-type", "application/json")


class App:
    """One ctxstore node: its parts, wired together, behind one ASGI callable."""

    def __init__(self, settings: Settings, tenants: TenantRegistry, engine: Engine | None = None) -> None:
        self.node = NodeState.create(settings, tenants, engine)
        self.metrics = Metrics(self.node)  # first: the services count into it (docs/metrics.md)
        requests = self.metrics.requests
        limits = shell.BodyLimits(settings.body_timeout, settings.min_body_rate)
        self.s3 = partial(shell.serve, S3Service(self.node.engine, tenants.lookup, settings), requests, limits)
        self.events = EventHub(self.node.engine, settings, self.node.node_id)  # for routers (docs/events.md)
        routes = None if self.events.routes is None else self.events.routes.remember
        self.bulk = partial(shell.serve, BulkService(self.node.engine, tenants.lookup, settings, routes), requests,
                            limits)
        self.event_stream = EventStream(self.events, self.node)
        self.admin = create_admin_app(self.node)
        self._housekeeper: asyncio.Task[None] | None = None

    @property
    def engine(self) -> Engine:
        return self.node.engine

    def _holds(self, bucket: str, keys: list[str]) -> list[bool]:
        """Per key, whether the node holds a live block there (of whichever tenant owns the bucket)."""
        owner = self.engine.owner_of(bucket)
        return self.engine.existing(owner, bucket, keys) if owner is not None else [False] * len(keys)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            path = scope["path"]
            if path.startswith(BULK_PREFIX):
                await self.bulk(scope, receive, send)
            elif path.startswith(ADMIN_PREFIX):
                if not self.node.admin_token:
                    await send_response(send, 403, [_JSON],
                                        b'{"detail":"admin API disabled: set CTXSTORE_ADMIN_TOKEN"}')
                    return
                await self.admin(scope, receive, send)
            elif path.startswith(RESERVED_PREFIX):
                await self._reserved(scope, receive, send)
            elif path == METRICS_PATH and is_scrape(scope):  # else S3 (a bucket named "metrics")
                await self.metrics.serve(scope, send)
            else:
                await self.s3(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    async def _reserved(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"]
        if path == EVENTS_PATH or path.startswith(EVENTS_PATH + "/"):
            await self.event_stream.serve(scope, receive, send)
        elif path == RESERVED_METRICS_PATH:
            await self.metrics.serve(scope, send)
        elif path in (HEALTH_LIVE, HEALTH_READY) and scope["method"] in ("GET", "HEAD"):
            await health(self.node, path == HEALTH_READY, scope["method"] == "HEAD", send)
        else:
            await send_response(send, 404, [_JSON], b'{"error":"no such endpoint"}')

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    # The flash tier's index is rebuilt before the port opens: ready means it serves what it holds.
                    await self.engine.open()
                except OSError as exc:  # the directory: in use, not writable, full. One line says it all.
                    reason = exc.strerror or str(exc)
                    where = f" ({exc.filename})" if exc.filename else ""
                    await send({"type": "lifespan.startup.failed", "message": f"flash tier: {reason}{where}"})
                    return
                except Exception as exc:
                    log.exception("the flash tier could not be opened")
                    await send({"type": "lifespan.startup.failed", "message": f"flash tier: {exc}"})
                    return
                self.node.apply_file_quotas()
                if self.events.routes is not None:
                    self.events.routes.retain(self._holds)
                await self.events.start()
                self.engine.announce_recovered()  # after AllBlocksCleared: what this process holds again
                self._housekeeper = asyncio.create_task(self._housekeeping())
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                self.node.draining = True
                if self._housekeeper is not None:
                    self._housekeeper.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await self._housekeeper
                try:
                    # What waits for flash is written, then what only RAM holds (bounded by the drain timeout),
                    # so a restart comes back with it; the segments are sealed.
                    await self.engine.close(spill_seconds=self.node.settings.drain_timeout)
                except Exception:
                    log.exception("closing the flash tier failed")
                await self.events.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _housekeeping(self) -> None:
        """Reclaim expired objects and stale uploads in bounded passes; the flash tier's work once a second."""
        passes = 0
        while True:
            await asyncio.sleep(HOUSEKEEPING_INTERVAL)
            passes += 1
            try:
                self.node.engine.reap(HOUSEKEEPING_BATCH)
                if passes % DISK_HOUSEKEEPING_EVERY == 0:
                    await self.node.engine.housekeep_disk()
                    allocator.trim()
            except Exception:  # never let housekeeping die silently
                log.exception("housekeeping pass failed")


async def health(node: NodeState, ready: bool, head: bool, send: Send) -> None:
    """Liveness always answers 200; readiness answers 503 once the node is draining. A flash tier that stopped
    writing (device full or failing) is a detail, not unreadiness: RAM still serves."""
    ok = not ready or not node.draining
    answer: dict[str, str] = {"status": "ok" if ok else "draining"}
    degraded = node.engine.disk_degraded
    if degraded is not None:
        answer["disk"] = f"degraded: {degraded}"
    await send_response(send, 200 if ok else 503, [_JSON], json.dumps(answer, separators=(",", ":")).encode(), head=head)
