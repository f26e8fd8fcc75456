"""The asyncio core of the client: bulk calls fanned out over the pod, one per node, reassembled in order.

Policy (SPEC §4.5): lookups and restores never raise into the inference path unless ``strict=True`` — a node
that is down, slow or failing contributes misses, and the call returns within its timeouts. Configuration
mistakes always raise. :class:`~ctxstore.sync.ContextStore` runs this same core on a private event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import random
import ssl
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import xxhash

from . import s3, wire
from .buckets import check_bucket
from .buffers import Destinations, Target, byte_view
from .credentials import resolve_credentials
from .errors import (
    ConfigurationError,
    ContextStoreError,
    IntegrityError,
    NoSuchBucket,
    NodeUnavailable,
    ProtocolError,
    ServerError,
    SlowDown,
    server_error,
)
from .hashing import Fingerprint
from . import staging as staging_module
from .lanes import Lanes, check_threads, default_threads
from .metrics import Metrics
from .pod import Node, Pod, is_ip, parse_pod, resolve
from .frames import GetReader, TrailedPayloads
from .sigv4 import Signer
from .tls import TLS_CA_ENV, client_context
from .transport import BodyReader, Buffer, BytesReader, Response


T = TypeVar("T")
log = logging.getLogger("ctxstore.client")

#: A node's share of a bulk call is cut into parts for the client's threads, but not below this many bytes
#: (or keys, when the sizes are not known before the answer): a small restore stays one request on one thread.
MIN_PART_BYTES = 1 << 20
MIN_PART_KEYS = 16
#: A device's staging pool is this many host chunks: all but one being received at a time, one being copied.
STAGING_CHUNKS = 4
#: A node's refusals (4xx: wrong credentials, a bucket that is not there) are logged at most this often per node
#: and error code: a worker with a wrong secret fails every call, and one line a minute says why.
REFUSAL_LOG_INTERVAL = 60.0
#: A put refused with SlowDown is sent again this many times, after about 0.1, 0.2, 0.4 s (jittered): a node
#: whose flash tier is behind has made room by then (it held the write up to --disk-write-wait first).
SLOWDOWN_RETRIES = 3
SLOWDOWN_PAUSE = 0.1


@dataclass(frozen=True)
class Timeouts:
    """Per-phase deadlines in seconds. Short by default: a slow node must not stall a prefill."""

    connect: float = 0.5
    read: float = 2.0  # no byte for this long → timeout
    total: float = 10.0  # a whole bulk call

    def __post_init__(self) -> None:
        for name in ("connect", "read", "total"):
            _require_positive(f"Timeouts.{name}", getattr(self, name))


@dataclass(frozen=True)
class Limits:
    """Client-side split of large calls (each node also enforces its own limits)."""

    keys_per_call: int = 8192
    bytes_per_call: int = 64 << 20  # well under any sane node budget: a call must fit whole
    #: A restore expecting more than this from one node goes as several calls of about this size, sent at
    #: once on their own connections: the node reads one from its flash tier while it sends another (a
    #: 128 MiB restore from flash ran 1.2-1.6x faster as 4 calls, from RAM no slower: docs/benchmarks.md).
    bytes_per_get: int = 32 << 20

    def __post_init__(self) -> None:
        for name in ("keys_per_call", "bytes_per_call", "bytes_per_get"):
            _require_positive(f"Limits.{name}", getattr(self, name), integer=True)


def _require_positive(label: str, value: object, *, integer: bool = False, zero: bool = False) -> None:
    """ConfigurationError at construction for a value that would hang, spin or split into nothing later
    (``zero``: 0 is allowed too)."""
    kinds = (int,) if integer else (int, float)
    number = float(value) if isinstance(value, kinds) and not isinstance(value, bool) else float("nan")
    if not ((number >= 0 if zero else number > 0) and number < float("inf")):
        kind = "a positive integer" if integer else "a positive number of seconds"
        raise ConfigurationError(f"{label} must be {kind}{' or 0' if zero else ''}, not {value!r}")


@dataclass
class RestoreResult:
    """What :meth:`AsyncNamespace.restore` fetched: the leading cached blocks, in order."""

    n_blocks: int
    n_tokens: int
    blocks: list[Target] = field(default_factory=list, repr=False)  # a Scatter where ``out`` scattered a block

    @property
    def nbytes(self) -> int:
        return sum(len(b) for b in self.blocks)

    def __repr__(self) -> str:  # not two thousand memoryviews
        return f"RestoreResult(n_blocks={self.n_blocks}, n_tokens={self.n_tokens}, nbytes={self.nbytes})"


@dataclass
class SaveResult:
    """What :meth:`AsyncNamespace.save` did with each block: stored it, found it already there, or failed
    (rejected, or its node was down)."""

    stored: int = 0
    existed: int = 0
    failed: int = 0


@dataclass
class QueryResult:
    """What the pod holds of a prompt's blocks (:meth:`AsyncContextStore.query`), per tier: a router's question,
    which no node counts as a read."""

    tiers: list[str | None] = field(default_factory=list)  # per block asked: "ram", "disk" (flash) or None
    n_blocks: int = 0  # leading blocks the pod holds, in either tier
    ram_blocks: int = 0  # leading blocks the pod holds in RAM
    disk_blocks: int = 0  # blocks of the n_blocks on a node's flash tier (a restore reads them from flash)
    block_size: int = 0  # tokens per block; 0 for a query by keys that did not say

    @property
    def n_tokens(self) -> int:
        return self.n_blocks * self.block_size

    @property
    def ram_tokens(self) -> int:
        return self.ram_blocks * self.block_size


def flash_resident(keys: Sequence[str], found: Sequence[tuple[int, str] | None]) -> list[str]:
    """Of ``keys``, those that :meth:`AsyncContextStore.locate_keys` (``found``) places on a node's flash tier:
    what the prefetch of a matched prefix asks for (none on RAM-only nodes, where a caller then starts nothing)."""
    return [k for k, f in zip(keys, found, strict=True) if f is not None and f[1] == "disk"]


class AsyncContextStore:
    """A pod of ctxstore nodes, for asyncio code. See :class:`ctxstore.ContextStore` for the sync twin."""

    def __init__(
        self,
        nodes: str | Sequence[str] | None = None,
        *,
        access_key: str | None = None,
        secret_key: str | None = None,
        region: str = "us-east-1",
        timeouts: Timeouts | None = None,
        limits: Limits | None = None,
        strict: bool = False,
        pool_size: int = 8,
        probe_interval: float = 0.5,
        dns_refresh: float = 30.0,
        threads: int | None = None,
        staging: str = "auto",
        staging_bytes: int = 1 << 30,
        tls_ca: str | os.PathLike[str] | None = None,
    ) -> None:
        nodes = nodes if nodes is not None else os.environ.get("CTXSTORE_NODES")
        if not nodes:
            raise ConfigurationError("no nodes: pass nodes=... or set CTXSTORE_NODES")
        access_key, secret_key = resolve_credentials(access_key, secret_key)
        _require_positive("pool_size", pool_size, integer=True)
        _require_positive("probe_interval", probe_interval)
        _require_positive("dns_refresh", dns_refresh, zero=True)  # 0: re-resolve names at every call
        self.timeouts = timeouts or Timeouts()
        self.limits = limits or Limits()
        self.strict = strict
        self.signer = Signer(access_key, secret_key, region)
        self.metrics = Metrics()
        scheme, self._spec = parse_pod(nodes)
        self.tls = _tls_of(scheme, tls_ca if tls_ca is not None else os.environ.get(TLS_CA_ENV) or None)
        self._names = resolve(self._spec)  # every node's address, and the name its certificate is checked for
        self._addresses = list(self._names)
        # Names (not IP literals) are re-resolved in the background every dns_refresh seconds, so a
        # headless service's pods that come, go or change address are followed.
        self.dns_refresh = dns_refresh
        self._resolved_at = time.monotonic()
        self._resolving: asyncio.Task[None] | None = None
        self._pod_args = dict(pool_size=pool_size, connect_timeout=self.timeouts.connect,
                              read_timeout=self.timeouts.read, probe_interval=probe_interval, tls=self.tls)
        self._pod: Pod | None = None
        self._pid = os.getpid()
        self._buckets: set[str] = set()  # created by this store: re-created on a node that restarted empty
        self._refusals_logged: dict[tuple[str, str], float] = {}  # (node, error code) -> when last logged
        # Bulk gets and puts are spread over this many threads: the calling loop's and threads - 1 more.
        self.threads = default_threads() if threads is None else check_threads(threads)
        self._lanes = Lanes(self.threads, pool_size=pool_size, connect_timeout=self.timeouts.connect,
                            read_timeout=self.timeouts.read, tls=self.tls)
        # Tensors on a device (and CPU torch tensors in "host" mode) move through a pool of this many bytes of
        # host chunks per device (staging.py), allocated at first use. 1 GiB: on an H200 a 4 GiB restore into
        # HBM ran at 0.62 of the host-only restore with 256 MiB, 0.82 with 1 GiB, 0.84 with 2 GiB
        # (docs/benchmarks.md, "GPU"): chunks must be large enough that every node and thread gets a big part.
        if staging not in staging_module.MODES:
            raise ConfigurationError(f"staging must be one of {staging_module.MODES}, not {staging!r}")
        _require_positive("staging_bytes", staging_bytes, integer=True)
        self.staging = staging
        self.staging_bytes = staging_bytes
        self._stagers: dict[tuple[str, int | None], staging_module.Stager] = {}

    @property
    def pod(self) -> Pod:
        # Created lazily: its pools and probes belong to the event loop that first uses them.
        self._own_process()
        if self._pod is None:
            self._pod = Pod(self._addresses, names=self._names, **self._pod_args)  # type: ignore[arg-type]
        return self._pod

    def _own_process(self) -> None:
        """In a forked child, forget the parent's pod, staging pools and DNS task (its connections, copy
        threads and streams are the parent's, left untouched): the child makes its own at first use."""
        if self._pid != os.getpid():
            self._pid = os.getpid()
            self._pod, self._resolving, self._stagers = None, None, {}

    def _mark_down(self, node: Node, reason: str) -> None:
        self.pod.mark_down(node, reason)
        self._lanes.forget(node.host, node.port)

    async def namespace(self, bucket: str, *, model: str, block_size: int = 16, scheme: str = "xxh3-128",
                        create: bool = True, **fingerprint: Any) -> AsyncNamespace:
        """A namespace bound to ``bucket`` and a model fingerprint; creates the bucket on every node."""
        known = {f.name for f in dataclasses.fields(Fingerprint)} - {"extra"}
        fields = {k: v for k, v in fingerprint.items() if k in known}
        extra = {k: str(v) for k, v in fingerprint.items() if k not in known}
        fp = Fingerprint(model=model, block_size=block_size, extra=extra, **fields)
        ns = AsyncNamespace(self, check_bucket(bucket), fp, scheme)
        if create:
            await self.create_bucket(bucket)
        return ns

    async def create_bucket(self, bucket: str) -> None:
        """S3 CreateBucket on every node that is up (re-creating one's own bucket is not an error)."""
        self._buckets.add(check_bucket(bucket))
        await _gather_all([self._create_on(n, bucket) for n in self.pod.nodes if n.up])

    async def _create_on(self, node: Node, bucket: str) -> None:
        try:
            response = await s3.request(self.signer, node, "PUT", bucket)  # CreateBucket: no body
        except NodeUnavailable as exc:
            self._mark_down(node, str(exc))
            if self.strict:
                raise
            return
        if response.status != 200:
            error = s3.error_of(node.name, response)
            self._note_refusal(node, error)
            raise error

    # ------------------------------------------------------------------ one call to one node

    async def _call(self, node: Node, bucket: str, op: str, head_bytes: bytes,
                    payloads: Sequence[Buffer] | TrailedPayloads, reader: BodyReader | None = None,
                    lane: int = 0) -> Response:
        """One bulk request, sent and received on ``lane`` (0: this loop); a 200 answer's body goes to ``reader``
        (default: a small buffer), others to a buffer the error is read from. Raises the client error of any
        failure."""
        if not node.up:
            raise NodeUnavailable(node.name, "marked down")
        path = wire.path(bucket, op)
        body: Sequence[Buffer] | TrailedPayloads
        if isinstance(payloads, TrailedPayloads):  # made as it is sent: the frame's head goes with the request's
            length, body, prefix = len(head_bytes) + payloads.length, payloads, head_bytes
        else:
            length, body, prefix = len(head_bytes) + sum(len(p) for p in payloads), (head_bytes, *payloads), b""
        request = s3.signed_head(self.signer, "POST", node.host_header, path, length,
                                 content_type=wire.CONTENT_TYPE) + prefix

        def factory(status: int, n: int) -> BodyReader:
            return reader if status == 200 and reader is not None else BytesReader(n)

        started = time.perf_counter()
        try:
            async with asyncio.timeout(self.timeouts.total):
                if lane:
                    response = await self._lanes.request(lane, node.host, node.port, request, body, factory,
                                                         server_hostname=node.tls_name)
                else:
                    response = await node.pool.request(request, body, factory)
        except TimeoutError:
            exc: ContextStoreError = NodeUnavailable(node.name, f"call exceeded {self.timeouts.total:g} s")
            self._mark_down(node, str(exc))
            raise exc from None
        except NodeUnavailable as exc:
            self._mark_down(node, str(exc))
            raise
        except wire.WireError as exc:
            raise ProtocolError(node.name, 200, exc.code, str(exc)) from None
        self.metrics.observe(op, time.perf_counter() - started)
        if response.status == 200 or wire.FEATURES_HEADER in response.headers:  # a bulk answer, even a refusal
            node.put_trailer = wire.has_feature(response.headers, wire.FEATURE_PUT_TRAILER)
            node.put_route = wire.has_feature(response.headers, wire.FEATURE_PUT_ROUTE)
            node.features_known = True
        if response.status != 200:
            error = _error_of(node, response)
            refused = isinstance(error, ProtocolError) and error.code == "MalformedFrame"
            if refused and isinstance(body, TrailedPayloads):
                node.put_trailer = False  # e.g. a node rolled back to a version without trailers
                raise _TrailerRefused()
            if response.status >= 500 and not isinstance(error, SlowDown):
                self._mark_down(node, str(error))
            raise error
        return response

    def _note_refusal(self, node: Node, error: ContextStoreError) -> None:
        """A node's 4xx answer: its first line becomes the node's ``last_error`` (metrics_snapshot) and is logged
        at WARNING, at most once per :data:`REFUSAL_LOG_INTERVAL` per node and code. Unlike a 5xx it does not
        mark the node down (the node is fine; the call is wrong), so without this it would fail in silence."""
        if not (isinstance(error, ServerError) and 400 <= error.status < 500):
            return
        message = error.message.splitlines()[0] if error.message else ""
        node.last_error = f"{node.name}: {error.status} {error.code}: {message}"
        key, now = (node.name, error.code), time.monotonic()
        last = self._refusals_logged.get(key)
        if last is None or now - last >= REFUSAL_LOG_INTERVAL:
            self._refusals_logged[key] = now
            log.warning("ctxstore node %s refused a call: %s %s: %s (logged at most once a minute per node and "
                        "error code)", node.name, error.status, error.code, message)

    def _degrade(self, exc: ContextStoreError) -> None:
        """A failure on a degradable path: counted, raised only in strict mode."""
        self.metrics.count("errors")
        if self.strict or not isinstance(exc, ContextStoreError):
            raise exc

    # ------------------------------------------------------------------ bulk operations over the pod

    def _chunks(self, indices: list[int]) -> list[list[int]]:
        n = self.limits.keys_per_call
        return [indices[i:i + n] for i in range(0, len(indices), n)]

    async def _exchange(self, node: Node, bucket: str, op: str, head: bytes, decode: Callable[[Response], T], *,
                        payloads: Sequence[Buffer] | TrailedPayloads = (), reader: BodyReader | None = None,
                        recreate_bucket: bool = False, lane: int = 0) -> T | None:
        """One bulk call to one node and its decoded answer. A failure is counted and answers None (strict mode
        raises it instead). ``recreate_bucket``: a node that restarted empty since this store created the bucket
        answers NoSuchBucket; the bucket is created there again, once, and the call repeated."""
        try:
            try:
                response = await self._call_backing_off(node, bucket, op, head, payloads, reader, lane)
            except NoSuchBucket:
                if not (recreate_bucket and bucket in self._buckets):
                    raise
                await self._create_on(node, bucket)
                response = await self._call(node, bucket, op, head, payloads, reader, lane)
            return decode(response)
        except (ContextStoreError, wire.WireError) as exc:
            error = _as_client_error(node, exc)
            self._note_refusal(node, error)
            self._degrade(error)
            return None

    async def _call_backing_off(self, node: Node, bucket: str, op: str, head: bytes,
                                payloads: Sequence[Buffer] | TrailedPayloads, reader: BodyReader | None,
                                lane: int) -> Response:
        """A put that a node refuses with SlowDown (RAM full and its flash tier writing as fast as it can, or its
        budget pinned) is sent again after a growing pause, :data:`SLOWDOWN_RETRIES` times: a refused put
        stored nothing, and a moment later it usually fits. Past that its blocks are reported as failed."""
        attempt = 0
        while True:
            try:
                return await self._call(node, bucket, op, head, payloads, reader, lane)
            except SlowDown:
                if op != "put" or attempt == SLOWDOWN_RETRIES:
                    raise
                self.metrics.count("slowdown_retries")
                await asyncio.sleep(SLOWDOWN_PAUSE * 2 ** attempt * (0.5 + random.random()))
                attempt += 1

    async def _learn_features(self, bucket: str) -> None:
        """An empty lookup to each up node that has not answered a bulk call yet, so that the first save to it
        already carries what it asks for (a router's route: a save without one is not credited to routers).
        Any bulk answer tells, a refusal too; its failures are the save's to meet: ignored here."""
        unknown = [n for n in self.pod.nodes if n.up and not n.features_known]
        if not unknown:
            return
        head = wire.encode_keys_request("lookup", wire.KeysRequest([]))

        async def ask(node: Node) -> None:
            with contextlib.suppress(ContextStoreError):
                await self._call(node, bucket, "lookup", head, (), None, 0)

        await asyncio.gather(*(ask(n) for n in unknown))

    async def lookup_keys(self, bucket: str, keys: Sequence[str], *, pin: float = 0.0,
                          sizes: list[int] | None = None) -> list[int]:
        """Size of each key's block (``wire.ABSENT`` where missing or its node failed); ``pin``: keep every
        present block from eviction for that many seconds (a restore is about to follow). ``sizes``: the list to
        fill and return (``len(keys)`` long, ``ABSENT`` throughout); each node's answer lands in it as it comes,
        so a caller that stops waiting at its own deadline keeps the answers of the nodes that were in time."""
        check_bucket(bucket)
        if sizes is None:
            sizes = [wire.ABSENT] * len(keys)
        elif len(sizes) != len(keys):
            raise ConfigurationError(f"sizes has {len(sizes)} slots for {len(keys)} keys")

        def place(idx: list[int], result: wire.LookupResponse) -> None:
            if len(idx) == len(keys):  # one node holds them all: its answer is in key order already
                sizes[:] = result.sizes
                return
            for i, size in zip(idx, result.sizes, strict=True):
                sizes[i] = size

        await self._lookup(bucket, keys, pin, place)
        return sizes

    async def locate_keys(self, bucket: str, keys: Sequence[str], *, pin: float = 0.0
                          ) -> list[tuple[int, str] | None]:
        """Per key its block's (size, tier), the tier being ``"ram"`` or ``"disk"`` (a node's flash tier), or
        None where missing or its node failed. A node too old to name tiers answers ``"ram"``. ``pin`` as for
        :meth:`lookup_keys`."""
        check_bucket(bucket)
        found: list[tuple[int, str] | None] = [None] * len(keys)

        def place(idx: list[int], result: wire.LookupResponse) -> None:
            tiers = result.tiers or [wire.TIER_RAM] * len(idx)
            for i, size, code in zip(idx, result.sizes, tiers, strict=True):
                if size != wire.ABSENT:
                    found[i] = (size, wire.TIER_NAMES.get(code, "ram"))

        await self._lookup(bucket, keys, pin, place)
        return found

    async def _lookup(self, bucket: str, keys: Sequence[str], pin: float,
                      place: Callable[[list[int], wire.LookupResponse], None]) -> None:
        """One lookup call per node; ``place(idx, answer)`` takes each node's answer (not called for a node
        that failed: its keys stay missing)."""

        async def one(node: Node, idx: list[int], lane: int) -> None:
            head = wire.encode_keys_request("lookup", wire.KeysRequest([keys[i] for i in idx], pin=pin))
            result = await self._exchange(node, bucket, "lookup", head,
                                          lambda r: wire.decode_lookup_response(_head(r, "lookup", len(idx)), len(idx)))
            if result is not None:
                place(idx, result)

        await self._fan_out(one, keys)

    async def prefetch_keys(self, bucket: str, keys: Sequence[str]) -> int:
        """Ask the nodes to bring these keys' flash-resident blocks into RAM (a restore of them follows); the
        nodes answer at once. Returns how many blocks they will read from flash."""
        return await self.keys_op(bucket, "prefetch", keys)

    async def prefetch_located(self, bucket: str, keys: Sequence[str],
                               found: Sequence[tuple[int, str] | None]) -> int:
        """The prefetch of a matched prefix (:meth:`AsyncNamespace.prefetch`): ``found`` is :meth:`locate_keys`'s
        answer for ``keys``; the blocks it places on a node's flash tier (:func:`flash_resident`, which the vLLM
        and LMCache connectors use to decide whether to start a prefetch at all) are asked for, and nothing at
        all when none is there (RAM-only nodes). Returns how many blocks the nodes will read from flash."""
        cold = flash_resident(keys, found)
        return await self.prefetch_keys(bucket, cold) if cold else 0

    async def query(self, bucket: str, keys: Sequence[str], *, block_size: int = 0) -> QueryResult:
        """Which of ``keys`` (a prompt's block keys, in order) the pod holds, per tier, in one parallel round: each
        node is asked about the keys it owns with the bulk ``query`` op, which is not a read (no hit or miss, no
        LRU or TTL change on the node). A node that is down, slow or failing, or too old to answer queries, holds
        nothing here (strict mode raises instead). ``block_size``: tokens per block, for the result's tokens."""
        check_bucket(bucket)
        codes = [wire.TIER_ABSENT] * len(keys)

        async def one(node: Node, idx: list[int], lane: int) -> None:
            head = wire.encode_query_request(wire.QueryRequest(keys=[keys[i] for i in idx]))
            answer = await self._exchange(node, bucket, "query", head,
                                          lambda r: wire.decode_query_response(_head(r, "query", len(idx)), len(idx)))
            if answer is not None:
                for i, code in zip(idx, answer.tiers, strict=True):
                    codes[i] = code

        await self._fan_out(one, keys)
        summary = wire.query_summary(codes)
        return QueryResult([wire.TIER_NAMES.get(code) for code in codes], summary.prefix, summary.ram, summary.disk,
                           block_size)

    async def get_keys(self, bucket: str, keys: Sequence[str], destinations: Destinations, *,
                       pin: float = 0.0) -> list[Target | None]:
        """Fetch blocks into their destinations; None where missing, failed or corrupt."""
        check_bucket(bucket)
        views: list[Target | None] = [None] * len(keys)

        async def one(node: Node, idx: list[int], lane: int) -> None:
            reader = GetReader(len(idx), destinations, idx)
            head = wire.encode_keys_request("get", wire.KeysRequest([keys[i] for i in idx], pin=pin))
            if await self._exchange(node, bucket, "get", head, lambda r: reader.finish(), reader=reader,
                                    lane=lane) is None:
                return
            if reader.oversized:  # blocks that did not fit the caller's buffers were discarded: misses
                self.metrics.count("oversized_blocks", len(reader.oversized))
                if self.strict:
                    raise ConfigurationError(destinations.error or "a block does not fit its buffer")
            received = 0
            for j, i in enumerate(idx):
                view = reader.views[j]
                if view is None:
                    continue
                if not reader.verified[j]:
                    self.metrics.count("checksum_failures")
                    if self.strict:
                        raise IntegrityError(f"{node.name}: block {keys[i]} failed its XXH3-64 check")
                    continue  # a block that does not verify is a miss
                views[i] = view
                received += len(view)
            self.metrics.count("bytes_in", received)

        await self._fan_out(one, keys, split=lambda idx: self._get_batches(idx, destinations), spread=True)
        return views

    def _get_batches(self, idx: list[int], destinations: Destinations) -> list[list[int]]:
        """``idx`` in runs of at most ``bytes_per_get`` bytes of destination, and in at least as many runs as
        there are threads when there is enough to share (whole keys when new memory is allocated: the sizes are
        not known before the answer)."""
        capacities = [c for c in map(destinations.capacity, idx) if c is not None]
        if len(capacities) < len(idx):
            parts = min(self.threads, max(1, len(idx) // MIN_PART_KEYS))
            return [idx[len(idx) * k // parts:len(idx) * (k + 1) // parts] for k in range(parts)]
        return _byte_runs(idx, capacities, self._part_bytes(sum(capacities), self.limits.bytes_per_get))

    def _part_bytes(self, total: int, limit: int) -> int:
        """The most bytes one part of a node's share of ``total`` bytes carries: ``limit``, or less so that every
        thread gets a part (never below :data:`MIN_PART_BYTES`: a small call stays one request)."""
        if self.threads == 1:
            return limit
        return min(limit, max(MIN_PART_BYTES, -(-total // self.threads)))

    async def put_keys(self, bucket: str, keys: Sequence[str], blocks: Sequence[memoryview], *,
                       ttl: float | None = None, if_absent: bool = True,
                       route: wire.PutRoute | None = None) -> SaveResult:
        """Store ``blocks`` under ``keys``. ``route`` (in key order): what a node whose events feed a router
        asks of each block; sent only to nodes that asked for it."""
        check_bucket(bucket)
        result = SaveResult()

        async def one(node: Node, batch: list[int], lane: int) -> None:
            answer = await self._put_batch(node, bucket, [keys[i] for i in batch], [blocks[i] for i in batch],
                                           ttl, if_absent, lane,
                                           route.select(batch) if route is not None and node.put_route else None)
            if answer is not None:
                result.stored += answer.results.count("stored")
                result.existed += answer.results.count("exists")
                self.metrics.count("bytes_out", sum(len(blocks[i]) for i in batch))

        def batches(idx: list[int]) -> list[list[int]]:
            sizes = [len(blocks[i]) for i in idx]
            limit = self.limits.bytes_per_call
            if self.threads > 1:  # several in flight per node: each no larger than a get's part
                limit = self._part_bytes(sum(sizes), min(limit, self.limits.bytes_per_get))
            # The last run first: keys are a chain's blocks in order, and a node ranks what it stored last as
            # the most recent, so its eviction takes a long chain's tail before its head (a hole ends a prefix).
            return _byte_runs(idx, sizes, limit)[::-1]

        # A thread's batches to one node go one after another (each decoded before the next starts): a node
        # has at most one put call per client thread to take in at a time.
        await self._fan_out(one, keys, split=batches, spread=True, in_turn=True)
        # Everything neither stored nor found: rejected, failed calls, and blocks of nodes marked down.
        result.failed = len(keys) - result.stored - result.existed
        return result

    async def _put_batch(self, node: Node, bucket: str, keys: list[str], blocks: list[memoryview],
                         ttl: float | None, if_absent: bool, lane: int,
                         route: wire.PutRoute | None = None) -> wire.PutResponse | None:
        """One put call. To a node that announced it, the checksums follow the payloads (each block hashed as
        it is sent); a node that then refuses that frame (it was replaced by an older version) gets the call
        again with the checksums in the head."""
        n = len(keys)

        def decode(r: Response) -> wire.PutResponse:
            return wire.decode_put_response(_head(r, "put", n), n)

        sizes = [len(b) for b in blocks]
        if node.put_trailer:
            head = wire.encode_put_head(wire.PutRequest(keys, sizes, None, ttl, if_absent, route))
            try:
                return await self._exchange(node, bucket, "put", head, decode, payloads=TrailedPayloads(blocks),
                                            recreate_bucket=True, lane=lane)
            except _TrailerRefused:
                pass
        head = wire.encode_put_head(wire.PutRequest(keys, sizes, [xxhash.xxh3_64_intdigest(b) for b in blocks],
                                                    ttl, if_absent, route))
        return await self._exchange(node, bucket, "put", head, decode, payloads=blocks, recreate_bucket=True,
                                    lane=lane)

    async def get_keys_staged(self, bucket: str, keys: Sequence[str], out: Any, *, pin: float = 0.0) -> list[int]:
        """Fetch the leading blocks of ``keys`` into device memory through the staging pool (docs/client.md):
        ``out`` is a tensor with a slot per key, a list of per-key tensors, or a :class:`staging.Target` (e.g. a
        paged KV cache). Returns the sizes of the leading blocks that arrived whole and verified, every one of
        them copied by the time this returns; nothing after the first missing one is copied."""
        check_bucket(bucket)
        if not keys:
            return []
        target, event = staging_module.target_of(staging_module.ready(out), len(keys))

        async def fetch(first: int, count: int, host: Any, slot: int) -> list[int | None]:
            arena = byte_view(host)[:count * slot]
            views = await self.get_keys(bucket, keys[first:first + count], Destinations(arena, count), pin=pin)
            return [None if v is None else len(v) for v in views]

        return await staging_module.restore(self._stager(target.device), target, event, fetch)

    async def put_keys_staged(self, bucket: str, keys: Sequence[str], blocks: Any, *,
                              ttl: float | None = None, if_absent: bool = True,
                              route: wire.PutRoute | None = None) -> SaveResult:
        """Save blocks from device memory through the staging pool, a chunk at a time: ``blocks`` is a tensor
        with a block per row, a list of equally sized tensors, or a :class:`staging.Target`. ``if_absent`` and
        ``route`` as for :meth:`put_keys`."""
        check_bucket(bucket)
        if not keys:
            return SaveResult()
        source, event = staging_module.target_of(staging_module.ready(blocks), len(keys), what="blocks")

        async def send(first: int, count: int, host: Any, size: int) -> SaveResult:
            arena = byte_view(host)
            views = [arena[i * size:(i + 1) * size] for i in range(count)]
            part = route.select(range(first, first + count)) if route is not None else None
            return await self.put_keys(bucket, keys[first:first + count], views, ttl=ttl, if_absent=if_absent,
                                       route=part)

        total = SaveResult()
        for r in await staging_module.save(self._stager(source.device), source, event, send):
            total.stored += r.stored
            total.existed += r.existed
            total.failed += r.failed
        return total

    async def keys_op(self, bucket: str, op: str, keys: Sequence[str], *, ttl: float | None = None,
                      seconds: float = 0.0) -> int:
        """touch (``ttl``) / pin (``seconds``) / unpin / delete over the pod; returns how many keys were live."""
        check_bucket(bucket)
        total = 0

        async def one(node: Node, idx: list[int], lane: int) -> None:
            nonlocal total
            head = wire.encode_keys_request(op, wire.KeysRequest([keys[i] for i in idx], ttl=ttl, seconds=seconds))
            count = await self._exchange(node, bucket, op, head, lambda r: wire.decode_count_response(_head(r, "count", 0)))
            if count is not None:
                total += count.count

        await self._fan_out(one, keys)
        return total

    def _maybe_refresh_membership(self) -> None:
        if (self._resolving is not None or time.monotonic() - self._resolved_at < self.dns_refresh
                or all(is_ip(host) for host, _ in self._spec)):
            return
        self._resolving = asyncio.get_running_loop().create_task(self._refresh_membership())

    async def _refresh_membership(self) -> None:
        try:
            loop = asyncio.get_running_loop()
            names = await loop.run_in_executor(None, resolve, self._spec)  # getaddrinfo blocks
            addresses = list(names)
            if addresses != self._addresses:
                for gone in set(self._addresses) - set(addresses):
                    self._lanes.forget(*gone)
                self._addresses, self._names = addresses, names
                self.pod.update(addresses, names)
        finally:
            self._resolved_at = time.monotonic()
            self._resolving = None

    async def _fan_out(self, one: Callable[[Node, list[int], int], Awaitable[None]], keys: Sequence[str],
                       split: Callable[[list[int]], list[list[int]]] | None = None, *, spread: bool = False,
                       in_turn: bool = False) -> None:
        """``one(node, part, lane)`` for every part of each up node's keys (``split`` cuts a node's keys into
        parts). ``spread``: the parts go round the client's threads, else all run on this loop (lane 0).
        ``in_turn``: a lane's parts to one node run one after another, else all at once."""
        self._maybe_refresh_membership()
        work: list[tuple[Node, list[int]]] = []
        for node, idx in self.pod.group(keys).items():
            if not node.up:
                self.metrics.count("skipped_down_node_keys", len(idx))
                if self.strict:
                    raise NodeUnavailable(node.name, "marked down")
                continue
            chunks = self._chunks(idx)
            work += [(node, part) for chunk in chunks for part in (split(chunk) if split else [chunk])]
        lanes = self.threads if spread else 1
        if not in_turn:
            await _gather_all([one(node, part, k % lanes) for k, (node, part) in enumerate(work)])
            return
        queues: dict[tuple[Node, int], list[list[int]]] = {}
        for k, (node, part) in enumerate(work):
            queues.setdefault((node, k % lanes), []).append(part)

        async def in_order(node: Node, lane: int, parts: list[list[int]]) -> None:
            for part in parts:
                await one(node, part, lane)

        await _gather_all([in_order(node, lane, parts) for (node, lane), parts in queues.items()])

    def _stager(self, device: Any) -> staging_module.Stager:
        """The staging pool of a device (made at first use: host chunks are allocated then, once)."""
        key = (device.type, device.index)
        self._own_process()
        stager = self._stagers.get(key)
        if stager is None:
            chunks = STAGING_CHUNKS
            stager = staging_module.Stager(staging_module.backend_for(device), self.staging_bytes // chunks, chunks)
            self._stagers[key] = stager
        return stager

    def metrics_snapshot(self) -> dict[str, object]:
        """Hits, misses, bytes, checksum failures, errors, latency percentiles and node health."""
        return {**self.metrics.snapshot(), "nodes": self.pod.health()}

    async def aclose(self) -> None:
        self._own_process()
        if self._pod is not None:
            self._pod.close()
        self._lanes.close()
        for stager in self._stagers.values():
            stager.backend.close()
        self._stagers.clear()

    async def __aenter__(self) -> AsyncContextStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class AsyncNamespace:
    """Blocks of one model fingerprint in one bucket: save, look up and restore token prefixes."""

    def __init__(self, store: AsyncContextStore, bucket: str, fingerprint: Fingerprint, scheme: str) -> None:
        self.store = store
        self.bucket = bucket
        self.fingerprint = fingerprint
        self.scheme = scheme
        self.block_size = fingerprint.block_size

    def __repr__(self) -> str:
        return namespace_repr(type(self).__name__, self.bucket, self.fingerprint, self.scheme)

    def block_hashes(self, tokens: Sequence[int]) -> list[str]:
        """Keys of the full blocks of ``tokens`` (a trailing partial block has none)."""
        return self.fingerprint.block_hashes(tokens, self.scheme)

    async def lookup(self, tokens: Sequence[int]) -> int:
        """Number of leading full blocks of ``tokens`` the pod holds."""
        keys = self.block_hashes(tokens)
        sizes = await self.store.lookup_keys(self.bucket, keys)
        n = wire.prefix_length(sizes)
        self.store.metrics.count("hits", n)
        self.store.metrics.count("misses", len(keys) - n)
        return n

    async def locate(self, tokens: Sequence[int]) -> list[str | None]:
        """Per full block of ``tokens``: ``"ram"``, ``"disk"`` (a node's flash tier) or None where absent, so
        a router can tell a RAM hit from a flash hit."""
        return [None if f is None else f[1] for f in await self.store.locate_keys(self.bucket, self.block_hashes(tokens))]

    async def prefetch(self, tokens: Sequence[int]) -> int:
        """Ask the nodes to promote the longest cached prefix of ``tokens`` from flash into RAM ahead of a
        restore; returns at once (after one lookup and one prefetch round trip) the number of leading blocks
        cached in either tier. The promotion runs in the nodes' background."""
        keys = self.block_hashes(tokens)
        found = await self.store.locate_keys(self.bucket, keys)
        n = next((i for i, f in enumerate(found) if f is None), len(found))
        await self.store.prefetch_located(self.bucket, keys[:n], found[:n])
        return n

    async def query(self, tokens: Sequence[int]) -> QueryResult:
        """What the pod holds of the full blocks of ``tokens``, per tier (:meth:`AsyncContextStore.query`): for
        a router choosing where a request's prefix is cheapest to restore. Not a read: unlike :meth:`lookup`,
        no node counts it as hits or keeps the blocks alive for it."""
        return await self.store.query(self.bucket, self.block_hashes(tokens), block_size=self.block_size)

    async def restore(self, tokens: Sequence[int], out: Any = None, *, pin: float = 0.0) -> RestoreResult:
        """Fetch the cached prefix of ``tokens`` in one round trip per node.

        ``out``: None (allocate), a list of per-block buffers, or one buffer holding every block in equal
        slots (bytearray, memoryview, numpy array, torch tensor). A tensor on a GPU (one, or one per block) is
        filled through the client's staging pool (docs/client.md); the blocks of the result are then uint8
        views of it. ``pin``: keep the fetched blocks from eviction for that many seconds."""
        keys = self.block_hashes(tokens)
        if staging_module.wants_staging(out, self.store.staging):
            target, event = staging_module.target_of(staging_module.ready(out), len(keys))
            sizes = await self.store.get_keys_staged(self.bucket, keys, staging_module.Ready(target, event), pin=pin)
            blocks: list[Any] = [target.block(i, size) for i, size in enumerate(sizes)]
        else:
            views = await self.store.get_keys(self.bucket, keys, Destinations(out, len(keys)), pin=pin)
            blocks = []
            for view in views:
                if view is None:
                    break
                blocks.append(view)
        self.store.metrics.count("hits", len(blocks))
        self.store.metrics.count("misses", len(keys) - len(blocks))
        return RestoreResult(len(blocks), len(blocks) * self.block_size, blocks)

    async def save(self, tokens: Sequence[int], blocks: Sequence[Any], ttl: float | None = None) -> SaveResult:
        """Store one buffer per full block of ``tokens`` (a prefix of them is fine); existing blocks are skipped."""
        keys = self.block_hashes(tokens)
        if len(blocks) > len(keys):
            raise ConfigurationError(f"{len(blocks)} blocks for {len(keys)} full blocks of tokens")
        if ttl is not None and not ttl > 0:
            raise ConfigurationError("ttl must be positive")
        keys = keys[:len(blocks)]
        await self.store._learn_features(self.bucket)
        route = self._route(tokens, keys) if any(n.put_route for n in self.store.pod.nodes) else None
        if staging_module.wants_staging(blocks, self.store.staging):
            return await self.store.put_keys_staged(self.bucket, keys, blocks, ttl=ttl, route=route)
        return await self.store.put_keys(self.bucket, keys, [byte_view(b) for b in blocks], ttl=ttl, route=route)

    def _route(self, tokens: Sequence[int], keys: list[str]) -> wire.PutRoute:
        """What a router's index needs of the blocks of ``keys`` (the first full blocks of ``tokens``): their
        tokens, each one's parent key and the namespace's salt (its fingerprint's hex digest: the
        ``cache_salt`` under which the ``dynamo`` scheme's keys are Dynamo's own)."""
        size = self.block_size
        flat = tokens.tolist() if hasattr(tokens, "tolist") else list(tokens)
        return wire.PutRoute(size, [list(map(int, flat[i * size:(i + 1) * size])) for i in range(len(keys))],
                             [None, *keys[:-1]], self.fingerprint.hexdigest())

    async def touch(self, tokens: Sequence[int], ttl: float | None = None) -> int:
        """Extend the life of the cached blocks of ``tokens``; returns how many were live."""
        return await self.store.keys_op(self.bucket, "touch", self.block_hashes(tokens), ttl=ttl)

    async def pin(self, tokens: Sequence[int], seconds: float) -> int:
        """Protect the cached blocks of ``tokens`` from eviction for ``seconds`` (bounded by the node)."""
        if not seconds > 0:
            raise ConfigurationError("seconds must be positive")
        return await self.store.keys_op(self.bucket, "pin", self.block_hashes(tokens), seconds=seconds)

    async def unpin(self, tokens: Sequence[int]) -> int:
        return await self.store.keys_op(self.bucket, "unpin", self.block_hashes(tokens))

    async def delete(self, tokens: Sequence[int]) -> int:
        return await self.store.keys_op(self.bucket, "delete", self.block_hashes(tokens))

    async def park(self, tokens: Sequence[int], blocks: Sequence[Any], *, ttl: float, pin: float) -> SaveResult:
        """Save a session's context with a longer TTL and pin it, e.g. during a long tool call."""
        result = await self.save(tokens, blocks, ttl=ttl)
        await self.pin(tokens[:len(blocks) * self.block_size], pin)
        return result


def namespace_repr(kind: str, bucket: str, fingerprint: Fingerprint, scheme: str) -> str:
    """``kind(bucket=..., model=..., fingerprint=<its first 12 hex digits>, block_size=..., scheme=...)``: enough
    to tell two namespaces apart in a log, and never a fingerprint's salt."""
    return (f"{kind}(bucket={bucket!r}, model={fingerprint.model!r}, "
            f"fingerprint={fingerprint.hexdigest()[:12]!r}, block_size={fingerprint.block_size}, scheme={scheme!r})")


def _tls_of(scheme: str, ca: str | os.PathLike[str] | None) -> ssl.SSLContext | None:
    """The pod's TLS context (``https`` nodes), verifying against ``ca`` or the system's CAs; None for ``http``."""
    if scheme == "https":
        return client_context(ca)
    if ca is not None:
        raise ConfigurationError(f"a TLS CA bundle is given (tls_ca or {TLS_CA_ENV}) but the nodes are http://: "
                                 "write them as https://host:port, or drop the bundle")
    return None


def _byte_runs(idx: list[int], sizes: Sequence[int], limit: int) -> list[list[int]]:
    """``idx`` (with ``sizes`` beside it) cut into consecutive runs of at most ``limit`` bytes each (a single
    larger item is a run of its own)."""
    runs: list[list[int]] = [[]]
    total = 0
    for i, n in zip(idx, sizes, strict=True):
        if runs[-1] and total + n > limit:
            runs.append([])
            total = 0
        runs[-1].append(i)
        total += n
    return [run for run in runs if run]


async def _gather_all(calls: list[Any]) -> None:
    """Run every call to its end, then raise the first failure (strict mode): no call outlives the operation,
    so a restore that raised never keeps writing into the caller's buffers afterwards."""
    for outcome in await asyncio.gather(*calls, return_exceptions=True):
        if isinstance(outcome, BaseException):
            raise outcome


def _head(response: Response, kind: str, n_keys: int) -> dict[str, Any]:
    """The head of a small (frame-only) answer of ``kind`` to a call of ``n_keys``."""
    if not isinstance(response.reader, BytesReader):
        raise wire.WireError("expected a frame-only answer")
    return wire.unpack_head(response.reader.data, wire.answer_schema(kind, n_keys))[0]


class _TrailerRefused(Exception):
    """A put with a checksum trailer was answered MalformedFrame: send it again the first bulk API's way. (Not a
    ContextStoreError: no failure is counted or raised for it.)"""


def _error_of(node: Node, response: Response) -> ContextStoreError:
    """The error of a non-200 bulk answer: its error frame, else an S3 error document or a plain body (an answer
    from something in front of the node, or from the node's HTTP layer)."""
    try:
        head, _ = wire.unpack_head(s3.body_of(response), wire.answer_schema("error", 0))
        err = wire.decode_error(head)
        return server_error(node.name, response.status, err.error, err.message)
    except wire.WireError:
        return s3.error_of(node.name, response)


def _as_client_error(node: Node, exc: Exception) -> ContextStoreError:
    if isinstance(exc, ContextStoreError):
        return exc
    return ProtocolError(node.name, 200, getattr(exc, "code", "MalformedFrame"), str(exc))

