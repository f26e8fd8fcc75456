"""Node addresses as users write them, parsed by one set of rules for the client and ``ctxstore admin``:
``host``, ``host:port``, ``[v6]:port`` or ``http(s)://host:port/``, separated by commas or spaces; the port
defaults to 9000 (``ctxstore serve``'s)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_PORT = 9000


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
        endpoint = _parse_one(item)
        if endpoint not in out:
            out.append(endpoint)
    if not out:
        raise ValueError("no nodes given")
    return out


def _parse_one(text: str) -> Endpoint:
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
    if has_port and not (port_text.isascii() and port_text.isdigit() and 0 < int(port_text) < 65536):
        raise ValueError(f"bad node address {text!r}: expected host:port (port 1-65535)")
    return Endpoint(scheme, host, int(port_text) if has_port else DEFAULT_PORT)
