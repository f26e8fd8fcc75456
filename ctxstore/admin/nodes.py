"""Talking to the admin API of every node of a pod in parallel: addresses, errors, the HTTP calls."""

from __future__ import annotations

import json
import socket
import ssl
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ..endpoints import parse_endpoints
from .common import DEFAULT_TIMEOUT, ENV_NODES, NodeError, UsageError

# ---------------------------------------------------------------------------------------------- parsing

def parse_nodes(text: str) -> list[str]:
    """A comma- or space-separated list of nodes as URLs, deduplicated in order (:mod:`ctxstore.endpoints`)."""
    try:
        return [endpoint.url for endpoint in parse_endpoints(text or "")]
    except ValueError as exc:
        raise UsageError(f"{exc} (--nodes host:port,host:port or {ENV_NODES})") from None


def node_name(endpoint: str) -> str:
    """How a node is shown: ``host:port`` for plain HTTP, the full URL otherwise."""
    return endpoint[len("http://"):] if endpoint.startswith("http://") else endpoint


# ---------------------------------------------------------------------------------------------- transport

@dataclass
class NodeResult:
    """What one node answered (``data``) or why it did not (``error``)."""

    endpoint: str
    data: Any = None
    error: str | None = None
    kind: str = "up"  # up | down | error
    http_status: int | None = None
    ms: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None

    def status(self) -> dict[str, Any]:
        return {"node": node_name(self.endpoint), "endpoint": self.endpoint, "ok": self.ok,
                "status": self.kind, "error": self.error}


@dataclass
class Pod:
    """The nodes of a pod and how to reach their admin APIs."""

    endpoints: list[str]
    token: str = ""
    timeout: float = DEFAULT_TIMEOUT
    insecure: bool = False
    _opener: urllib.request.OpenerDirector = field(init=False, repr=False)

    def __post_init__(self) -> None:
        # Admin traffic goes straight to the nodes, never through an HTTP proxy from the environment.
        handlers: list[urllib.request.BaseHandler] = [urllib.request.ProxyHandler({})]
        if any(e.startswith("https://") for e in self.endpoints):  # loading CA certificates takes a while
            context = ssl._create_unverified_context() if self.insecure else ssl.create_default_context()
            handlers.append(urllib.request.HTTPSHandler(context=context))
        self._opener = urllib.request.build_opener(*handlers)

    def _open(self, request: urllib.request.Request) -> Any:
        return self._opener.open(request, timeout=self.timeout)

    def call(self, endpoint: str, method: str, path: str, body: Any = None, auth: bool = True) -> Any:
        """One JSON call; raises NodeError."""
        headers = {"Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        if auth:
            headers["Authorization"] = f"Bearer {self.token}"
        request = urllib.request.Request(endpoint + path, data=data, method=method, headers=headers)
        try:
            with self._open(request) as response:
                payload = response.read()
        except urllib.error.HTTPError as exc:
            raise NodeError("error", f"HTTP {exc.code}: {_detail(exc)}", exc.code) from None
        except urllib.error.URLError as exc:
            raise NodeError("down", _reason(exc.reason)) from None
        except (TimeoutError, socket.timeout):
            raise NodeError("down", f"timed out after {self.timeout:g}s") from None
        except OSError as exc:  # connection reset, remote disconnected, ...
            raise NodeError("down", _reason(exc)) from None
        try:
            return json.loads(payload) if payload else None
        except ValueError:
            raise NodeError("error", "the answer is not JSON (is this a ctxstore node?)") from None

    def each(self, method: str, path: str, body: Any = None, auth: bool = True,
             endpoints: Sequence[str] | None = None) -> list[NodeResult]:
        """The same call on every node, in parallel; results in node order."""
        targets = list(endpoints if endpoints is not None else self.endpoints)

        def one(endpoint: str) -> NodeResult:
            started = time.perf_counter()
            try:
                data = self.call(endpoint, method, path, body, auth)
                return NodeResult(endpoint, data=data, ms=(time.perf_counter() - started) * 1000)
            except NodeError as exc:
                return NodeResult(endpoint, error=str(exc), kind=exc.kind, http_status=exc.status,
                                  ms=(time.perf_counter() - started) * 1000)

        if len(targets) == 1:
            return [one(targets[0])]
        with ThreadPoolExecutor(max_workers=min(32, len(targets))) as pool:
            return list(pool.map(one, targets))


def _detail(exc: urllib.error.HTTPError) -> str:
    try:
        body = json.loads(exc.read() or b"null")
    except (ValueError, OSError):
        body = None
    detail = body.get("detail") if isinstance(body, dict) else None
    if isinstance(detail, list):  # FastAPI validation errors
        detail = "; ".join(f"{'.'.join(str(p) for p in d.get('loc', [])[1:])}: {d.get('msg')}"
                           for d in detail)
    if exc.code == 401:
        return f"{detail or 'unauthorized'} (wrong admin token?)"
    return str(detail or exc.reason)


def _reason(reason: object) -> str:
    if isinstance(reason, (TimeoutError, socket.timeout)):
        return "timed out"
    if isinstance(reason, ConnectionRefusedError):
        return "connection refused"
    if isinstance(reason, socket.gaierror):
        return f"unknown host ({reason.strerror})"
    if isinstance(reason, ssl.SSLError):
        return f"TLS error: {reason}"
    if isinstance(reason, OSError) and reason.strerror:
        return reason.strerror.lower()
    return str(reason) or type(reason).__name__
