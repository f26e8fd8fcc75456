"""The pod view behind the status page (``GET /_ctx/v1/admin/pod``): this node asks every peer's admin API for
its info and stats and adds them up, so one page shows the whole pod.

Why the node asks and not the page: the operator's browser usually reaches one node (a published port, a
``kubectl port-forward``) while the nodes reach each other; the page keeps its Content-Security-Policy
(``connect-src 'self'``), no node needs CORS, and the token never leaves the page for another origin. The node
calls its peers with its own admin token (a pod shares one, docs/operations.md); only a caller that presented
that token gets here.

The peers are the ``peers`` setting: ``host:port`` addresses as workers write ``CTXSTORE_NODES``, or a DNS name
resolving to every node (a headless service; names are re-resolved every :data:`DNS_REFRESH` seconds and one
that resolves to several addresses becomes one peer per address, as the client does). The node itself is
recognised among them by its node id; when it is not listed (or its listed address does not lead back to it) its
own numbers are added from memory.

Bounds, so that neither a slow peer nor many open pages can hang or load the node:

- every call has a short timeout (:data:`PEER_TIMEOUT`) and the whole fan-out a deadline (:data:`DEADLINE`); a
  peer that has not answered by then is shown as down;
- the calls run on a small thread pool (:data:`MAX_CALLS` at a time) through the same urllib client as
  ``ctxstore admin`` (:class:`ctxstore.admin.nodes.Pod`); the event loop only awaits them;
- a snapshot is reused for :data:`REUSE` seconds and concurrent requests share one fan-out, so any number of
  open pages cost each peer at most two calls per :data:`REUSE` seconds.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ctxstore import __version__
from ctxstore.admin.aggregate import node_stats, ratio, total_stats
from ctxstore.admin.common import NodeError
from ctxstore.admin.nodes import NodeResult, Pod, node_name
from ctxstore.admin_schema import ADMIN_PREFIX, BUCKET_KEYS
from ctxstore.endpoints import Endpoint, parse_endpoints
from ctxstore.pod import expand_dns, is_ip

from ..node import NodeState

PEER_TIMEOUT = 1.0  # seconds, per call (connect, then each read)
DEADLINE = 2.5  # seconds for the whole fan-out
MAX_CALLS = 16  # peer calls in flight at once
REUSE = 1.0  # seconds a snapshot is served again
DNS_REFRESH = 30.0  # seconds between two resolutions of the peers' names


class PodView:
    """The pod as one node sees it; :meth:`snapshot` is the ``/pod`` document."""

    def __init__(self, node: NodeState) -> None:
        self.node = node
        self.peers = node.settings.peers.strip()
        self._specs: list[Endpoint] = parse_endpoints(self.peers) if self.peers else []
        self._pool = ThreadPoolExecutor(max_workers=MAX_CALLS, thread_name_prefix="ctxstore-pod")
        self._endpoints: list[str] = [e.url for e in self._specs]
        self._resolved_at = -DNS_REFRESH
        self._client = Pod(self._endpoints, token=node.admin_token, timeout=PEER_TIMEOUT)
        self._last: tuple[float, dict[str, Any]] | None = None
        self._running: asyncio.Future[dict[str, Any]] | None = None

    async def snapshot(self) -> dict[str, Any]:
        """The pod's nodes, their numbers and the totals (reused for :data:`REUSE` seconds)."""
        if self._last is not None and time.monotonic() - self._last[0] < REUSE:
            return self._last[1]
        if self._running is None:
            self._running = asyncio.ensure_future(self._gather())
            self._running.add_done_callback(self._finished)
        # shield: a caller that goes away does not cancel the fan-out the others wait for
        return await asyncio.shield(self._running)

    def _finished(self, future: asyncio.Future[dict[str, Any]]) -> None:
        self._running = None
        if not future.cancelled() and future.exception() is None:
            self._last = (time.monotonic(), future.result())

    # ------------------------------------------------------------------ peers

    def _resolve(self) -> list[str]:
        """The peers' URLs, names expanded to their addresses (blocking: getaddrinfo; runs in the pool). An
        HTTPS name is kept: its certificate names the host, not its addresses."""
        out: list[str] = []
        for spec in self._specs:
            if spec.scheme == "https" or is_ip(spec.host):
                urls = [spec.url]
            else:
                urls = [Endpoint(spec.scheme, host, port).url for host, port in expand_dns([(spec.host, spec.port)])]
            out += [u for u in urls if u not in out]
        return out

    async def _peers(self) -> list[str]:
        if self._specs and time.monotonic() - self._resolved_at >= DNS_REFRESH and not all(
                is_ip(s.host) for s in self._specs):
            loop = asyncio.get_running_loop()
            try:
                endpoints = await asyncio.wait_for(loop.run_in_executor(self._pool, self._resolve), DEADLINE)
            except TimeoutError:
                endpoints = self._endpoints  # keep what was known; try again next time
            else:
                self._resolved_at = time.monotonic()
            if endpoints != self._endpoints:
                self._endpoints = endpoints
                self._client = Pod(endpoints, token=self.node.admin_token, timeout=PEER_TIMEOUT)
        return self._endpoints

    def _call(self, endpoint: str, path: str) -> NodeResult:
        started = time.perf_counter()
        try:
            data = self._client.call(endpoint, "GET", ADMIN_PREFIX + path)
            return NodeResult(endpoint, data=data, ms=(time.perf_counter() - started) * 1000)
        except NodeError as exc:
            return NodeResult(endpoint, error=str(exc), kind=exc.kind, http_status=exc.status,
                              ms=(time.perf_counter() - started) * 1000)

    # ------------------------------------------------------------------ the document

    async def _gather(self) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        endpoints = await self._peers()
        calls: dict[tuple[str, str], asyncio.Future[NodeResult]] = {}
        for endpoint in endpoints:
            for path in ("/info", "/stats"):
                calls[endpoint, path] = loop.run_in_executor(self._pool, self._call, endpoint, path)
        if calls:
            await asyncio.wait(calls.values(), timeout=DEADLINE)
        entries: list[dict[str, Any]] = []
        buckets: list[dict[str, Any]] = []
        for endpoint in endpoints:
            info, stats = (_result(calls[endpoint, p], endpoint) for p in ("/info", "/stats"))
            entry = _entry(endpoint, info, stats)
            entry["self"] = entry["node_id"] == self.node.node_id
            entries.append(entry)
            if entry["ok"]:
                buckets.append(stats.data.get("buckets") or {})
        if not any(e["self"] for e in entries):
            raw = self.node.engine.operator.stats()
            entries.insert(0, self._own_entry(raw))
            buckets.insert(0, raw.get("buckets") or {})
        up = [e["stats"] for e in entries if e["ok"]]
        return {
            "time": time.time(),
            "node": self.node.node_id,
            "peers": self.peers,
            "nodes_total": len(entries),
            "nodes_up": len(up),
            "total": total_stats(up),
            "nodes": entries,
            "buckets": merge_buckets(buckets),
        }

    def _own_entry(self, raw: dict[str, Any]) -> dict[str, Any]:
        node = self.node
        return {
            "node": node.node_id, "endpoint": None, "self": True, "ok": True, "status": "up", "error": None,
            "ms": 0.0, "at": time.time(), "node_id": node.node_id, "version": __version__,
            "uptime": time.time() - node.started, "draining": node.draining,
            "stats": node_stats(raw),
        }


def _result(future: asyncio.Future[NodeResult], endpoint: str) -> NodeResult:
    if future.done() and not future.cancelled() and future.exception() is None:
        return future.result()
    future.cancel()  # still queued: never started; already running: it ends by its own timeout
    return NodeResult(endpoint, error=f"no answer within {DEADLINE:g} s", kind="down")


def _entry(endpoint: str, info: NodeResult, stats: NodeResult) -> dict[str, Any]:
    """One peer as the page shows it; ``at`` is when its stats arrived (the page's rates divide by it)."""
    about = info.data if info.ok and isinstance(info.data, dict) else {}
    answered = stats.ok and isinstance(stats.data, dict)
    error = stats.error if not stats.ok else None if answered else "the stats answer is not a JSON object"
    return {
        "node": node_name(endpoint), "endpoint": endpoint, "self": False, "ok": answered,
        "status": "up" if answered else stats.kind if not stats.ok else "error", "error": error,
        "ms": round(stats.ms, 1), "at": time.time() if answered else None,
        "node_id": about.get("node_id"), "version": about.get("version"), "uptime": about.get("uptime"),
        "draining": bool(about.get("draining")),
        "stats": node_stats(stats.data) if answered else None,
    }


def merge_buckets(per_node: Sequence[dict[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Each bucket summed over the nodes that hold it (``nodes``: how many), by name."""
    merged: dict[str, dict[str, Any]] = {}
    for buckets in per_node:
        for name, counters in buckets.items():
            entry = merged.setdefault(name, {"name": name, "nodes": 0, **dict.fromkeys(BUCKET_KEYS, 0)})
            entry["nodes"] += 1
            for key in BUCKET_KEYS:
                entry[key] += int(counters.get(key) or 0)
    out = [merged[name] for name in sorted(merged)]
    for entry in out:
        entry["hit_ratio"] = ratio(entry["hits"], entry["misses"])
    return out
