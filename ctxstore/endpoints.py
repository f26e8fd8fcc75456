"""Node addresses as users write them, parsed by one set of rules for the client and ``ctxstore admin``:
``host``, ``host:port``, ``[v6]:port`` or ``http(s)://host:port/``, separated by commas or spaces; the port
defaults to 9000 (``ctxstore serve``'s). A port range, ``host:9000-9003``, is one node per port: the shards of
a ``ctxstore serve --workers 4`` node."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_PORT = 9000
MAX_PORT_RANGE = 1024  # ports one range may name (a typo such as 9000-90000 must not make 81,000 nodes)


@dataclass(frozen=True)
class Endpoint:
    scheme: str  # "http" or "https"
    host: str  # without brackets
    port: int

    @property
    def netloc(self) -> str:
        """``host:port``, with an IPv6 host in brackets (what a Host header carries)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.netloc}"


def parse_endpoints(nodes: str | Sequence[str]) -> list[Endpoint]:
    """Every address in ``nodes``, in order, without repeats. ValueError names the first bad one."""
    items = re.split(r"[\s,]+", nodes) if isinstance(nodes, str) else [str(n) for n in nodes]
    out: list[Endpoint] = []
    for item in (i.strip() for i in items):
        if not item:
            continue
        for endpoint in _parse_one(item):
            if endpoint not in out:
                out.append(endpoint)
    if not out:
        raise ValueError("no nodes given")
    return out


def _parse_one(text: str) -> list[Endpoint]:
    scheme, sep, rest = text.partition("://")
    if not sep:
        scheme, rest = "http", text
    if scheme not in ("http", "https"):
        raise ValueError(f"unsupported scheme {scheme!r} in {text!r}")
    rest = rest.rstrip("/")
    if rest.startswith("["):
        host, bracket, tail = rest[1:].partition("]")
        if not bracket or (tail and not tail.startswith(":")):
            raise ValueError(f"bad node address {text!r}")
        port_text = tail[1:] if tail else ""
        has_port = bool(tail)
    else:
        host, colon, port_text = rest.rpartition(":") if ":" in rest else (rest, "", "")
        has_port = bool(colon)
    if not host or "/" in host:
        raise ValueError(f"bad node address {text!r}: expected host:port")
    if not has_port:
        return [Endpoint(scheme, host, DEFAULT_PORT)]
    first_text, dash, last_text = port_text.partition("-")
    first, last = _port(first_text, text), _port(last_text, text) if dash else None
    if last is None:
        return [Endpoint(scheme, host, first)]
    if not first <= last < first + MAX_PORT_RANGE:
        raise ValueError(f"bad node address {text!r}: a port range is FIRST-LAST with at most {MAX_PORT_RANGE} ports")
    return [Endpoint(scheme, host, port) for port in range(first, last + 1)]


def _port(port_text: str, text: str) -> int:
    if not (port_text.isascii() and port_text.isdigit() and 0 < int(port_text) < 65536):
        raise ValueError(f"bad node address {text!r}: expected host:port or host:first-last (ports 1-65535)")
    return int(port_text)
