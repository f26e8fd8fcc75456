"""Adding up what the nodes answered: totals, per-bucket and per-tenant views, rates for ``top``."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..admin_schema import BUCKET_KEYS, STAT_KEYS
from .common import EXIT_FAILED, EXIT_OK, RATES
from .nodes import NodeResult, node_name

# ---------------------------------------------------------------------------------------------- aggregation

def ratio(hits: int, misses: int) -> float | None:
    lookups = hits + misses
    return hits / lookups if lookups else None


def node_stats(raw: dict[str, Any]) -> dict[str, Any]:
    """A node's stats document projected on the stable keys."""
    out: dict[str, Any] = {k: int(raw.get(k) or 0) for k in STAT_KEYS}
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
            detail: dict[str, Any] = {"node": node_name(r.endpoint), **{k: int(b.get(k) or 0) for k in BUCKET_KEYS}}
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


# The flash tier's rates in ``top`` (name -> the counters whose deltas it sums), next to common.RATES: blocks read
# back from flash (its share of the hits), bytes read from the device (reads, prefetches), blocks written to flash
# (RAM's eviction victims, direct writes).
FLASH_RATES: dict[str, tuple[str, ...]] = {
    "flash_hits": ("disk_hits",),
    "flash_bytes_read": ("disk_bytes_read",),
    "demotions": ("demotions",),
}
TOP_RATES = {**RATES, **FLASH_RATES}


def has_flash(stats: dict[str, Any] | None) -> bool:
    """Whether a node's stats describe a flash tier (``disk_*`` are zero without ``--disk``)."""
    return stats is not None and stats["disk_budget"] > 0


@dataclass
class Sample:
    """One node's counters at one moment (``top`` derives rates from two of them)."""

    at: float
    stats: dict[str, Any] | None


def rates_between(previous: Sample | None, current: Sample) -> dict[str, float | None]:
    """Per-second rates from two samples; None when unknown (first sample, node was down, counters reset)."""
    out: dict[str, float | None] = {name: None for name in TOP_RATES}
    if previous is None or previous.stats is None or current.stats is None:
        return out
    elapsed = current.at - previous.at
    if elapsed <= 0:
        return out
    for name, keys in TOP_RATES.items():
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
    """One refresh of ``top``: per-node levels, cumulative hit ratio and rates since the previous refresh;
    ``flash`` says whether any node that answered has a flash tier (the table then shows its columns; the rates
    and the ``disk_*`` levels are in every frame). Updates ``previous`` in place."""
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
    for name in TOP_RATES:
        values = [n["rates"][name] for n in up]
        total_rates[name] = sum(values) if values and all(v is not None for v in values) else None
    return {"time": time.time(), "nodes_total": len(nodes), "nodes_up": len(up),
            "flash": any(has_flash(n["stats"]) for n in up),
            "total": {**total_stats([n["stats"] for n in up]), "rates": total_rates}, "nodes": nodes}


def exit_code(statuses: Sequence[dict[str, Any]], strict: bool = False) -> int:
    ok = sum(1 for s in statuses if s["ok"])
    if not ok or (strict and ok < len(statuses)):
        return EXIT_FAILED
    return EXIT_OK
