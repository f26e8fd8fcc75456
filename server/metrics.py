"""Prometheus metrics of one node: request metrics observed by the data paths, store metrics read from the
engine at scrape time, and the ``/metrics`` endpoint (docs/metrics.md).

Every node owns its own :class:`~prometheus_client.CollectorRegistry` (:class:`Metrics`): nothing
here touches prometheus_client's default registry, so several nodes can live in one process (the tests do).

Per-request cost. The S3 and bulk services call :meth:`RequestMetrics.observe_request` once per request.
The series of each (api, operation, status) is bound once and kept in a dict; an observation is one dict
lookup and a few integer additions on that series. prometheus_client's own ``Counter``/``Histogram`` children
take a ``threading.Lock`` per value (five per request here: three counters, the histogram's sum and bucket),
which measured 3-5x slower (docs/metrics.md); every observation and every scrape runs on the event loop
thread, so the series need no lock, and :meth:`RequestMetrics.collect` turns them into ordinary counter and
histogram families at scrape time.
"""

from __future__ import annotations

import gzip
import logging
import time
from bisect import bisect_left
from collections.abc import Iterable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from ctxstore import __version__

from . import bearer
from .node import NodeState
from .protocol.asgi import Request, Scope, Send, ascii_int, raw_header, send_response

audit = logging.getLogger("ctxstore.audit")

# The services put the operation into the ASGI scope as soon as they know it (S3: once routed; bulk: once the
# path names a valid op), so a request that fails afterwards is still counted under its operation.
SCOPE_OPERATION = "ctxstore.operation"
UNKNOWN = "Unknown"
CLIENT_CLOSED = 499  # the client went away before the response (nginx's convention); nothing was sent

# 0.1 ms .. 10 s: a memory hit on loopback is well under a millisecond, a multi-GiB upload takes seconds.
DURATION_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                    1.0, 2.5, 5.0, 10.0)
_LE = tuple(floatToGoString(b) for b in DURATION_BUCKETS) + ("+Inf",)


_REQUEST_LABELS = ("api", "operation", "status")


class _Series:
    """The counters of one (api, operation, status); ``io`` is shared by every status of (api, operation)."""

    __slots__ = ("count", "sum", "buckets", "io")

    def __init__(self, io: list[int]) -> None:
        self.count = 0
        self.sum = 0.0
        self.buckets = [0] * len(_LE)  # per bucket, not cumulative; the last one is +Inf
        self.io = io  # [request payload bytes, response body bytes]


class RequestMetrics(Collector):
    """``ctxstore_requests_total``, ``ctxstore_request_duration_seconds``, ``ctxstore_request_bytes_total``
    and ``ctxstore_response_bytes_total``, labelled by api (s3, bulk), operation and status."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self._series: dict[tuple[str, str, int], _Series] = {}
        self._io: dict[tuple[str, str], list[int]] = {}
        self.writes_after_close = 0  # counted by the HTTP protocol (server/protocol/http.py)
        if registry is not None:
            registry.register(self)

    def _bind(self, key: tuple[str, str, int]) -> _Series:
        io = self._io.setdefault(key[:2], [0, 0])
        series = self._series[key] = _Series(io)
        return series

    def observe(self, api: str, operation: str, status: int, started: float, bytes_in: int = 0,
                bytes_out: int = 0) -> None:
        """One answered request; ``started`` is its ``time.perf_counter()`` on arrival."""
        elapsed = time.perf_counter() - started
        series = self._series.get((api, operation, status)) or self._bind((api, operation, status))
        series.count += 1
        series.sum += elapsed
        series.buckets[bisect_left(DURATION_BUCKETS, elapsed)] += 1  # the first bound >= elapsed ("le")
        if bytes_in:
            series.io[0] += bytes_in
        if bytes_out:
            series.io[1] += bytes_out

    def observe_request(self, api: str, req: Request, status: int, started: float, bytes_out: int) -> None:
        """:meth:`observe` (inlined: this is the data path's call) for a request of the S3 or bulk service:
        the operation from the scope, the bytes in from the headers of a body read to its end
        (:func:`body_bytes`)."""
        elapsed = time.perf_counter() - started
        key = (api, req.scope.get(SCOPE_OPERATION, UNKNOWN), status)
        series = self._series.get(key) or self._bind(key)
        series.count += 1
        series.sum += elapsed
        series.buckets[bisect_left(DURATION_BUCKETS, elapsed)] += 1
        if req.body_done:
            series.io[0] += body_bytes(req)
        if bytes_out:
            series.io[1] += bytes_out

    def _families(self) -> tuple[CounterMetricFamily, HistogramMetricFamily, CounterMetricFamily, CounterMetricFamily]:
        return (
            CounterMetricFamily("ctxstore_requests", "Requests answered, by API, operation and HTTP status.",
                                labels=_REQUEST_LABELS),
            HistogramMetricFamily("ctxstore_request_duration_seconds",
                                  "Seconds from the request head to the last response byte handed to the "
                                  "server.", labels=_REQUEST_LABELS),
            CounterMetricFamily("ctxstore_request_bytes", "Request payload bytes read, by API and operation.",
                                labels=("api", "operation")),
            CounterMetricFamily("ctxstore_response_bytes", "Response body bytes sent, by API and operation.",
                                labels=("api", "operation")),
        )

    def describe(self) -> Iterable[Metric]:
        return [*self._families(), _writes_after_close()]

    def collect(self) -> Iterator[Metric]:
        requests, duration, bytes_in, bytes_out = self._families()
        for (api, operation, status), series in sorted(self._series.items()):
            labels = [api, operation, str(status)]
            requests.add_metric(labels, series.count)
            cumulative, running = [], 0
            for le, n in zip(_LE, series.buckets, strict=True):
                running += n
                cumulative.append((le, running))
            duration.add_metric(labels, cumulative, series.sum)
        for (api, operation), (n_in, n_out) in sorted(self._io.items()):
            bytes_in.add_metric([api, operation], n_in)
            bytes_out.add_metric([api, operation], n_out)
        yield from (requests, duration, bytes_in, bytes_out)
        dropped = _writes_after_close()
        dropped.add_metric([], self.writes_after_close)
        yield dropped


def _writes_after_close() -> CounterMetricFamily:
    return CounterMetricFamily("ctxstore_writes_after_close", "Answers dropped unwritten: the client had closed "
                               "or half-closed the connection (or the node had ended it after an earlier answer).")


def body_bytes(req: Request) -> int:
    """Payload bytes of a request body: ``x-amz-decoded-content-length`` for aws-chunked uploads (the payload
    without the chunk framing), else ``Content-Length``; 0 if neither is usable."""
    headers = req.headers
    declared = headers.get("x-amz-decoded-content-length") or headers.get("content-length")
    return ascii_int(declared) or 0


class StoreCollector(Collector):
    """Engine gauges and counters, read from ``engine.operator.stats()`` at scrape time (nothing on the data path)."""

    BUCKET_LEVELS = (  # stats key, metric name, help
        ("objects", "ctxstore_bucket_objects", "Live objects in the bucket."),
        ("bytes", "ctxstore_bucket_bytes", "Payload bytes of the bucket's objects."),
        ("charged", "ctxstore_bucket_charged_bytes",
         "Bytes the bucket's objects count against the budget and quotas (payload plus key)."),
        ("pinned_bytes", "ctxstore_bucket_pinned_bytes", "Charged bytes of the bucket's pinned objects."),
        ("disk_objects", "ctxstore_bucket_disk_objects", "Blocks of the bucket held by the flash tier."),
        ("disk_bytes", "ctxstore_bucket_disk_bytes", "Payload bytes of the bucket held by the flash tier."),
    )
    BUCKET_COUNTERS = (
        ("hits", "ctxstore_bucket_hits", "Reads that found a live object (S3 and bulk)."),
        ("misses", "ctxstore_bucket_misses", "Reads of an absent or expired key (S3 and bulk)."),
        ("puts", "ctxstore_bucket_puts", "Objects stored (PutObject, CopyObject, multipart, bulk put)."),
        ("deletes", "ctxstore_bucket_deletes", "Objects deleted by a client."),
        ("evictions", "ctxstore_bucket_evictions", "Objects evicted to make room in the budget or a quota."),
        ("expirations", "ctxstore_bucket_expirations", "Objects dropped because their TTL ran out."),
        ("bytes_in", "ctxstore_bucket_bytes_in", "Payload bytes stored into the bucket."),
        ("bytes_out", "ctxstore_bucket_bytes_out", "Payload bytes read from the bucket."),
        ("disk_hits", "ctxstore_bucket_disk_hits", "Of the hits: reads served from the flash tier."),
        ("demotions", "ctxstore_bucket_demotions", "Blocks moved from RAM to the flash tier."),
        ("promotions", "ctxstore_bucket_promotions", "Blocks read back from the flash tier into RAM."),
    )
    NODE_LEVELS = (
        ("budget", "ctxstore_budget_bytes", "The node's byte budget (--memory)."),
        ("used", "ctxstore_used_bytes", "Bytes charged against the budget: objects, parts, reservations."),
        ("reserved", "ctxstore_reserved_bytes", "Of used: budget reserved for bodies still arriving."),
        ("parts_bytes", "ctxstore_parts_bytes", "Of used: parts of unfinished multipart uploads."),
        ("pinned_bytes", "ctxstore_pinned_bytes", "Of used: objects pinned right now (never evicted)."),
        ("uploads", "ctxstore_uploads_in_progress", "Multipart uploads not yet completed or aborted."),
        ("state_bytes", "ctxstore_state_bytes", "Of used: buckets, uploads and parts' records."),
        ("sending_bytes", "ctxstore_sending_bytes", "Of used: removed objects whose answers are still being sent."),
        ("buffer_bytes", "ctxstore_buffer_bytes", "Payload buffers kept for reuse (their charged part is in state)."),
        ("disk_budget", "ctxstore_disk_budget_bytes", "The flash tier's byte budget (--disk-size; 0: no tier)."),
        ("disk_used", "ctxstore_disk_used_bytes", "Bytes the flash tier's files take (segments, manifest)."),
        ("disk_objects", "ctxstore_disk_objects", "Blocks the flash tier holds."),
        ("disk_bytes", "ctxstore_disk_bytes", "Payload bytes the flash tier holds."),
        ("disk_segments", "ctxstore_disk_segments", "Segment files of the flash tier."),
        ("disk_queued_bytes", "ctxstore_disk_queued_bytes", "Blocks waiting to be written to flash."),
        ("disk_direct_waiting", "ctxstore_disk_direct_waiting",
         "Blocks of --disk-direct-size in RAM, waiting for room in the demotion queue."),
        ("disk_index_bytes", "ctxstore_disk_index_bytes", "RAM of the flash tier's index."),
        ("disk_degraded", "ctxstore_disk_degraded", "1 when the flash tier stopped writing after a device error."),
    )
    NODE_COUNTERS = (
        ("prefetches", "ctxstore_prefetches", "Blocks prefetch asked to bring from flash into RAM."),
        ("buffer_reuses", "ctxstore_buffer_reuses", "Payload buffers of dead blocks handed to new ones."),
        ("disk_bytes_read", "ctxstore_disk_read_bytes", "Bytes read from the flash tier's files."),
        ("disk_bytes_written", "ctxstore_disk_written_bytes", "Bytes written to the flash tier's files."),
        ("disk_evictions", "ctxstore_disk_evictions", "Blocks the flash tier dropped to make room."),
        ("disk_expirations", "ctxstore_disk_expirations", "Blocks the flash tier dropped because their TTL ran out."),
        ("disk_corrupt", "ctxstore_disk_corrupt", "Flash records that failed verification (answered as misses)."),
        ("disk_compactions", "ctxstore_disk_compactions", "Flash segments compacted."),
        ("disk_dropped_short_ttl", "ctxstore_disk_dropped_short_ttl",
         "RAM victims dropped, not demoted: less life left than --disk-min-ttl."),
        ("disk_dropped_too_large", "ctxstore_disk_dropped_too_large",
         "RAM victims dropped, not demoted: larger than a flash segment or the demotion queue."),
        ("disk_dropped_over_share", "ctxstore_disk_dropped_over_share",
         "RAM victims dropped, not demoted: their tenant's share of the flash tier is full."),
        ("disk_dropped_not_writing", "ctxstore_disk_dropped_not_writing",
         "RAM victims dropped, not demoted: the flash tier is not writing (degraded, or the write failed)."),
        ("disk_write_waits", "ctxstore_disk_write_waits",
         "Writes that waited for the flash demotion queue to drain (RAM full, queue full)."),
        ("disk_write_refusals", "ctxstore_disk_write_refusals",
         "Writes refused with SlowDown after waiting --disk-write-wait for the demotion queue."),
    )

    def __init__(self, node: NodeState) -> None:
        self.node = node

    def _families(self) -> dict[str, GaugeMetricFamily | CounterMetricFamily]:
        bucket_labels = ("bucket", "tenant")
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}
        for key, name, doc in self.BUCKET_LEVELS:
            families[key] = GaugeMetricFamily(name, doc, labels=bucket_labels)
        for key, name, doc in self.BUCKET_COUNTERS:
            families[key] = CounterMetricFamily(name, doc, labels=bucket_labels)
        for key, name, doc in self.NODE_LEVELS:
            families["node_" + key] = GaugeMetricFamily(name, doc)
        for key, name, doc in self.NODE_COUNTERS:
            families["node_" + key] = CounterMetricFamily(name, doc)
        families["recovery"] = GaugeMetricFamily(
            "ctxstore_disk_recovery_seconds", "How long the flash tier's index rebuild took when the node started.")
        families["up"] = GaugeMetricFamily("ctxstore_up", "1: the node is serving (it answered this scrape).")
        families["draining"] = GaugeMetricFamily("ctxstore_draining", "1 once the node is shutting down.")
        families["start"] = GaugeMetricFamily("ctxstore_start_time_seconds", "Unix time the node started.")
        return families

    def describe(self) -> Iterable[Metric]:
        return [*self._families().values(), _info_family()]

    def collect(self) -> Iterator[Metric]:
        node = self.node
        stats = node.engine.operator.stats()
        families = self._families()
        for name, counters in sorted(stats["buckets"].items()):
            labels = [name, node.engine.owner_of(name) or ""]
            for key, _, _ in self.BUCKET_LEVELS + self.BUCKET_COUNTERS:
                families[key].add_metric(labels, counters.get(key, 0))
        for key, _, _ in self.NODE_LEVELS + self.NODE_COUNTERS:
            families["node_" + key].add_metric([], stats.get(key, 0))
        families["recovery"].add_metric([], (stats.get("disk_recovery") or {}).get("seconds", 0.0))
        families["up"].add_metric([], 1)
        families["draining"].add_metric([], 1 if node.draining else 0)
        families["start"].add_metric([], node.started)
        info = _info_family()
        info.add_metric([], {"version": __version__, "node_id": node.node_id})
        yield from families.values()
        yield info


def _info_family() -> InfoMetricFamily:
    return InfoMetricFamily("ctxstore", "Version and node id.")


class Metrics:
    """The metrics of one node: its registry, the request metrics and the scrape endpoint."""

    def __init__(self, node: NodeState) -> None:
        self.node = node
        self.registry = CollectorRegistry()
        self.requests = RequestMetrics(self.registry)
        self.registry.register(StoreCollector(node))
        # process_* (resident memory, CPU, open fds) of this process, to compare with the budget.
        ProcessCollector(registry=self.registry)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    async def serve(self, scope: Scope, send: Send) -> None:
        """``GET``/``HEAD`` ``/metrics`` or ``/_ctx/metrics`` with ``Authorization: Bearer <admin token>``."""
        method = scope["method"]
        head = method == "HEAD"
        json = ("content-type", "application/json")
        if method not in ("GET", "HEAD"):
            await send_response(send, 405, [json, ("allow", "GET, HEAD")],
                                b'{"detail":"the metrics endpoint takes GET or HEAD"}')
            return
        expected = self.node.admin_token
        if not expected:
            await send_response(send, 403, [json], b'{"detail":"metrics disabled: set CTXSTORE_ADMIN_TOKEN"}',
                                head=head)
            return
        if not bearer.matches(raw_header(scope, b"authorization"), expected):
            audit.info("who=anonymous what=%s %s result=401", method, scope["path"])
            await send_response(send, 401, [json, ("www-authenticate", "Bearer")],
                                b'{"detail":"admin bearer token required"}', head=head)
            return
        body = self.exposition()
        headers = [("content-type", CONTENT_TYPE_LATEST), ("cache-control", "no-store")]
        if b"gzip" in (raw_header(scope, b"accept-encoding") or b"").lower():
            body = gzip.compress(body, compresslevel=6)
            headers.append(("content-encoding", "gzip"))
        await send_response(send, 200, headers, body, head=head)


def is_scrape(scope: Scope) -> bool:
    """Whether a request on ``/metrics`` is for the metrics endpoint rather than S3 (bucket "metrics").

    Only a GET or HEAD of exactly ``/metrics`` whose Authorization header uses the ``Bearer`` scheme. S3
    requests are signed (``AWS4-HMAC-SHA256 ...``, ``AWS ...``) or presigned (no Authorization header at all),
    so no valid S3 request is taken for a scrape, and every other request on the path stays S3."""
    return scope["method"] in ("GET", "HEAD") and bearer.token_of(raw_header(scope, b"authorization")) is not None
