"""``ctxstore serve``: resolve settings and credentials, then run the node on uvicorn (uvloop + httptools).

Safe defaults: loopback bind; with no credentials configured on loopback a random key pair is generated and
printed once; a non-loopback bind without configured credentials is refused. SIGTERM stops accepting
connections, lets in-flight requests finish (``drain_timeout``) and exits 0.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import sys

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from . import settings as settings_mod
from .app import App
from .settings import Settings
from .tenants import TenantRegistry, generate_credentials

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
        access, secret = generate_credentials()
        tenants.add(DEFAULT_TENANT, access, secret)
        print("ctxstore: no credentials configured; generated for this run (loopback only):", file=out)
        print(f"  export AWS_ACCESS_KEY_ID={access}", file=out)
        print(f"  export AWS_SECRET_ACCESS_KEY={secret}", file=out)
    return tenants


def protocol_with_header_limit(limit: int) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with a cap on the request line plus headers (no cap of its own)."""

    class LimitedHttpToolsProtocol(HttpToolsProtocol):
        _header_bytes = 0

        def on_message_begin(self) -> None:
            self._header_bytes = 0
            super().on_message_begin()

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

    return LimitedHttpToolsProtocol


def uvicorn_config(app: App, settings: Settings) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        loop="uvloop",
        http=protocol_with_header_limit(settings.max_header_size),
        lifespan="on",
        access_log=False,
        log_level=settings.log_level,
        timeout_keep_alive=int(settings.keepalive_timeout),
        timeout_graceful_shutdown=int(settings.drain_timeout),
        server_header=False,
        ssl_certfile=settings.tls_cert or None,
        ssl_keyfile=settings.tls_key or None,
    )


class DrainingServer(uvicorn.Server):
    """Marks the node as draining (readiness 503) the moment SIGTERM/SIGINT arrives."""

    def __init__(self, config: uvicorn.Config, app: App) -> None:
        super().__init__(config)
        self.node = app

    def handle_exit(self, sig: int, frame: object) -> None:
        self.node.draining = True
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
    if bool(settings.tls_cert) != bool(settings.tls_key):
        parser.error("--tls-cert and --tls-key go together")
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = App(settings, tenants)
    scheme = "https" if settings.tls_cert else "http"
    print(f"ctxstore: serving S3 on {scheme}://{settings.host}:{settings.port} "
          f"(budget {settings.memory} bytes, default TTL {settings.default_ttl:g}s)", flush=True)
    print(f"  e.g. aws --endpoint-url {scheme}://{settings.host}:{settings.port} s3 ls", flush=True)
    DrainingServer(uvicorn_config(app, settings), app).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
