"""The pod: its nodes, which node owns a block (rendezvous hashing), and which nodes are up.

Membership comes from a list of ``host:port`` or from a DNS name that resolves to several addresses (a
Kubernetes headless service). A block's owner is the node with the highest XXH3-64 weight of the key
seeded by the node's name: adding or removing a node moves only that node's share of the keys.

A node that refuses, times out or answers 5xx is marked down: calls skip it at once (its blocks are misses)
and a background probe asks its readiness endpoint, with jittered backoff, until it answers again.
"""

from __future__ import annotations

import asyncio
import logging
import random
import socket
import ssl
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import xxhash

from .endpoints import parse_endpoints
from .errors import ConfigurationError
from .transport import BytesReader, Pool, request_head

log = logging.getLogger("ctxstore.client")

READY_PATH = "/_ctx/health/ready"
_OWNER_CACHE_LIMIT = 1 << 17


def parse_nodes(nodes: str | Sequence[str]) -> list[tuple[str, int]]:
    """``"a:9000,b:9000"`` or ``["http://a:9000", "b"]`` → [(host, port)]; the port defaults to 9000."""
    return parse_pod(nodes)[1]


def parse_pod(nodes: str | Sequence[str]) -> tuple[str, list[tuple[str, int]]]:
    """The pod's scheme (``http``, the default, or ``https``) and its [(host, port)]. Every node has the same
    scheme: a pod of some TLS and some plain nodes is a typo that would send blocks in clear."""
    try:
        endpoints = parse_endpoints(nodes)
    except ValueError as exc:
        raise ConfigurationError(f"{exc} (pass nodes=... or set CTXSTORE_NODES)") from None
    schemes = sorted({e.scheme for e in endpoints})
    if len(schemes) > 1:
        raise ConfigurationError(f"nodes mix {' and '.join(schemes)}: write every node as https://host:port, or "
                                 "none")
    return schemes[0], [(e.host, e.port) for e in endpoints]


def resolve(entries: Iterable[tuple[str, int]]) -> dict[tuple[str, int], str]:
    """:func:`expand_dns` of ``entries``, with the name each address was found under: a TLS node's certificate
    names the DNS name (a headless service's), not the address it resolved to."""
    names: dict[tuple[str, int], str] = {}
    for host, port in entries:
        for address in expand_dns([(host, port)]):
            names.setdefault(address, host)
    return dict(sorted(names.items()))


def expand_dns(entries: Iterable[tuple[str, int]]) -> list[tuple[str, int]]:
    """A name that resolves to several addresses (a headless service) becomes one node per address."""
    out: list[tuple[str, int]] = []
    for host, port in entries:
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError:
            out.append((host, port))  # unresolvable now: keep it; it will be marked down and probed
            continue
        addresses = sorted({str(info[4][0]) for info in infos})
        if len(addresses) > 1 and not is_ip(host):
            out.extend((addr, port) for addr in addresses)
        else:
            out.append((host, port))
    return sorted(set(out))


def is_ip(host: str) -> bool:
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            socket.inet_pton(family, host)
            return True
        except OSError:
            pass
    return False


@dataclass(eq=False)
class Node:
    """One node of the pod and its health."""

    host: str
    port: int
    pool: Pool
    #: The name the node's TLS certificate is checked for: ``host``, or the DNS name it was resolved from.
    tls_name: str = ""
    up: bool = True
    failures: int = 0
    last_error: str = ""
    # The node's last bulk answer announced puts with a checksum trailer (wire.FEATURE_PUT_TRAILER).
    put_trailer: bool = False
    # ... and asked for each saved block's tokens, block size and parent (wire.FEATURE_PUT_ROUTE).
    put_route: bool = False
    # Whether a bulk answer of this node said the above yet (before that, both read False).
    features_known: bool = False
    probe: asyncio.Task[None] | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def host_header(self) -> str:
        return self.name if ":" not in self.host else f"[{self.host}]:{self.port}"

    @property
    def seed(self) -> int:
        return xxhash.xxh3_64_intdigest(self.name.encode())


class Pod:
    """The nodes of a pod, rendezvous placement and health tracking."""

    def __init__(self, addresses: Sequence[tuple[str, int]], *, pool_size: int, connect_timeout: float,
                 read_timeout: float, probe_interval: float, max_probe_interval: float = 5.0,
                 tls: ssl.SSLContext | None = None, names: Mapping[tuple[str, int], str] | None = None) -> None:
        if not addresses:
            raise ConfigurationError("a pod needs at least one node")
        self._pool_args = dict(limit=pool_size, connect_timeout=connect_timeout, read_timeout=read_timeout,
                               tls=tls)
        self.nodes: list[Node] = []
        self.probe_interval = probe_interval
        self.max_probe_interval = max_probe_interval
        self.update(addresses, names)

    def update(self, addresses: Sequence[tuple[str, int]], names: Mapping[tuple[str, int], str] | None = None
               ) -> None:
        """New membership (e.g. a headless service re-resolved): known nodes keep their pools and health,
        new ones start up, departed ones are closed. Only the keys of nodes that came or went move. ``names``:
        the name each address's TLS certificate is checked for (default: the address)."""
        known = {(n.host, n.port): n for n in self.nodes}
        wanted = sorted(set(addresses))
        for gone in set(known) - set(wanted):
            node = known[gone]
            if node.probe is not None:
                node.probe.cancel()
            node.pool.close()
        self.nodes = [known.get((host, port)) or self._new_node(host, port, (names or {}).get((host, port), host))
                      for host, port in wanted]
        self._seeds = [n.seed for n in self.nodes]
        self._owner_cache: dict[str, int] = {}

    def _new_node(self, host: str, port: int, tls_name: str) -> Node:
        pool = Pool(host, port, server_hostname=tls_name, **self._pool_args)  # type: ignore[arg-type]
        return Node(host, port, pool, tls_name=tls_name)

    def owner(self, key: str) -> Node:
        """The node that holds ``key`` (whether it is up or not)."""
        index = self._owner_cache.get(key)
        if index is None:
            data = key.encode()
            weights = [xxhash.xxh3_64_intdigest(data, seed=s) for s in self._seeds]
            index = weights.index(max(weights))
            if len(self._owner_cache) >= _OWNER_CACHE_LIMIT:
                self._owner_cache.clear()
            self._owner_cache[key] = index
        return self.nodes[index]

    def group(self, keys: Sequence[str]) -> dict[Node, list[int]]:
        """Key indices per owning node, in key order."""
        if len(self.nodes) == 1:  # rendezvous hashing over one node: it owns every key
            return {self.nodes[0]: list(range(len(keys)))} if keys else {}
        groups: dict[Node, list[int]] = {}
        for i, key in enumerate(keys):
            groups.setdefault(self.owner(key), []).append(i)
        return groups

    def mark_down(self, node: Node, reason: str) -> None:
        node.failures += 1
        node.last_error = reason
        if node.up:
            node.up = False
            node.features_known = False  # what comes back may be another version of the node
            node.pool.close()
            log.warning("ctxstore node %s marked down: %s", node.name, reason)
        if node.probe is None or node.probe.done():
            node.probe = asyncio.get_running_loop().create_task(self._probe(node))

    async def _probe(self, node: Node) -> None:
        """Ask the node's readiness endpoint with jittered exponential backoff until it answers 200."""
        delay = self.probe_interval
        while True:
            await asyncio.sleep(delay * random.uniform(0.5, 1.0))
            try:
                head = request_head("GET", node.host_header, READY_PATH, [], 0)
                response = await node.pool.request(head, (), lambda status, n: BytesReader(n))
                if response.status == 200:
                    node.up = True
                    log.warning("ctxstore node %s is back", node.name)
                    return
            except Exception as exc:  # any failure: still down
                node.last_error = str(exc)
            delay = min(delay * 2, self.max_probe_interval)

    def health(self) -> dict[str, dict[str, object]]:
        return {n.name: {"up": n.up, "failures": n.failures, "last_error": n.last_error} for n in self.nodes}

    def close(self) -> None:
        for node in self.nodes:
            if node.probe is not None:
                node.probe.cancel()
            node.pool.close()
