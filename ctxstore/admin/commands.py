"""One function per ``ctxstore admin`` command: ask the pod, aggregate, print (table or ``--json``)."""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ..admin_schema import ADMIN_PREFIX, HEALTH_LIVE, HEALTH_READY, MUTABLE_SETTINGS, generate_key_pair
from ..units import parse_duration, parse_size, plural
from .aggregate import Sample, exit_code, has_flash, summarize_buckets, summarize_stats, summarize_tenants, top_frame
from .common import EXIT_FAILED, EXIT_OK, NodeError, UsageError
from .nodes import Pod, node_name
from .render import (
    _console,
    _print_problems,
    _state,
    _table,
    fmt_byte_rate,
    fmt_bytes,
    fmt_duration,
    fmt_int,
    fmt_rate,
    fmt_ratio,
    fmt_uptime,
)

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

        table = _table(f"ctxstore pod: {p['nodes_up']}/{plural(p['nodes_total'], 'node')} up")
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
        if p["total"].get("disk_budget"):
            console.print(_flash_table(p))
        _print_problems(console, p["nodes"])

    _emit(ctx, payload, render)
    _fail_all(ctx, "stats", payload["nodes"])
    return exit_code(payload["nodes"], ctx.strict)


def _flash_table(p: dict[str, Any]) -> Any:
    """The flash tier of each node (shown when any node has one): space, blocks, the share of hits it served,
    what moved between the tiers, and what its device did."""
    from rich.markup import escape

    table = _table("flash tier")
    columns = ("node", "used", "budget", "use", "objects", "flash hits", "of hits", "demoted", "promoted",
               "prefetched", "read", "written", "evicted", "corrupt", "state")
    for col in columns:
        table.add_column(col, justify="left" if col in ("node", "state") else "right", no_wrap=True)

    def row(name: str, s: dict[str, Any] | None, style: str | None = None) -> None:
        if s is None or not s.get("disk_budget"):
            table.add_row(name, *["–"] * (len(columns) - 2), "–" if s is None else "no tier", style=style)
            return
        use = fmt_ratio(s["disk_used"] / s["disk_budget"])
        share = fmt_ratio(s["disk_hits"] / s["hits"]) if s["hits"] else "–"
        state = "degraded" if s["disk_degraded"] else "ok"
        table.add_row(name, fmt_bytes(s["disk_used"]), fmt_bytes(s["disk_budget"]), use, fmt_int(s["disk_objects"]),
                      fmt_int(s["disk_hits"]), share, fmt_int(s["demotions"]), fmt_int(s["promotions"]),
                      fmt_int(s["prefetches"]), fmt_bytes(s["disk_bytes_read"]), fmt_bytes(s["disk_bytes_written"]),
                      fmt_int(s["disk_evictions"]), fmt_int(s["disk_corrupt"]), state, style=style)

    for n in p["nodes"]:
        row(escape(n["node"]), n["stats"])
    table.add_section()
    row("total", p["total"], style="bold")
    return table


def cmd_buckets(ctx: Context) -> int:
    payload = summarize_buckets(ctx.pod.each("GET", f"{ADMIN_PREFIX}/buckets"))
    per_node = ctx.args.per_node

    def render(console: Any, p: dict[str, Any]) -> None:
        from rich.markup import escape

        table = _table(f"buckets over {p['nodes_up']}/{plural(p['nodes_total'], 'node')}")
        for col in ("bucket", "owner", "nodes", "objects", "bytes", "hit ratio", "hits", "misses", "puts",
                    "evictions", "expirations", "in", "out"):
            table.add_column(col, justify="left" if col in ("bucket", "owner") else "right", no_wrap=True)
        def counters(d: dict[str, Any]) -> list[str]:
            return [fmt_int(d["objects"]), fmt_bytes(d["bytes"]), fmt_ratio(d["hit_ratio"]), fmt_int(d["hits"]),
                    fmt_int(d["misses"]), fmt_int(d["puts"]), fmt_int(d["evictions"]), fmt_int(d["expirations"]),
                    fmt_bytes(d["bytes_in"]), fmt_bytes(d["bytes_out"])]

        for b in p["buckets"]:
            table.add_row(escape(b["name"]), escape(",".join(b["owners"])), str(b["nodes"]), *counters(b),
                          style="bold" if per_node else None)
            if per_node:
                for d in b["per_node"]:
                    table.add_row("  " + escape(d["node"]), "", "", *counters(d), style="dim")
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

        table = _table(f"tenant keys over {p['nodes_up']}/{plural(p['nodes_total'], 'node')}")
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
        print(f"tenant {p['tenant']!r}: key {p['access_key']} created on "
              f"{created}/{plural(len(statuses), 'node')}" + (f", quota {fmt_bytes(quota)} per node" if quota else ""))
        print(f"  AWS_ACCESS_KEY_ID={p['access_key']}")
        print(f"  AWS_SECRET_ACCESS_KEY={p['secret_key']}")
        print("The secret is shown this once. Keys made here live in the nodes' memory; to keep them across "
              "restarts add this entry to every node's CTXSTORE_TENANTS_FILE:")
        entry = {"tenant": p["tenant"], "access_key": p["access_key"], "secret_key": p["secret_key"],
                 **({"quota": quota} if quota else {})}
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
            console.print(f"access key {key} {action} on {applied}/{plural(len(statuses), 'node')}", markup=False)
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
            console.print(f"{verb} {plural(total, 'object')} of {escape(where)} on "
                          f"{present}/{plural(len(statuses), 'node')}")
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
            pod.call(endpoint, "GET", HEALTH_LIVE, auth=False)
            entry.update(ok=True, status="up", live=True, ms=round((time.perf_counter() - started) * 1000, 1))
        except NodeError as exc:
            entry.update(status=exc.kind, error=str(exc))
            return entry
        try:
            pod.call(endpoint, "GET", HEALTH_READY, auth=False)
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
    flash = bool(p.get("flash"))  # the flash tier's columns, when some node has one
    use = fmt_ratio(total["used"] / total["budget"]) if total["budget"] else "–"
    levels = f"used {fmt_bytes(total['used'])} of {fmt_bytes(total['budget'])} ({use})"
    if flash:
        levels = f"RAM {levels}  flash {fmt_bytes(total['disk_used'])} of {fmt_bytes(total['disk_budget'])}"
    header = Text.from_markup(
        f"[bold]ctxstore top[/]  {time.strftime('%H:%M:%S', time.localtime(p['time']))}  "
        f"nodes up [bold]{p['nodes_up']}/{p['nodes_total']}[/]  {levels}  hit ratio {fmt_ratio(total['hit_ratio'])}  "
        f"every {interval:g}s (Ctrl-C quits)")
    columns = ["used / budget", "use", "objects", "hit ratio", "reads/s", "writes/s", "in/s", "out/s", "evictions/s",
               "expirations/s"]
    if flash:  # two header lines, the tier over the first column of its group: the table stays within ~200 columns
        columns = [f"RAM\n{columns[0]}", *(f"\n{c}" for c in columns[1:]),
                   "flash\nused / size", "\nobjects", "\nhits/s", "\nread/s", "\ndemotions/s"]
    table = _table(narrow=flash)
    for col in ("node", "state", *columns):
        table.add_column(col, justify="left" if col in ("node", "state") else "right", no_wrap=True)

    def flash_cells(s: dict[str, Any], rates: dict[str, float | None]) -> list[str]:
        if not has_flash(s):  # a node without a flash tier, in a pod with some
            return ["–"] * 5
        return [f"{fmt_bytes(s['disk_used'])} / {fmt_bytes(s['disk_budget'])}", fmt_int(s["disk_objects"]),
                fmt_rate(rates["flash_hits"]), fmt_byte_rate(rates["flash_bytes_read"]), fmt_rate(rates["demotions"])]

    def row(name: str, state: str, s: dict[str, Any] | None, rates: dict[str, float | None],
            style: str | None = None) -> None:
        if s is None:
            table.add_row(name, state, *["–"] * len(columns), style=style)
            return
        cells = [f"{fmt_bytes(s['used'])} / {fmt_bytes(s['budget'])}",
                 fmt_ratio(s["used"] / s["budget"]) if s["budget"] else "–", fmt_int(s["objects"]),
                 fmt_ratio(s["hit_ratio"]), fmt_rate(rates["reads"]), fmt_rate(rates["writes"]),
                 fmt_byte_rate(rates["bytes_in"]), fmt_byte_rate(rates["bytes_out"]),
                 fmt_rate(rates["evictions"]), fmt_rate(rates["expirations"])]
        table.add_row(name, state, *cells, *(flash_cells(s, rates) if flash else []), style=style)

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
