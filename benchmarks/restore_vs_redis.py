"""Restore and lookup of a 32k-token prompt: ctxstore's bulk API against Redis (redis-py + hiredis), 1 and 3
nodes.

Command (results go in docs/benchmarks.md):

    apt-get install -y redis-server                          # the peer (Debian: Redis 7)
    .venv/bin/pip install redis hiredis                      # its Python client and C parser
    .venv/bin/python benchmarks/restore_vs_redis.py          # --runs 20 --warmup 2 --nodes 1,3 (defaults)

What it measures, per pod size (1 node, 3 nodes), both systems loaded with the same blocks under the same keys
(the namespace's chained xxh3-128 block hashes):

- restore 2048 × 64 KiB (16-token blocks) and 128 × 1 MiB (256-token blocks), 128 MiB each, of a
  32768-token prompt. ctxstore: ``Namespace.restore(tokens, out=arena)`` on the sync client, ``arena`` one
  preallocated bytearray (equal 64 KiB / 1 MiB slots). Redis: compute the same keys, one ``MGET`` per server,
  copy each value into the same arena slot. Both end with the blocks in the caller's buffer (checked byte for
  byte after the timed runs); ctxstore also verifies every block's XXH3-64, Redis verifies nothing.
- lookup of 8192 keys (131072 tokens, 16-token blocks, 4 KiB values): ctxstore ``Namespace.lookup(tokens)``
  (one bulk call per node; checked through the client's metrics), against two per-key presence checks on
  Redis: a pipelined ``EXISTS`` per key (the plain redis-py way) and one ``EVALSHA`` of a Lua script returning
  ``EXISTS`` per key (the cheapest single-command per-key check; multi-key ``EXISTS`` only returns a count, so
  it cannot give the cached prefix and is not used). Both sides compute the keys from the tokens inside the
  timed region.

Sharding: Redis keys are placed on servers by the same rendezvous rule the ctxstore client uses (XXH3-64 of
the key seeded by the server's ``host:port``, highest weight wins, with a per-key owner cache as in
``ctxstore.pod``); with 3 servers the per-server commands run concurrently on 3 threads of a persistent pool
(the ctxstore client fans out on its event loop).

Method: servers pinned to core 0 (``taskset -c 0``; all 3 nodes of a pod share that core), the client process
to core 1 (``os.sched_setaffinity``). Per scenario: ``--warmup`` untimed calls per system, then ``--runs``
rounds, each round timing one call of every system, the order alternating between rounds (noise hits both
sides alike),
bounded by ``--budget`` seconds per scenario. Reported: median and p99 (nearest rank: with 20 runs that is the
slowest run) latency, GB/s (10^9 bytes) from the median, ctxstore's throughput over Redis's (= Redis median
time / ctxstore median time) and the median of per-round ratios, and the CPU time per call each side used
(client process and its threads; all server processes of that system; from /proc, 10 ms ticks averaged over
the runs). CPU per call is the steadier figure on a shared machine: a process that waits for a core to be free
gets slower in wall time but not in CPU time.
"""

from __future__ import annotations

import argparse
import ctypes
import math
import os
import random
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib import metadata

import xxhash

from ctxstore import ContextStore, Namespace, Timeouts

ACCESS, SECRET = "BENCHACCESSKEY000001", "bench-secret-key-000001"
SERVER_CORE, CLIENT_CORE = 0, 1
PROMPT_TOKENS = 32768
LOOKUP_KEYS = 8192
LOOKUP_VALUE = 4 << 10
RESTORES = (  # (label, tokens per block, bytes per block)
    ("restore 2048 × 64 KiB", 16, 64 << 10),
    ("restore 128 × 1 MiB", 256, 1 << 20),
)


# ---------------------------------------------------------------------------- processes (shared with
# transport_compare.py, which imports these)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def exit_on_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C, so the ``finally`` blocks stop every server this benchmark started."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def pin_client() -> bool:
    """Pin this process (and the threads it starts later) to the client core."""
    if len(os.sched_getaffinity(0)) < 2 or (os.cpu_count() or 1) < 2:
        print("# warning: fewer than 2 cores; client and servers are not separated", file=sys.stderr)
        return False
    os.sched_setaffinity(0, {CLIENT_CORE})
    return True


def client_cpu_seconds() -> float:
    """CPU of this process (all threads) plus its finished children (e.g. a curl per call)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process (all its threads) so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _die_with_parent() -> None:
    """In the child before exec: the kernel sends it SIGTERM if this benchmark dies, however it dies."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG (kept across exec of taskset and the server)


class Processes:
    """Servers started by this benchmark; :meth:`stop` ends exactly these (by their own handles)."""

    def __init__(self) -> None:
        self.procs: list[tuple[str, subprocess.Popen[bytes], str]] = []

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        fd, path = tempfile.mkstemp(prefix=f"bench-{name}-", suffix=".log")
        with os.fdopen(fd, "wb") as log:
            # Servers start before any client thread exists (and after the previous pod's threads ended).
            proc = subprocess.Popen(["taskset", "-c", str(SERVER_CORE), *argv], env=env, stdout=log,
                                    stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)  # noqa: PLW1509
        self.procs.append((name, proc, path))
        return proc

    def log_tail(self, proc: subprocess.Popen[bytes]) -> str:
        for _, p, path in self.procs:
            if p is proc:
                with open(path, errors="replace") as f:
                    return f.read()[-2000:]
        return ""

    def stop(self) -> None:
        for _, proc, _ in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for _, proc, path in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
            os.unlink(path)
        self.procs.clear()


def start_ctxstore(procs: Processes, port: int) -> subprocess.Popen[bytes]:
    env = {**os.environ, "CTXSTORE_ACCESS_KEY": ACCESS, "CTXSTORE_SECRET_KEY": SECRET}
    return procs.start("ctxstore", [sys.executable, "-m", "ctxstore_server.serve", "--port", str(port),
                                    "--memory", "2GiB", "--log-level", "warning"], env)


def wait_ctxstore(procs: Processes, proc: subprocess.Popen[bytes], port: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    url = f"http://127.0.0.1:{port}/_ctx/health/ready"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"ctxstore on port {port} exited:\n{procs.log_tail(proc)}")
        try:
            urllib.request.urlopen(url, timeout=1).close()
            return
        except (urllib.error.URLError, OSError):
            time.sleep(0.1)
    raise RuntimeError(f"ctxstore on port {port} did not become ready in {timeout:g} s")


def start_redis(procs: Processes, port: int) -> subprocess.Popen[bytes]:
    return procs.start("redis", ["redis-server", "--save", "", "--appendonly", "no", "--port", str(port),
                                 "--bind", "127.0.0.1", "--dir", tempfile.gettempdir()])


def busy_cores(seconds: float = 2.0) -> str:
    """How busy each core was (all processes, before this benchmark starts its own): the noise to expect."""

    def snap() -> dict[str, list[int]]:
        with open("/proc/stat") as f:
            return {p[0]: [int(x) for x in p[1:]] for p in (line.split() for line in f)
                    if p[0].startswith("cpu") and p[0] != "cpu"}

    a = snap()
    time.sleep(seconds)
    b = snap()
    out = []
    for cpu in sorted(a):
        delta = [y - x for x, y in zip(a[cpu], b[cpu], strict=True)]
        idle = delta[3] + delta[4]
        out.append(f"{cpu} {100 * (1 - idle / max(1, sum(delta))):.0f}%")
    return ", ".join(out)


def source_state() -> str:
    """The commit the code under test is at, and whether the working tree differs from it."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        head = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], check=False,
                              capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                               check=False, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "source: unknown"
    return f"source: {head or 'unknown'}{' + uncommitted changes' if dirty else ''}"


def stats(samples: Sequence[float]) -> tuple[float, float]:
    """(median, p99 by nearest rank) of ``samples``."""
    ordered = sorted(samples)
    return statistics.median(ordered), ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


def version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


# ---------------------------------------------------------------------------- Redis side


class RedisPod:
    """N Redis servers with keys placed by rendezvous hashing, as the ctxstore client places them."""

    def __init__(self, ports: Sequence[int]) -> None:
        import redis

        self.clients = [redis.Redis(host="127.0.0.1", port=p, socket_timeout=30, socket_connect_timeout=5)
                        for p in ports]
        self._seeds = [xxhash.xxh3_64_intdigest(f"127.0.0.1:{p}".encode()) for p in ports]
        self._owner: dict[str, int] = {}
        self._pool = ThreadPoolExecutor(len(ports)) if len(ports) > 1 else None
        script = "local r = {} for i = 1, #KEYS do r[i] = redis.call('EXISTS', KEYS[i]) end return r"
        self._scripts = [c.register_script(script) for c in self.clients]

    def wait(self, timeout: float = 30) -> None:
        import redis

        deadline = time.monotonic() + timeout
        for client in self.clients:
            while True:
                try:
                    client.ping()
                    break
                except redis.ConnectionError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)

    def group(self, keys: Sequence[str]) -> dict[int, list[int]]:
        groups: dict[int, list[int]] = {}
        for i, key in enumerate(keys):
            s = self._owner.get(key)
            if s is None:
                data = key.encode()
                weights = [xxhash.xxh3_64_intdigest(data, seed=seed) for seed in self._seeds]
                s = self._owner[key] = weights.index(max(weights))
            groups.setdefault(s, []).append(i)
        return groups

    def fan_out(self, keys: Sequence[str], one: Callable[[int, list[int]], int]) -> int:
        groups = self.group(keys)
        if self._pool is None or len(groups) == 1:
            return sum(one(s, idx) for s, idx in groups.items())
        return sum(f.result() for f in [self._pool.submit(one, s, idx) for s, idx in groups.items()])

    def load(self, keys: Sequence[str], blocks: Sequence[memoryview]) -> None:
        def one(s: int, idx: list[int]) -> int:
            pipe = self.clients[s].pipeline(transaction=False)
            size = 0
            for i in idx:
                pipe.set(keys[i], blocks[i])
                size += len(blocks[i])
                if size >= 32 << 20:
                    pipe.execute()
                    size = 0
            pipe.execute()
            return len(idx)

        self.fan_out(keys, one)

    def restore(self, keys: Sequence[str], arena: memoryview, slot: int) -> int:
        """One MGET per server, each value copied into its block's slot; returns how many were found."""

        def one(s: int, idx: list[int]) -> int:
            values = self.clients[s].mget([keys[i] for i in idx])
            found = 0
            for i, value in zip(idx, values, strict=True):
                if value is not None:
                    start = i * slot
                    arena[start:start + len(value)] = value
                    found += 1
            return found

        return self.fan_out(keys, one)

    def lookup_pipelined(self, keys: Sequence[str]) -> int:
        """Cached prefix length from a pipelined EXISTS per key (one pipeline per server)."""
        present = [False] * len(keys)

        def one(s: int, idx: list[int]) -> int:
            pipe = self.clients[s].pipeline(transaction=False)
            for i in idx:
                pipe.exists(keys[i])
            for i, hit in zip(idx, pipe.execute(), strict=True):
                present[i] = bool(hit)
            return 0

        self.fan_out(keys, one)
        return _prefix(present)

    def lookup_script(self, keys: Sequence[str]) -> int:
        """Cached prefix length from one EVALSHA per server returning EXISTS per key."""
        present = [False] * len(keys)

        def one(s: int, idx: list[int]) -> int:
            for i, hit in zip(idx, self._scripts[s](keys=[keys[i] for i in idx]), strict=True):
                present[i] = bool(hit)
            return 0

        self.fan_out(keys, one)
        return _prefix(present)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
        for client in self.clients:
            client.close()


def _prefix(present: Sequence[bool]) -> int:
    for i, hit in enumerate(present):
        if not hit:
            return i
    return len(present)


# ---------------------------------------------------------------------------- measurement


@dataclass
class Variant:
    system: str
    call: Callable[[], int]  # returns blocks restored / prefix length, checked against `expect`
    expect: int
    server_pids: list[int]
    times: list[float] = field(default_factory=list)
    client_cpu: float = 0.0
    server_cpu: float = 0.0


def measure(variants: list[Variant], warmup: int, runs: int, budget: float) -> None:
    """Warm-ups, then rounds of one timed call per variant (order alternating), within ``budget`` seconds."""
    for v in variants:
        for _ in range(warmup):
            _check(v, v.call())
    deadline = time.monotonic() + budget
    for r in range(runs):
        if time.monotonic() > deadline:
            print(f"# budget of {budget:g} s reached after {r} rounds", file=sys.stderr)
            break
        for v in (variants if r % 2 == 0 else variants[::-1]):
            s0 = sum(cpu_seconds(p) for p in v.server_pids)
            c0 = client_cpu_seconds()
            t0 = time.perf_counter()
            got = v.call()
            v.times.append(time.perf_counter() - t0)
            v.client_cpu += client_cpu_seconds() - c0
            v.server_cpu += sum(cpu_seconds(p) for p in v.server_pids) - s0
            _check(v, got)


def _check(v: Variant, got: int) -> None:
    if got != v.expect:
        raise RuntimeError(f"{v.system}: got {got}, expected {v.expect}")


def rows_for(scenario: str, nodes: int, variants: list[Variant],
             nbytes: int | None) -> list[dict[str, object]]:
    base = variants[0]  # ctxstore
    rows = []
    for v in variants:
        med, p99 = stats(v.times)
        row: dict[str, object] = {
            "scenario": scenario, "nodes": nodes, "system": v.system, "runs": len(v.times),
            "median_ms": med * 1000, "p99_ms": p99 * 1000,
            "gbps": nbytes / med / 1e9 if nbytes else None,
            "client_cpu": v.client_cpu / len(v.times) * 1000,
            "server_cpu": v.server_cpu / len(v.times) * 1000,
        }
        if v is not base:
            row["ratio"] = med / stats(base.times)[0]
            row["paired"] = statistics.median(o / b for o, b in zip(v.times, base.times, strict=True))
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------- one pod size


def run_pod(n_nodes: int, args: argparse.Namespace, notes: list[str],
            round_trips: dict[int, int]) -> list[dict[str, object]]:
    procs = Processes()
    rows: list[dict[str, object]] = []
    store: ContextStore | None = None
    rpod: RedisPod | None = None
    try:
        cports = [free_port() for _ in range(n_nodes)]
        rports = [free_port() for _ in range(n_nodes)]
        cprocs = [start_ctxstore(procs, p) for p in cports]
        rprocs = [start_redis(procs, p) for p in rports]
        for proc, port in zip(cprocs, cports, strict=True):
            wait_ctxstore(procs, proc, port)
        rpod = RedisPod(rports)
        rpod.wait()
        cpids, rpids = [p.pid for p in cprocs], [p.pid for p in rprocs]
        # Generous timeouts and strict mode: a slow call under noise must fail loudly, never turn into misses.
        store = ContextStore([f"127.0.0.1:{p}" for p in cports], access_key=ACCESS, secret_key=SECRET,
                             timeouts=Timeouts(connect=5, read=20, total=60), strict=True)
        rng = random.Random(1234)
        prompt = [rng.randrange(128000) for _ in range(PROMPT_TOKENS)]
        arena = bytearray(PROMPT_TOKENS // 16 * (64 << 10))  # 128 MiB, reused by every restore
        view = memoryview(arena)

        for label, block_tokens, block_bytes in RESTORES:
            n_blocks = PROMPT_TOKENS // block_tokens
            ns = store.namespace(f"bench-b{block_tokens}", model="bench/restore-vs-redis",
                                 block_size=block_tokens)
            source = os.urandom(n_blocks * block_bytes)
            src = memoryview(source)
            blocks = [src[i * block_bytes:(i + 1) * block_bytes] for i in range(n_blocks)]
            keys = ns.block_hashes(prompt)
            saved = ns.save(prompt, blocks)
            if saved.stored + saved.existed != n_blocks:
                raise RuntimeError(f"ctxstore save: {saved}")
            rpod.load(keys, blocks)
            slot = len(arena) // n_blocks

            def ctx_restore(ns: Namespace = ns) -> int:
                return ns.restore(prompt, out=arena).n_blocks

            def redis_restore(ns: Namespace = ns, slot: int = slot) -> int:
                return rpod.restore(ns.block_hashes(prompt), view, slot)

            variants = [Variant("ctxstore", ctx_restore, n_blocks, cpids),
                        Variant("Redis MGET", redis_restore, n_blocks, rpids)]
            measure(variants, args.warmup, args.runs, args.budget)
            for v in variants:  # same end state: every block, byte for byte, in the caller's buffer
                view[:] = bytes(len(arena))
                v.call()
                if xxhash.xxh3_128_intdigest(view[:len(source)]) != xxhash.xxh3_128_intdigest(source):
                    raise RuntimeError(f"{v.system}: the arena does not hold the blocks after {label}")
            rows += rows_for(label, n_nodes, variants, len(source))
            hash_t = min(_timed(lambda ns=ns: ns.block_hashes(prompt)) for _ in range(9))
            notes.append(f"{n_nodes} node(s), {label}: computing the {n_blocks} keys from the tokens "
                         f"(both sides, inside the timed region) takes {hash_t * 1000:.2f} ms (fastest of 9)")
            del blocks, src, source

        tokens = [rng.randrange(128000) for _ in range(LOOKUP_KEYS * 16)]
        ns = store.namespace("bench-lookup", model="bench/restore-vs-redis", block_size=16)
        value = memoryview(os.urandom(LOOKUP_VALUE))
        keys = ns.block_hashes(tokens)
        saved = ns.save(tokens, [value] * LOOKUP_KEYS)
        if saved.stored + saved.existed != LOOKUP_KEYS:
            raise RuntimeError(f"ctxstore save: {saved}")
        rpod.load(keys, [value] * LOOKUP_KEYS)
        calls = _lookup_calls(store)
        if ns.lookup(tokens) != LOOKUP_KEYS:
            raise RuntimeError("ctxstore lookup did not find every key")
        calls = _lookup_calls(store) - calls
        per_node = "one per node" if calls == n_nodes else "NOT one per node"
        notes.append(f"{n_nodes} node(s): one lookup of {LOOKUP_KEYS} keys made {calls} bulk HTTP call(s) "
                     f"({per_node}; counted by the client's metrics)")
        round_trips[n_nodes] = calls
        variants = [
            Variant("ctxstore", lambda: ns.lookup(tokens), LOOKUP_KEYS, cpids),
            Variant("Redis pipelined EXISTS", lambda: rpod.lookup_pipelined(ns.block_hashes(tokens)),
                    LOOKUP_KEYS, rpids),
            Variant("Redis EVALSHA (EXISTS per key)", lambda: rpod.lookup_script(ns.block_hashes(tokens)),
                    LOOKUP_KEYS, rpids),
        ]
        measure(variants, args.warmup, args.runs, args.budget)
        rows += rows_for(f"lookup {LOOKUP_KEYS} keys", n_nodes, variants, None)
        hash_t = min(_timed(lambda: ns.block_hashes(tokens)) for _ in range(9))
        notes.append(f"{n_nodes} node(s), lookup: computing the {LOOKUP_KEYS} keys from {len(tokens)} tokens "
                     f"takes {hash_t * 1000:.2f} ms (fastest of 9)")
    finally:
        if store is not None:
            store.close()
        if rpod is not None:
            rpod.close()
        procs.stop()
    return rows


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _lookup_calls(store: ContextStore) -> int:
    latency = store.metrics_snapshot().get("latency", {})
    return int(latency.get("lookup", {}).get("count", 0))  # type: ignore[union-attr]


# ---------------------------------------------------------------------------- report


def print_report(rows: list[dict[str, object]], notes: list[str], header: list[str],
                 round_trips: dict[int, int]) -> None:
    for line in header:
        print(line)
    print()
    print("| scenario | nodes | system | runs | median ms | p99 ms | GB/s | ctxstore ÷ this: throughput "
          "(paired) | client CPU ms/call | server CPU ms/call |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        gbps = f"{r['gbps']:.2f}" if r["gbps"] is not None else "–"
        ratio = f"{r['ratio']:.2f}× ({r['paired']:.2f}×)" if "ratio" in r else "–"
        print(f"| {r['scenario']} | {r['nodes']} | {r['system']} | {r['runs']} | {r['median_ms']:.1f} | "
              f"{r['p99_ms']:.1f} | {gbps} | {ratio} | {r['client_cpu']:.0f} | {r['server_cpu']:.0f} |")
    print()
    for note in notes:
        print(f"- {note}")
    print()
    print("Targets (issue): restore ≥ 1.5× Redis MGET throughput; lookup of 8192 keys in one round trip per "
          "node.")
    for r in rows:
        if str(r["scenario"]).startswith("restore") and "ratio" in r:
            met = "met" if r["ratio"] >= 1.5 else "NOT met"  # type: ignore[operator]
            print(f"- {r['scenario']}, {r['nodes']} node(s): {r['ratio']:.2f}× Redis MGET → {met}")
    for n, calls in round_trips.items():
        others = ", ".join(f"{r['ratio']:.2f}× {r['system']}" for r in rows
                           if r["nodes"] == n and str(r["scenario"]).startswith("lookup") and "ratio" in r)
        met = "met" if calls == n else "NOT met"
        print(f"- lookup, {n} node(s): {calls} round trip(s) for {n} node(s) → {met}; "
              f"speed against Redis: {others}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20,
                        help="timed rounds per scenario (each times every system)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls per system before the rounds")
    parser.add_argument("--nodes", default="1,3", help="pod sizes to run, e.g. 1,3")
    parser.add_argument("--budget", type=float, default=35.0,
                        help="seconds of timed rounds per scenario, at most")
    args = parser.parse_args()
    if not 1 <= args.runs <= 200 or not 0 <= args.warmup <= 10:
        parser.error("--runs must be 1..200 and --warmup 0..10")
    try:
        import hiredis  # noqa: F401
        import redis  # noqa: F401
    except ImportError:
        print("redis-py and hiredis are missing: .venv/bin/pip install redis hiredis", file=sys.stderr)
        return 2
    redis_version = subprocess.run(["redis-server", "--version"], check=False, capture_output=True,
                                   text=True).stdout.split()
    exit_on_sigterm()
    busy = busy_cores()
    pinned = pin_client()
    load0 = os.getloadavg()
    started = time.monotonic()
    rows: list[dict[str, object]] = []
    notes: list[str] = []
    round_trips: dict[int, int] = {}
    for n in (int(x) for x in args.nodes.split(",")):
        rows += run_pod(n, args, notes, round_trips)
    load1 = os.getloadavg()
    client = f"on core {CLIENT_CORE}" if pinned else "NOT pinned"
    header = [
        (f"restore_vs_redis: {os.cpu_count()} CPUs, servers on core {SERVER_CORE}, client {client}; "
         f"{args.runs} rounds after {args.warmup} warm-ups; took {time.monotonic() - started:.0f} s; "
         f"load average {load0[0]:.1f} → {load1[0]:.1f}; cores busy with other work just before: {busy}"),
        (f"Python {sys.version.split()[0]}, redis-py {version('redis')}, hiredis {version('hiredis')}, "
         f"{' '.join(redis_version[:3])}, ctxstore {version('ctxstore')} ({source_state()})"),
    ]
    print_report(rows, notes, header, round_trips)
    return 0


if __name__ == "__main__":
    sys.exit(main())
