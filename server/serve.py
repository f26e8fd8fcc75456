"""``ctxstore serve``: resolve settings and credentials, then run the node on uvicorn (uvloop + httptools).

Safe defaults: loopback bind; with no credentials configured on loopback a random key pair is generated and
printed once; a non-loopback bind without configured credentials is refused. SIGTERM stops accepting
connections, lets in-flight requests finish (``drain_timeout``) and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import math
import secrets
import signal
import sys

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from ctxstore.admin_schema import generate_key_pair

from . import allocator
from . import settings as settings_mod
from .app import App
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
        print("ctxstore: no credentials configured; generated for this run (loopback only):", file=out)
        print(f"  export AWS_ACCESS_KEY_ID={access}", file=out)
        print(f"  export AWS_SECRET_ACCESS_KEY={secret}", file=out)
    return tenants


def ensure_admin_token(settings: Settings, out=sys.stdout) -> None:  # noqa: ANN001
    """Generate and print an admin token on a loopback start without one; elsewhere the admin API stays off."""
    if settings.admin_token:
        return
    if is_loopback(settings.host):
        settings.admin_token = secrets.token_urlsafe(24)
        print("ctxstore: no admin token configured; generated for this run (loopback only):", file=out)
        print(f"  export CTXSTORE_ADMIN_TOKEN={settings.admin_token}", file=out)
    else:
        print("ctxstore: CTXSTORE_ADMIN_TOKEN is not set: the admin API and /metrics are disabled", file=out)


def protocol_with_header_limit(
    limit: int, idle_timeout: float | None = None, header_timeout: float | None = None,
    write_timeout: float | None = None,
) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with a cap on the request line plus headers (no cap of its own), and
    deadlines uvicorn lacks: a new connection that sends nothing closes after ``idle_timeout`` (uvicorn only
    times out idle connections after a first response), a request whose line and headers are still
    incomplete ``header_timeout`` after its first byte closes (uvicorn cancels its only timer on any byte, so a
    client dribbling a header would hold the connection forever), and a response the client stopped reading
    (the write buffer full and not draining for ``write_timeout``) is dropped, freeing what it was sending."""

    class LimitedHttpToolsProtocol(HttpToolsProtocol):
        _header_bytes = 0
        _header_timer: asyncio.TimerHandle | None = None
        _write_timer: asyncio.TimerHandle | None = None
        _write_seen = 0

        def pause_writing(self) -> None:
            super().pause_writing()
            if write_timeout is not None and self._write_timer is None:
                self._write_seen = self.transport.get_write_buffer_size()
                self._write_timer = self.loop.call_later(write_timeout, self._check_writes)

        def resume_writing(self) -> None:
            self._stop_watching_writes()
            super().resume_writing()

        def _check_writes(self) -> None:
            """Paused all along: drop the connection unless the client took some bytes meanwhile."""
            self._write_timer = None
            pending = self.transport.get_write_buffer_size()
            if pending and pending >= self._write_seen:
                self.transport.abort()  # uvicorn then unblocks the response's sends; they go nowhere
            elif pending and write_timeout is not None:
                self._write_seen = pending
                self._write_timer = self.loop.call_later(write_timeout, self._check_writes)

        def _stop_watching_writes(self) -> None:
            if self._write_timer is not None:
                self._write_timer.cancel()
                self._write_timer = None

        def connection_made(self, transport) -> None:  # noqa: ANN001
            super().connection_made(transport)
            self._arm(idle_timeout)

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            self._stop_watching_writes()
            super().connection_lost(exc)

        def on_message_begin(self) -> None:
            self._header_bytes = 0
            self._arm(header_timeout)
            super().on_message_begin()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def on_url(self, url: bytes) -> None:
            self._count(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._count(len(name) + len(value) + 4)
            super().on_header(name, value)

        def _count(self, n: int) -> None:
            self._header_bytes += n
            if self._header_bytes > limit:
                # Raised inside a parser callback: uvicorn answers 400 and closes the connection.
                raise ValueError("request headers too large")

        def shutdown(self) -> None:
            # On SIGTERM uvicorn closes idle connections and waits until every one is gone. Closing a TLS
            # connection waits for the peer's close_notify (up to 30 s), which an idle pooled client never
            # sends: the drain would last the whole drain_timeout with nothing in flight. A connection with
            # no request in progress and nothing left to write is dropped at once instead.
            idle = self.cycle is None or self.cycle.response_complete
            if idle and not self.transport.get_write_buffer_size():
                self._disarm()
                self.transport.abort()
            else:
                super().shutdown()

        def _arm(self, timeout: float | None) -> None:
            self._disarm()
            if timeout is not None:
                self._header_timer = self.loop.call_later(timeout, self._headers_timed_out)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_timed_out(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                self.transport.close()

    return LimitedHttpToolsProtocol


def uvicorn_config(app: App, settings: Settings) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        loop="uvloop",
        http=protocol_with_header_limit(settings.max_header_size, settings.keepalive_timeout,
                                        settings.body_timeout, settings.body_timeout),
        lifespan="on",
        access_log=False,
        log_level=settings.log_level,
        timeout_keep_alive=math.ceil(settings.keepalive_timeout),  # uvicorn counts whole seconds
        timeout_graceful_shutdown=math.ceil(settings.drain_timeout),
        server_header=False,
        ssl_certfile=settings.tls_cert or None,
        ssl_keyfile=settings.tls_key or None,
    )


def _size(n: int) -> str:
    for unit, factor in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= factor:
            return f"{n / factor:g} {unit}"
    return f"{n} bytes"


class DrainingServer(uvicorn.Server):
    """Marks the node as draining (readiness 503) the moment SIGTERM/SIGINT arrives."""

    def __init__(self, config: uvicorn.Config, app: App) -> None:
        super().__init__(config)
        self.app = app

    def handle_exit(self, sig: int, frame: object) -> None:
        self.app.node.draining = True
        super().handle_exit(sig, frame)  # type: ignore[arg-type]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ctxstore serve", description="Run a ctxstore node.")
    settings_mod.add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        settings = settings_mod.resolve(args)
        tenants = build_tenants(settings)
    except ValueError as exc:
        parser.error(str(exc))
    ensure_admin_token(settings)
    if bool(settings.tls_cert) != bool(settings.tls_key):
        parser.error("--tls-cert and --tls-key go together")
    if bool(settings.disk) != bool(settings.disk_size):
        parser.error("--disk and --disk-size go together: the flash tier's directory and its byte budget")
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    allocator.tune()
    try:
        app = App(settings, tenants)
    except ValueError as exc:  # e.g. a flash tier too small for its segments
        parser.error(str(exc))
    scheme = "https" if settings.tls_cert else "http"
    base = f"{scheme}://{settings.host}:{settings.port}"
    disk = f", flash tier {settings.disk} ({_size(settings.disk_size)})" if settings.disk else ""
    print(f"ctxstore: serving S3 on {base} (budget {_size(settings.memory)}{disk}, default TTL "
          f"{settings.default_ttl:g} s)", flush=True)
    print(f"  e.g. aws --endpoint-url {base} s3 ls", flush=True)
    if settings.admin_token:
        print(f"  status page: {base}/_ctx/v1/admin/status#token=<CTXSTORE_ADMIN_TOKEN>", flush=True)
    server = DrainingServer(uvicorn_config(app, settings), app)

    def on_sigterm(signum: int, frame: object) -> None:
        # uvicorn drains on SIGTERM, then re-raises the signal once its own handler is gone; that second
        # delivery lands here and must not kill the process (the drain is done: exit 0). A SIGTERM that
        # arrives before uvicorn installed its handler just stops the node.
        if not server.should_exit:
            raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_sigterm)
    server.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
