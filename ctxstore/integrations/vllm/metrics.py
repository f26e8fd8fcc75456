"""The connector's counters: vLLM's per-interval stats (``KV Transfer metrics: ...`` in its log) and Prometheus.

Counters (summed over the scheduler and every worker): ``lookups``, ``lookup_errors``, ``lookup_ms``,
``prefetched_blocks`` (matched blocks the nodes promote from their flash tier ahead of the load),
``hit_tokens`` (tokens vLLM took from ctxstore instead of computing), ``loaded_blocks``, ``loaded_bytes`` (those
three count what vLLM reused: a load up to its first block that failed, since vLLM recomputes from there),
``load_errors`` (blocks that did not arrive whole and verified), ``load_ms``, ``saved_blocks``, ``saved_bytes``,
``save_existing`` (already in ctxstore), ``resaved_blocks`` (saved again after their stored copy failed to load),
``save_errors``, ``save_dropped`` (staging budget full), ``save_ms``.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

__all__ = ["COUNTERS", "CtxStoreConnectorStats", "CtxStorePromMetrics", "StatsCounter"]

#: name -> Prometheus help text. Times are milliseconds (float sums): vLLM's offline metrics reader rounds
#: counters to integers, which would turn seconds into zeros.
COUNTERS: dict[str, str] = {
    "lookups": "Bulk lookups started (one per request, one call per node).",
    "lookup_errors": "Lookups that failed or timed out (their blocks counted as misses).",
    "lookup_ms": "Milliseconds from a lookup's start to its answer being used.",
    "prefetched_blocks": "Matched blocks the nodes started bringing from their flash tier into RAM.",
    "hit_tokens": "Prompt tokens loaded from ctxstore and reused by vLLM instead of computed.",
    "loaded_blocks": "Blocks restored into the paged KV cache and reused (up to a load's first failed block).",
    "loaded_bytes": "Bytes of the blocks restored into the paged KV cache and reused.",
    "load_errors": "Blocks that did not load whole and verified (vLLM recomputed from the first one on).",
    "load_ms": "Milliseconds spent in loads (the step waits for them).",
    "saved_blocks": "Blocks stored in ctxstore.",
    "saved_bytes": "Bytes stored in ctxstore.",
    "save_existing": "Blocks already in ctxstore when saved.",
    "resaved_blocks": "Blocks saved again, once recomputed, in place of a stored copy that failed to load.",
    "save_errors": "Blocks whose save failed.",
    "save_dropped": "Blocks not saved because the staging budget was full.",
    "save_ms": "Milliseconds saves spent in flight (in the background).",
}


class StatsCounter:
    """Thread-safe counters, taken (and reset) once per step by vLLM."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def add(self, name: str, n: float = 1) -> None:
        with self._lock:
            self._counts[name] += n  # type: ignore[assignment]

    def take(self) -> dict[str, float]:
        with self._lock:
            counts, self._counts = self._counts, Counter()
        return {k: v for k, v in counts.items() if v}


@dataclass
class CtxStoreConnectorStats(KVConnectorStats):
    """One interval's counters; aggregation sums them."""

    def reset(self) -> None:
        self.data = dict[str, Any]()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        merged = dict(self.data)
        for k, v in other.data.items():
            merged[k] = merged.get(k, 0) + v
        return CtxStoreConnectorStats(data=merged)

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {k: (round(v, 3) if k.endswith("_ms") else int(v))
                                       for k, v in sorted(self.data.items())}
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


class CtxStorePromMetrics(KVConnectorPromMetrics):
    """``vllm:ctxstore_<counter>_total`` per engine, from the counters above."""

    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        for name, doc in COUNTERS.items():
            counter = self._counter_cls(name=f"vllm:ctxstore_{name}", documentation=doc, labelnames=labelnames)
            self._counters[name] = {idx: counter.labels(*values) for idx, values in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            per_engine = self._counters.get(name)
            if per_engine is not None and engine_idx in per_engine and value > 0:
                per_engine[engine_idx].inc(value)
