"""The Grafana dashboard of a ctxstore pod, written as data: ``python3 deploy/grafana/dashboard.py`` regenerates
``deploy/grafana/dashboards/ctxstore.json`` (a test keeps the two in sync and checks that every metric a query
names exists on a live node).

Every query reads the metrics of docs/metrics.md, selected by the ``job`` and ``instance`` variables (one
instance is one node). The flash tier's panels read zero, or "No data" for ratios, on nodes without one.
Standard library only, so it runs anywhere Python does.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

OUT = Path(__file__).with_name("dashboards") / "ctxstore.json"
DS = {"type": "prometheus", "uid": "${datasource}"}
S = 'job=~"$job", instance=~"$instance"'  # every selector carries it
RATE = "$__rate_interval"
BULK_GET = 'api="bulk", operation="get"'
BULK_PUT = 'api="bulk", operation="put"'
S3_GET = 'api="s3", operation="GetObject"'
S3_PUT = 'api="s3", operation=~"PutObject|UploadPart"'
CLIENT_ERRORS = 'status=~"4..", status!="499"'


def sel(extra: str = "") -> str:
    return "{" + S + (", " + extra if extra else "") + "}"


def rate(metric: str, extra: str = "") -> str:
    return f"rate({metric}{sel(extra)}[{RATE}])"


def labels(**values: str) -> str:
    """``api="bulk", operation="get"``; a value starting with ``~`` is a regex match (``=~``)."""
    return ", ".join(f'{k}=~"{v[1:]}"' if v.startswith("~") else f'{k}="{v}"' for k, v in values.items())


def quantile(q: float, by: str, **match: str) -> str:
    inner = rate("ctxstore_request_duration_seconds_bucket", labels(**match))
    return f"histogram_quantile({q}, sum by (le, {by}) ({inner}))"


class Layout:
    """Panels placed left to right on Grafana's 24-column grid, rows one under the other."""

    def __init__(self) -> None:
        self.panels: list[dict[str, Any]] = []
        self.y = 0
        self.x = 0
        self.row_height = 0

    def _id(self) -> int:
        return len(self.panels) + 1

    def row(self, title: str) -> None:
        self._newline()
        self.panels.append({"type": "row", "id": self._id(), "title": title, "collapsed": False, "panels": [],
                            "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y}})
        self.y += 1

    def _newline(self) -> None:
        if self.x:
            self.y += self.row_height
            self.x, self.row_height = 0, 0

    def _place(self, w: int, h: int) -> dict[str, int]:
        if self.x + w > 24:
            self._newline()
        pos = {"h": h, "w": w, "x": self.x, "y": self.y}
        self.x += w
        self.row_height = max(self.row_height, h)
        return pos

    def _targets(self, queries: list[tuple[str, str]]) -> list[dict[str, Any]]:
        return [{"refId": chr(ord("A") + i), "datasource": DS, "expr": expr, "legendFormat": legend, "range": True}
                for i, (expr, legend) in enumerate(queries)]

    def stat(self, title: str, description: str, expr: str, unit: str, *, w: int = 4, decimals: int | None = None,
             thresholds: list[tuple[float | None, str]] | None = None) -> None:
        steps = [{"color": color, "value": value} for value, color in (thresholds or [(None, "blue")])]
        defaults: dict[str, Any] = {"unit": unit, "color": {"mode": "thresholds"},
                                    "thresholds": {"mode": "absolute", "steps": steps}}
        if decimals is not None:
            defaults["decimals"] = decimals
        self.panels.append({
            "type": "stat", "id": self._id(), "title": title, "description": description, "datasource": DS,
            "gridPos": self._place(w, 4), "targets": self._targets([(expr, "")]),
            "fieldConfig": {"defaults": defaults, "overrides": []},
            "options": {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                        "colorMode": "value", "graphMode": "area", "justifyMode": "auto", "textMode": "auto",
                        "orientation": "auto", "wideLayout": True, "showPercentChange": False},
        })

    def graph(self, title: str, description: str, queries: list[tuple[str, str]], unit: str, *, w: int = 12,
              h: int = 8, dashed: str | None = None, stack: bool = False, max_value: float | None = None) -> None:
        defaults: dict[str, Any] = {
            "unit": unit, "min": 0, "color": {"mode": "palette-classic"},
            "custom": {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10 if not stack else 30,
                       "showPoints": "never", "spanNulls": False,
                       "stacking": {"mode": "normal" if stack else "none", "group": "A"}},
        }
        if max_value is not None:
            defaults["max"] = max_value
        overrides = []
        if dashed:  # series whose legend matches this regex are drawn dashed, unfilled (limits: budgets)
            overrides.append({"matcher": {"id": "byRegexp", "options": dashed}, "properties": [
                {"id": "custom.lineStyle", "value": {"fill": "dash", "dash": [10, 10]}},
                {"id": "custom.fillOpacity", "value": 0},
                {"id": "custom.stacking", "value": {"mode": "none", "group": "A"}}]})
        self.panels.append({
            "type": "timeseries", "id": self._id(), "title": title, "description": description, "datasource": DS,
            "gridPos": self._place(w, h), "targets": self._targets(queries),
            "fieldConfig": {"defaults": defaults, "overrides": overrides},
            "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True, "calcs": []},
                        "tooltip": {"mode": "multi", "sort": "desc"}},
        })


def hit_ratio(by: str = "") -> str:
    group = f" by ({by})" if by else ""
    hits = f"sum{group} ({rate('ctxstore_bucket_hits_total')})"
    misses = f"sum{group} ({rate('ctxstore_bucket_misses_total')})"
    return f"{hits} / ({hits} + {misses})"


def build() -> dict[str, Any]:
    p = Layout()
    p.row("Pod")
    p.stat("Nodes up", "Nodes Prometheus scraped successfully (its own `up`), of those it knows.",
           f"sum(up{sel()})", "none", thresholds=[(None, "red"), (1, "green")])
    p.stat("RAM used", "Bytes charged against the budgets of all nodes, over the budgets (ctxstore_used_bytes / "
           "ctxstore_budget_bytes). A full cache is normal: writes evict the least recently used blocks.",
           f"sum(ctxstore_used_bytes{sel()}) / sum(ctxstore_budget_bytes{sel()})", "percentunit", decimals=1)
    p.stat("Flash used", "Bytes of the flash tiers' files over their budgets; no value on a pod without a flash "
           "tier (--disk).", f"sum(ctxstore_disk_used_bytes{sel()}) / sum(ctxstore_disk_budget_bytes{sel()})",
           "percentunit", decimals=1)
    p.stat("Hit ratio", "Reads that found their block (S3 GET, bulk get and lookup), pod-wide, over the rate "
           "interval.", hit_ratio(), "percentunit", decimals=1,
           thresholds=[(None, "orange"), (0.5, "green")])
    p.stat("Restore throughput", "Bytes sent by bulk gets (restores), pod-wide.",
           f"sum({rate('ctxstore_response_bytes_total', BULK_GET)})", "Bps")
    p.stat("Server errors", "Requests answered 5xx per second, pod-wide (503 SlowDown included: a node out of "
           "room because everything left is pinned or in flight).",
           f"sum({rate('ctxstore_requests_total', labels(status='~5..'))}) or vector(0)", "reqps", decimals=2,
           thresholds=[(None, "green"), (0.01, "red")])

    p.row("Memory and flash per node")
    p.graph("RAM used per node", "ctxstore_used_bytes against the budget (dashed).",
            [(f"ctxstore_used_bytes{sel()}", "{{instance}}"),
             (f"ctxstore_budget_bytes{sel()}", "budget {{instance}}")], "bytes", dashed="^budget ")
    p.graph("Resident memory per node", "The node process' resident set (what a container limit counts) "
            "against its budget (dashed); docs/deployment.md sizes limits at budget x 1.1 + 256 MiB.",
            [(f"process_resident_memory_bytes{sel()}", "{{instance}}"),
             (f"ctxstore_budget_bytes{sel()}", "budget {{instance}}")], "bytes", dashed="^budget ")
    p.graph("Flash used per node", "Bytes of the flash tier's files (segments, manifest) against its budget "
            "(dashed). Zero without a flash tier.",
            [(f"ctxstore_disk_used_bytes{sel()}", "{{instance}}"),
             (f"ctxstore_disk_budget_bytes{sel()}", "budget {{instance}}")], "bytes", dashed="^budget ")
    p.graph("Blocks per tier", "Blocks held in RAM (all buckets) and on flash, per node.",
            [(f"sum by (instance) (ctxstore_bucket_objects{sel()})", "RAM {{instance}}"),
             (f"ctxstore_disk_objects{sel()}", "flash {{instance}}")], "short")
    p.graph("Pinned, reserved and in-flight bytes", "Parts of ctxstore_used_bytes that eviction cannot take: "
            "pinned blocks, bodies still arriving, multipart parts, answers still being sent.",
            [(f"sum({m}{sel()})", label) for m, label in (
                ("ctxstore_pinned_bytes", "pinned"), ("ctxstore_reserved_bytes", "reserved"),
                ("ctxstore_parts_bytes", "multipart parts"), ("ctxstore_sending_bytes", "being sent"),
                ("ctxstore_state_bytes", "bucket and upload records"))], "bytes")
    p.graph("Flash write queue and index", "Blocks waiting to be written to flash, and the RAM of the flash "
            "tier's index, per node.",
            [(f"ctxstore_disk_queued_bytes{sel()}", "queued {{instance}}"),
             (f"ctxstore_disk_index_bytes{sel()}", "index {{instance}}")], "bytes")

    p.row("Hits and tiers")
    p.graph("Hit ratio per bucket", "Hits over reads, per bucket (one bucket per model namespace).",
            [(hit_ratio("bucket"), "{{bucket}}")], "percentunit", max_value=1)
    p.graph("Reads per second by tier", "Hits served from RAM, hits served from flash, and misses, pod-wide "
            "(stacked).",
            [(f"sum({rate('ctxstore_bucket_hits_total')}) - sum({rate('ctxstore_bucket_disk_hits_total')})",
              "RAM hits"),
             (f"sum({rate('ctxstore_bucket_disk_hits_total')})", "flash hits"),
             (f"sum({rate('ctxstore_bucket_misses_total')})", "misses")], "ops", stack=True)
    p.graph("Demotions, promotions, prefetches", "Blocks moved from RAM to flash (instead of being evicted), "
            "read back from flash into RAM, and asked for by prefetch, per second.",
            [(f"sum({rate('ctxstore_bucket_demotions_total')})", "demoted to flash"),
             (f"sum({rate('ctxstore_bucket_promotions_total')})", "promoted to RAM"),
             (f"sum({rate('ctxstore_prefetches_total')})", "prefetched")], "ops")
    p.graph("Flash I/O", "Bytes read from and written to the flash tier's files, per node.",
            [(rate("ctxstore_disk_read_bytes_total"), "read {{instance}}"),
             (rate("ctxstore_disk_written_bytes_total"), "written {{instance}}")], "Bps")

    p.row("Throughput")
    p.graph("Restore and save throughput per node", "Bulk get response bytes (restores) and bulk put request "
            "bytes (saves), per node.",
            [(f"sum by (instance) ({rate('ctxstore_response_bytes_total', BULK_GET)})",
              "restore {{instance}}"),
             (f"sum by (instance) ({rate('ctxstore_request_bytes_total', BULK_PUT)})",
              "save {{instance}}")], "Bps")
    p.graph("S3 throughput", "Bytes of S3 GetObject answers and PutObject (and UploadPart) bodies, pod-wide.",
            [(f"sum({rate('ctxstore_response_bytes_total', S3_GET)})", "GET"),
             (f"sum({rate('ctxstore_request_bytes_total', S3_PUT)})",
              "PUT")], "Bps")
    p.graph("Requests per second by operation", "Every request answered, by API and operation, pod-wide.",
            [(f"sum by (api, operation) ({rate('ctxstore_requests_total')})", "{{api}} {{operation}}")], "reqps")
    p.graph("Block traffic per second", "Payload bytes stored into and read from buckets (S3 and bulk), "
            "pod-wide.",
            [(f"sum({rate('ctxstore_bucket_bytes_in_total')})", "stored"),
             (f"sum({rate('ctxstore_bucket_bytes_out_total')})", "read")], "Bps")

    p.row("Latency")
    for api, ops in (("bulk", "get|put|lookup"), ("s3", "GetObject|PutObject|HeadObject")):
        p.graph(f"{'Bulk' if api == 'bulk' else 'S3'} latency p50 / p90 / p99",
                f"Seconds from the request head to the last response byte, by operation ({ops.replace('|', ', ')}), "
                "pod-wide, from ctxstore_request_duration_seconds.",
                [(quantile(q, "operation", api=api, operation="~" + ops), f"p{int(q * 100)} {{{{operation}}}}")
                 for q in (0.5, 0.9, 0.99)], "s")

    p.row("Evictions, expirations and errors")
    p.graph("Evictions and expirations per second", "Blocks evicted to make room and dropped because their TTL "
            "ran out, pod-wide; the flash tier's share separately.",
            [(f"sum({rate('ctxstore_bucket_evictions_total')})", "evicted"),
             (f"sum({rate('ctxstore_bucket_expirations_total')})", "expired"),
             (f"sum({rate('ctxstore_disk_evictions_total')})", "of which from flash"),
             (f"sum({rate('ctxstore_disk_expirations_total')})", "of which expired on flash")], "ops")
    p.graph("Errors per second", "Server errors (5xx, including 503 SlowDown) and requests the client gave up "
            "on (499), by operation; 4xx are listed apart: most are misses (404 NoSuchKey) and conditional "
            "writes of blocks that exist (412).",
            [(f"sum by (api, operation, status) ({rate('ctxstore_requests_total', labels(status='~5..|499'))})",
              "{{status}} {{api}} {{operation}}"),
             (f"sum by (status) ({rate('ctxstore_requests_total', CLIENT_ERRORS)})",
              "{{status}} (client errors)")], "reqps")
    p.graph("Flash health", "Flash records that failed verification (served as misses), nodes whose flash tier "
            "stopped writing after a device error, compactions; and the index rebuild time at start (s).",
            [(f"sum(increase(ctxstore_disk_corrupt_total{sel()}[{RATE}]))", "corrupt records"),
             (f"sum(ctxstore_disk_degraded{sel()})", "degraded nodes"),
             (f"sum(increase(ctxstore_disk_compactions_total{sel()}[{RATE}]))", "segments compacted"),
             (f"max(ctxstore_disk_recovery_seconds{sel()})", "recovery seconds (max)")], "short")
    p.graph("Restarts and draining", "Node restarts (the start time changed; a restarted node comes back empty "
            "unless it has a flash tier) and nodes draining on SIGTERM.",
            [(f"sum by (instance) (changes(ctxstore_start_time_seconds{sel()}[{RATE}]))", "restart {{instance}}"),
             (f"sum(ctxstore_draining{sel()})", "draining")], "short")

    return {
        "uid": "ctxstore-pod",
        "title": "ctxstore pod",
        "description": "Memory and flash per node, hit ratio, restore throughput, latency percentiles, evictions, "
                       "expirations and errors of a ctxstore pod (deploy/grafana/dashboard.py).",
        "tags": ["ctxstore"],
        "timezone": "browser",
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "links": [],
        "annotations": {"list": [{
            "builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"}, "enable": True, "hide": True,
            "iconColor": "rgba(0, 211, 255, 1)", "name": "Annotations & Alerts", "type": "dashboard"}]},
        "templating": {"list": [
            {"type": "datasource", "name": "datasource", "label": "Prometheus", "query": "prometheus",
             "current": {}, "hide": 0, "refresh": 1, "regex": "", "options": []},
            {"type": "query", "name": "job", "label": "job", "datasource": DS,
             "query": {"query": "label_values(ctxstore_up, job)", "refId": "job"},
             "definition": "label_values(ctxstore_up, job)", "refresh": 2, "sort": 1, "current": {},
             "includeAll": False, "multi": False, "hide": 0, "options": [], "regex": ""},
            {"type": "query", "name": "instance", "label": "node", "datasource": DS,
             "query": {"query": 'label_values(ctxstore_up{job=~"$job"}, instance)', "refId": "instance"},
             "definition": 'label_values(ctxstore_up{job=~"$job"}, instance)', "refresh": 2, "sort": 1,
             "current": {}, "includeAll": True, "allValue": ".*", "multi": True, "hide": 0, "options": [],
             "regex": ""},
        ]},
        "panels": p.panels,
    }


def render() -> str:
    return json.dumps(build(), indent=2) + "\n"


if __name__ == "__main__":
    if sys.argv[1:] == ["-"]:
        sys.stdout.write(render())
    else:
        OUT.parent.mkdir(parents=True, exist_ok=True)
        OUT.write_text(render())
        print(f"wrote {OUT}")
