"""The node's settings, declared once: each is a typed field of :class:`Settings` carrying its row of the table
(type, default, env var, help, runtime-mutable).

The table (:data:`SETTINGS`, derived from the fields) drives the ``ctxstore serve`` flags, the environment
variables and docs/configuration.md (``python -m ctxstore_server.settings`` regenerates it); the engine's
configuration is built from a :class:`Settings`. Precedence: flag, then environment, then default.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from ctxstore.endpoints import parse_endpoints
from ctxstore.units import format_duration, parse_duration, parse_size

__all__ = ["SETTINGS", "Setting", "Settings", "add_arguments", "check_ttls", "markdown", "parse_bool",
           "parse_duration", "parse_size", "resolve"]


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


def _parse_node_list(text: str) -> str:
    """A node list as the client reads it (``host:port,...``, ``http(s)://...`` or a DNS name), kept as written;
    an empty one is allowed. ValueError names the first bad address."""
    value = str(text).strip()
    if value:
        parse_endpoints(value)
    return value


NODE_LIST = SettingType("nodes", _parse_node_list)


def _parse_port(text: str) -> int:
    port = int(text)
    if not 0 < port < 65536:
        raise ValueError(f"not a TCP port (1-65535): {text!r}")
    return port


PORT = SettingType("integer", _parse_port)


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
    """One row of the settings table."""

    name: str  # attribute name; the flag is --name-with-dashes
    type: SettingType
    default: Any
    env: str
    help: str
    mutable: bool = False  # may change at run time through the admin API
    flag: bool = True  # secrets come from the environment only, never from argv (visible in ps)


def setting(default: Any, kind: SettingType, env: str, help: str, *, mutable: bool = False,
            flag: bool = True) -> Any:
    """A field of :class:`Settings` with its row of the table (the name is the field's)."""
    return field(default=default,
                 metadata={"row": {"type": kind, "env": env, "help": help, "mutable": mutable, "flag": flag}})


@dataclass
class Settings:
    """Resolved settings of one node. ``Settings()`` is every default; :func:`resolve` reads flags and
    environment. The admin API changes the mutable ones at run time."""

    host: str = setting("127.0.0.1", STR, "CTXSTORE_HOST",
                "Address to bind. A non-loopback address requires configured credentials.")
    port: int = setting(9000, PORT, "CTXSTORE_PORT",
                "TCP port for S3 (and the other APIs under reserved prefixes).")
    memory: int = setting(1 << 30, SIZE, "CTXSTORE_MEMORY",
                "Byte budget for stored objects, multipart parts and uploads in flight (e.g. 4GiB).", mutable=True)
    disk: str = setting("", STR, "CTXSTORE_DISK",
                "Directory of the flash tier (an NVMe file system). RAM's eviction victims are demoted to it and read "
                "back verified; it survives a restart (docs/flash.md). Empty: RAM only.")
    disk_size: int = setting(0, SIZE, "CTXSTORE_DISK_SIZE",
                "Byte budget of the flash tier's files (e.g. 400GiB); required with --disk and never exceeded.")
    disk_reset: bool = setting(False, BOOL, "CTXSTORE_DISK_RESET",
                "Start with an empty flash tier: delete what --disk holds instead of recovering it.")
    disk_segment_size: int = setting(64 << 20, SIZE, "CTXSTORE_DISK_SEGMENT_SIZE",
                "Size of one flash segment file; an object larger than this (less 16 KiB) is never demoted.")
    disk_min_ttl: float = setting(5.0, DURATION, "CTXSTORE_DISK_MIN_TTL",
                "A RAM victim with less life left than this is dropped rather than demoted.")
    disk_promote: bool = setting(True, BOOL, "CTXSTORE_DISK_PROMOTE",
                "A read served from flash copies the block back into RAM (it stays on flash too).")
    disk_direct_size: int = setting(0, SIZE, "CTXSTORE_DISK_DIRECT_SIZE",
                "Objects at least this large go to flash right after their write instead of waiting in RAM for "
                "eviction (if the flash write queue is full, they wait in RAM for their turn). 0: off.")
    disk_queue: int = setting(0, SIZE, "CTXSTORE_DISK_QUEUE",
                "Bytes of demoted blocks waiting for their flash write (held outside --memory); a write that needs a "
                "victim demoted while it is full waits (--disk-write-wait). 0: --memory/16, between 8 MiB and 256 MiB.")
    disk_write_back: bool = setting(True, BOOL, "CTXSTORE_DISK_WRITE_BACK",
                "Copy every block to flash right after its write, keeping it in RAM (inclusive tiers): eviction then "
                "writes nothing, and a SIGKILL loses only the copies still waiting for the device. false: blocks "
                "reach flash only when evicted (or at a clean shutdown).")
    disk_write_wait: float = setting(1.0, DURATION, "CTXSTORE_DISK_WRITE_WAIT",
                "A write that needs a RAM victim demoted while the flash write queue is full waits this long for the "
                "queue to drain, then is refused (503 SlowDown, a retryable bulk error): victims are never dropped "
                "for want of queue room.")
    disk_readers: int = setting(4, INT, "CTXSTORE_DISK_READERS",
                "Threads reading the flash tier (reads never block the event loop).")
    default_ttl: float = setting(3600.0, DURATION, "CTXSTORE_DEFAULT_TTL",
                "TTL when neither the request nor the bucket sets one.", mutable=True)
    max_ttl: float = setting(7 * 86400.0, DURATION, "CTXSTORE_MAX_TTL",
                "Upper bound on every TTL.", mutable=True)
    max_pin: float = setting(86400.0, DURATION, "CTXSTORE_MAX_PIN",
                "Upper bound on a pin's duration.")
    region: str = setting("us-east-1", STR, "CTXSTORE_REGION",
                "Region reported by GetBucketLocation.")
    domain: str = setting("", STR, "CTXSTORE_DOMAIN",
                "Enables virtual-hosted-style requests: Host `<bucket>.<domain>` addresses that bucket.")
    access_key: str = setting("", STR, "CTXSTORE_ACCESS_KEY",
                "Access key of the default tenant.", flag=False)
    secret_key: str = setting("", STR, "CTXSTORE_SECRET_KEY",
                "Secret key of the default tenant.", flag=False)
    admin_token: str = setting("", STR, "CTXSTORE_ADMIN_TOKEN",
                "Bearer token of the admin API and /metrics. Generated and printed on a loopback start when unset; "
                "without it a non-loopback node serves no admin API.", flag=False)
    node_id: str = setting("", STR, "CTXSTORE_NODE_ID",
                "This node's name in stats and events (default: host:port).")
    peers: str = setting("", NODE_LIST, "CTXSTORE_PEERS",
                "The pod's nodes, for the status page's pod view (`GET /_ctx/v1/admin/pod`): host:port list as "
                "workers write CTXSTORE_NODES, or a DNS name resolving to every node (a headless service). This "
                "node asks their admin APIs with its own admin token. Empty: the page shows this node alone.")
    tenants_file: str = setting("", STR, "CTXSTORE_TENANTS_FILE",
                "JSON file listing tenants: [{\"tenant\": ..., \"access_key\": ..., \"secret_key\": ..., \"quota\": "
                "...}]; `quota` (optional: bytes or a size such as \"64MiB\") caps what the tenant holds on this node, "
                "from start-up on. An unknown field is an error.")
    max_buckets_per_tenant: int = setting(1000, INT, "CTXSTORE_MAX_BUCKETS_PER_TENANT",
                "Buckets one tenant may own; more get TooManyBuckets.")
    max_uploads_per_tenant: int = setting(1000, INT, "CTXSTORE_MAX_UPLOADS_PER_TENANT",
                "Multipart uploads one tenant may have in progress; more are refused until some complete, abort or "
                "expire (--upload-ttl).")
    tenant_reserve_limit: int = setting(0, SIZE, "CTXSTORE_TENANT_RESERVE_LIMIT",
                "Bytes of request bodies one tenant may have in flight at once (declared lengths); more get 503 "
                "SlowDown. 0: a quarter of --memory.")
    min_body_rate: int = setting(64 << 10, SIZE, "CTXSTORE_MIN_BODY_RATE",
                "Bytes per second a request body must arrive at, measured over each --body-timeout; a slower one "
                "fails with RequestTimeout (a trickling upload cannot hold its reservation).")
    max_object_size: int = setting(5 << 30, SIZE, "CTXSTORE_MAX_OBJECT_SIZE",
                "Largest object or part body accepted.")
    min_part_size: int = setting(5 << 20, SIZE, "CTXSTORE_MIN_PART_SIZE",
                "Smallest multipart part except the last (S3 uses 5 MiB).")
    upload_ttl: float = setting(3600.0, DURATION, "CTXSTORE_UPLOAD_TTL",
                "An unfinished multipart upload is dropped (and its memory freed) after this.")
    max_xml_size: int = setting(1 << 20, SIZE, "CTXSTORE_MAX_XML_SIZE",
                "Largest XML request body.")
    max_header_size: int = setting(64 << 10, SIZE, "CTXSTORE_MAX_HEADER_SIZE",
                "Largest request line plus headers; bigger requests get 400 and the connection closes.")
    bulk_max_keys: int = setting(16384, INT, "CTXSTORE_BULK_MAX_KEYS",
                "Most keys one bulk API call may name; more get TooManyKeys and change nothing.")
    bulk_max_bytes: int = setting(1 << 30, SIZE, "CTXSTORE_BULK_MAX_BYTES",
                "Most payload bytes one bulk put may carry; more get TooManyBytes before the payloads are read.")
    body_timeout: float = setting(30.0, DURATION, "CTXSTORE_BODY_TIMEOUT",
                "A request body fails with RequestTimeout when this long passes with no byte of it arriving, or when it "
                "arrives slower than --min-body-rate over a period this long (periods run back to back from the first "
                "wait for it); headers must also arrive within it.")
    keepalive_timeout: float = setting(30.0, DURATION, "CTXSTORE_KEEPALIVE_TIMEOUT",
                "Idle connections (kept alive, or new and silent) close after this.")
    drain_timeout: float = setting(30.0, DURATION, "CTXSTORE_DRAIN_TIMEOUT",
                "On SIGTERM, in-flight requests get this long to finish.")
    workers: int = setting(1, INT, "CTXSTORE_WORKERS",
                "Shard processes: shard i serves on --port + i with 1/N of --memory, each an independent node; "
                "clients list them as `host:PORT-LASTPORT` (docs/operations.md).")
    tls_cert: str = setting("", STR, "CTXSTORE_TLS_CERT",
                "PEM certificate: serve HTTPS (with --tls-key).")
    tls_key: str = setting("", STR, "CTXSTORE_TLS_KEY",
                "PEM private key for --tls-cert.")
    log_level: str = setting("info", STR, "CTXSTORE_LOG_LEVEL",
                "debug, info, warning or error.")
    events_buffer: int = setting(100000, INT, "CTXSTORE_EVENTS_BUFFER",
                "Store events kept for replay by the event stream (`since=`) and the ZMQ replay socket; a consumer "
                "further behind gets a gap frame and resyncs from a snapshot (docs/events.md).")
    events_consumer_queue: int = setting(10000, INT, "CTXSTORE_EVENTS_CONSUMER_QUEUE",
                "Events one event-stream consumer may have waiting; one that falls further behind gets a gap frame "
                "and is disconnected.")
    events_medium: str = setting("CPU", STR, "CTXSTORE_EVENTS_MEDIUM",
                "`medium` of the events of blocks in RAM (stream frames, ZMQ BlockStored/BlockRemoved). Dynamo 1.6.1 "
                "reads CPU (also CPU_PINNED, CPU_TIER1) as its host tier, DISK (also CPU_TIER2, NVME, EXTERNAL, "
                "NETWORK, REMOTE, SHARED) as its disk tier, GPU/DEVICE as the device, and drops events of any "
                "other medium (docs/events.md).")
    events_disk_medium: str = setting("DISK", STR, "CTXSTORE_EVENTS_DISK_MEDIUM",
                "`medium` of the events of blocks the flash tier holds (demoted, or recovered after a restart): "
                "Dynamo's disk tier.")
    events_zmq_pub: str = setting("", STR, "CTXSTORE_EVENTS_ZMQ_PUB",
                "Bind a ZMQ PUB socket here publishing KV events in the --events-zmq-style, e.g. "
                "tcp://127.0.0.1:5557 (a leading `>` connects instead). Empty: off.")
    events_zmq_replay: str = setting("", STR, "CTXSTORE_EVENTS_ZMQ_REPLAY",
                "Bind the ZMQ ROUTER replay socket here (vLLM's replay protocol), e.g. tcp://127.0.0.1:5558. "
                "Empty: off.")
    events_zmq_topic: str = setting("kv-events", STR, "CTXSTORE_EVENTS_ZMQ_TOPIC",
                "Topic frame of every ZMQ message in the `vllm` style (`llm-d` names its own per medium and "
                "bucket, `mooncake` sends an empty one).")
    events_zmq_format: str = setting("array", choice("array", "map"), "CTXSTORE_EVENTS_ZMQ_FORMAT",
                "Each event of a ZMQ batch as a positional array (`array`, vLLM before PR 42892) or a tagged map "
                "(`map`, vLLM after it); `vllm` style only.")
    events_zmq_hashes: str = setting("int", choice("key", "int", "bytes"), "CTXSTORE_EVENTS_ZMQ_HASHES",
                "What ZMQ `block_hashes` carry: the key's last path segment read as hex, low 64 bits (`int`: "
                "Dynamo, llm-d, vLLM with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES), the key (`key`: Dynamo cannot "
                "decode it), or that hex as bytes (`bytes`, vLLM's default); `vllm` style only (`llm-d` sends "
                "`int`, `mooncake` the key).")
    events_zmq_style: str = setting("vllm", choice("vllm", "llm-d", "mooncake"), "CTXSTORE_EVENTS_ZMQ_STYLE",
                "`vllm`: vLLM's KV-event batches on --events-zmq-topic, with each saved block's tokens, parent and "
                "block size (Dynamo's indexer credits them). `llm-d`: as llm-d's storage tier publishes them "
                "(llmd_fs_backend): topic kv@<medium>@<bucket>, positional events, hashes' low 64 bits. "
                "`mooncake`: the envelope of Mooncake's KV-event RFC #1527 (object key, tenant) that Dynamo's "
                "shared KV cache subscriber reads (docs/events.md).")
    events_zmq_buckets: str = setting("", STR, "CTXSTORE_EVENTS_ZMQ_BUCKETS",
                "Comma-separated buckets the ZMQ publisher reports (empty: all).")

    def as_dict(self, *, redact: bool = True) -> dict[str, Any]:
        out = {s.name: getattr(self, s.name) for s in SETTINGS}
        if redact:
            for secret in SECRETS:
                out[secret] = "***" if out[secret] else ""
        return out

    def with_values(self, values: Mapping[str, Any]) -> Settings:
        """A copy with some settings changed; an unknown name is a ValueError."""
        unknown = set(values) - set(_BY_NAME)
        if unknown:
            raise ValueError(f"unknown settings: {sorted(unknown)}")
        return replace(self, **values)


SECRETS = ("secret_key", "admin_token")
SETTINGS: tuple[Setting, ...] = tuple(Setting(name=f.name, default=f.default, **f.metadata["row"])
                                      for f in fields(Settings))
_BY_NAME = {s.name: s for s in SETTINGS}


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
    sources: dict[str, str] = {}
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
        if s.type in (SIZE, DURATION, INT, PORT) and not value > 0 and not (value == 0 and s.default == 0):
            raise ValueError(f"{source}: must be positive, got {raw!r}")  # 0 only where the default (0) means "auto"
        values[s.name] = value
        sources[s.name] = source
    settings = Settings().with_values(values)
    check_ttls(settings.default_ttl, settings.max_ttl, sources.get("default_ttl", "default_ttl"),
               sources.get("max_ttl", "max_ttl"))
    return settings


def check_ttls(default_ttl: float, max_ttl: float, default_name: str = "default_ttl",
               max_name: str = "max_ttl") -> None:
    """The rule tying the two TTL settings, the same at start-up and at run time (where the admin API changes
    them): a default above the maximum would be cut to it on every write, silently."""
    if default_ttl > max_ttl:
        raise ValueError(f"{default_name} {format_duration(default_ttl)} exceeds {max_name} "
                         f"{format_duration(max_ttl)}: the default TTL must be at most the maximum")


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
