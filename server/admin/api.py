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
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from ..engine import errors as storage
from ..settings import SETTINGS, parse_duration, parse_size
from . import tenants as tenant_keys

if TYPE_CHECKING:
    from ..app import App

PREFIX = "/_ctx/v1/admin"
# The only paths served without the token: the API docs and the status page (which holds no data; its API
# calls carry the token).
DOCS_PATHS = (f"{PREFIX}/docs", f"{PREFIX}/openapi.json", f"{PREFIX}/status")
audit = logging.getLogger("ctxstore.audit")


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt field is a 422, not a silent no-op


class BucketPolicy(_Body):
    default_ttl: float | None = Field(None, gt=0, allow_inf_nan=False,
                                      description="Seconds; null = the server default")
    sliding_ttl: bool | None = Field(None, description="Reads push the expiry forward")
    quota: int | None = Field(None, ge=0, description="Byte quota of the bucket; 0 = none")


class TenantCreate(_Body):
    tenant: str = Field(..., min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._\-]+$")
    quota: int | None = Field(None, ge=0, description="Byte quota of the tenant; 0/null = none")
    access_key: str | None = Field(None, pattern=r"^[A-Za-z0-9._\-]{3,128}$",
                                   description="Given by a pod-wide CLI so every node gets the same pair")
    secret_key: str | None = Field(None, min_length=8, max_length=256, description="Given with access_key")


class TenantUpdate(_Body):
    enabled: bool | None = None
    quota: int | None = Field(None, ge=0)


class FlushRequest(_Body):
    bucket: str
    prefix: str = ""
    mode: str = Field("flush", pattern="^(flush|expire)$", description="flush: delete now; expire: expire now")


class SettingsUpdate(_Body):
    memory: str | int | None = Field(None, description="Byte budget, e.g. 4GiB; a cut evicts down to it")
    default_ttl: str | float | None = None
    max_ttl: str | float | None = None


def create_admin_app(node: App) -> FastAPI:
    """The admin FastAPI application of one node."""
    app = FastAPI(
        title="ctxstore admin API",
        version="1",
        docs_url=DOCS_PATHS[0],
        openapi_url=DOCS_PATHS[1],
        redoc_url=None,
        swagger_ui_oauth2_redirect_url=None,  # no OAuth; its default route would sit outside PREFIX
    )

    def token_ok(request: Request) -> bool:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        expected = node.admin_token
        return (bool(expected) and scheme.lower() == "bearer" and bool(token)
                and hmac.compare_digest(token.encode(), expected.encode()))

    def require_token(request: Request) -> str:
        """Per-route check (and the OpenAPI security note); the middleware below already checked."""
        if not token_ok(request):
            raise HTTPException(401, "admin bearer token required", headers={"WWW-Authenticate": "Bearer"})
        return "admin"

    @app.middleware("http")
    async def guard_and_audit(request: Request, call_next: Any) -> Response:
        """The token is checked here, before routing and body parsing, for every path but the docs: a route
        added without ``dependencies=auth``, an unknown path or a wrong method all answer 401 without it."""
        path = request.url.path
        if path in DOCS_PATHS:
            return await call_next(request)
        started = time.perf_counter()
        who = "admin" if token_ok(request) else "anonymous"
        client = request.client.host if request.client else "-"

        def log(status: int) -> None:
            audit.info("who=%s client=%s what=%s %s result=%d ms=%.1f", who, client, request.method, path,
                       status, (time.perf_counter() - started) * 1000)

        if who != "admin":
            log(401)
            return JSONResponse({"detail": "admin bearer token required"}, status_code=401,
                                headers={"WWW-Authenticate": "Bearer"})
        try:
            response = await call_next(request)
        except Exception:
            log(500)
            raise
        log(response.status_code)
        return response

    @app.exception_handler(storage.StorageError)
    async def storage_error(request: Request, exc: storage.StorageError) -> JSONResponse:
        status = {storage.NoSuchBucket: 404, storage.InsufficientCapacity: 503}.get(type(exc), 400)
        return JSONResponse({"detail": str(exc), "error": type(exc).__name__}, status_code=status)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        """422 saying where and why, without echoing the input: it may be a secret (a too-short
        secret_key), or NaN / Infinity, which JSON cannot carry back (FastAPI's own handler then
        fails with 500)."""
        errors = [{"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")}
                  for e in exc.errors()]
        return JSONResponse({"detail": errors}, status_code=422)

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
        return tenant_keys.list_tenants(node)

    @app.post(f"{PREFIX}/tenants", dependencies=auth, status_code=201)
    def create_tenant(body: TenantCreate) -> dict[str, Any]:
        """Create a key pair for a tenant (new or existing). The secret is returned once, never again."""
        return tenant_keys.create_tenant_key(node, body.tenant, body.quota, body.access_key, body.secret_key)

    @app.patch(f"{PREFIX}/tenants/{{access_key}}", dependencies=auth)
    def update_tenant(access_key: str, body: TenantUpdate) -> dict[str, Any]:
        return tenant_keys.update_tenant_key(node, access_key, enabled=body.enabled, quota=body.quota)

    @app.delete(f"{PREFIX}/tenants/{{access_key}}", dependencies=auth)
    def delete_tenant(access_key: str) -> dict[str, Any]:
        return tenant_keys.delete_tenant_key(node, access_key)

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

    @app.get(f"{PREFIX}/status", include_in_schema=False)
    def status_page() -> Response:
        """The status page (admin/status.html). It loads without the token because it holds no data and no
        secret; every API call it makes carries the token the operator gives it (URL fragment ``#token=`` or
        its token field). The CSP admits only its own inline script and style and calls to this origin."""
        import base64
        import hashlib
        import re
        from pathlib import Path

        try:
            page = Path(__file__).with_name("status.html").read_bytes()
        except OSError:
            raise HTTPException(404, "status page not installed (admin/status.html)") from None

        scripts = " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(m).digest()).decode()}'"
                           for m in re.findall(rb"<script>(.*?)</script>", page, re.S))
        csp = (f"default-src 'none'; script-src {scripts}; style-src 'unsafe-inline'; connect-src 'self'; "
               "img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
        return Response(page, media_type="text/html; charset=utf-8", headers={
            "Cache-Control": "no-store", "Content-Security-Policy": csp, "Referrer-Policy": "no-referrer",
            "X-Content-Type-Options": "nosniff", "X-Frame-Options": "DENY"})

    return app
