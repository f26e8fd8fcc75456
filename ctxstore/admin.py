"""``ctxstore admin``: the admin API of one node or of a whole pod, from the command line.

Every command talks to each node of the pod in parallel (stdlib ``urllib``, short timeouts), aggregates
what the nodes answered, and prints rich tables, or with ``--json`` one machine-readable document with
stable keys. A node that is down never hides the others: it is marked down with its error.

Exit codes (also in docs/operations.md):

- ``0``: at least one node answered (nodes that did not are marked in the output); with ``--strict``,
  every node answered.
- ``1``: no node answered, or none could do what was asked (e.g. revoking a key no node knows);
  with ``--strict``, any node failed.
- ``2``: usage error: bad arguments, no admin token, no nodes.

The admin token comes from ``--token`` or ``CTXSTORE_ADMIN_TOKEN`` (prefer the variable: arguments show in
``ps``); the nodes from ``--nodes a:9000,b:9000`` or ``CTXSTORE_NODES`` (default ``127.0.0.1:9000``).
``rich`` (the ``admin`` extra) is needed for tables, not for ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import socket
import ssl
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from .units import parse_duration, parse_size

ENV_NODES = "CTXSTORE_NODES"
ENV_TOKEN = "CTXSTORE_ADMIN_TOKEN"
DEFAULT_NODES = "127.0.0.1:9000"
ADMIN_PREFIX = "/_ctx/v1/admin"
HEALTH_PREFIX = "/_ctx/health"
DEFAULT_TIMEOUT = 2.0

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2

MUTABLE_SETTINGS = ("memory", "default_ttl", "max_ttl")

# Keys of the per-node and total stats documents (stable: missing server fields count as 0).
LEVEL_KEYS = ("used", "budget", "objects", "bytes", "charged", "pinned_bytes", "reserved", "parts_bytes",
              "uploads")
COUNTER_KEYS = ("hits", "misses", "puts", "deletes", "evictions", "expirations", "bytes_in", "bytes_out")
STAT_KEYS = LEVEL_KEYS + COUNTER_KEYS
BUCKET_KEYS = ("objects", "bytes", "charged", "pinned_bytes") + COUNTER_KEYS
# Rates of `top`: name -> the counters whose deltas it sums.
RATES: dict[str, tuple[str, ...]] = {
    "reads": ("hits", "misses"),
    "writes": ("puts",),
    "deletes": ("deletes",),
    "bytes_in": ("bytes_in",),
    "bytes_out": ("bytes_out",),
    "evictions": ("evictions",),
    "expirations": ("expirations",),
}


class UsageError(Exception):
    """Bad arguments, no token, no nodes: exit code 2."""


class NodeError(Exception):
    """One node did not do what was asked. ``kind`` is ``down`` (unreachable, timed out) or ``error``
    (it answered with an HTTP error); ``status`` is the HTTP status when there is one."""

    def __init__(self, kind: str, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.status = status


# ---------------------------------------------------------------------------------------------- parsing

def normalize_endpoint(text: str) -> str:
    """``host:port`` → ``http://host:port``; ``https://host:port/`` → ``https://host:port``."""
    raw = text.strip()
    if "://" not in raw:
        raw = "http://" + raw
    parts = urllib.parse.urlsplit(raw)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UsageError(f"not a node address: {text!r} (expected host:port or http(s)://host:port)")
    try:
        parts.port  # noqa: B018 - validates the port
    except ValueError:
        raise UsageError(f"not a node address: {text!r} (bad port)") from None
    return f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/')}"


def parse_nodes(text: str) -> list[str]:
    """A comma- or space-separated list of nodes, normalized and deduplicated in order."""
    out: list[str] = []
    for item in re.split(r"[\s,]+", text or ""):
        if item:
            endpoint = normalize_endpoint(item)
            if endpoint not in out:
                out.append(endpoint)
    if not out:
        raise UsageError(f"no nodes given (--nodes host:port,host:port or {ENV_NODES})")
    return out


def node_name(endpoint: str) -> str:
    """How a node is shown: ``host:port`` for plain HTTP, the full URL otherwise."""
    return endpoint[len("http://"):] if endpoint.startswith("http://") else endpoint


def generate_key_pair() -> tuple[str, str]:
    """An access key (``CTX`` + 17 uppercase alphanumerics, AWS-shaped) and a 40-character secret."""
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    access = "CTX" + "".join(secrets.choice(alphabet) for _ in range(17))
    return access, secrets.token_urlsafe(30)[:40]


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


# ---------------------------------------------------------------------------------------------- aggregation

def ratio(hits: int, misses: int) -> float | None:
    lookups = hits + misses
    return hits / lookups if lookups else None


def node_stats(raw: dict[str, Any]) -> dict[str, Any]:
    """A node's stats document projected on the stable keys."""
    out = {k: int(raw.get(k) or 0) for k in STAT_KEYS}
    out["hit_ratio"] = ratio(out["hits"], out["misses"])
    return out


def total_stats(per_node: Sequence[dict[str, Any]]) -> dict[str, Any]:
    out = {k: sum(s[k] for s in per_node) for k in STAT_KEYS}
    out["hit_ratio"] = ratio(out["hits"], out["misses"])
    return out


def summarize_stats(results: Sequence[NodeResult]) -> dict[str, Any]:
    nodes = []
    for r in results:
        entry = r.status()
        entry["stats"] = node_stats(r.data) if r.ok else None
        nodes.append(entry)
    up = [n["stats"] for n in nodes if n["ok"]]
    return {"nodes_total": len(nodes), "nodes_up": len(up), "total": total_stats(up), "nodes": nodes}


def summarize_buckets(results: Sequence[NodeResult]) -> dict[str, Any]:
    merged: dict[str, dict[str, Any]] = {}
    for r in results:
        if not r.ok:
            continue
        for b in r.data or []:
            entry = merged.setdefault(b["name"], {"name": b["name"], "owners": [], "nodes": 0,
                                                  **{k: 0 for k in BUCKET_KEYS}, "per_node": []})
            if b.get("owner") and b["owner"] not in entry["owners"]:
                entry["owners"].append(b["owner"])
            entry["nodes"] += 1
            detail = {"node": node_name(r.endpoint), **{k: int(b.get(k) or 0) for k in BUCKET_KEYS}}
            detail["hit_ratio"] = ratio(detail["hits"], detail["misses"])
            detail["policy"] = b.get("policy")
            entry["per_node"].append(detail)
            for k in BUCKET_KEYS:
                entry[k] += detail[k]
    buckets = []
    for name in sorted(merged):
        entry = merged[name]
        entry["owners"].sort()
        entry["hit_ratio"] = ratio(entry["hits"], entry["misses"])
        buckets.append(entry)
    statuses = [r.status() for r in results]
    return {"nodes_total": len(statuses), "nodes_up": sum(1 for s in statuses if s["ok"]), "nodes": statuses,
            "buckets": buckets}


def summarize_tenants(results: Sequence[NodeResult]) -> dict[str, Any]:
    merged: dict[str, dict[str, Any]] = {}
    for r in results:
        if not r.ok:
            continue
        for t in r.data or []:
            entry = merged.setdefault(t["access_key"], {
                "tenant": t["tenant"], "access_key": t["access_key"], "enabled": True, "present_on": 0,
                "enabled_on": 0, "quota": 0, "charged": 0, "per_node": []})
            entry["present_on"] += 1
            entry["enabled_on"] += 1 if t.get("enabled") else 0
            entry["enabled"] = entry["enabled"] and bool(t.get("enabled"))
            entry["quota"] = max(entry["quota"], int(t.get("quota") or 0))
            entry["charged"] += int(t.get("charged") or 0)
            entry["per_node"].append({"node": node_name(r.endpoint), "enabled": bool(t.get("enabled")),
                                      "quota": int(t.get("quota") or 0),
                                      "charged": int(t.get("charged") or 0)})
    tenants = sorted(merged.values(), key=lambda e: (e["tenant"], e["access_key"]))
    statuses = [r.status() for r in results]
    return {"nodes_total": len(statuses), "nodes_up": sum(1 for s in statuses if s["ok"]), "nodes": statuses,
            "tenants": tenants}


@dataclass
class Sample:
    """One node's counters at one moment (``top`` derives rates from two of them)."""

    at: float
    stats: dict[str, Any] | None


def rates_between(previous: Sample | None, current: Sample) -> dict[str, float | None]:
    """Per-second rates from two samples; None when unknown (first sample, node was down, counters reset)."""
    out: dict[str, float | None] = {name: None for name in RATES}
    if previous is None or previous.stats is None or current.stats is None:
        return out
    elapsed = current.at - previous.at
    if elapsed <= 0:
        return out
    for name, keys in RATES.items():
        delta = sum(current.stats[k] - previous.stats[k] for k in keys)
        out[name] = delta / elapsed if delta >= 0 else None
    return out


def interval_hit_ratio(previous: Sample | None, current: Sample) -> float | None:
    if previous is None or previous.stats is None or current.stats is None:
        return None
    hits = current.stats["hits"] - previous.stats["hits"]
    misses = current.stats["misses"] - previous.stats["misses"]
    if hits < 0 or misses < 0:
        return None
    return ratio(hits, misses)


def top_frame(results: Sequence[NodeResult], previous: dict[str, Sample], now: float) -> dict[str, Any]:
    """One refresh of ``top``: per-node levels, cumulative hit ratio and rates since the previous refresh.
    Updates ``previous`` in place."""
    nodes = []
    for r in results:
        current = Sample(now, node_stats(r.data) if r.ok else None)
        before = previous.get(r.endpoint)
        entry = r.status()
        entry["stats"] = current.stats
        entry["rates"] = rates_between(before, current)
        entry["hit_ratio_interval"] = interval_hit_ratio(before, current)
        nodes.append(entry)
        previous[r.endpoint] = current
    up = [n for n in nodes if n["ok"]]
    total_rates: dict[str, float | None] = {}
    for name in RATES:
        values = [n["rates"][name] for n in up]
        total_rates[name] = sum(values) if values and all(v is not None for v in values) else None
    return {"time": time.time(), "nodes_total": len(nodes), "nodes_up": len(up),
            "total": {**total_stats([n["stats"] for n in up]), "rates": total_rates}, "nodes": nodes}


def exit_code(statuses: Sequence[dict[str, Any]], strict: bool = False) -> int:
    ok = sum(1 for s in statuses if s["ok"])
    if not ok or (strict and ok < len(statuses)):
        return EXIT_FAILED
    return EXIT_OK


# ---------------------------------------------------------------------------------------------- formatting

def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "–"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def fmt_ratio(r: float | None) -> str:
    return "–" if r is None else f"{r * 100:.1f}%"


def fmt_rate(r: float | None, unit: str = "/s") -> str:
    if r is None:
        return "–"
    return f"{r:.0f}{unit}" if r >= 100 else f"{r:.1f}{unit}"


def fmt_byte_rate(r: float | None) -> str:
    return "–" if r is None else fmt_bytes(r) + "/s"


def fmt_duration(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    for unit, factor in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= factor and seconds % factor == 0:
            return f"{int(seconds // factor)}{unit}"
    return f"{seconds:g}s"


def fmt_uptime(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    left = int(seconds)
    parts = []
    for unit, factor in (("d", 86400), ("h", 3600), ("m", 60)):
        if left >= factor:
            parts.append(f"{left // factor}{unit}")
            left %= factor
    if not parts or (left and len(parts) < 2):
        parts.append(f"{left}s")
    return " ".join(parts[:2])


def fmt_int(n: int | None) -> str:
    return "–" if n is None else f"{n:,}"


def _console(stderr: bool = False) -> Any:
    try:
        from rich.console import Console
    except ImportError:  # pragma: no cover - rich ships with the admin extra
        raise UsageError("tables need rich: pip install 'ctxstore[admin]' (or use --json)") from None
    width = None
    stream = sys.stderr if stderr else sys.stdout
    if not stream.isatty() and "COLUMNS" not in os.environ:
        width = 200  # piped or captured: do not squeeze tables into 80 columns
    return Console(file=stream, width=width, highlight=False, soft_wrap=False)


def _table(title: str | None = None) -> Any:
    from rich import box
    from rich.table import Table

    return Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)


def _state(entry: dict[str, Any]) -> str:
    if entry["ok"]:
        return "[green]up[/]"
    return "[red]down[/]" if entry["status"] == "down" else "[red]error[/]"


def _print_problems(console: Any, statuses: Sequence[dict[str, Any]]) -> None:
    from rich.markup import escape

    for s in statuses:
        if not s["ok"]:
            console.print(f"[red]✗ {escape(s['node'])} {s['status']}:[/] {escape(s['error'] or '')}")


# ---------------------------------------------------------------------------------------------- commands

@dataclass
class Context:
    pod: Pod
    json: bool
    strict: bool
    args: argparse.Namespace


def _emit(ctx: Context, payload: dict[str, Any], render: Callable[[Any, dict[str, Any]], None]) -> None:
    if ctx.json:
        print(json.dumps(payload, indent=2, sort_keys=False))
    else:
        render(_console(), payload)


def _fail_all(ctx: Context, what: str, statuses: Sequence[dict[str, Any]]) -> None:
    if not any(s["ok"] for s in statuses):
        errors = "; ".join(f"{s['node']}: {s['error']}" for s in statuses)
        print(f"ctxstore admin: {what}: failed on every node ({errors})", file=sys.stderr)


def cmd_stats(ctx: Context) -> int:
    path = f"{ADMIN_PREFIX}/stats" + ("?reset=true" if ctx.args.reset else "")
    payload = summarize_stats(ctx.pod.each("GET", path))

    def render(console: Any, p: dict[str, Any]) -> None:
        from rich.markup import escape

        table = _table(f"ctxstore pod: {p['nodes_up']}/{p['nodes_total']} nodes up")
        for col in ("node", "state", "used", "budget", "use", "objects", "hit ratio", "hits", "misses",
                    "puts", "deletes", "evictions", "expirations", "in", "out"):
            table.add_column(col, justify="left" if col in ("node", "state") else "right", no_wrap=True)

        def row(name: str, state: str, s: dict[str, Any] | None, style: str | None = None) -> None:
            if s is None:
                table.add_row(name, state, *["–"] * 13, style=style)
                return
            use = fmt_ratio(s["used"] / s["budget"]) if s["budget"] else "–"
            table.add_row(name, state, fmt_bytes(s["used"]), fmt_bytes(s["budget"]), use,
                          fmt_int(s["objects"]), fmt_ratio(s["hit_ratio"]), fmt_int(s["hits"]),
                          fmt_int(s["misses"]), fmt_int(s["puts"]),
                          fmt_int(s["deletes"]), fmt_int(s["evictions"]), fmt_int(s["expirations"]),
                          fmt_bytes(s["bytes_in"]), fmt_bytes(s["bytes_out"]), style=style)

        for n in p["nodes"]:
            row(escape(n["node"]), _state(n), n["stats"])
        table.add_section()
        row("total", f"{p['nodes_up']}/{p['nodes_total']}", p["total"], style="bold")
        console.print(table)
        _print_problems(console, p["nodes"])

    _emit(ctx, payload, render)
    _fail_all(ctx, "stats", payload["nodes"])
    return exit_code(payload["nodes"], ctx.strict)


def cmd_buckets(ctx: Context) -> int:
    payload = summarize_buckets(ctx.pod.each("GET", f"{ADMIN_PREFIX}/buckets"))
    per_node = ctx.args.per_node

    def render(console: Any, p: dict[str, Any]) -> None:
        from rich.markup import escape

        table = _table(f"buckets over {p['nodes_up']}/{p['nodes_total']} nodes")
        for col in ("bucket", "owner", "nodes", "objects", "bytes", "hit ratio", "hits", "misses", "puts",
                    "evictions", "expirations", "in", "out"):
            table.add_column(col, justify="left" if col in ("bucket", "owner") else "right", no_wrap=True)
        for b in p["buckets"]:
            table.add_row(escape(b["name"]), escape(",".join(b["owners"])), str(b["nodes"]),
                          fmt_int(b["objects"]), fmt_bytes(b["bytes"]), fmt_ratio(b["hit_ratio"]),
                          fmt_int(b["hits"]), fmt_int(b["misses"]),
                          fmt_int(b["puts"]), fmt_int(b["evictions"]), fmt_int(b["expirations"]),
                          fmt_bytes(b["bytes_in"]), fmt_bytes(b["bytes_out"]),
                          style="bold" if per_node else None)
            if per_node:
                for d in b["per_node"]:
                    table.add_row("  " + escape(d["node"]), "", "", fmt_int(d["objects"]),
                                  fmt_bytes(d["bytes"]),
                                  fmt_ratio(d["hit_ratio"]), fmt_int(d["hits"]), fmt_int(d["misses"]),
                                  fmt_int(d["puts"]), fmt_int(d["evictions"]), fmt_int(d["expirations"]),
                                  fmt_bytes(d["bytes_in"]), fmt_bytes(d["bytes_out"]), style="dim")
        if not p["buckets"]:
            console.print("no buckets")
        else:
            console.print(table)
        _print_problems(console, p["nodes"])

    _emit(ctx, payload, render)
    _fail_all(ctx, "buckets", payload["nodes"])
    return exit_code(payload["nodes"], ctx.strict)


def cmd_tenants_list(ctx: Context) -> int:
    payload = summarize_tenants(ctx.pod.each("GET", f"{ADMIN_PREFIX}/tenants"))

    def render(console: Any, p: dict[str, Any]) -> None:
        from rich.markup import escape

        table = _table(f"tenant keys over {p['nodes_up']}/{p['nodes_total']} nodes")
        for col in ("tenant", "access key", "enabled", "on nodes", "quota", "charged"):
            table.add_column(col, justify="right" if col in ("quota", "charged", "on nodes") else "left",
                             no_wrap=True)
        for t in p["tenants"]:
            if t["enabled"]:
                enabled = "[green]yes[/]"
            elif t["enabled_on"]:
                enabled = f"[yellow]mixed ({t['enabled_on']}/{t['present_on']})[/]"
            else:
                enabled = "[red]revoked[/]"
            table.add_row(escape(t["tenant"]), escape(t["access_key"]), enabled,
                          f"{t['present_on']}/{p['nodes_up']}",
                          fmt_bytes(t["quota"]) if t["quota"] else "none",
                          fmt_bytes(t["charged"]))
        console.print(table)
        _print_problems(console, p["nodes"])

    _emit(ctx, payload, render)
    _fail_all(ctx, "tenants list", payload["nodes"])
    return exit_code(payload["nodes"], ctx.strict)


def cmd_tenants_create(ctx: Context) -> int:
    args = ctx.args
    try:
        quota = parse_size(args.quota) if args.quota is not None else None
    except ValueError as exc:
        raise UsageError(f"--quota: {exc}") from None
    if not re.fullmatch(r"[A-Za-z0-9._\-]{1,64}", args.name):
        raise UsageError("a tenant name is 1-64 letters, digits, '.', '_' or '-'")
    access_key, secret_key = generate_key_pair()
    body: dict[str, Any] = {"tenant": args.name, "access_key": access_key, "secret_key": secret_key}
    if quota is not None:
        body["quota"] = quota
    results = ctx.pod.each("POST", f"{ADMIN_PREFIX}/tenants", body)
    statuses = [r.status() for r in results]
    created = sum(1 for s in statuses if s["ok"])
    payload = {"tenant": args.name, "access_key": access_key, "secret_key": secret_key if created else None,
               "quota": quota or 0, "created_on": created, "nodes_total": len(statuses), "nodes": statuses}

    def render(console: Any, p: dict[str, Any]) -> None:
        if not created:
            _print_problems(console, p["nodes"])
            return
        # Plain prints: the secret must never be cut or wrapped by a table.
        print(f"tenant {p['tenant']!r}: key {p['access_key']} created on {created}/{len(statuses)} nodes"
              + (f", quota {fmt_bytes(quota)} per node" if quota else ""))
        print(f"  AWS_ACCESS_KEY_ID={p['access_key']}")
        print(f"  AWS_SECRET_ACCESS_KEY={p['secret_key']}")
        print("The secret is shown this once. Keys made here live in the nodes' memory; to keep them across "
              "restarts add this entry to every node's CTXSTORE_TENANTS_FILE:")
        entry = {"tenant": p["tenant"], "access_key": p["access_key"], "secret_key": p["secret_key"]}
        print("  " + json.dumps(entry))
        sys.stdout.flush()
        if created < len(statuses):
            console.print("[yellow]warning: the key does not work on these nodes:[/]")
        _print_problems(console, p["nodes"])

    _emit(ctx, payload, render)
    _fail_all(ctx, "tenants create", statuses)
    return exit_code(statuses, ctx.strict)


def cmd_tenants_revoke(ctx: Context) -> int:
    key = ctx.args.access_key
    path = f"{ADMIN_PREFIX}/tenants/{urllib.parse.quote(key, safe='')}"
    if ctx.args.delete:
        results = ctx.pod.each("DELETE", path)
    else:
        results = ctx.pod.each("PATCH", path, {"enabled": False})
    statuses = []
    applied = 0
    for r in results:
        s = r.status()
        s["applied"] = r.ok
        if r.http_status == 404:  # the node does not know the key: nothing to revoke there
            s.update(ok=True, status="up", error=None)
        applied += r.ok
        statuses.append(s)
    action = "deleted" if ctx.args.delete else "revoked"
    payload = {"access_key": key, "action": action, "applied_on": applied, "nodes_total": len(statuses),
               "nodes": statuses}

    def render(console: Any, p: dict[str, Any]) -> None:
        if applied:
            console.print(f"access key {key} {action} on {applied}/{len(statuses)} nodes", markup=False)
        _print_problems(console, p["nodes"])

    _emit(ctx, payload, render)
    _fail_all(ctx, f"tenants revoke {key}", statuses)
    if not applied and any(s["ok"] for s in statuses):
        print(f"ctxstore admin: no node knows access key {key}", file=sys.stderr)
        return EXIT_FAILED
    return exit_code(statuses, ctx.strict)


def cmd_flush(ctx: Context) -> int:
    args = ctx.args
    mode = "expire" if args.expire else "flush"
    body = {"bucket": args.bucket, "prefix": args.prefix, "mode": mode}
    results = ctx.pod.each("POST", f"{ADMIN_PREFIX}/flush", body)
    statuses = []
    total = 0
    present = 0
    for r in results:
        s = r.status()
        s["removed"] = None
        s["absent"] = False
        if r.ok:
            s["removed"] = int((r.data or {}).get("expired" if mode == "expire" else "flushed", 0))
            total += s["removed"]
            present += 1
        elif r.http_status == 404:  # the bucket does not exist on this node
            s.update(ok=True, status="up", error=None, absent=True, removed=0)
        statuses.append(s)
    payload = {"bucket": args.bucket, "prefix": args.prefix, "mode": mode, "removed": total,
               "present_on": present, "nodes_total": len(statuses), "nodes": statuses}

    def render(console: Any, p: dict[str, Any]) -> None:
        from rich.markup import escape

        where = f"{p['bucket']}/{p['prefix']}*" if p["prefix"] else p["bucket"]
        verb = "expired" if mode == "expire" else "flushed"
        if present:
            console.print(f"{verb} {total:,} objects of {escape(where)} on {present}/{len(statuses)} nodes")
            for s in p["nodes"]:
                if s["ok"]:
                    note = "no such bucket" if s["absent"] else f"{s['removed']:,}"
                    console.print(f"  {escape(s['node'])}: {note}")
        _print_problems(console, p["nodes"])

    _emit(ctx, payload, render)
    _fail_all(ctx, f"flush {args.bucket}", statuses)
    if not present and any(s["ok"] for s in statuses):
        print(f"ctxstore admin: no node has bucket {args.bucket}", file=sys.stderr)
        return EXIT_FAILED
    return exit_code(statuses, ctx.strict)


def _settings_render(console: Any, p: dict[str, Any], extra: Sequence[str] = ()) -> None:
    from rich.markup import escape

    table = _table()
    for col in ("node", "state", "memory", "default_ttl", "max_ttl", *extra):
        table.add_column(col, justify="left" if col in ("node", "state") else "right", no_wrap=True)
    for n in p["nodes"]:
        s = n.get("settings")
        if s is None:
            table.add_row(escape(n["node"]), _state(n), "–", "–", "–", *["–"] * len(extra))
            continue
        cells = [fmt_bytes(s.get("memory")), fmt_duration(s.get("default_ttl")),
                 fmt_duration(s.get("max_ttl"))]
        cells += [fmt_bytes(n.get(col)) if col == "over_budget" else fmt_int(n.get(col)) for col in extra]
        table.add_row(escape(n["node"]), _state(n), *cells)
    console.print(table)
    _print_problems(console, p["nodes"])


def cmd_settings_get(ctx: Context) -> int:
    results = ctx.pod.each("GET", f"{ADMIN_PREFIX}/settings")
    nodes = []
    mutable: list[str] = list(MUTABLE_SETTINGS)
    for r in results:
        s = r.status()
        s["settings"] = (r.data or {}).get("settings") if r.ok else None
        if r.ok and (r.data or {}).get("mutable"):
            mutable = list(r.data["mutable"])
        nodes.append(s)
    values = [tuple(n["settings"].get(k) for k in mutable) for n in nodes if n["settings"] is not None]
    payload = {"mutable": mutable, "consistent": len(set(values)) <= 1, "nodes_total": len(nodes),
               "nodes_up": len(values), "nodes": nodes}

    def render(console: Any, p: dict[str, Any]) -> None:
        _settings_render(console, p)
        if not p["consistent"]:
            console.print("[yellow]warning: the nodes' runtime settings differ[/]")

    _emit(ctx, payload, render)
    _fail_all(ctx, "settings get", nodes)
    return exit_code(nodes, ctx.strict)


def cmd_settings_set(ctx: Context) -> int:
    changes: dict[str, str] = {}
    for item in ctx.args.assignments:
        name, sep, value = item.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or not value.strip():
            raise UsageError(f"expected NAME=VALUE, got {item!r} (e.g. memory=4GiB default_ttl=10m)")
        if name not in MUTABLE_SETTINGS:
            raise UsageError(f"{name!r} cannot change at run time; these can: {', '.join(MUTABLE_SETTINGS)}")
        try:  # checked here so a typo changes no node; the nodes check again
            parsed = parse_size(value) if name == "memory" else parse_duration(value)
        except ValueError as exc:
            raise UsageError(f"{name}: {exc}") from None
        if not parsed > 0:
            raise UsageError(f"{name} must be positive")
        changes[name] = value.strip()
    results = ctx.pod.each("PUT", f"{ADMIN_PREFIX}/settings", changes)
    nodes = []
    for r in results:
        s = r.status()
        data = r.data or {}
        s["settings"] = data.get("settings") if r.ok else None
        s["evicted"] = data.get("evicted") if r.ok else None
        s["over_budget"] = data.get("over_budget") if r.ok else None
        nodes.append(s)
    payload = {"requested": changes, "nodes_total": len(nodes), "nodes_up": sum(1 for n in nodes if n["ok"]),
               "nodes": nodes}

    def render(console: Any, p: dict[str, Any]) -> None:
        _settings_render(console, p, extra=("evicted", "over_budget"))

    _emit(ctx, payload, render)
    _fail_all(ctx, "settings set", nodes)
    return exit_code(nodes, ctx.strict)


def health_of(pod: Pod) -> dict[str, Any]:
    """live/ready of every node (no token needed), plus node id, version and uptime when a token is given."""

    def probe(endpoint: str) -> dict[str, Any]:
        entry: dict[str, Any] = {"node": node_name(endpoint), "endpoint": endpoint, "ok": False,
                                 "status": "down", "error": None, "live": False, "ready": False, "ms": None,
                                 "node_id": None, "version": None, "uptime": None}
        started = time.perf_counter()
        try:
            pod.call(endpoint, "GET", f"{HEALTH_PREFIX}/live", auth=False)
            entry.update(ok=True, status="up", live=True, ms=round((time.perf_counter() - started) * 1000, 1))
        except NodeError as exc:
            entry.update(status=exc.kind, error=str(exc))
            return entry
        try:
            pod.call(endpoint, "GET", f"{HEALTH_PREFIX}/ready", auth=False)
            entry["ready"] = True
        except NodeError as exc:
            entry["error"] = f"not ready: {exc}"
        if pod.token:
            try:
                info = pod.call(endpoint, "GET", f"{ADMIN_PREFIX}/info") or {}
                entry.update(node_id=info.get("node_id"), version=info.get("version"),
                             uptime=info.get("uptime"))
            except NodeError:
                pass  # health needs no token; a wrong one only hides these details
        return entry

    with ThreadPoolExecutor(max_workers=min(32, len(pod.endpoints))) as pool:
        nodes = list(pool.map(probe, pod.endpoints))
    return {"nodes_total": len(nodes), "nodes_live": sum(n["live"] for n in nodes),
            "nodes_ready": sum(n["ready"] for n in nodes), "nodes": nodes}


def cmd_health(ctx: Context) -> int:
    payload = health_of(ctx.pod)

    def render(console: Any, p: dict[str, Any]) -> None:
        from rich.markup import escape

        table = _table(f"health: {p['nodes_live']}/{p['nodes_total']} live, {p['nodes_ready']} ready")
        for col in ("node", "live", "ready", "latency", "node id", "version", "uptime", "error"):
            table.add_column(col, no_wrap=col != "error")
        for n in p["nodes"]:
            live = "[green]live[/]" if n["live"] else "[red]down[/]"
            if n["ready"]:
                ready = "[green]ready[/]"
            else:
                ready = "[yellow]not ready[/]" if n["live"] else "[red]–[/]"
            uptime = fmt_uptime(n["uptime"])
            latency = f"{n['ms']:.1f} ms" if n["ms"] is not None else "–"
            table.add_row(escape(n["node"]), live, ready, latency, escape(n["node_id"] or "–"),
                          escape(n["version"] or "–"), uptime, escape(n["error"] or ""))
        console.print(table)

    _emit(ctx, payload, render)
    _fail_all(ctx, "health", payload["nodes"])
    return exit_code(payload["nodes"], ctx.strict)


def render_top(p: dict[str, Any], interval: float) -> Any:
    from rich.console import Group
    from rich.markup import escape
    from rich.text import Text

    total = p["total"]
    use = fmt_ratio(total["used"] / total["budget"]) if total["budget"] else "–"
    header = Text.from_markup(
        f"[bold]ctxstore top[/]  {time.strftime('%H:%M:%S', time.localtime(p['time']))}  "
        f"nodes up [bold]{p['nodes_up']}/{p['nodes_total']}[/]  used {fmt_bytes(total['used'])} of "
        f"{fmt_bytes(total['budget'])} ({use})  hit ratio {fmt_ratio(total['hit_ratio'])}  "
        f"every {interval:g}s (Ctrl-C quits)")
    table = _table()
    for col in ("node", "state", "used / budget", "use", "objects", "hit ratio", "reads/s", "writes/s",
                "in/s", "out/s", "evictions/s", "expirations/s"):
        table.add_column(col, justify="left" if col in ("node", "state") else "right", no_wrap=True)

    def row(name: str, state: str, s: dict[str, Any] | None, rates: dict[str, float | None],
            style: str | None = None) -> None:
        if s is None:
            table.add_row(name, state, *["–"] * 10, style=style)
            return
        table.add_row(name, state, f"{fmt_bytes(s['used'])} / {fmt_bytes(s['budget'])}",
                      fmt_ratio(s["used"] / s["budget"]) if s["budget"] else "–", fmt_int(s["objects"]),
                      fmt_ratio(s["hit_ratio"]), fmt_rate(rates["reads"]), fmt_rate(rates["writes"]),
                      fmt_byte_rate(rates["bytes_in"]), fmt_byte_rate(rates["bytes_out"]),
                      fmt_rate(rates["evictions"]), fmt_rate(rates["expirations"]), style=style)

    for n in p["nodes"]:
        row(escape(n["node"]), _state(n), n["stats"], n["rates"])
    table.add_section()
    row("total", f"{p['nodes_up']}/{p['nodes_total']}", total, total["rates"], style="bold")
    problems = [Text.from_markup(f"[red]✗ {escape(n['node'])} {n['status']}:[/] ") + Text(n["error"] or "")
                for n in p["nodes"] if not n["ok"]]
    return Group(header, table, *problems)


def cmd_top(ctx: Context) -> int:
    interval = ctx.args.interval
    iterations = ctx.args.iterations
    if interval <= 0:
        raise UsageError("--interval must be positive")
    previous: dict[str, Sample] = {}
    frame: dict[str, Any] = {"nodes": []}
    count = 0

    def sample() -> dict[str, Any]:
        results = ctx.pod.each("GET", f"{ADMIN_PREFIX}/stats")
        return top_frame(results, previous, time.monotonic())

    def pace(started: float) -> None:
        time.sleep(max(0.0, interval - (time.monotonic() - started)))

    try:
        if ctx.json:  # one JSON document per line and refresh
            while iterations is None or count < iterations:
                started = time.monotonic()
                frame = sample()
                count += 1
                print(json.dumps(frame), flush=True)
                if iterations is None or count < iterations:
                    pace(started)
        else:
            console = _console()
            if console.is_terminal:
                from rich.live import Live

                with Live(console=console, auto_refresh=False, transient=False) as live:
                    while iterations is None or count < iterations:
                        started = time.monotonic()
                        frame = sample()
                        count += 1
                        live.update(render_top(frame, interval), refresh=True)
                        if iterations is None or count < iterations:
                            pace(started)
            else:  # piped: one frame after the other, like `top -b`
                while iterations is None or count < iterations:
                    started = time.monotonic()
                    frame = sample()
                    count += 1
                    console.print(render_top(frame, interval))
                    if iterations is None or count < iterations:
                        pace(started)
    except KeyboardInterrupt:
        return EXIT_OK
    return exit_code(frame["nodes"], ctx.strict)


# ---------------------------------------------------------------------------------------------- arguments

def build_parser() -> argparse.ArgumentParser:
    # The common options are accepted before or after the subcommand (`ctxstore admin stats --json`).
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--nodes", default=argparse.SUPPRESS,
                        help=f"comma-separated host:port or http(s)://host:port of the pod's nodes "
                             f"[env {ENV_NODES}; default {DEFAULT_NODES}]")
    common.add_argument("--token", default=argparse.SUPPRESS,
                        help=f"admin bearer token [env {ENV_TOKEN}, preferred: arguments show in ps]")
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                        help="print one machine-readable JSON document (top: one per line)")
    common.add_argument("--timeout", type=float, default=argparse.SUPPRESS,
                        help=f"seconds per call and node [default {DEFAULT_TIMEOUT:g}]")
    common.add_argument("--strict", action="store_true", default=argparse.SUPPRESS,
                        help="exit 1 when any node failed (default: only when all did)")
    common.add_argument("--insecure", action="store_true", default=argparse.SUPPRESS,
                        help="do not verify HTTPS certificates")

    parser = argparse.ArgumentParser(
        prog="ctxstore admin", parents=[common],
        description="Administer a ctxstore node or a whole pod through the admin API.",
        epilog="exit codes: 0 at least one node answered (with --strict: all did); 1 no node answered or "
               "none could do it; 2 usage error (bad arguments, no token). See docs/operations.md.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser("stats", parents=[common], help="totals of the pod and one row per node")
    p.add_argument("--reset", action="store_true", help="zero the counters after reading them")
    p.set_defaults(func=cmd_stats)

    p = sub.add_parser("buckets", parents=[common], help="buckets summed over the nodes")
    p.add_argument("--per-node", action="store_true", help="one row per node under each bucket")
    p.set_defaults(func=cmd_buckets)

    tenants = sub.add_parser("tenants", parents=[common], help="tenant keys: create, list, revoke")
    tsub = tenants.add_subparsers(dest="tenants_command", metavar="ACTION")
    tsub.required = True
    p = tsub.add_parser("create", parents=[common], help="one key pair for NAME, created on every node")
    p.add_argument("name", metavar="NAME")
    p.add_argument("--quota", metavar="SIZE", help="byte quota of the tenant on each node, e.g. 2GiB")
    p.set_defaults(func=cmd_tenants_create)
    p = tsub.add_parser("list", parents=[common], help="every key, merged over the nodes")
    p.set_defaults(func=cmd_tenants_list)
    p = tsub.add_parser("revoke", parents=[common], help="disable a key on every node")
    p.add_argument("access_key", metavar="ACCESS_KEY")
    p.add_argument("--delete", action="store_true", help="delete the key instead of disabling it")
    p.set_defaults(func=cmd_tenants_revoke)

    p = sub.add_parser("flush", parents=[common], help="delete (or expire) a bucket's objects on every node")
    p.add_argument("bucket", metavar="BUCKET")
    p.add_argument("--prefix", default="", help="only keys under this prefix")
    p.add_argument("--expire", action="store_true", help="expire the objects instead of deleting them")
    p.set_defaults(func=cmd_flush)

    settings = sub.add_parser("settings", parents=[common], help="runtime settings: get, set")
    ssub = settings.add_subparsers(dest="settings_command", metavar="ACTION")
    ssub.required = True
    p = ssub.add_parser("get", parents=[common], help="memory budget and TTLs of every node")
    p.set_defaults(func=cmd_settings_get)
    p = ssub.add_parser("set", parents=[common], help="e.g. memory=4GiB default_ttl=10m max_ttl=1d")
    p.add_argument("assignments", nargs="+", metavar="NAME=VALUE")
    p.set_defaults(func=cmd_settings_set)

    p = sub.add_parser("health", parents=[common], help="live/ready of every node (no token needed)")
    p.set_defaults(func=cmd_health, needs_token=False)

    p = sub.add_parser("top", parents=[common], help="live view: memory, hit ratio, rates per node")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes [default 2]")
    p.add_argument("--iterations", type=int, default=None, metavar="N", help="stop after N refreshes")
    p.set_defaults(func=cmd_top)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        nodes = parse_nodes(getattr(args, "nodes", None) or os.environ.get(ENV_NODES) or DEFAULT_NODES)
        token = getattr(args, "token", None) or os.environ.get(ENV_TOKEN, "")
        token = token.strip()
        if getattr(args, "needs_token", True) and not token:
            raise UsageError(f"no admin token: set {ENV_TOKEN} (a node started without one prints the token "
                             "it generated) or pass --token")
        timeout = getattr(args, "timeout", DEFAULT_TIMEOUT)
        if not timeout > 0:
            raise UsageError("--timeout must be positive")
        pod = Pod(nodes, token=token, timeout=timeout, insecure=getattr(args, "insecure", False))
        ctx = Context(pod=pod, json=getattr(args, "json", False), strict=getattr(args, "strict", False),
                      args=args)
        return args.func(ctx)
    except UsageError as exc:
        print(f"ctxstore admin: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:  # `ctxstore admin ... | head`
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
