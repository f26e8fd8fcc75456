"""Client-side counters and latency samples, read as a plain dict."""

from __future__ import annotations

import statistics
from collections import Counter, deque

LATENCY_SAMPLES = 1024
# Counters every snapshot carries, zero until first counted (a dashboard must not KeyError on a fresh client).
COUNTERS = ("hits", "misses", "bytes_in", "bytes_out", "checksum_failures", "errors",
            "skipped_down_node_keys", "oversized_blocks", "slowdown_retries")


class Metrics:
    def __init__(self) -> None:
        self.counters: Counter[str] = Counter()
        self._latency: dict[str, deque[float]] = {}

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] += n

    def observe(self, op: str, seconds: float) -> None:
        self._latency.setdefault(op, deque(maxlen=LATENCY_SAMPLES)).append(seconds)

    def snapshot(self) -> dict[str, object]:
        latency = {}
        for op, samples in self._latency.items():
            ordered = sorted(samples)
            latency[op] = {
                "count": len(ordered),
                "p50_ms": statistics.median(ordered) * 1000,
                "p99_ms": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1000,
            }
        return {**dict.fromkeys(COUNTERS, 0), **self.counters, "latency": latency}
