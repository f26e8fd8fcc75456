"""Probes of a running node from the outside: its admin stats (``used``, ``reserved``, per-bucket counters),
its resident memory and CPU time from ``/proc/<pid>``, whether it is alive and answering, and what its log says.

Memory figures are read from the kernel, not from the node: ``VmRSS`` (resident now) and ``VmHWM`` (the peak
since start, or since :func:`reset_peak_rss`; writing ``5`` to ``/proc/<pid>/clear_refs`` resets it, Linux
4.0+, allowed for processes we own).
"""

from __future__ import annotations

import http.client
import json
import os
import re
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .nodes import Node, start_node

ADMIN_TOKEN = "ctx-adv-admin-" + secrets.token_hex(12)
KiB = 1 << 10
MiB = 1 << 20
CLK_TCK = os.sysconf("SC_CLK_TCK")


def start_probed_node(tmp: Path, *args: str, env: dict[str, str] | None = None, wait: bool = True) -> Node:
    """``start_node`` with the admin token these probes use."""
    return start_node(tmp, *args, env={"CTXSTORE_ADMIN_TOKEN": ADMIN_TOKEN, **(env or {})}, wait=wait)


# ---------------------------------------------------------------------------- /proc


def _status_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def rss(pid: int) -> int:
    """Resident set size now, in bytes."""
    return _status_kib(pid, "VmRSS") * KiB


def peak_rss(pid: int) -> int:
    """Peak resident set size since start or the last :func:`reset_peak_rss`, in bytes."""
    return _status_kib(pid, "VmHWM") * KiB


def reset_peak_rss(pid: int) -> None:
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time the process has used."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


# ---------------------------------------------------------------------------- HTTP probes


def http_request(port: int, method: str, path: str, body: bytes | None = None,
                 headers: dict[str, str] | None = None, timeout: float = 10.0) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def metric(node: Node, sample: str, token: str = ADMIN_TOKEN) -> float:
    """One sample of the node's /metrics (0 when absent), written as exposed, e.g.
    ``ctxstore_requests_total{api="bulk",operation="lookup",status="200"}``."""
    status, body = http_request(node.port, "GET", "/metrics", headers={"Authorization": f"Bearer {token}"})
    assert status == 200, body[:200]
    match = re.search(rb"^" + re.escape(sample.encode()) + rb" (\S+)$", body, re.MULTILINE)
    return float(match.group(1)) if match is not None else 0.0


def alive(node: Node, timeout: float = 5.0) -> bool:
    """The process runs and answers its liveness endpoint."""
    if node.proc.poll() is not None:
        return False
    try:
        status, _ = http_request(node.port, "GET", "/_ctx/health/live", timeout=timeout)
    except OSError:
        return False
    return status == 200


class Admin:
    """The admin API of one node (``/_ctx/v1/admin``), with :data:`ADMIN_TOKEN`."""

    def __init__(self, node: Node, token: str = ADMIN_TOKEN) -> None:
        self.node = node
        self.token = token

    def call(self, method: str, path: str, body: Any = None, *, expect: int | None = 200) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Authorization": f"Bearer {self.token}"}
        if data is not None:
            headers["Content-Type"] = "application/json"
        status, raw = http_request(self.node.port, method, "/_ctx/v1/admin" + path, data, headers)
        if expect is not None:
            assert status == expect, (method, path, status, raw[:500])
        return json.loads(raw) if raw else None

    def stats(self) -> dict[str, Any]:
        return self.call("GET", "/stats")

    def used(self) -> int:
        return int(self.stats()["used"])

    def bucket(self, name: str) -> dict[str, Any]:
        return self.stats()["buckets"][name]

    def create_tenant(self, name: str, quota: int | None = None) -> tuple[str, str]:
        body: dict[str, Any] = {"tenant": name}
        if quota is not None:
            body["quota"] = quota
        created = self.call("POST", "/tenants", body, expect=201)
        return created["access_key"], created["secret_key"]

    def set_bucket_quota(self, bucket: str, quota: int) -> None:
        self.call("PUT", f"/buckets/{bucket}/policy", {"quota": quota})


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0, interval: float = 0.05) -> bool:
    """Poll ``predicate`` until it holds or ``timeout`` passes; returns its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def log_text(node: Node) -> str:
    return node.log.read_text(errors="replace") if node.log is not None and node.log.exists() else ""


def tracebacks(node: Node, since: int = 0) -> list[str]:
    """Tracebacks and internal-error lines the node logged after byte ``since`` of its log."""
    text = log_text(node)[since:]
    lines = text.splitlines()
    return [line for line in lines if "Traceback" in line or "internal error" in line or "Exception in ASGI" in line]


def log_size(node: Node) -> int:
    return len(log_text(node))
