"""``ctxstore bench``: load a running pod from a worker's machine, with a worker's credentials, and measure it.

Operations, run one after the other in this order (``--ops``):

- ``save``: synthetic prompts of ``--blocks`` blocks of ``--block-size`` bytes through the public client
  (:meth:`ctxstore.AsyncNamespace.save`: one bulk put per node);
- ``lookup``: how much of each saved prompt the pod holds (:meth:`~ctxstore.AsyncNamespace.lookup`);
- ``restore``: each saved prompt into a buffer (:meth:`~ctxstore.AsyncNamespace.restore`);
- ``s3-put`` / ``s3-get``: S3 PutObject / GetObject of ``--object-size`` bytes, sent as the client sends its
  own S3 requests (:mod:`ctxstore.s3`, signed with its SigV4; boto3 is not needed) to the node each key hashes to.

Each operation runs ``--concurrency`` requests at a time until it has done ``--count`` of them or ``--duration``
has passed, whichever comes first. The client is the one inference workers use, in its default, lenient mode: a
node that is down or slow makes misses and failed saves, which the table counts, not a crash.

It writes only into ``--namespace`` (a bucket; there is no default, so it never writes where it was not told to),
with a TTL (``--ttl``) so that nothing outlives a bench that was killed, and afterwards deletes what it wrote: its
blocks and objects, and the bucket on the nodes where it created it (``--keep`` leaves everything).

Output: a live progress display (rich, on stderr) and a table of throughput and latency percentiles (p50, p90,
p99, max); ``--json`` prints one document instead. rich comes with the ``cli`` extra
(``pip install rich``: the ``cli`` extra); ``--json`` runs without it.

Exit codes: 0 every operation succeeded (misses are not failures); 1 some failed (or cleanup did); 2 usage error;
130 interrupted (what was written is still cleaned up).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from . import __version__, s3
from .buckets import broken_rule
from .cliargs import ArgumentParser
from .core import AsyncContextStore, AsyncNamespace, Timeouts
from .credentials import resolve_credentials
from .endpoints import parse_endpoints
from .errors import ContextStoreError
from .pod import Node
from .transport import BytesReader, Response
from .units import format_size, parse_duration, parse_size, plural

OPS = ("save", "lookup", "restore", "s3-put", "s3-get")
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
S3_PREFIX = "ctxstore-bench"
MODEL = "ctxstore-bench"  # the namespace fingerprint's model: bench blocks never match a real model's
INSTALL_RICH = "pip install rich (the cli extra)"
CLEANUP_ATTEMPTS, CLEANUP_PAUSE = 5, 0.5  # a bucket not yet empty after a Ctrl-C: tries, pause between
# Why an operation ended before --count: OpResult.stopped_by -> what the table says.
STOPPED = {"count": "--count done", "duration": "--duration reached", "interrupted": "interrupted",
           "nothing written": "nothing to read: the write before it sent nothing"}


class UsageError(Exception):
    """Bad arguments or a missing setting: exit code 2."""


@dataclass(frozen=True)
class Config:
    """What to run (the command line, checked)."""

    nodes: str
    namespace: str
    ops: tuple[str, ...] = OPS
    count: int = 256
    duration: float = 30.0
    concurrency: int = 4
    blocks: int = 16
    block_size: int = 64 << 10
    tokens_per_block: int = 16
    object_size: int = 1 << 20
    ttl: float = 600.0
    timeout: float = 30.0
    keep: bool = False
    seed: int = 0

    @property
    def prompt_bytes(self) -> int:
        return self.blocks * self.block_size

    def as_dict(self) -> dict[str, Any]:
        return {"nodes": self.nodes, "namespace": self.namespace, "ops": list(self.ops), "count": self.count,
                "duration": self.duration, "concurrency": self.concurrency, "blocks": self.blocks,
                "block_size": self.block_size, "tokens_per_block": self.tokens_per_block,
                "object_size": self.object_size, "ttl": self.ttl, "timeout": self.timeout, "keep": self.keep,
                "seed": self.seed}


@dataclass
class Outcome:
    """What one request did."""

    ok: bool = True
    nbytes: int = 0
    found: int = 0  # blocks found (lookup, restore)
    asked: int = 0  # blocks asked for
    error: str = ""


@dataclass
class OpResult:
    """One operation's totals; :meth:`summary` is its row of the table and of ``--json``."""

    op: str
    planned: int
    ops: int = 0
    failed: int = 0
    nbytes: int = 0
    found: int = 0
    asked: int = 0
    seconds: float = 0.0
    stopped_by: str = "count"  # a key of STOPPED
    latencies: list[float] = field(default_factory=list, repr=False)  # seconds, successful requests
    errors: Counter[str] = field(default_factory=Counter)

    def add(self, outcome: Outcome, seconds: float) -> None:
        self.ops += 1
        self.nbytes += outcome.nbytes
        self.found += outcome.found
        self.asked += outcome.asked
        if outcome.ok:
            self.latencies.append(seconds)
        else:
            self.failed += 1
            self.errors[outcome.error or "failed"] += 1

    def summary(self) -> dict[str, Any]:
        ordered = sorted(self.latencies)

        def rate(n: int) -> float | None:
            return round(n / self.seconds, 3) if self.seconds > 0 else None

        return {
            "op": self.op, "planned": self.planned, "ops": self.ops, "failed": self.failed,
            "seconds": round(self.seconds, 4), "ops_per_s": rate(self.ops), "bytes": self.nbytes,
            "bytes_per_s": rate(self.nbytes),
            "latency_ms": {name: None if not ordered else round(percentile(ordered, q) * 1000, 4)
                           for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99), ("max", 1.0))},
            "blocks_found": self.found, "blocks_asked": self.asked,
            "found_ratio": self.found / self.asked if self.asked else None,
            "stopped_by": self.stopped_by, "errors": dict(self.errors.most_common(5)),
        }


def percentile(ordered: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of sorted values (``q`` in 0..1; 1 is the maximum)."""
    return ordered[max(0, min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1))]


# ---------------------------------------------------------------------------------------------- S3 answers


class _Into:
    """A GET body read into a reused buffer (wrapping around: the bytes are counted, not kept)."""

    def __init__(self, buffer: memoryview) -> None:
        self.buffer = buffer
        self.received = 0

    def begin(self, length: int) -> None:
        pass

    def get_buffer(self) -> memoryview:
        return self.buffer[self.received % len(self.buffer):]

    def written(self, n: int) -> None:
        self.received += n


def _s3_error(response: Response) -> str:
    """``HTTP 404 NoSuchBucket``, or ``HTTP 502`` for an answer without an S3 error document."""
    code = s3.error_of("", response).code
    return f"HTTP {response.status}" if code == "HTTP" else f"HTTP {response.status} {code}"


# ---------------------------------------------------------------------------------------------- the run


class Bench:
    """One run: :meth:`run` executes the operations, then cleans up; the report is the ``--json`` document."""

    def __init__(self, config: Config, store: AsyncContextStore,
                 progress: Callable[[OpResult, bool], None] | None = None) -> None:
        self.config = config
        self.store = store
        self.progress = progress or (lambda result, final: None)
        self.ns: AsyncNamespace | None = None
        rng = random.Random(config.seed)
        self.tokens_per_prompt = config.blocks * config.tokens_per_block
        # Token ids are u32; each prompt is a distinct run of them, from a random start per run.
        self.base = rng.randrange(0, (1 << 32) - max(1, config.count) * self.tokens_per_prompt)
        self.run_id = f"{rng.getrandbits(40):010x}"
        payload = bytearray(rng.randbytes(config.block_size))
        self.blocks = [memoryview(payload)] * config.blocks  # the same bytes in every block: content is opaque
        self.object = memoryview(bytearray(rng.randbytes(config.object_size)))
        # One restore buffer and one GET buffer per request in flight, reused.
        self._buffers = [bytearray(config.prompt_bytes) for _ in range(config.concurrency)]
        self._object_buffers = [memoryview(bytearray(config.object_size)) for _ in range(config.concurrency)]
        self.saved = 0  # prompts 0..saved-1 were sent (cleanup deletes them all)
        self.s3_written = 0  # objects 0..s3_written-1 were sent
        self.created_on: list[str] = []  # nodes where this run created the bucket
        self.results: list[OpResult] = []

    def tokens(self, prompt: int) -> list[int]:
        start = self.base + prompt * self.tokens_per_prompt
        return list(range(start, start + self.tokens_per_prompt))

    def s3_key(self, i: int) -> str:
        return f"{S3_PREFIX}/{self.run_id}/{i:08d}"

    # -------------------------------------------------------------- S3

    async def _s3(self, method: str, key: str | None, body: memoryview | None = None,
                  into: memoryview | None = None) -> Response:
        node = self.store.pod.owner(key) if key is not None else None
        return await self._s3_on(node, method, key, body, into)

    async def _s3_on(self, node: Node | None, method: str, key: str | None, body: memoryview | None = None,
                     into: memoryview | None = None, query: str = "") -> Response:
        assert node is not None

        def reader(status: int, n: int) -> Any:
            return _Into(into) if status == 200 and into is not None else BytesReader(n)

        async with asyncio.timeout(self.config.timeout):
            return await s3.request(self.store.signer, node, method, self.config.namespace, key, query=query,
                                    body=body, reader=reader)

    async def _bucket_exists(self, node: Node) -> bool | None:
        """Whether the bucket is on ``node`` (GetBucketLocation); None when that cannot be told."""
        if not node.up:
            return None
        try:
            response = await self._s3_on(node, "GET", None, query="location=")
        except (ContextStoreError, TimeoutError):
            return None
        return True if response.status == 200 else False if response.status == 404 else None

    # -------------------------------------------------------------- the operations

    async def op_save(self, i: int, worker: int) -> Outcome:
        assert self.ns is not None
        self.saved = max(self.saved, i + 1)
        result = await self.ns.save(self.tokens(i), self.blocks, ttl=self.config.ttl)
        failed = result.failed > 0
        return Outcome(ok=not failed, nbytes=self.config.prompt_bytes,
                       error=f"{result.failed} of {plural(self.config.blocks, 'block')} not stored"
                       if failed else "")

    async def op_lookup(self, i: int, worker: int) -> Outcome:
        assert self.ns is not None
        n = await self.ns.lookup(self.tokens(i % self.saved))
        return Outcome(found=n, asked=self.config.blocks)

    async def op_restore(self, i: int, worker: int) -> Outcome:
        assert self.ns is not None
        result = await self.ns.restore(self.tokens(i % self.saved), out=self._buffers[worker])
        return Outcome(nbytes=result.nbytes, found=result.n_blocks, asked=self.config.blocks)

    async def op_s3_put(self, i: int, worker: int) -> Outcome:
        self.s3_written = max(self.s3_written, i + 1)
        response = await self._s3("PUT", self.s3_key(i), body=self.object)
        if response.status != 200:
            return Outcome(ok=False, error=_s3_error(response))
        return Outcome(nbytes=len(self.object))

    async def op_s3_get(self, i: int, worker: int) -> Outcome:
        into = self._object_buffers[worker]
        response = await self._s3("GET", self.s3_key(i % self.s3_written), into=into)
        if response.status != 200:
            return Outcome(ok=False, error=_s3_error(response))
        received = response.reader.received if isinstance(response.reader, _Into) else 0
        if received != self.config.object_size:
            return Outcome(ok=False, nbytes=received, error=f"{received} bytes, expected {self.config.object_size}")
        return Outcome(nbytes=received)

    async def _drive(self, op: str, work: Callable[[int, int], Awaitable[Outcome]], count: int) -> OpResult:
        """``count`` requests, ``concurrency`` at a time, stopping early when ``duration`` has passed."""
        result = OpResult(op, planned=count)
        self.results.append(result)
        self.progress(result, False)
        deadline = time.monotonic() + self.config.duration
        next_index = 0
        started = time.perf_counter()

        async def worker(w: int) -> None:
            nonlocal next_index
            while next_index < count:
                if time.monotonic() >= deadline:
                    result.stopped_by = "duration"
                    return
                i = next_index
                next_index += 1
                t0 = time.perf_counter()
                try:
                    outcome = await work(i, w)
                except (ContextStoreError, TimeoutError, OSError) as exc:
                    outcome = Outcome(ok=False, error=f"{type(exc).__name__}: {exc}"[:200])
                result.add(outcome, time.perf_counter() - t0)
                result.seconds = time.perf_counter() - started
                self.progress(result, False)

        try:
            await asyncio.gather(*(worker(w) for w in range(min(self.config.concurrency, count))))
        except asyncio.CancelledError:
            result.stopped_by = "interrupted"
            raise
        finally:
            result.seconds = time.perf_counter() - started
            self.progress(result, True)
        return result

    async def run(self) -> dict[str, Any]:
        """Every operation of the config, then the cleanup; the report (``interrupted`` if cancelled)."""
        config = self.config
        interrupted = False
        started = time.time()
        try:
            existed = [await self._bucket_exists(n) for n in self.store.pod.nodes]
            self.ns = await self.store.namespace(config.namespace, model=MODEL, block_size=config.tokens_per_block)
            self.created_on = [n.name for n, e in zip(self.store.pod.nodes, existed, strict=True) if e is False]
            work = {"save": self.op_save, "lookup": self.op_lookup, "restore": self.op_restore,
                    "s3-put": self.op_s3_put, "s3-get": self.op_s3_get}
            for op in config.ops:
                source = {"lookup": self.saved, "restore": self.saved, "s3-get": self.s3_written}.get(op, 1)
                if not source:  # the write before it was stopped before its first request
                    self.results.append(OpResult(op, planned=config.count, stopped_by="nothing written"))
                    continue
                await self._drive(op, work[op], config.count)
        except asyncio.CancelledError:
            interrupted = True
        cleanup = await self.cleanup()
        return {"version": __version__, "started": started, "config": config.as_dict(),
                "nodes": [n.name for n in self.store.pod.nodes],
                "operations": [r.summary() for r in self.results], "cleanup": cleanup,
                "interrupted": interrupted}

    async def cleanup(self) -> dict[str, Any]:
        """Delete the blocks and objects this run sent and the bucket where it created it (unless ``keep``).

        After a Ctrl-C the requests that were in flight may still land once their keys were deleted: a bucket
        that is then not empty gets those last keys deleted again, a few times over about two seconds."""
        out: dict[str, Any] = {"kept": self.config.keep, "prompts": self.saved, "objects": self.s3_written,
                               "blocks_deleted": 0, "objects_deleted": 0, "bucket_deleted_on": [], "errors": []}
        if self.config.keep or self.ns is None:
            return out
        await self._delete_sent(out, 0, 0)
        in_flight = self.config.concurrency  # at most this many requests were cut short
        for attempt in range(CLEANUP_ATTEMPTS):
            errors: list[str] = []
            not_empty = False
            for node in self.store.pod.nodes:
                if node.name not in self.created_on or node.name in out["bucket_deleted_on"]:
                    continue
                try:
                    response = await self._s3_on(node, "DELETE", None)
                except (ContextStoreError, TimeoutError) as exc:
                    errors.append(f"delete bucket on {node.name}: {exc}")
                    continue
                if response.status in (200, 204):
                    out["bucket_deleted_on"].append(node.name)
                else:
                    error = _s3_error(response)
                    not_empty = not_empty or error.endswith("BucketNotEmpty")
                    errors.append(f"delete bucket on {node.name}: {error}")
            if not not_empty or attempt == CLEANUP_ATTEMPTS - 1:
                out["errors"] += errors
                break
            await asyncio.sleep(CLEANUP_PAUSE)
            await self._delete_sent(out, max(0, self.saved - in_flight), max(0, self.s3_written - in_flight))
        out["errors"] = out["errors"][:10]
        return out

    async def _delete_sent(self, out: dict[str, Any], first_prompt: int, first_object: int) -> None:
        """Delete the blocks of prompts ``first_prompt..saved-1`` and the objects ``first_object..s3_written-1``,
        counting what was deleted into ``out``."""
        assert self.ns is not None
        ns = self.ns
        for start in range(first_prompt, self.saved, 256):  # bounded batches of keys
            keys = [k for p in range(start, min(self.saved, start + 256)) for k in ns.block_hashes(self.tokens(p))]
            try:
                out["blocks_deleted"] += await self.store.keys_op(ns.bucket, "delete", keys)
            except ContextStoreError as exc:
                out["errors"].append(f"delete blocks: {exc}")
        gate = asyncio.Semaphore(self.config.concurrency)

        async def delete_object(i: int) -> None:
            async with gate:
                try:
                    response = await self._s3("DELETE", self.s3_key(i))
                except (ContextStoreError, TimeoutError) as exc:
                    out["errors"].append(f"delete {self.s3_key(i)}: {exc}")
                    return
                if response.status in (200, 204):
                    out["objects_deleted"] += 1

        await asyncio.gather(*(delete_object(i) for i in range(first_object, self.s3_written)))


# ---------------------------------------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="ctxstore bench",
        description="Load a running ctxstore pod with a worker's credentials and measure it: save, lookup and "
                    "restore of synthetic prompts through the client, S3 PUT and GET. Writes only into "
                    "--namespace and deletes what it wrote afterwards (unless --keep).",
        epilog="credentials: --access-key/--secret-key, else CTXSTORE_ACCESS_KEY and CTXSTORE_SECRET_KEY, else "
               "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (a worker's key pair). exit codes: 0 all requests "
               "succeeded, 1 some failed, 2 usage error, 130 interrupted. See docs/operations.md.")
    parser.add_argument("--namespace", required=True, metavar="BUCKET",
                        help="the bucket the bench may write into (required: there is no default)")
    parser.add_argument("--nodes", default=None, help="the pod's nodes, as workers give them [env CTXSTORE_NODES]")
    parser.add_argument("--access-key", default=None,
                        help="the key pair's access key [env CTXSTORE_ACCESS_KEY, else AWS_ACCESS_KEY_ID]")
    parser.add_argument("--secret-key", default=None,
                        help="its secret [env CTXSTORE_SECRET_KEY, else AWS_SECRET_ACCESS_KEY; the environment is "
                             "better: arguments show in ps]")
    parser.add_argument("--tls-ca", default=None, metavar="FILE",
                        help="CA bundle (PEM) that https:// nodes' certificates are checked against [env "
                             "CTXSTORE_TLS_CA; default the system's CAs]")
    parser.add_argument("--ops", default=",".join(OPS),
                        help=f"operations to run, in this order [default {','.join(OPS)}]")
    parser.add_argument("--count", type=int, default=256,
                        help="requests per operation (save: distinct prompts) [default 256]")
    parser.add_argument("--duration", default="30s", help="time limit per operation [default 30s]")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight [default 4]")
    parser.add_argument("--blocks", type=int, default=16, help="blocks per prompt [default 16]")
    parser.add_argument("--block-size", default="64KiB", help="bytes per block [default 64KiB]")
    parser.add_argument("--tokens-per-block", type=int, default=16, help="tokens per block [default 16]")
    parser.add_argument("--object-size", default="1MiB", help="bytes per S3 object [default 1MiB]")
    parser.add_argument("--ttl", default="10m", help="TTL of what the bench writes [default 10m]")
    parser.add_argument("--timeout", default="30s", help="limit of one request [default 30s]")
    parser.add_argument("--seed", type=int, default=None, help="for the synthetic data [default: random]")
    parser.add_argument("--keep", action="store_true", help="leave the blocks, objects and bucket in place")
    parser.add_argument("--json", action="store_true", help="print one JSON document (no table)")
    parser.add_argument("--quiet", action="store_true", help="no live progress")
    return parser


def config_from(args: argparse.Namespace) -> Config:
    nodes = args.nodes or os.environ.get("CTXSTORE_NODES", "")
    if not nodes.strip():
        raise UsageError("no nodes: pass --nodes host:port,... or set CTXSTORE_NODES")
    rule = broken_rule(args.namespace)
    if rule is not None:
        raise UsageError(f"--namespace {args.namespace!r}: an S3 bucket name {rule}")
    ops = tuple(o.strip() for o in args.ops.split(",") if o.strip())
    unknown = [o for o in ops if o not in OPS]
    if unknown or not ops:
        raise UsageError(f"--ops: {', '.join(unknown) or 'none given'}; choose from {', '.join(OPS)}")
    ops = tuple(o for o in OPS if o in ops)  # reads follow the writes they read
    for reader, writer in (("lookup", "save"), ("restore", "save"), ("s3-get", "s3-put")):
        if reader in ops and writer not in ops:
            raise UsageError(f"{reader} reads what {writer} wrote in this run: add {writer} to --ops")
    try:
        sizes = {name: parse_size(getattr(args, name)) for name in ("block_size", "object_size")}
        times = {name: parse_duration(getattr(args, name)) for name in ("duration", "ttl", "timeout")}
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    for name, value in {**sizes, **times, "count": args.count, "concurrency": args.concurrency,
                        "blocks": args.blocks, "tokens_per_block": args.tokens_per_block}.items():
        if not value > 0:
            raise UsageError(f"--{name.replace('_', '-')} must be positive")
    if args.count * args.blocks * args.tokens_per_block >= 1 << 31:
        raise UsageError("--count x --blocks x --tokens-per-block must stay under 2**31 token ids")
    return Config(nodes=nodes, namespace=args.namespace, ops=ops, count=args.count, concurrency=args.concurrency,
                  blocks=args.blocks, tokens_per_block=args.tokens_per_block, keep=args.keep,
                  seed=args.seed if args.seed is not None else random.randrange(1 << 30),
                  block_size=sizes["block_size"], object_size=sizes["object_size"], duration=times["duration"],
                  ttl=times["ttl"], timeout=times["timeout"])


def main(argv: list[str] | None = None) -> int:
    """``ctxstore bench ...``; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from(args)
        access_key, secret_key = resolve_credentials(args.access_key, args.secret_key,
                                                     how="pass --access-key and --secret-key")
        display = Display(config, live=not args.quiet, table=not args.json)
        store = AsyncContextStore(
            config.nodes, access_key=access_key, secret_key=secret_key, tls_ca=args.tls_ca,
            timeouts=Timeouts(connect=2.0, read=min(10.0, config.timeout), total=config.timeout),
            pool_size=max(8, config.concurrency))
    except UsageError as exc:
        print(f"ctxstore bench: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except ContextStoreError as exc:  # no credentials, a bad node address
        print(f"ctxstore bench: {exc}", file=sys.stderr)
        return EXIT_USAGE

    reports: list[dict[str, Any]] = []

    async def run() -> None:
        try:
            reports.append(await Bench(config, store, display.update).run())
        finally:
            await store.aclose()

    display.start()
    try:
        asyncio.run(run())
    except KeyboardInterrupt:
        pass  # asyncio.run cancelled the run, which cleaned up, and raises Ctrl-C again once it has finished
    except ContextStoreError as exc:  # e.g. the bucket is another tenant's
        display.stop()
        print(f"ctxstore bench: {exc}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        display.stop()
    if not reports:
        print("ctxstore bench: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    report = reports[0]
    try:
        if args.json:
            print(json.dumps(report, indent=1))
        else:
            display.table(report)
    except BrokenPipeError:  # `ctxstore bench ... | head`
        pass
    if report["interrupted"]:
        return EXIT_INTERRUPTED
    failed = any(op["failed"] for op in report["operations"]) or report["cleanup"]["errors"]
    return EXIT_FAILED if failed else EXIT_OK


# ---------------------------------------------------------------------------------------------- display


def fmt_ms(v: float | None) -> str:
    return "–" if v is None else f"{v:.2f}" if v < 10 else f"{v:.1f}" if v < 100 else f"{v:.0f}"


class Display:
    """The live progress (stderr) and the final table (stdout), with rich; nothing when rich is absent and not
    needed (``--json``)."""

    def __init__(self, config: Config, *, live: bool, table: bool) -> None:
        self.config = config
        try:
            import rich  # noqa: F401
        except ImportError:
            if table:
                raise UsageError(f"the progress display and the table need rich: {INSTALL_RICH} "
                                 "(or use --json)") from None
            live = False
        self.live = live
        self._progress: Any = None
        self._tasks: dict[int, Any] = {}
        self._last = 0.0

    def start(self) -> None:
        if not self.live:
            return
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        console = Console(stderr=True)
        c = self.config
        nodes = len(parse_endpoints(c.nodes))
        console.print(f"[bold]ctxstore bench[/] → {plural(nodes, 'node')}, namespace "
                      f"[bold]{c.namespace}[/]: {plural(c.count, 'prompt')} × {plural(c.blocks, 'block')} × "
                      f"{format_size(c.block_size)} "
                      f"({format_size(c.count * c.prompt_bytes)}), objects of {format_size(c.object_size)}; "
                      f"concurrency {c.concurrency}, at most {c.duration:g} s per operation")
        self._progress = Progress(TextColumn("{task.description:<8}"), BarColumn(bar_width=30),
                                  MofNCompleteColumn(), TextColumn("{task.fields[rate]}"), TimeElapsedColumn(),
                                  TextColumn("[dim]{task.fields[note]}"), console=console)
        self._progress.start()

    def update(self, result: OpResult, final: bool) -> None:
        if self._progress is None:
            return
        key = id(result)
        if key not in self._tasks:
            self._tasks[key] = self._progress.add_task(result.op, total=result.planned, rate="", note="")
        now = time.monotonic()
        if not final and now - self._last < 0.1:  # progress is drawn ten times a second anyway
            return
        self._last = now
        s = result.seconds or 1e-9
        rate = f"{result.ops / s:8.1f} req/s"
        if result.nbytes:
            rate += f" {result.nbytes / s / 1e6:8.1f} MB/s"
        note = f"{result.failed} failed" if result.failed else ""
        if final and result.stopped_by != "count":
            note = (note + ", " if note else "") + STOPPED[result.stopped_by]
        self._progress.update(self._tasks[key], completed=result.ops, rate=rate, note=note,
                              **({"total": result.ops} if final and result.ops < result.planned else {}))

    def stop(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def table(self, report: dict[str, Any]) -> None:
        from rich import box
        from rich.console import Console
        from rich.table import Table

        width = None if sys.stdout.isatty() or "COLUMNS" in os.environ else 160
        console = Console(width=width, highlight=False)
        c = report["config"]
        table = Table(title=f"ctxstore bench: {plural(len(report['nodes']), 'node')}, namespace {c['namespace']}, "
                            f"concurrency {c['concurrency']}", title_justify="left", box=box.SIMPLE_HEAD,
                      pad_edge=False, collapse_padding=True)
        for name in ("op", "size", "requests", "failed", "s", "req/s", "MB/s", "p50 ms", "p90 ms", "p99 ms",
                     "max ms", "found"):
            table.add_column(name, justify="left" if name == "op" else "right", no_wrap=True)
        for op in report["operations"]:
            shape = f"{c['blocks']}×{format_size(c['block_size'])}" if op["op"] in ("save", "restore", "lookup") \
                else format_size(c["object_size"])
            lat = op["latency_ms"]
            found = "" if op["found_ratio"] is None else f"{op['found_ratio'] * 100:.1f}%"
            table.add_row(op["op"], shape, f"{op['ops']:,}", f"{op['failed']:,}" if op["failed"] else "0",
                          f"{op['seconds']:.2f}", f"{op['ops_per_s'] or 0:,.1f}",
                          f"{(op['bytes_per_s'] or 0) / 1e6:,.1f}" if op["bytes"] else "–",
                          fmt_ms(lat["p50"]), fmt_ms(lat["p90"]), fmt_ms(lat["p99"]), fmt_ms(lat["max"]), found)
        console.print(table)
        for op in report["operations"]:
            for message, n in op["errors"].items():
                console.print(f"[red]{op['op']}: {n} × {message}[/]")
            if op["stopped_by"] != "count":
                console.print(f"{op['op']}: stopped ({STOPPED[op['stopped_by']]}) after {op['ops']:,} of "
                              f"{op['planned']:,} requests")
        cleanup = report["cleanup"]
        if cleanup["kept"]:
            console.print(f"kept (--keep): {cleanup['prompts']:,} prompts and {cleanup['objects']:,} objects in "
                          f"bucket {c['namespace']} (they expire after {c['ttl']:g} s)")
        else:
            where = len(cleanup["bucket_deleted_on"])
            sent = cleanup["prompts"] * c["blocks"]
            gone = "" if cleanup["blocks_deleted"] >= sent else "; the others were evicted, expired or never stored"
            console.print(f"cleaned up: deleted {cleanup['blocks_deleted']:,} blocks (of {sent:,} sent{gone}) and "
                          f"{cleanup['objects_deleted']:,} objects; bucket {c['namespace']} deleted on {where} node"
                          f"{'' if where == 1 else 's'}"
                          + ("" if where == len(report["nodes"]) else " (it existed before on the others)"))
        for error in cleanup["errors"]:
            console.print(f"[red]cleanup: {error}[/]")
