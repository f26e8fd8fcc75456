"""The synchronous client: the asyncio core (:mod:`ctxstore.core`) on a private event-loop thread.

Every method of :class:`ContextStore` and :class:`Namespace` mirrors its async twin and returns its result;
a test checks the two surfaces stay identical.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from . import wire
from .buffers import Destinations, Target
from .core import AsyncContextStore, AsyncNamespace, QueryResult, RestoreResult, SaveResult, namespace_repr
from .lanes import LoopThread
from .staging import ready


class ContextStore:
    """A pod of ctxstore nodes, for synchronous code (inference workers' usual case).

    ``ContextStore(nodes, access_key=..., secret_key=...)``; ``nodes`` is ``"host:port,host:port"``, a list, or a
    DNS name resolving to every node (``https://host:port`` for nodes serving TLS). Missing arguments come from
    ``CTXSTORE_NODES`` and ``CTXSTORE_ACCESS_KEY`` / ``CTXSTORE_SECRET_KEY`` (else ``AWS_ACCESS_KEY_ID`` /
    ``AWS_SECRET_ACCESS_KEY``). Other keywords as for :class:`AsyncContextStore`
    (``threads``: how many threads receive and send a bulk call, this client's loop thread included;
    ``tls_ca``: the PEM bundle of CAs that https nodes' certificates are checked against, default
    ``CTXSTORE_TLS_CA``, else the system's).

    Its loop thread starts at the first call. In a child process forked after that, the first call starts the
    child's own threads and connections (the parent's are left to the parent).
    """

    def __init__(self, nodes: str | Sequence[str] | None = None, **kwargs: Any) -> None:
        self._async = AsyncContextStore(nodes, **kwargs)
        self._loop = LoopThread("ctxstore-client")

    def namespace(self, bucket: str, *, model: str, block_size: int = 16, scheme: str = "xxh3-128",
                  create: bool = True, **fingerprint: Any) -> Namespace:
        """A namespace bound to ``bucket`` and a model fingerprint; creates the bucket on every node."""
        ns = self._loop.run(self._async.namespace(bucket, model=model, block_size=block_size, scheme=scheme,
                                                  create=create, **fingerprint))
        return Namespace(ns, self._loop)

    def create_bucket(self, bucket: str) -> None:
        self._loop.run(self._async.create_bucket(bucket))

    def lookup_keys(self, bucket: str, keys: Sequence[str], *, pin: float = 0.0,
                    sizes: list[int] | None = None) -> list[int]:
        return self._loop.run(self._async.lookup_keys(bucket, keys, pin=pin, sizes=sizes))

    def locate_keys(self, bucket: str, keys: Sequence[str], *, pin: float = 0.0) -> list[tuple[int, str] | None]:
        return self._loop.run(self._async.locate_keys(bucket, keys, pin=pin))

    def prefetch_keys(self, bucket: str, keys: Sequence[str]) -> int:
        return self._loop.run(self._async.prefetch_keys(bucket, keys))

    def prefetch_located(self, bucket: str, keys: Sequence[str], found: Sequence[tuple[int, str] | None]) -> int:
        return self._loop.run(self._async.prefetch_located(bucket, keys, found))

    def query(self, bucket: str, keys: Sequence[str], *, block_size: int = 0) -> QueryResult:
        return self._loop.run(self._async.query(bucket, keys, block_size=block_size))

    def get_keys(self, bucket: str, keys: Sequence[str], destinations: Destinations, *,
                 pin: float = 0.0) -> list[Target | None]:
        return self._loop.run(self._async.get_keys(bucket, keys, destinations, pin=pin))

    def put_keys(self, bucket: str, keys: Sequence[str], blocks: Sequence[memoryview], *,
                 ttl: float | None = None, if_absent: bool = True,
                 route: wire.PutRoute | None = None) -> SaveResult:
        return self._loop.run(self._async.put_keys(bucket, keys, blocks, ttl=ttl, if_absent=if_absent, route=route))

    def get_keys_staged(self, bucket: str, keys: Sequence[str], out: Any, *, pin: float = 0.0) -> list[int]:
        return self._loop.run(self._async.get_keys_staged(bucket, keys, ready(out), pin=pin))

    def put_keys_staged(self, bucket: str, keys: Sequence[str], blocks: Any, *,
                        ttl: float | None = None, if_absent: bool = True,
                        route: wire.PutRoute | None = None) -> SaveResult:
        return self._loop.run(self._async.put_keys_staged(bucket, keys, ready(blocks), ttl=ttl, if_absent=if_absent,
                                                          route=route))

    def keys_op(self, bucket: str, op: str, keys: Sequence[str], *, ttl: float | None = None,
                seconds: float = 0.0) -> int:
        return self._loop.run(self._async.keys_op(bucket, op, keys, ttl=ttl, seconds=seconds))

    @property
    def threads(self) -> int:
        return self._async.threads

    def metrics_snapshot(self) -> dict[str, object]:
        return self._loop.run(_value(self._async.metrics_snapshot))

    def close(self) -> None:
        if self._loop.started:
            self._loop.run(self._async.aclose())
        self._loop.stop()

    def __enter__(self) -> ContextStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Namespace:
    """Synchronous twin of :class:`~ctxstore.core.AsyncNamespace`."""

    def __init__(self, ns: AsyncNamespace, loop: LoopThread) -> None:
        self._ns = ns
        self._loop = loop
        self.bucket = ns.bucket
        self.fingerprint = ns.fingerprint
        self.scheme = ns.scheme
        self.block_size = ns.block_size

    def __repr__(self) -> str:
        return namespace_repr(type(self).__name__, self.bucket, self.fingerprint, self.scheme)

    def block_hashes(self, tokens: Sequence[int]) -> list[str]:
        return self._ns.block_hashes(tokens)

    def lookup(self, tokens: Sequence[int]) -> int:
        return self._loop.run(self._ns.lookup(tokens))

    def locate(self, tokens: Sequence[int]) -> list[str | None]:
        return self._loop.run(self._ns.locate(tokens))

    def prefetch(self, tokens: Sequence[int]) -> int:
        return self._loop.run(self._ns.prefetch(tokens))

    def query(self, tokens: Sequence[int]) -> QueryResult:
        return self._loop.run(self._ns.query(tokens))

    # Device tensors are marked with this thread's current stream here: the loop thread has another.

    def restore(self, tokens: Sequence[int], out: Any = None, *, pin: float = 0.0) -> RestoreResult:
        return self._loop.run(self._ns.restore(tokens, ready(out), pin=pin))

    def save(self, tokens: Sequence[int], blocks: Sequence[Any], ttl: float | None = None) -> SaveResult:
        return self._loop.run(self._ns.save(tokens, ready(blocks), ttl))

    def touch(self, tokens: Sequence[int], ttl: float | None = None) -> int:
        return self._loop.run(self._ns.touch(tokens, ttl))

    def pin(self, tokens: Sequence[int], seconds: float) -> int:
        return self._loop.run(self._ns.pin(tokens, seconds))

    def unpin(self, tokens: Sequence[int]) -> int:
        return self._loop.run(self._ns.unpin(tokens))

    def delete(self, tokens: Sequence[int]) -> int:
        return self._loop.run(self._ns.delete(tokens))

    def park(self, tokens: Sequence[int], blocks: Sequence[Any], *, ttl: float, pin: float) -> SaveResult:
        return self._loop.run(self._ns.park(tokens, ready(blocks), ttl=ttl, pin=pin))


async def _value(fn: Any) -> Any:
    return fn()
