"""The admin API's routes: one function each, over the node's state (``request.app.state.node``).

:data:`ROUTES` is the table (method, path, function); every route but the status page depends on
:func:`require_token` (the middleware in :mod:`.api` already checked it, before routing and body parsing; the
dependency documents it in the OpenAPI schema and guards a route mounted elsewhere)."""

from __future__ import annotations

import functools
import inspect
import time
from typing import Annotated, Any

from collections.abc import Callable

from fastapi import Depends, FastAPI, HTTPException, Request, Response

from ctxstore import __version__
from ctxstore.admin_schema import ADMIN_PREFIX

from .. import bearer
from ..node import NodeState
from ..settings import SETTINGS, parse_duration, parse_size
from . import status
from . import tenants as tenant_keys
from .pod import PodView
from .models import BucketPolicy, FlushRequest, SettingsUpdate, TenantCreate, TenantUpdate


def node_of(request: Request) -> NodeState:
    state: NodeState = request.app.state.node
    return state


def require_token(request: Request) -> str:
    if not bearer.matches(request.headers.get("authorization"), node_of(request).admin_token):
        raise HTTPException(401, "admin bearer token required", headers={"WWW-Authenticate": "Bearer"})
    return "admin"


Node = Annotated[NodeState, Depends(node_of)]


def info(node: Node) -> dict[str, Any]:
    """Version, uptime, node id, settings in force, budget."""
    return {
        "version": __version__,
        "node_id": node.node_id,
        "uptime": time.time() - node.started,
        "draining": node.draining,
        "settings": node.settings.as_dict(),
        "budget": node.engine.config.budget,
        "used": node.engine.budget.used,
    }


def stats(node: Node, reset: bool = False) -> dict[str, Any]:
    """Global and per-bucket counters; ``reset=true`` zeroes the counters after reading them."""
    return node.engine.operator.stats(reset=reset)


def buckets(node: Node) -> list[dict[str, Any]]:
    return node.engine.operator.bucket_summaries()


def set_policy(node: Node, bucket: str, policy: BucketPolicy) -> dict[str, Any]:
    return node.engine.set_bucket_policy(bucket, **policy.model_dump(exclude_none=True))


def tenants(node: Node) -> list[dict[str, Any]]:
    return tenant_keys.list_tenants(node)


def create_tenant(node: Node, body: TenantCreate) -> dict[str, Any]:
    """Create a key pair for a tenant (new or existing). The secret is returned once, never again."""
    return tenant_keys.create_tenant_key(node, body.tenant, body.quota, body.access_key, body.secret_key)


def update_tenant(node: Node, access_key: str, body: TenantUpdate) -> dict[str, Any]:
    return tenant_keys.update_tenant_key(node, access_key, enabled=body.enabled, quota=body.quota)


def delete_tenant(node: Node, access_key: str) -> dict[str, Any]:
    return tenant_keys.delete_tenant_key(node, access_key)


async def flush(node: Node, body: FlushRequest) -> dict[str, Any]:
    """Delete (or expire) every key of a bucket, or every key under a prefix."""
    if body.mode == "expire":
        return {"expired": await node.engine.expire_now(body.bucket, body.prefix)}
    return {"flushed": await node.engine.flush(body.bucket, body.prefix)}


def get_settings(node: Node) -> dict[str, Any]:
    mutable = [s.name for s in SETTINGS if s.mutable]
    return {"settings": node.settings.as_dict(), "mutable": mutable}


def set_settings(node: Node, body: SettingsUpdate) -> dict[str, Any]:
    """Change the budget and TTL defaults at run time (validated; a budget cut evicts down to it)."""
    try:
        memory = parse_size(str(body.memory)) if body.memory is not None else None
        default_ttl = parse_duration(str(body.default_ttl)) if body.default_ttl is not None else None
        max_ttl = parse_duration(str(body.max_ttl)) if body.max_ttl is not None else None
    except ValueError as exc:
        raise HTTPException(422, str(exc)) from None
    for name, value in (("default_ttl", default_ttl), ("max_ttl", max_ttl), ("memory", memory)):
        if value is not None and not value > 0:
            raise HTTPException(422, f"{name} must be positive")
    result = node.engine.operator.set_limits(budget=memory, default_ttl=default_ttl, max_ttl=max_ttl)
    if memory is not None:
        node.settings.memory = memory
    if default_ttl is not None:
        node.settings.default_ttl = default_ttl
    if max_ttl is not None:
        node.settings.max_ttl = max_ttl
    return {"settings": node.settings.as_dict(), **result}


async def pod(request: Request) -> dict[str, Any]:
    """Every node of the pod (the ``peers`` setting) with its tiers, counters and health, and the pod's totals:
    what the status page shows (see :mod:`.pod`)."""
    view: PodView | None = getattr(request.app.state, "pod_view", None)
    if view is None:
        view = request.app.state.pod_view = PodView(node_of(request))
    return await view.snapshot()


def status_page(request: Request) -> Response:
    """The status page (see :mod:`.status`); HEAD gets the GET's headers, its length included, and no body."""
    try:
        page, headers = status.page_and_headers()
    except OSError:
        raise HTTPException(404, "status page not installed (admin/status.html)") from None
    if request.method == "HEAD":
        return Response(media_type="text/html; charset=utf-8", headers={**headers, "Content-Length": str(len(page))})
    return Response(page, media_type="text/html; charset=utf-8", headers=headers)


# (method, path under the prefix, function, status code of success)
ROUTES: tuple[tuple[str, str, Callable[..., object], int], ...] = (
    ("GET", "/info", info, 200),
    ("GET", "/stats", stats, 200),
    ("GET", "/pod", pod, 200),
    ("GET", "/buckets", buckets, 200),
    ("PUT", "/buckets/{bucket}/policy", set_policy, 200),
    ("GET", "/tenants", tenants, 200),
    ("POST", "/tenants", create_tenant, 201),
    ("PATCH", "/tenants/{access_key}", update_tenant, 200),
    ("DELETE", "/tenants/{access_key}", delete_tenant, 200),
    ("POST", "/flush", flush, 200),
    ("GET", "/settings", get_settings, 200),
    ("PUT", "/settings", set_settings, 200),
)


def on_the_loop(endpoint: Callable[..., Any]) -> Callable[..., Any]:
    """FastAPI runs a plain ``def`` endpoint in a worker thread; the engine is single-threaded (every call is
    atomic only on the event loop), so each route runs on the loop instead, as a coroutine of the same
    signature."""
    if inspect.iscoroutinefunction(endpoint):
        return endpoint

    @functools.wraps(endpoint)
    async def run(*args: Any, **kwargs: Any) -> Any:
        return endpoint(*args, **kwargs)

    return run


def register(app: FastAPI) -> None:
    """Add every route of :data:`ROUTES` (token required) and the status page (public: it holds no data)."""
    for method, path, endpoint, status_code in ROUTES:
        app.add_api_route(ADMIN_PREFIX + path, on_the_loop(endpoint), methods=[method], status_code=status_code,
                          dependencies=[Depends(require_token)])
    app.add_api_route(ADMIN_PREFIX + "/status", status_page, methods=["GET", "HEAD"], include_in_schema=False)
