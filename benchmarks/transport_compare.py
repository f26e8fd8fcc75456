"""The client's HTTP transport, measured: one bulk ``get`` of 2048 × 64 KiB blocks (128 MiB) fetched from one
ctxstore node into a preallocated buffer, by ctxstore's own transport and by general-purpose Python HTTP
clients.

Command (from the repository root; results go in docs/benchmarks.md, the plot to
docs/benchmarks-transport.png):

    .venv/bin/pip install -e '.[bench]'                # aiohttp, urllib3, matplotlib (uvloop comes with the server)
    .venv/bin/python benchmarks/transport_compare.py   # --runs 20 --warmup 2 (defaults)

Every variant sends the same request: ``POST wire.path(bucket, "get")`` with the frame
``wire.encode_keys_request("get", KeysRequest(keys))``, signed by ``ctxstore.sigv4.Signer`` (fresh signature
per call), over a kept-alive connection, and must end with every block in its 64 KiB slot of the same
preallocated 128 MiB bytearray (checked byte for byte after the timed runs). Variants:

- ``ctxstore Pool (asyncio)``: ``ctxstore.transport.Pool`` + ``ctxstore.frames.GetReader`` on a default asyncio
  event loop (the loop ``ContextStore`` runs): the socket reads straight into each block's slot
  (``BufferedProtocol``).
- ``ctxstore Pool (uvloop)``: the same code on a uvloop event loop.
- ``ContextStore.restore``: the full sync client, ``Namespace.restore(tokens, out=arena)`` — adds key hashing,
  the hop to the client's loop thread and XXH3-64 verification of every block (the transport rows verify
  nothing); also with ``out=`` a list of 2048 per-block views (the arena's slots), and with ``out=None`` (the
  client allocates a new buffer per block; its end state is those buffers, not the arena).
- ``aiohttp read()+copy``: ``await resp.read()`` (the whole body as one ``bytes``), then the payloads copied
  into their slots.
- ``aiohttp streamed``: the body's chunks as they arrive (``resp.content.iter_any()``) copied into their
  slots.
- ``urllib3 readinto``: ``preload_content=False`` then ``HTTPResponse.readinto(slot)`` per block (urllib3 2.x
  implements ``readinto`` as ``read()`` plus a copy).
- ``http.client readinto``: the standard library's ``HTTPResponse.readinto(slot)`` per block (reads of a slot
  larger than its buffer go straight from the socket into the slot).
- ``curl → /dev/null``: reference only, when curl is installed: a native client that discards the body (one
  process per call, so a few ms of start-up included); roughly what the server alone can send.

Method: the node pinned to core 0 (``taskset -c 0``), this process to core 1. ``--warmup`` untimed calls per
variant, then ``--runs`` rounds timing one call of every variant, order alternating between rounds, bounded
by ``--budget`` seconds. Median and p99 (nearest rank) latency, GB/s (10^9 bytes) from the median, each
variant's median time over ctxstore Pool (asyncio)'s, and CPU time per call (client process with its threads
and finished children; the server process), from /proc and getrusage. On a shared machine the CPU per call is
the steadier figure: it says what each client costs, while wall time also says how long each side waited for
a core.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import xxhash

from ctxstore import ContextStore, Timeouts, wire
from ctxstore.buffers import Destinations
from ctxstore.frames import GetReader
from ctxstore.sigv4 import Signer
from ctxstore.transport import BytesReader, Pool, request_head

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# The sibling module's process, measurement and plot helpers.
from _common import (
    ACCESS,
    CLIENT_CORE,
    DOCS,
    SECRET,
    SERVER_CORE,
    Processes,
    Variant,
    busy_cores,
    exit_on_sigterm,
    free_port,
    measure,
    pin_client,
    pyplot,
    save_figure,
    source_state,
    start_ctxstore,
    stats,
    today,
    version,
    wait_ctxstore,
)

N_BLOCKS = 2048
BLOCK = 64 << 10
BUCKET = "bench-transport"


class Sink:
    """Places a ``get`` response body arriving in pieces: the frame head, then each payload into its slot."""

    def __init__(self, arena: memoryview, n_keys: int) -> None:
        self.arena = arena
        self.n_keys = n_keys
        self.slot = len(arena) // n_keys
        self._head = bytearray()
        self._targets: list[memoryview] | None = None
        self._t = 0
        self._pos = 0
        self.placed = 0

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data)
        if self._targets is None:
            self._head += view
            if len(self._head) < wire.HEAD_LEN.size or len(self._head) < wire.head_length(self._head):
                return
            head, end = wire.unpack_head(self._head, wire.ANY_HEAD)
            self._targets = targets(self.arena, self.slot, wire.decode_get_head(head, self.n_keys))
            view = memoryview(bytes(self._head[end:]))
        while len(view):
            target = self._targets[self._t]
            k = min(len(target) - self._pos, len(view))
            target[self._pos:self._pos + k] = view[:k]
            view = view[k:]
            self._pos += k
            if self._pos == len(target):
                self._t += 1
                self._pos = 0
                self.placed += 1


def targets(arena: memoryview, slot: int, meta: wire.GetResponse) -> list[memoryview]:
    """The slot view of every present block, in payload order."""
    return [arena[i * slot:i * slot + size] for i, size in enumerate(meta.sizes) if size > 0]


def read_frame_head(readinto: object, n_keys: int) -> wire.GetResponse:
    """Read the frame head with a ``readinto``-style function."""
    prefix = bytearray(wire.HEAD_LEN.size)
    fill(readinto, memoryview(prefix))
    rest = bytearray(wire.head_length(prefix) - len(prefix))
    fill(readinto, memoryview(rest))
    head, _ = wire.unpack_head(bytes(prefix) + bytes(rest))
    return wire.decode_get_head(head, n_keys)


def fill(readinto: object, target: memoryview) -> None:
    pos = 0
    while pos < len(target):
        n = readinto(target[pos:])  # type: ignore[operator]
        if not n:
            raise RuntimeError("the body ended early")
        pos += n


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--budget", type=float, default=100.0, help="seconds of timed rounds, at most")
    parser.add_argument("--plot", type=Path, default=DOCS / "benchmarks-transport.png", help="where to write the PNG")
    args = parser.parse_args()
    if not 1 <= args.runs <= 200 or not 0 <= args.warmup <= 10:
        parser.error("--runs must be 1..200 and --warmup 0..10")
    try:
        import aiohttp
        import urllib3
        import uvloop
    except ImportError as exc:
        print(f"missing {exc.name}: .venv/bin/pip install aiohttp urllib3 "
              "(uvloop comes with ctxstore[server])", file=sys.stderr)
        return 2

    exit_on_sigterm()
    busy = busy_cores()
    pinned = pin_client()
    load0 = os.getloadavg()
    started = time.monotonic()
    procs = Processes()
    loops: list[asyncio.AbstractEventLoop] = []
    store: ContextStore | None = None
    cleanups: list[object] = []
    try:
        port = free_port()
        server = start_ctxstore(procs, port)
        wait_ctxstore(procs, server, port)
        host = f"127.0.0.1:{port}"
        store = ContextStore(host, access_key=ACCESS, secret_key=SECRET,
                             timeouts=Timeouts(connect=5, read=20, total=60), strict=True)
        ns = store.namespace(BUCKET, model="bench/transport-compare", block_size=16)
        rng = random.Random(99)
        tokens = [rng.randrange(128000) for _ in range(N_BLOCKS * 16)]
        source = os.urandom(N_BLOCKS * BLOCK)
        src = memoryview(source)
        saved = ns.save(tokens, [src[i * BLOCK:(i + 1) * BLOCK] for i in range(N_BLOCKS)])
        if saved.stored + saved.existed != N_BLOCKS:
            raise RuntimeError(f"save: {saved}")
        keys = ns.block_hashes(tokens)
        frame = wire.encode_keys_request("get", wire.KeysRequest(keys))
        path = wire.path(BUCKET, "get")
        signer = Signer(ACCESS, SECRET)
        arena = bytearray(N_BLOCKS * BLOCK)
        view = memoryview(arena)

        def signed() -> dict[str, str]:
            return {**dict(signer.headers("POST", host, path)), "content-type": "application/x-msgpack"}

        # (a) ctxstore's transport on two event loops
        def ctx_pool_on(loop: asyncio.AbstractEventLoop) -> tuple[Callable[[], int], Pool]:
            pool = Pool("127.0.0.1", port, limit=1, connect_timeout=5, read_timeout=20)

            async def call() -> int:
                head = request_head("POST", host, path, signer.headers("POST", host, path), len(frame))
                reader = GetReader(N_BLOCKS, Destinations(arena, N_BLOCKS), range(N_BLOCKS))
                response = await pool.request(head, (frame,),
                                              lambda status, n: reader if status == 200 else BytesReader(n))
                if response.status != 200:
                    raise RuntimeError(f"status {response.status}")
                return sum(v is not None for v in reader.views)

            return (lambda: loop.run_until_complete(call())), pool

        aloop = asyncio.new_event_loop()
        uloop = uvloop.new_event_loop()
        loops += [aloop, uloop]
        ctx_asyncio, pool_a = ctx_pool_on(aloop)
        ctx_uvloop, pool_u = ctx_pool_on(uloop)
        cleanups += [pool_a.close, pool_u.close]

        # (b) aiohttp
        async def make_session() -> aiohttp.ClientSession:
            return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1),
                                         timeout=aiohttp.ClientTimeout(total=60), auto_decompress=False)

        session = aloop.run_until_complete(make_session())
        cleanups.append(lambda: aloop.run_until_complete(session.close()))
        url = f"http://{host}{path}"

        async def aiohttp_read() -> int:
            async with session.post(url, data=frame, headers=signed()) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"status {resp.status}")
                body = await resp.read()
            sink = Sink(view, N_BLOCKS)
            sink.feed(body)
            return sink.placed

        async def aiohttp_stream() -> int:
            async with session.post(url, data=frame, headers=signed()) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"status {resp.status}")
                sink = Sink(view, N_BLOCKS)
                async for chunk in resp.content.iter_any():
                    sink.feed(chunk)
            return sink.placed

        # (c) urllib3, (d) http.client
        u3 = urllib3.HTTPConnectionPool("127.0.0.1", port, maxsize=1, retries=False,
                                        timeout=urllib3.Timeout(connect=5, read=20))
        cleanups.append(u3.close)

        def urllib3_readinto() -> int:
            resp = u3.urlopen("POST", path, body=frame, headers=signed(), preload_content=False,
                              decode_content=False)
            try:
                if resp.status != 200:
                    raise RuntimeError(f"status {resp.status}")
                meta = read_frame_head(resp.readinto, N_BLOCKS)
                blocks = targets(view, BLOCK, meta)
                for target in blocks:
                    fill(resp.readinto, target)
                return len(blocks)
            finally:
                resp.release_conn()

        hc = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
        cleanups.append(hc.close)

        def httpclient_readinto() -> int:
            hc.request("POST", path, body=frame, headers=signed())
            resp = hc.getresponse()
            if resp.status != 200:
                raise RuntimeError(f"status {resp.status}")
            meta = read_frame_head(resp.readinto, N_BLOCKS)
            blocks = targets(view, BLOCK, meta)
            for target in blocks:
                fill(resp.readinto, target)
            if resp.read(1):
                raise RuntimeError("bytes after the last payload")
            return len(blocks)

        def full_client() -> int:
            return ns.restore(tokens, out=arena).n_blocks

        per_block = [view[i * BLOCK:(i + 1) * BLOCK] for i in range(N_BLOCKS)]  # the arena's slots, as a list

        def full_client_list() -> int:
            return ns.restore(tokens, out=per_block).n_blocks

        def full_client_alloc() -> int:
            return ns.restore(tokens).n_blocks

        fd, frame_path = tempfile.mkstemp(prefix="bench-get-frame-")
        with os.fdopen(fd, "wb") as f:
            f.write(frame)
        cleanups.append(lambda: os.unlink(frame_path))

        def curl_discard() -> int:
            """Reference only: a native client that throws the body away (the server's ceiling, roughly)."""
            argv = ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "--max-time", "60",
                    "--data-binary", f"@{frame_path}", f"http://{host}{path}"]
            for name, value in signed().items():
                argv += ["-H", f"{name}: {value}"]
            done = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=90)
            return int(done.stdout or 0)

        pids = [server.pid]
        variants = [
            Variant("ctxstore Pool (asyncio)", ctx_asyncio, N_BLOCKS, pids),
            Variant("ctxstore Pool (uvloop)", ctx_uvloop, N_BLOCKS, pids),
            Variant("ContextStore.restore, out=arena (full client)", full_client, N_BLOCKS, pids),
            Variant("ContextStore.restore, out=per-block list", full_client_list, N_BLOCKS, pids),
            Variant("ContextStore.restore, out=None (allocates)", full_client_alloc, N_BLOCKS, pids),
            Variant("aiohttp read()+copy", lambda: aloop.run_until_complete(aiohttp_read()), N_BLOCKS, pids),
            Variant("aiohttp streamed", lambda: aloop.run_until_complete(aiohttp_stream()), N_BLOCKS, pids),
            Variant("urllib3 readinto", urllib3_readinto, N_BLOCKS, pids),
            Variant("http.client readinto", httpclient_readinto, N_BLOCKS, pids),
        ]
        if shutil.which("curl"):
            variants.append(Variant("curl → /dev/null (reference, body discarded)", curl_discard, 200, pids))
        measure(variants, args.warmup, args.runs, args.budget)
        expected = xxhash.xxh3_128_intdigest(source)
        for v in variants:  # same end state for all (but curl and out=None, which keep nothing in the arena)
            if v.call is curl_discard or v.call is full_client_alloc:
                continue
            view[:] = bytes(len(arena))
            v.call()
            if xxhash.xxh3_128_intdigest(view) != expected:
                raise RuntimeError(f"{v.system}: the arena does not hold the blocks")
        load1 = os.getloadavg()
        client = f"on core {CLIENT_CORE}" if pinned else "NOT pinned"
        print(f"transport_compare, {today()}: one bulk get of {N_BLOCKS} × {BLOCK >> 10} KiB "
              f"({N_BLOCKS * BLOCK >> 20} MiB) from one node; {os.cpu_count()} CPUs, "
              f"server on core {SERVER_CORE}, client {client}; "
              f"{args.runs} rounds after {args.warmup} warm-ups; took {time.monotonic() - started:.0f} s; "
              f"load average {load0[0]:.1f} → {load1[0]:.1f}; cores busy with other work just before: {busy}")
        print(f"Python {sys.version.split()[0]}, aiohttp {version('aiohttp')}, urllib3 {version('urllib3')}, "
              f"uvloop {version('uvloop')}, ctxstore {version('ctxstore')} ({source_state()})")
        print()
        print_table(variants, len(source))
        plot(variants, args.plot, f"benchmarks/transport_compare.py, {today()}, {source_state()}, "
                                  f"load {load0[0]:.1f}→{load1[0]:.1f}")
    finally:
        for cleanup in cleanups:
            try:
                cleanup()  # type: ignore[operator]
            except Exception as exc:  # noqa: BLE001 - best effort, keep stopping the rest
                print(f"# cleanup: {exc}", file=sys.stderr)
        if store is not None:
            store.close()
        for loop in loops:
            loop.close()
        procs.stop()
    return 0


def print_table(variants: Sequence[Variant], nbytes: int) -> None:
    base = stats(variants[0].times)[0]
    print("| client | runs | median ms | p99 ms | GB/s | time ÷ ctxstore Pool (asyncio) | client CPU ms/call "
          "| server CPU ms/call |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for v in variants:
        med, p99 = stats(v.times)
        n = len(v.times)
        print(f"| {v.system} | {n} | {med * 1000:.1f} | {p99 * 1000:.1f} | {nbytes / med / 1e9:.2f} | "
              f"{med / base:.2f} | {v.client_cpu / n * 1000:.0f} | {v.server_cpu / n * 1000:.0f} |")


def plot(variants: Sequence[Variant], path: Path, note: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    base = stats(variants[0].times)[0]
    fig, ax = plt.subplots(figsize=(7.5, 3.2))
    medians = [stats(v.times)[0] * 1000 for v in variants]
    ax.barh(range(len(variants)), medians, color=["#1f77b4" if v.system.startswith(("ctxstore", "ContextStore"))
                                                  else "#7f7f7f" for v in variants])
    for i, m in enumerate(medians):
        ax.text(m, i, f" {m:.0f} ms ({m / 1000 / base:.2f}×)", va="center", fontsize=6)
    ax.set_yticks(range(len(variants)), [v.system for v in variants], fontsize=6)
    ax.invert_yaxis()
    ax.set_xlabel("ms per bulk get of 2048 × 64 KiB (median; label: time ÷ ctxstore Pool (asyncio))")
    ax.margins(x=0.3)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    save_figure(plt, fig, path, note)


if __name__ == "__main__":
    sys.exit(main())
