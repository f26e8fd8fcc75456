"""The admin API: JSON over FastAPI under ``/_ctx/v1/admin``, authenticated with the admin bearer token.

S3 keys never open it and the token never opens S3. Every call leaves one audit log line (who, what,
result) on the ``ctxstore.audit`` logger; no secret is ever logged.
"""

from __future__ import annotations

import hmac
import logging
import time
from typing import TYPE_CHECKING, Any

from fastapi import Depends, FastAPI, HTTPException, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from ..engine import errors as storage
from ..settings import SETTINGS, parse_duration, parse_size

if TYPE_CHECKING:
    from ..app import App

PREFIX = "/_ctx/v1/admin"
audit = logging.getLogger("ctxstore.audit")


class BucketPolicy(BaseModel):
    default_ttl: float | None = Field(None, gt=0, description="Seconds; null = the server default")
    sliding_ttl: bool | None = Field(None, description="Reads push the expiry forward")
    quota: int | None = Field(None, ge=0, description="Byte quota of the bucket; 0 = none")


class TenantCreate(BaseModel):
    tenant: str = Field(..., min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._\-]+$")
    quota: int | None = Field(None, ge=0, description="Byte quota of the tenant; 0/null = none")
    access_key: str | None = Field(None, description="Given by a pod-wide CLI so every node gets the same pair")
    secret_key: str | None = Field(None, min_length=8)


class TenantUpdate(BaseModel):
    enabled: bool | None = None
    quota: int | None = Field(None, ge=0)


class FlushRequest(BaseModel):
    bucket: str
    prefix: str = ""
    mode: str = Field("flush", pattern="^(flush|expire)$", description="flush: delete now; expire: expire now")


class SettingsUpdate(BaseModel):
    memory: str | int | None = Field(None, description="Byte budget, e.g. 4GiB; a cut evicts down to it")
    default_ttl: str | float | None = None
    max_ttl: str | float | None = None


def create_admin_app(node: App) -> FastAPI:
    """The admin FastAPI application of one node."""
    app = FastAPI(
        title="ctxstore admin API",
        version="1",
        docs_url=f"{PREFIX}/docs",
        openapi_url=f"{PREFIX}/openapi.json",
        redoc_url=None,
    )

    def require_token(request: Request) -> str:
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        expected = node.admin_token
        if scheme.lower() != "bearer" or not token or not hmac.compare_digest(token.encode(), expected.encode()):
            raise HTTPException(401, "admin bearer token required", headers={"WWW-Authenticate": "Bearer"})
        return "admin"

    @app.middleware("http")
    async def audit_log(request: Request, call_next: Any) -> Response:
        started = time.perf_counter()
        response = await call_next(request)
        if request.url.path.startswith(PREFIX) and not request.url.path.startswith(
                (f"{PREFIX}/docs", f"{PREFIX}/openapi.json")):
            who = "admin" if response.status_code not in (401, 403) else "anonymous"
            audit.info("who=%s what=%s %s result=%d ms=%.1f", who, request.method, request.url.path,
                       response.status_code, (time.perf_counter() - started) * 1000)
        return response

    @app.exception_handler(storage.StorageError)
    async def storage_error(request: Request, exc: storage.StorageError) -> JSONResponse:
        status = {storage.NoSuchBucket: 404, storage.InsufficientCapacity: 503}.get(type(exc), 400)
        return JSONResponse({"detail": str(exc), "error": type(exc).__name__}, status_code=status)

    auth = [Depends(require_token)]

    @app.get(f"{PREFIX}/info", dependencies=auth)
    def info() -> dict[str, Any]:
        """Version, uptime, node id, settings in force, budget."""
        from ctxstore import __version__

        return {
            "version": __version__,
            "node_id": node.node_id,
            "uptime": time.time() - node.started,
            "draining": node.draining,
            "settings": node.settings.as_dict(),
            "budget": node.engine.config.budget,
            "used": node.engine.used,
        }

    @app.get(f"{PREFIX}/stats", dependencies=auth)
    def stats(reset: bool = False) -> dict[str, Any]:
        """Global and per-bucket counters; ``reset=true`` zeroes the counters after reading them."""
        return node.engine.stats(reset=reset)

    @app.get(f"{PREFIX}/buckets", dependencies=auth)
    def buckets() -> list[dict[str, Any]]:
        return node.engine.bucket_summaries()

    @app.put(f"{PREFIX}/buckets/{{bucket}}/policy", dependencies=auth)
    def set_policy(bucket: str, policy: BucketPolicy) -> dict[str, Any]:
        return node.engine.set_bucket_policy(bucket, **policy.model_dump(exclude_none=True))

    @app.get(f"{PREFIX}/tenants", dependencies=auth)
    def tenants() -> list[dict[str, Any]]:
        return node.list_tenants()

    @app.post(f"{PREFIX}/tenants", dependencies=auth, status_code=201)
    def create_tenant(body: TenantCreate) -> dict[str, Any]:
        """Create a key pair for a tenant (new or existing). The secret is returned once, never again."""
        return node.create_tenant_key(body.tenant, body.quota, body.access_key, body.secret_key)

    @app.patch(f"{PREFIX}/tenants/{{access_key}}", dependencies=auth)
    def update_tenant(access_key: str, body: TenantUpdate) -> dict[str, Any]:
        return node.update_tenant_key(access_key, enabled=body.enabled, quota=body.quota)

    @app.delete(f"{PREFIX}/tenants/{{access_key}}", dependencies=auth)
    def delete_tenant(access_key: str) -> dict[str, Any]:
        return node.delete_tenant_key(access_key)

    @app.post(f"{PREFIX}/flush", dependencies=auth)
    def flush(body: FlushRequest) -> dict[str, Any]:
        """Delete (or expire) every key of a bucket, or every key under a prefix."""
        if body.mode == "expire":
            return {"expired": node.engine.expire_now(body.bucket, body.prefix)}
        return {"flushed": node.engine.flush(body.bucket, body.prefix)}

    @app.get(f"{PREFIX}/settings", dependencies=auth)
    def get_settings() -> dict[str, Any]:
        mutable = [s.name for s in SETTINGS if s.mutable]
        return {"settings": node.settings.as_dict(), "mutable": mutable}

    @app.put(f"{PREFIX}/settings", dependencies=auth)
    def set_settings(body: SettingsUpdate) -> dict[str, Any]:
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
        result = node.engine.set_limits(budget=memory, default_ttl=default_ttl, max_ttl=max_ttl)
        for name, value in (("memory", memory), ("default_ttl", default_ttl), ("max_ttl", max_ttl)):
            if value is not None:
                setattr(node.settings, name, value)
        return {"settings": node.settings.as_dict(), **result}

    return app
