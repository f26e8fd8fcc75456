"""How the client checks a node's certificate (``https://`` nodes): always verified, against the system's CA
certificates or the bundle given as ``tls_ca`` / ``CTXSTORE_TLS_CA``. There is no switch that turns checking off:
a node with a self-signed certificate is reached by giving that certificate as the CA bundle."""

from __future__ import annotations

import os
import ssl

from .errors import ConfigurationError

TLS_CA_ENV = "CTXSTORE_TLS_CA"


def client_context(ca: str | os.PathLike[str] | None) -> ssl.SSLContext:
    """A context that verifies the node's certificate chain and name: against the certificates in the PEM file
    ``ca`` only, or the system's when ``ca`` is None. One context serves every connection of a client (its
    receive threads' too): OpenSSL contexts are shared between threads."""
    try:
        return ssl.create_default_context(cafile=None if ca is None else os.fspath(ca))
    except (OSError, ValueError) as exc:  # no such file; a file without certificates (ssl.SSLError)
        raise ConfigurationError(f"TLS CA bundle {str(ca)!r} cannot be loaded: {exc}") from None


def describe_failure(exc: ssl.SSLError, server_hostname: str) -> str:
    """A handshake failure in words that say what to check."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return (f"TLS verification of {server_hostname}'s certificate failed: {exc.verify_message or exc} "
                f"(the CAs trusted are the bundle in tls_ca / {TLS_CA_ENV}, else the system's)")
    return f"TLS handshake failed: {exc.reason or exc} (is the node serving https?)"
