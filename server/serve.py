"""``ctxstore serve``: resolve settings and credentials, then run the node on uvicorn (uvloop + httptools).

Safe defaults: loopback bind; with no credentials configured on loopback a random key pair is generated and
printed once; a non-loopback bind without configured credentials is refused. SIGTERM stops accepting
connections, lets in-flight requests finish (``drain_timeout``) and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import io
import ipaddress
import logging
import math
import os
import secrets
import signal
import socket
import sys
from functools import partial
from typing import cast

import uvicorn

from ctxstore.admin_schema import generate_key_pair
from ctxstore.cliargs import ArgumentParser
from ctxstore.units import format_duration, format_size

from . import allocator, shards
from . import settings as settings_mod
from .app import App
from .protocol.http import HttpOptions, NodeHttpProtocol
from .settings import Settings
from .tenants import TenantRegistry

DEFAULT_TENANT = "default"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def build_tenants(settings: Settings, out=sys.stdout) -> TenantRegistry:  # noqa: ANN001
    """Tenants from the environment and the tenants file; generated on loopback when there are none."""
    tenants = TenantRegistry()
    if bool(settings.access_key) != bool(settings.secret_key):
        raise SystemExit("ctxstore: set both CTXSTORE_ACCESS_KEY and CTXSTORE_SECRET_KEY, or neither")
    if settings.access_key:
        tenants.add(DEFAULT_TENANT, settings.access_key, settings.secret_key)
    if settings.tenants_file:
        tenants.load_file(settings.tenants_file)
    if not len(tenants):
        if not is_loopback(settings.host):
            raise SystemExit(
                f"ctxstore: refusing to bind {settings.host} without credentials; set CTXSTORE_ACCESS_KEY and "
                "CTXSTORE_SECRET_KEY (or CTXSTORE_TENANTS_FILE)"
            )
        access, secret = generate_key_pair()
        tenants.add(DEFAULT_TENANT, access, secret)
        print("  no credentials configured; generated for this run (loopback only; the aws CLI, boto3 and the "
              "ctxstore client all read these):", file=out)
        print(f"  export AWS_ACCESS_KEY_ID={access}", file=out)
        print(f"  export AWS_SECRET_ACCESS_KEY={secret}", file=out)
    return tenants


def ensure_admin_token(settings: Settings, out=sys.stdout) -> None:  # noqa: ANN001
    """Generate and print an admin token on a loopback start without one; elsewhere the admin API stays off."""
    if settings.admin_token:
        return
    if is_loopback(settings.host):
        settings.admin_token = secrets.token_urlsafe(24)
        print("  no admin token configured; generated for this run (loopback only; ctxstore admin reads it):",
              file=out)
        print(f"  export CTXSTORE_ADMIN_TOKEN={settings.admin_token}", file=out)
    else:
        print("  CTXSTORE_ADMIN_TOKEN is not set: the admin API and /metrics are disabled", file=out)


def http_options(settings: Settings) -> HttpOptions:
    """The HTTP protocol's limits: a silent new connection waits as long as an idle kept-alive one, and both a
    request's headers and a response the client stopped reading get the body's timeout."""
    return HttpOptions(max_header_size=settings.max_header_size, idle_timeout=settings.keepalive_timeout,
                       header_timeout=settings.body_timeout, write_timeout=settings.body_timeout)


def uvicorn_config(app: App, settings: Settings) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        loop="uvloop",
        # uvicorn makes the protocol of each connection by calling this with keyword arguments
        http=cast("type[asyncio.Protocol]", partial(NodeHttpProtocol, options=http_options(settings),
                                                     counters=app.metrics.requests)),
        lifespan="on",
        access_log=False,
        log_level=settings.log_level,
        timeout_keep_alive=math.ceil(settings.keepalive_timeout),  # uvicorn counts whole seconds
        timeout_graceful_shutdown=math.ceil(settings.drain_timeout),
        server_header=False,
        proxy_headers=False,  # nothing reads the client address; the middleware cost every request a few µs
        ssl_certfile=settings.tls_cert or None,
        ssl_keyfile=settings.tls_key or None,
    )


# The cyclic garbage collector runs a young collection each time the number of live container objects made
# since the last one passes gen0's threshold (700 by default). A bulk get of 2048 blocks holds ~6,000 such
# objects (a lease per block) while it is sent, so every get set collections off, their survivors were promoted
# and full collections followed, each traversing every stored object: with 300,000 blocks stored, a 2048-key get
# took 24 ms instead of 1.9 ms (and a full collection paused the node ~250 ms). What a request allocates is freed
# by reference counting when it ends, so a threshold above what one request holds makes collections rare.
GC_THRESHOLD = 50_000


def tune_gc() -> None:
    """Raise gen0's collection threshold above what one request holds, and move what start-up made (modules,
    the application) out of the collector's way for good."""
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_THRESHOLD, older, oldest)
    gc.freeze()


class DrainingServer(uvicorn.Server):
    """Prints the banner once the node serves (the flash tier open, the port listening), and marks the node as
    draining (readiness 503) the moment SIGTERM/SIGINT arrives."""

    def __init__(self, config: uvicorn.Config, app: App, banner: str = "") -> None:
        super().__init__(config)
        self.app = app
        self.banner = banner

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)  # exits (SystemExit) when the application's start-up failed
        print(self.banner, end="", flush=True)

    def handle_exit(self, sig: int, frame: object) -> None:
        self.app.node.draining = True
        super().handle_exit(sig, frame)  # type: ignore[arg-type]


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="ctxstore serve", description="Run a ctxstore node.")
    settings_mod.add_arguments(parser)
    args = parser.parse_args(argv)
    # What start-up generated (keys, an admin token) is printed with the banner, once the node serves: printed
    # before a start that then fails, it would send the user to whatever else holds the port.
    notices = io.StringIO()
    try:
        settings = settings_mod.resolve(args)
        tenants = build_tenants(settings, notices)
    except ValueError as exc:
        parser.error(str(exc))
    configured_token = bool(settings.admin_token)
    ensure_admin_token(settings, notices)
    if bool(settings.tls_cert) != bool(settings.tls_key):
        parser.error("--tls-cert and --tls-key go together")
    if bool(settings.disk) != bool(settings.disk_size):
        parser.error("--disk and --disk-size go together: the flash tier's directory and its byte budget")
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    scheme = "https" if settings.tls_cert else "http"
    if settings.workers > 1:
        print(notices.getvalue(), end="", flush=True)
        return serve_shards(settings, tenants, scheme, list(sys.argv[1:] if argv is None else argv))
    sock = listen_socket(settings.host, settings.port)
    allocator.tune()
    try:
        app = App(settings, tenants)
    except ValueError as exc:  # e.g. a flash tier too small for its segments
        parser.error(str(exc))
    tune_gc()
    base = f"{scheme}://{settings.host}:{settings.port}"
    disk = f", flash tier {settings.disk} ({format_size(settings.disk_size)})" if settings.disk else ""
    shard = shards.shard_banner()
    if shard is not None:  # one of a --workers node's shards: the parent printed how to reach them
        banner = f"ctxstore: {shard} serving on {base} (budget {format_size(settings.memory)}{disk})\n"
    else:
        token = "<CTXSTORE_ADMIN_TOKEN>" if configured_token else settings.admin_token  # never print a configured one
        banner = (f"ctxstore: serving S3 on {base} (budget {format_size(settings.memory)}{disk}, default TTL "
                  f"{format_duration(settings.default_ttl)})\n"
                  f"  e.g. aws --endpoint-url {base} s3 ls\n{notices.getvalue()}")
        if settings.admin_token:
            banner += f"  status page: {base}/_ctx/v1/admin/status#token={token}\n"
    config = uvicorn_config(app, settings)
    logging.getLogger("uvicorn.error").addFilter(_after_the_reason)
    server = DrainingServer(config, app, banner)

    def on_sigterm(signum: int, frame: object) -> None:
        # uvicorn drains on SIGTERM, then re-raises the signal once its own handler is gone; that second
        # delivery lands here and must not kill the process (the drain is done: exit 0). A SIGTERM that
        # arrives before uvicorn installed its handler just stops the node.
        if not server.should_exit:
            raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_sigterm)
    server.run(sockets=[sock])  # a failed start exits 3 (uvicorn's SystemExit) once its reason was logged
    return 0


def listen_socket(host: str, port: int) -> socket.socket:
    """The node's listening socket, bound before anything else starts: a port in use is one line and exit 1,
    not a banner followed by uvicorn's error once the flash tier was opened."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError as exc:
        sock.close()
        raise SystemExit(f"ctxstore: cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def _after_the_reason(record: logging.LogRecord) -> bool:
    """uvicorn follows the reason a start failed (one line, logged already) with a generic line of its own."""
    return record.getMessage() != "Application startup failed. Exiting."


def serve_shards(settings: Settings, tenants: TenantRegistry, scheme: str, argv: list[str]) -> int:
    """``--workers N``: N shard processes (:mod:`.shards`); the credentials this process resolved or
    generated, and the admin token, reach them through their environment."""
    n = settings.workers
    last = settings.port + n - 1
    if last > 65535:
        raise SystemExit(f"ctxstore: --workers {n} from port {settings.port} needs ports up to {last}")
    for port in range(settings.port, last + 1):  # a port in use is one line now, not a shard restarted forever
        listen_socket(settings.host, port).close()
    env = dict(os.environ)
    if not settings.access_key:  # generated here (or from the tenants file): every shard must accept them
        default = [k.credentials for k in tenants.entries() if k.credentials.tenant == DEFAULT_TENANT]
        if len(default) == 1:
            env["CTXSTORE_ACCESS_KEY"], env["CTXSTORE_SECRET_KEY"] = default[0].access_key, default[0].secret_key
    if settings.admin_token:
        env["CTXSTORE_ADMIN_TOKEN"] = settings.admin_token
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    print(f"ctxstore: {n} shards on {scheme}://{host}:{settings.port}-{last} (budget "
          f"{format_size(settings.memory // n)} each, default TTL {format_duration(settings.default_ttl)})", flush=True)
    print(f"  clients: CTXSTORE_NODES={host}:{settings.port}-{last}; S3 tools: any shard, e.g. "
          f"aws --endpoint-url {scheme}://{host}:{settings.port} s3 ls", flush=True)
    return shards.Supervisor(settings, argv, env).run()


if __name__ == "__main__":
    sys.exit(main())
