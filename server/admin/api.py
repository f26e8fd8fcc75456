"""The admin API: JSON over FastAPI under ``/_ctx/v1/admin``, authenticated with the admin bearer token.

S3 keys never open it and the token never opens S3. Every call leaves one audit log line (who, what,
result) on the ``ctxstore.audit`` logger; no secret is ever logged. The routes are in :mod:`.routes`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from ctxstore.admin_schema import ADMIN_PREFIX

from .. import bearer
from ..engine import Kind, StorageError
from ..node import NodeState
from . import routes

PREFIX = ADMIN_PREFIX
# The only paths served without the token: the API docs and the status page (which holds no data; its API
# calls carry the token).
DOCS_PATHS = (f"{PREFIX}/docs", f"{PREFIX}/openapi.json", f"{PREFIX}/status")
audit = logging.getLogger("ctxstore.audit")

# Engine error kinds -> HTTP status: the one place they become admin API errors.
STATUS: dict[Kind, int] = {
    Kind.NO_SUCH_BUCKET: 404, Kind.NO_SUCH_KEY: 404, Kind.NO_SUCH_UPLOAD: 404,
    Kind.BUCKET_NOT_EMPTY: 409, Kind.BUCKET_EXISTS: 409, Kind.BUCKET_OWNED: 409,
    Kind.ACCESS_DENIED: 403, Kind.PRECONDITION_FAILED: 412, Kind.INSUFFICIENT_CAPACITY: 503,
    Kind.INVALID_PART: 400, Kind.INVALID_PART_ORDER: 400, Kind.ENTITY_TOO_SMALL: 400, Kind.ENTITY_TOO_LARGE: 400,
    Kind.INVALID_ARGUMENT: 400,
}


def create_admin_app(node: NodeState) -> FastAPI:
    """The admin FastAPI application of one node."""
    app = FastAPI(
        title="ctxstore admin API",
        version="1",
        docs_url=DOCS_PATHS[0],
        openapi_url=DOCS_PATHS[1],
        redoc_url=None,
        swagger_ui_oauth2_redirect_url=None,  # no OAuth; its default route would sit outside PREFIX
    )
    app.state.node = node
    app.middleware("http")(_guard_and_audit)
    app.add_exception_handler(StorageError, _storage_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _invalid_request)  # type: ignore[arg-type]
    routes.register(app)
    return app


async def _guard_and_audit(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
    """The token is checked here, before routing and body parsing, for every path but the docs: a route
    added without the token dependency, an unknown path or a wrong method all answer 401 without it."""
    path = request.url.path
    if path in DOCS_PATHS:
        return await call_next(request)
    started = time.perf_counter()
    token = routes.node_of(request).admin_token
    who = "admin" if bearer.matches(request.headers.get("authorization"), token) else "anonymous"
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


async def _storage_error(request: Request, exc: StorageError) -> JSONResponse:
    return JSONResponse({"detail": str(exc), "error": type(exc).__name__}, status_code=STATUS[exc.kind])


async def _invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
    """422 saying where and why, without echoing the input: it may be a secret (a too-short secret_key), or
    NaN / Infinity, which JSON cannot carry back (FastAPI's own handler then fails with 500)."""
    errors = [{"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")}
              for e in exc.errors()]
    return JSONResponse({"detail": errors}, status_code=422)
