"""The settings table: one row per setting (name, type, default, env var, help, runtime-mutable).

The table drives the ``ctxstore serve`` flags, the environment variables and docs/configuration.md
(``python -m ctxstore_server.settings`` regenerates it). Precedence: flag, then environment, then default.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ctxstore.units import parse_duration, parse_size

def parse_bool(text: str) -> bool:
    value = str(text).strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {text!r}")


@dataclass(frozen=True)
class SettingType:
    name: str
    parse: Callable[[str], Any]


STR = SettingType("string", str)
INT = SettingType("integer", int)
SIZE = SettingType("size", parse_size)
DURATION = SettingType("duration", parse_duration)
BOOL = SettingType("boolean", parse_bool)


def choice(*options: str) -> SettingType:
    """A string that must be one of ``options`` (compared lowercase)."""

    def parse(text: str) -> str:
        value = str(text).strip().lower()
        if value not in options:
            raise ValueError(f"not one of {', '.join(options)}: {text!r}")
        return value

    return SettingType("string", parse)


@dataclass(frozen=True)
class Setting:
    name: str  # attribute name; the flag is --name-with-dashes
    type: SettingType
    default: Any
    env: str
    help: str
    mutable: bool = False  # may change at run time through the admin API
    flag: bool = True  # secrets come from the environment only, never from argv (visible in ps)


SETTINGS: tuple[Setting, ...] = (
    Setting("host", STR, "127.0.0.1", "CTXSTORE_HOST",
            "Address to bind. A non-loopback address requires configured credentials."),
    Setting("port", INT, 9000, "CTXSTORE_PORT", "TCP port for S3 (and the other APIs under reserved prefixes)."),
    Setting("memory", SIZE, 1 << 30, "CTXSTORE_MEMORY",
            "Byte budget for stored objects, multipart parts and uploads in flight (e.g. 4GiB).", mutable=True),
    Setting("default_ttl", DURATION, 3600.0, "CTXSTORE_DEFAULT_TTL",
            "TTL when neither the request nor the bucket sets one.", mutable=True),
    Setting("max_ttl", DURATION, 7 * 86400.0, "CTXSTORE_MAX_TTL", "Upper bound on every TTL.", mutable=True),
    Setting("max_pin", DURATION, 86400.0, "CTXSTORE_MAX_PIN", "Upper bound on a pin's duration."),
    Setting("region", STR, "us-east-1", "CTXSTORE_REGION", "Region reported by GetBucketLocation."),
    Setting("domain", STR, "", "CTXSTORE_DOMAIN",
            "Enables virtual-hosted-style requests: Host `<bucket>.<domain>` addresses that bucket."),
    Setting("access_key", STR, "", "CTXSTORE_ACCESS_KEY", "Access key of the default tenant.", flag=False),
    Setting("secret_key", STR, "", "CTXSTORE_SECRET_KEY", "Secret key of the default tenant.", flag=False),
    Setting("admin_token", STR, "", "CTXSTORE_ADMIN_TOKEN",
            "Bearer token of the admin API and /metrics. Generated and printed on a loopback start when unset; "
            "without it a non-loopback node serves no admin API.", flag=False),
    Setting("node_id", STR, "", "CTXSTORE_NODE_ID", "This node's name in stats and events (default: host:port)."),
    Setting("tenants_file", STR, "", "CTXSTORE_TENANTS_FILE",
            "JSON file listing tenants: [{\"tenant\": ..., \"access_key\": ..., \"secret_key\": ...}]."),
    Setting("max_object_size", SIZE, 5 << 30, "CTXSTORE_MAX_OBJECT_SIZE", "Largest object or part body accepted."),
    Setting("min_part_size", SIZE, 5 << 20, "CTXSTORE_MIN_PART_SIZE",
            "Smallest multipart part except the last (S3 uses 5 MiB)."),
    Setting("upload_ttl", DURATION, 3600.0, "CTXSTORE_UPLOAD_TTL",
            "An unfinished multipart upload is dropped (and its memory freed) after this."),
    Setting("max_xml_size", SIZE, 1 << 20, "CTXSTORE_MAX_XML_SIZE", "Largest XML request body."),
    Setting("max_header_size", SIZE, 64 << 10, "CTXSTORE_MAX_HEADER_SIZE",
            "Largest request line plus headers; bigger requests get 400 and the connection closes."),
    Setting("bulk_max_keys", INT, 16384, "CTXSTORE_BULK_MAX_KEYS",
            "Most keys one bulk API call may name; more get TooManyKeys and change nothing."),
    Setting("bulk_max_bytes", SIZE, 1 << 30, "CTXSTORE_BULK_MAX_BYTES",
            "Most payload bytes one bulk put may carry; more get TooManyBytes before the payloads are read."),
    Setting("body_timeout", DURATION, 30.0, "CTXSTORE_BODY_TIMEOUT",
            "A request body that stalls this long (at least 3/4 of it) fails with RequestTimeout; headers must also "
            "arrive within it."),
    Setting("keepalive_timeout", DURATION, 30.0, "CTXSTORE_KEEPALIVE_TIMEOUT",
            "Idle connections (kept alive, or new and silent) close after this."),
    Setting("drain_timeout", DURATION, 30.0, "CTXSTORE_DRAIN_TIMEOUT",
            "On SIGTERM, in-flight requests get this long to finish."),
    Setting("tls_cert", STR, "", "CTXSTORE_TLS_CERT", "PEM certificate: serve HTTPS (with --tls-key)."),
    Setting("tls_key", STR, "", "CTXSTORE_TLS_KEY", "PEM private key for --tls-cert."),
    Setting("log_level", STR, "info", "CTXSTORE_LOG_LEVEL", "debug, info, warning or error."),
    Setting("events_buffer", INT, 100000, "CTXSTORE_EVENTS_BUFFER",
            "Store events kept for replay by the event stream (`since=`) and the ZMQ replay socket; a consumer "
            "further behind gets a gap frame and resyncs from a snapshot (docs/events.md)."),
    Setting("events_consumer_queue", INT, 10000, "CTXSTORE_EVENTS_CONSUMER_QUEUE",
            "Events one event-stream consumer may have waiting; one that falls further behind gets a gap frame "
            "and is disconnected."),
    Setting("events_medium", STR, "CTXSTORE", "CTXSTORE_EVENTS_MEDIUM",
            "`medium` of every event (stream frames, ZMQ BlockStored/BlockRemoved). Dynamo reads CPU_PINNED, "
            "DISK and EXTERNAL as its tiers and anything else as GPU."),
    Setting("events_zmq_pub", STR, "", "CTXSTORE_EVENTS_ZMQ_PUB",
            "Bind a ZMQ PUB socket here publishing vLLM-format KV event batches, e.g. tcp://127.0.0.1:5557 "
            "(a leading `>` connects instead). Empty: off."),
    Setting("events_zmq_replay", STR, "", "CTXSTORE_EVENTS_ZMQ_REPLAY",
            "Bind the ZMQ ROUTER replay socket here (vLLM's replay protocol), e.g. tcp://127.0.0.1:5558. "
            "Empty: off."),
    Setting("events_zmq_topic", STR, "kv-events", "CTXSTORE_EVENTS_ZMQ_TOPIC", "Topic frame of every ZMQ message."),
    Setting("events_zmq_format", choice("array", "map"), "array", "CTXSTORE_EVENTS_ZMQ_FORMAT",
            "Each event of a ZMQ batch as a positional array (`array`, vLLM before PR 42892) or a tagged map "
            "(`map`, vLLM after it)."),
    Setting("events_zmq_hashes", choice("key", "int", "bytes"), "key", "CTXSTORE_EVENTS_ZMQ_HASHES",
            "What ZMQ `block_hashes` carry: the key (`key`), its last path segment read as hex, low 64 bits "
            "(`int`, vLLM with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES, Dynamo), or that hex as bytes (`bytes`)."),
    Setting("events_zmq_buckets", STR, "", "CTXSTORE_EVENTS_ZMQ_BUCKETS",
            "Comma-separated buckets the ZMQ publisher reports (empty: all)."),
)

_BY_NAME = {s.name: s for s in SETTINGS}


class Settings:
    """Resolved settings: attribute access by name (``settings.memory``)."""

    def __init__(self, values: Mapping[str, Any]) -> None:
        unknown = set(values) - set(_BY_NAME)
        if unknown:
            raise ValueError(f"unknown settings: {sorted(unknown)}")
        self.__dict__.update({s.name: s.default for s in SETTINGS})
        self.__dict__.update(values)

    def as_dict(self, *, redact: bool = True) -> dict[str, Any]:
        out = {s.name: getattr(self, s.name) for s in SETTINGS}
        if redact:
            for secret in ("secret_key", "admin_token"):
                out[secret] = "***" if out[secret] else ""
        return out

    def __getattr__(self, name: str) -> Any:  # for type checkers: attributes are set dynamically
        raise AttributeError(name)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per setting (defaults left as None so the environment can fill them)."""
    for s in SETTINGS:
        if s.flag:
            parser.add_argument("--" + s.name.replace("_", "-"), dest=s.name, default=None, metavar=s.type.name.upper(),
                                help=f"{s.help} [env {s.env}; default {format_default(s)}]")


def resolve(args: argparse.Namespace | None = None, env: Mapping[str, str] | None = None) -> Settings:
    """Flags over environment over defaults. Raises ValueError naming the setting on a bad value."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    for s in SETTINGS:
        raw = getattr(args, s.name, None) if args is not None else None
        source = "--" + s.name.replace("_", "-")
        if raw is None and s.env in env:
            raw, source = env[s.env], s.env
        if raw is None:
            continue
        try:
            value = s.type.parse(raw)
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}") from None
        if s.type in (SIZE, DURATION, INT) and not value > 0:
            raise ValueError(f"{source}: must be positive, got {raw!r}")
        values[s.name] = value
    return Settings(values)


def format_default(s: Setting) -> str:
    d = s.default
    if s.type is SIZE:
        for unit, factor in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
            if d and d % factor == 0:
                return f"{d // factor}{unit}"
        return str(d)
    if s.type is DURATION:
        for unit, factor in (("d", 86400), ("h", 3600), ("m", 60)):
            if d and d % factor == 0:
                return f"{int(d // factor)}{unit}"
        return f"{d:g}s"
    return repr(d) if d == "" else str(d)


def markdown() -> str:
    """docs/configuration.md, generated from the table."""
    lines = [
        "# Configuration",
        "",
        "Generated from the settings table in `server/settings.py` by "
        "`python -m ctxstore_server.settings > docs/configuration.md`; a test keeps it in sync.",
        "",
        "Every setting is a flag of `ctxstore serve` and an environment variable; the flag wins. Sizes accept "
        "`B`, `KB`/`MB`/`GB` (powers of 10) and `KiB`/`MiB`/`GiB` (powers of 2); durations accept `s`, `m`, `h`, "
        "`d` (a bare number is seconds). Secrets are read from the environment only.",
        "",
        "| setting | flag | env | type | default | description |",
        "|---|---|---|---|---|---|",
    ]
    for s in SETTINGS:
        flag = "`--" + s.name.replace("_", "-") + "`" if s.flag else "(env only)"
        help_text = s.help.replace("|", "\\|")
        lines.append(f"| {s.name} | {flag} | `{s.env}` | {s.type.name} | `{format_default(s)}` | {help_text} |")
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(markdown())
