"""The admin API's schema, shared by the node's admin API and ``ctxstore admin``: where its
endpoints live, which settings change at run time, the stable keys of the stats documents, and the shape of
the key pairs it hands out. The bulk API's schema is :mod:`ctxstore.wire`; this is its twin for operators."""

from __future__ import annotations

import secrets

ADMIN_PREFIX = "/_ctx/v1/admin"
HEALTH_LIVE = "/_ctx/health/live"
HEALTH_READY = "/_ctx/health/ready"
EVENTS_PATH = "/_ctx/v1/events"
METRICS_PATH = "/metrics"  # Prometheus' default; only with a Bearer token (a bucket "metrics" stays S3)
RESERVED_METRICS_PATH = "/_ctx/metrics"

# Settings an operator may change at run time (`PUT <prefix>/settings`); a test checks the node's table agrees.
MUTABLE_SETTINGS = ("memory", "default_ttl", "max_ttl")

# Keys of the per-node stats document (`GET <prefix>/stats`) that ctxstore admin relies on; a test checks the
# node serves every one. Levels are current values, counters only grow (until a reset). ``disk_*`` describe the
# flash tier (zero without ``--disk``); ``objects``/``bytes`` are the RAM tier. ``hits``, ``evictions`` and
# ``expirations`` count both tiers; their ``disk_*`` namesakes are the flash tier's share of them.
BUCKET_LEVEL_KEYS = ("objects", "bytes", "charged", "pinned_bytes", "disk_objects", "disk_bytes")
BUCKET_COUNTER_KEYS = ("hits", "misses", "puts", "deletes", "evictions", "expirations", "bytes_in", "bytes_out",
                       "disk_hits", "demotions", "promotions")
LEVEL_KEYS = ("used", "budget", "objects", "bytes", "charged", "pinned_bytes", "reserved", "parts_bytes",
              "uploads", "state_bytes", "sending_bytes", "buffer_bytes", "disk_budget", "disk_used", "disk_objects", "disk_bytes",
              "disk_segments", "disk_queued_bytes", "disk_direct_waiting", "disk_index_bytes", "disk_degraded")
COUNTER_KEYS = BUCKET_COUNTER_KEYS + ("prefetches", "buffer_reuses", "disk_bytes_read", "disk_bytes_written", "disk_evictions",
                                      "disk_expirations", "disk_corrupt", "disk_compactions")
STAT_KEYS = LEVEL_KEYS + COUNTER_KEYS
BUCKET_KEYS = BUCKET_LEVEL_KEYS + BUCKET_COUNTER_KEYS


def generate_key_pair() -> tuple[str, str]:
    """A random access key (``CTX`` + 17 uppercase alphanumerics, AWS-shaped) and a 40-character secret."""
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    access = "CTX" + "".join(secrets.choice(alphabet) for _ in range(17))
    return access, secrets.token_urlsafe(30)[:40]
