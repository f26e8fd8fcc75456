"""Restore and save of a 32k-token prompt, side by side: a ctxstore node against Redis 7, Mooncake Store over
TCP and a C loopback ceiling, plus the lookup of 8192 keys. Writes docs/benchmarks-restore-save.png.

Command (from the repository root; results go in docs/benchmarks.md):

    apt-get install -y redis-server libibverbs1 gcc       # Redis 7; the verbs library Mooncake's wheel links to
    .venv/bin/pip install -e '.[bench]'                   # redis-py + hiredis, mooncake-transfer-engine-non-cuda,
                                                          # matplotlib
    .venv/bin/python benchmarks/restore_save.py           # defaults: --runs 20 --warmup 2 --budget 25
    # optional: --baseline DIR, a checkout of an earlier commit (git worktree add DIR COMMIT): its server runs as
    #   one more system, "ctxstore before (<commit>)", driven by this client: before/after in the same rounds

A peer that is not installed (or does not start) is skipped with a message; the run goes on without it.

Systems, all on 127.0.0.1, every server pinned to core 0 (``taskset -c 0``), the client to core 1:

- ctxstore: one node started as a user starts it (``ctxstore serve --port P --memory 2GiB``), driven by the
  sync ``ctxstore.ContextStore`` (strict mode, one bulk call per operation: ``Limits(bytes_per_call=256 MiB)``;
  with the default 64 MiB a 128 MiB save is two calls). Restore: ``Namespace.restore(tokens, out=arena)``
  (keys hashed from the tokens, every block's XXH3-64 verified). Save: ``Namespace.save(tokens, blocks)``.
- Redis 7 (``redis-server --save '' --appendonly no``), redis-py with the hiredis parser: the same keys
  (``Namespace.block_hashes``, computed inside the timed region as ctxstore does), one ``MGET`` whose values
  are copied into the arena slots; one ``MSET`` for a save. Redis verifies nothing.
- Mooncake Store over TCP (``mooncake-transfer-engine-non-cuda``): ``mooncake_master`` (with its HTTP
  metadata server) plus a standalone storage node (``mooncake_client --global_segment_size=1GB
  --protocol=tcp``), both on core 0; the Python client (``MooncakeDistributedStore.setup`` with no segment of
  its own, so every byte crosses the loopback TCP transport) with the arena and the source registered
  (``register_buffer``): ``batch_get_into`` into the arena slots, ``batch_put_from`` from the source blocks.
  ``MC_TCP_BIND_ADDRESS=127.0.0.1`` keeps its transfer engine on loopback.
- C loopback ceiling (``benchmarks/loopback_ceiling.c``, compiled here with gcc): a C server and a C client
  on one TCP connection, no protocol work, preallocated warm buffers on both sides. The request names the
  keys (16 bytes each); a get answers N × SIZE bytes, a put sends them and gets an 8-byte ack. Twice: with
  the block size as every send/recv size (one syscall per block, as the bulk path makes), and with one
  call for everything that is left (the kernel's own limit).

Scenarios (128 MiB each): restore and save of 2048 × 64 KiB (16-token blocks) and 128 × 1 MiB (256-token
blocks); lookup of 8192 keys (4 KiB values; ctxstore ``Namespace.lookup``, Redis one ``EVALSHA`` returning
``EXISTS`` per key and a pipelined ``EXISTS``, Mooncake ``batch_is_exist``). Saves write fresh keys every round
(a new random prompt, made outside the timed region) and delete them after it, outside the timed region too,
so each timed save stores 128 MiB. Each restore leaves every block in the caller's 128 MiB buffer, checked
byte for byte after the rounds; saved blocks are read back and checked the same way.

Method: ``--warmup`` untimed calls per system, then ``--runs`` rounds timing one call of every system (order
reversed every other round), at most ``--budget`` seconds of rounds per scenario. Reported per system: median
and p99 (nearest rank) time, GB/s (10^9 bytes) from the median, ctxstore's throughput over this system's
(= this median / ctxstore's median) and the median of the same-round ratios, CPU per call and per GB of the
server processes (all of them: Mooncake's master and storage node) and of the client (this process with its
threads; for the C ceiling, the C client), from /proc/<pid>/stat. On a shared machine, read same-round
ratios and CPU per GB: wall time also counts waiting for a core, CPU time does not.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (
    ACCESS,
    CLIENT_CORE,
    DOCS,
    SECRET,
    SERVER_CORE,
    Processes,
    Timed,
    Variant,
    busy_cores,
    exit_on_sigterm,
    free_port,
    measure,
    paired_ratio,
    pin_client,
    pyplot,
    save_figure,
    source_commit,
    source_state,
    start_ctxstore,
    stats,
    today,
    tool_version,
    version,
    wait_ctxstore,
    wait_port,
)
from ctxstore import ContextStore, Limits, Namespace, Timeouts

PROMPT_TOKENS = 32768
SHAPES = (  # (label, tokens per block, bytes per block): 128 MiB each
    ("2048 × 64 KiB", 16, 64 << 10),
    ("128 × 1 MiB", 256, 1 << 20),
)
TOTAL = PROMPT_TOKENS // 16 * (64 << 10)
LOOKUP_KEYS = 8192
LOOKUP_VALUE = 4 << 10
PLOT = DOCS / "benchmarks-restore-save.png"
GBPS_100 = 100e9 / 8 / 1e9  # 100 Gb/s in GB/s


class PeerUnavailable(Exception):
    """A peer that is not installed here or did not start: its column is skipped."""


# ---------------------------------------------------------------------------- Redis


class RedisPeer:
    name = "Redis"

    def __init__(self, procs: Processes) -> None:
        try:
            import hiredis  # noqa: F401
            import redis
        except ImportError as exc:
            raise PeerUnavailable(f"redis-py / hiredis missing ({exc.name}): pip install -e '.[bench]'") from exc
        if shutil.which("redis-server") is None:
            raise PeerUnavailable("redis-server missing: apt-get install -y redis-server")
        port = free_port()
        self.proc = procs.start("redis", ["redis-server", "--save", "", "--appendonly", "no", "--port", str(port),
                                          "--bind", "127.0.0.1", "--dir", tempfile.gettempdir()])
        wait_port(procs, self.proc, port)
        self.client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=60, socket_connect_timeout=5)
        self.client.ping()
        script = "local r = {} for i = 1, #KEYS do r[i] = redis.call('EXISTS', KEYS[i]) end return r"
        self.script = self.client.register_script(script)
        self.version = tool_version(["redis-server", "--version"]).split(" sha=")[0]

    @property
    def pids(self) -> list[int]:
        return [self.proc.pid]

    def load(self, keys: Sequence[str], blocks: Sequence[memoryview]) -> None:
        pipe = self.client.pipeline(transaction=False)
        size = 0
        for key, block in zip(keys, blocks, strict=True):
            pipe.set(key, block)
            size += len(block)
            if size >= 32 << 20:
                pipe.execute()
                size = 0
        pipe.execute()

    def restore(self, keys: Sequence[str], arena: memoryview, slot: int) -> int:
        found = 0
        values: list[bytes | None] = self.client.mget(keys)  # type: ignore[assignment]  # no decode_responses
        for i, value in enumerate(values):
            if value is not None:
                arena[i * slot:i * slot + len(value)] = value
                found += 1
        return found

    def save(self, keys: Sequence[str], blocks: Sequence[memoryview]) -> int:
        return len(keys) if self.client.mset(dict(zip(keys, blocks, strict=True))) else 0

    def delete(self, keys: Sequence[str]) -> None:
        self.client.delete(*keys)

    def lookup_script(self, keys: Sequence[str]) -> int:
        return _prefix(bool(hit) for hit in self.script(keys=list(keys)))

    def lookup_pipelined(self, keys: Sequence[str]) -> int:
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.exists(key)
        return _prefix(bool(hit) for hit in pipe.execute())

    def close(self) -> None:
        self.client.close()


# ---------------------------------------------------------------------------- Mooncake Store


class MooncakePeer:
    name = "Mooncake"

    def __init__(self, procs: Processes, buffers: Sequence[bytearray]) -> None:
        # Its transfer engine would otherwise advertise (and be reached on) the first LAN address.
        os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"
        os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # its INFO and WARNING lines go nowhere
        try:
            import mooncake
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:  # also: libibverbs.so.1 missing
            raise PeerUnavailable(f"mooncake does not import ({exc}): pip install -e '.[bench]' "
                                  "(mooncake-transfer-engine-non-cuda) and apt-get install -y libibverbs1") from exc
        home = Path(mooncake.__file__).parent
        master_bin, node_bin = home / "mooncake_master", home / "mooncake_client"
        if not (master_bin.exists() and node_bin.exists()):
            raise PeerUnavailable(f"mooncake_master / mooncake_client not found in {home}")
        for exe in (master_bin, node_bin):
            exe.chmod(exe.stat().st_mode | 0o111)
        rpc, meta, metrics, node_port = free_port(), free_port(), free_port(), free_port()
        env = {**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1"}
        self.master = procs.start("mooncake-master", [
            str(master_bin), f"--rpc_port={rpc}", "--rpc_address=127.0.0.1",
            "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
            f"--http_metadata_server_port={meta}", "--metrics_host=127.0.0.1", f"--metrics_port={metrics}",
            "--logtostderr", "--minloglevel=1"], env)
        wait_port(procs, self.master, rpc)
        wait_port(procs, self.master, meta)
        metadata = f"http://127.0.0.1:{meta}/metadata"
        self.node = procs.start("mooncake-node", [
            str(node_bin), "--host=127.0.0.1", f"--port={node_port}", "--global_segment_size=1GB",
            f"--master_server_address=127.0.0.1:{rpc}", f"--metadata_server={metadata}", "--protocol=tcp",
            "--logtostderr", "--minloglevel=1"], env)
        wait_port(procs, self.node, node_port)
        self.store = MooncakeDistributedStore()
        # No segment of its own (0): every object lives on the storage node and crosses the TCP transport.
        if self.store.setup("127.0.0.1", metadata, 0, 16 << 20, "tcp", "", f"127.0.0.1:{rpc}") != 0:
            raise PeerUnavailable("MooncakeDistributedStore.setup failed (see the messages above)")
        self._exports = [(ctypes.c_char * len(b)).from_buffer(b) for b in buffers]
        self.addrs = [ctypes.addressof(e) for e in self._exports]
        for addr, buf in zip(self.addrs, buffers, strict=True):
            if self.store.register_buffer(addr, len(buf)) != 0:
                raise PeerUnavailable("register_buffer failed")
        self._wait_for_segment(procs)
        self.version = version("mooncake-transfer-engine-non-cuda")

    def _wait_for_segment(self, procs: Processes, timeout: float = 30) -> None:
        """Until the storage node's segment is mounted: a probe object can be put."""
        deadline = time.monotonic() + timeout
        while self.store.batch_put_from(["probe"], [self.addrs[0]], [1])[0] != 0:
            if self.node.poll() is not None or time.monotonic() > deadline:
                raise PeerUnavailable(f"the storage node never took a put:\n{procs.log_tail(self.node)}")
            time.sleep(0.2)
        self.store.batch_remove(["probe"], True)

    @property
    def pids(self) -> list[int]:
        return [self.master.pid, self.node.pid]

    def restore(self, keys: Sequence[str], base: int, slot: int, size: int) -> int:
        got = self.store.batch_get_into(list(keys), [base + i * slot for i in range(len(keys))], [size] * len(keys))
        return sum(1 for n in got if n == size)

    def save(self, keys: Sequence[str], base: int, size: int) -> int:
        codes = self.store.batch_put_from(list(keys), [base + i * size for i in range(len(keys))],
                                          [size] * len(keys))
        return sum(1 for c in codes if c == 0)

    def load(self, keys: Sequence[str], base: int, size: int, batch: int = 1024) -> int:
        """Put many small objects in batches: one batch of 8192 overflows the TCP transport's per-peer queue."""
        return sum(self.save(keys[i:i + batch], base + i * size, size) for i in range(0, len(keys), batch))

    def delete(self, keys: Sequence[str]) -> None:
        self.store.batch_remove(list(keys), True)

    def lookup(self, keys: Sequence[str]) -> int:
        return _prefix(hit == 1 for hit in self.store.batch_is_exist(list(keys)))

    def close(self) -> None:
        self.store.close()
        del self._exports


# ---------------------------------------------------------------------------- C loopback ceiling


class CeilingPeer:
    name = "C loopback"

    def __init__(self, procs: Processes, workdir: str) -> None:
        source = Path(__file__).with_name("loopback_ceiling.c")
        exe = os.path.join(workdir, "loopback_ceiling")
        if shutil.which("gcc") is None:
            raise PeerUnavailable("gcc missing: apt-get install -y gcc")
        built = subprocess.run(["gcc", "-O2", "-o", exe, str(source)], capture_output=True, text=True, check=False)
        if built.returncode != 0:
            raise PeerUnavailable(f"gcc failed: {built.stderr[-500:]}")
        port = free_port()
        self.server = procs.start("ceiling-server", [exe, "server", str(port)])
        wait_port(procs, self.server, port)
        self.client = procs.start("ceiling-client", [exe, "client", str(port)], core=CLIENT_CORE,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def command(self, line: str) -> tuple[str, int]:
        assert self.client.stdin is not None and self.client.stdout is not None
        self.client.stdin.write(line.encode() + b"\n")
        self.client.stdin.flush()
        answer = self.client.stdout.readline().decode().split()
        if len(answer) != 2:
            raise RuntimeError(f"C client: {answer!r}")
        return answer[0], int(answer[1])

    def call(self, op: str, n: int, size: int, chunk: int) -> Timed:
        status, ns = self.command(f"{op} {n} {size} {chunk}")
        return Timed(n if status == "ok" else -1, ns / 1e9)

    def verify(self, n: int, size: int) -> bool:
        return self.command(f"verify {n} {size}")[0] == "ok"


# ---------------------------------------------------------------------------- scenarios


@dataclass
class Scenario:
    label: str
    op: str  # restore | save | lookup
    nbytes: int | None
    variants: list[Variant]


def _prefix(present: Any) -> int:
    n = 0
    for hit in present:
        if not hit:
            break
        n += 1
    return n


def fresh_prompt(rng: random.Random) -> list[int]:
    return [rng.randrange(128000) for _ in range(PROMPT_TOKENS)]


@dataclass
class Bench:
    """What every scenario uses: the node's client, the peers that started, the buffers."""

    args: argparse.Namespace
    store: ContextStore
    node_pids: list[int]
    redis: RedisPeer | None
    mc: MooncakePeer | None
    ceiling: CeilingPeer | None
    arena: bytearray
    view: memoryview
    src: memoryview
    prompt: list[int]
    rng: random.Random
    baseline: ContextStore | None = None  # --baseline: a node of an earlier commit, driven by this client
    baseline_pids: list[int] | None = None
    baseline_name: str = ""


def run(args: argparse.Namespace, notes: list[str], skipped: list[str], versions: list[str]) -> list[Scenario]:
    procs = Processes()
    scenarios: list[Scenario] = []
    store: ContextStore | None = None
    closers: list[Callable[[], None]] = []
    workdir = tempfile.mkdtemp(prefix="bench-restore-save-")
    try:
        port = free_port()
        node = start_ctxstore(procs, port)
        wait_ctxstore(procs, node, port)
        arena = bytearray(TOTAL)  # the caller's buffer, reused by every restore
        source = bytearray(os.urandom(TOTAL))  # the blocks every system saves

        peers: dict[str, Any] = {}
        wanted = set(args.peers.split(","))
        makers: dict[str, Callable[[], Any]] = {
            "redis": lambda: RedisPeer(procs),
            "mooncake": lambda: MooncakePeer(procs, [arena, source]),
            "ceiling": lambda: CeilingPeer(procs, workdir),
        }
        for name, make in makers.items():
            if name not in wanted:
                skipped.append(f"{name}: not asked for (--peers)")
                continue
            try:
                peers[name] = make()
            except PeerUnavailable as exc:
                print(f"# {name}: skipped: {exc}", file=sys.stderr)
                skipped.append(f"{name}: {exc}")
                continue
            if hasattr(peers[name], "close"):
                closers.append(peers[name].close)
        store = ContextStore(f"127.0.0.1:{port}", access_key=ACCESS, secret_key=SECRET, strict=True,
                             timeouts=Timeouts(connect=5, read=20, total=60),
                             limits=Limits(bytes_per_call=256 << 20))
        rng = random.Random(1234)
        b = Bench(args, store, [node.pid], peers.get("redis"), peers.get("mooncake"), peers.get("ceiling"),
                  arena, memoryview(arena), memoryview(source), fresh_prompt(rng), rng)
        if args.baseline is not None:
            bport = free_port()
            bnode = start_ctxstore(procs, bport, source=args.baseline)
            wait_ctxstore(procs, bnode, bport)
            b.baseline = ContextStore(f"127.0.0.1:{bport}", access_key=ACCESS, secret_key=SECRET, strict=True,
                                      timeouts=Timeouts(connect=5, read=20, total=60),
                                      limits=Limits(bytes_per_call=256 << 20))
            closers.append(b.baseline.close)
            b.baseline_pids, b.baseline_name = [bnode.pid], f"ctxstore before ({source_commit(args.baseline)})"
            versions.append(f"{b.baseline_name}: the server of {args.baseline}, driven by this client")
        if b.redis:
            versions.append(f"{b.redis.version}, redis-py {version('redis')}, hiredis {version('hiredis')}")
        if b.mc:
            versions.append(f"mooncake-transfer-engine-non-cuda {b.mc.version}")
        if b.ceiling:
            versions.append(tool_version(["gcc", "--version"]))
        for label, block_tokens, block_bytes in SHAPES:
            scenarios += shape_scenarios(b, label, block_tokens, block_bytes)
        scenarios.append(lookup_scenario(b, notes))
    finally:
        for close in closers:
            try:
                close()
            except Exception as exc:  # noqa: BLE001 - keep stopping the rest
                print(f"# cleanup: {exc}", file=sys.stderr)
        if store is not None:
            store.close()
        procs.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return scenarios


def shape_scenarios(b: Bench, label: str, block_tokens: int, block_bytes: int) -> list[Scenario]:
    """Restore, then save, of 128 MiB in blocks of ``block_bytes``."""
    n = PROMPT_TOKENS // block_tokens
    ns = b.store.namespace(f"bench-b{block_tokens}", model="bench/restore-save", block_size=block_tokens)
    blocks = [b.src[i * block_bytes:(i + 1) * block_bytes] for i in range(n)]
    keys = ns.block_hashes(b.prompt)
    saved = ns.save(b.prompt, blocks)
    if saved.stored + saved.existed != n:
        raise RuntimeError(f"ctxstore save: {saved}")
    redis_peer, mc, ceiling = b.redis, b.mc, b.ceiling
    if redis_peer:
        redis_peer.load(keys, blocks)
    if mc and mc.save(keys, mc.addrs[1], block_bytes) != n:
        raise RuntimeError("Mooncake: loading the restore blocks failed")

    # restore: every system fetches the same blocks into the same buffer ------------------------------------
    def ctx_restore() -> int:
        return ns.restore(b.prompt, out=b.arena).n_blocks

    restore = [Variant("ctxstore", ctx_restore, n, b.node_pids)]
    bns = None
    if b.baseline is not None:
        bns = b.baseline.namespace(f"bench-b{block_tokens}", model="bench/restore-save", block_size=block_tokens)
        if bns.save(b.prompt, blocks).stored != n:
            raise RuntimeError("baseline ctxstore: loading the restore blocks failed")
        base_ns = bns

        def base_restore() -> int:
            return base_ns.restore(b.prompt, out=b.arena).n_blocks

        restore.append(Variant(b.baseline_name, base_restore, n, b.baseline_pids or []))
    if redis_peer:
        rp = redis_peer

        def redis_restore() -> int:
            return rp.restore(ns.block_hashes(b.prompt), b.view, block_bytes)

        restore.append(Variant("Redis MGET", redis_restore, n, rp.pids))
    if mc:
        m = mc

        def mooncake_restore() -> int:
            return m.restore(ns.block_hashes(b.prompt), m.addrs[0], block_bytes, block_bytes)

        restore.append(Variant("Mooncake batch_get_into", mooncake_restore, n, m.pids))
    if ceiling:
        restore += _ceiling_variants(ceiling, "get", n, block_bytes)
    measure(restore, b.args.warmup, b.args.runs, b.args.budget)
    expected = xxhash.xxh3_128_intdigest(b.src)
    for v in restore:  # the same end state: every block, byte for byte, in the caller's buffer
        if v.system.startswith("C "):
            continue
        b.view[:] = bytes(TOTAL)
        v.call()
        if xxhash.xxh3_128_intdigest(b.view) != expected:
            raise RuntimeError(f"{v.system}: the arena does not hold the blocks after restore {label}")

    # save: fresh keys every round (made before the timed call), deleted after it ---------------------------
    current: dict[str, tuple[list[int], list[str]]] = {}

    def fresh(system: str) -> Callable[[], None]:
        def make() -> None:
            tokens = fresh_prompt(b.rng)
            current[system] = (tokens, ns.block_hashes(tokens))  # the keys, for the clean-up only
        return make

    def ctx_save() -> int:
        result = ns.save(current["ctxstore"][0], blocks)
        return result.stored if result.existed == 0 else -1

    def ctx_delete() -> None:
        _expect(ns.delete(current["ctxstore"][0]), n, "ctxstore delete")

    save = [Variant("ctxstore", ctx_save, n, b.node_pids, prepare=fresh("ctxstore"), cleanup=ctx_delete)]
    if bns is not None:
        bsave_ns = bns

        def base_save() -> int:
            result = bsave_ns.save(current["baseline"][0], blocks)
            return result.stored if result.existed == 0 else -1

        def base_delete() -> None:
            _expect(bsave_ns.delete(current["baseline"][0]), n, "baseline ctxstore delete")

        save.append(Variant(b.baseline_name, base_save, n, b.baseline_pids or [], prepare=fresh("baseline"),
                            cleanup=base_delete))
    if redis_peer:
        rp = redis_peer

        def redis_save() -> int:
            return rp.save(ns.block_hashes(current["redis"][0]), blocks)

        def redis_delete() -> None:
            rp.delete(current["redis"][1])

        save.append(Variant("Redis MSET", redis_save, n, rp.pids, prepare=fresh("redis"), cleanup=redis_delete))
    if mc:
        m = mc

        def mooncake_save() -> int:
            return m.save(ns.block_hashes(current["mooncake"][0]), m.addrs[1], block_bytes)

        def mooncake_delete() -> None:
            m.delete(current["mooncake"][1])

        save.append(Variant("Mooncake batch_put_from", mooncake_save, n, m.pids, prepare=fresh("mooncake"),
                            cleanup=mooncake_delete))
    if ceiling:
        save += _ceiling_variants(ceiling, "put", n, block_bytes)
    measure(save, b.args.warmup, b.args.runs, b.args.budget)
    _check_saved(ns, b.rng, blocks, b.src, b.view, redis_peer, mc, block_bytes)
    if ceiling:  # a put then a get through the C pair returns the server's pattern intact
        ceiling.call("put", n, block_bytes, 0)
        ceiling.call("get", n, block_bytes, 0)
        if not ceiling.verify(n, block_bytes):
            raise RuntimeError("C loopback: the buffer does not hold the pattern after put + get")
    return [Scenario(f"restore {label}", "restore", TOTAL, restore), Scenario(f"save {label}", "save", TOTAL, save)]


def lookup_scenario(b: Bench, notes: list[str]) -> Scenario:
    """The longest cached prefix of 131072 tokens (8192 keys, all present)."""
    tokens = [b.rng.randrange(128000) for _ in range(LOOKUP_KEYS * 16)]
    ns = b.store.namespace("bench-lookup", model="bench/restore-save", block_size=16)
    values = [b.src[i * LOOKUP_VALUE:(i + 1) * LOOKUP_VALUE] for i in range(LOOKUP_KEYS)]
    keys = ns.block_hashes(tokens)
    saved = ns.save(tokens, values)
    if saved.stored + saved.existed != LOOKUP_KEYS:
        raise RuntimeError(f"ctxstore save: {saved}")

    def ctx_lookup() -> int:
        return ns.lookup(tokens)

    lookup = [Variant("ctxstore", ctx_lookup, LOOKUP_KEYS, b.node_pids)]
    if b.baseline is not None:
        lns = b.baseline.namespace("bench-lookup", model="bench/restore-save", block_size=16)
        lns.save(tokens, values)

        def base_lookup() -> int:
            return lns.lookup(tokens)

        lookup.append(Variant(b.baseline_name, base_lookup, LOOKUP_KEYS, b.baseline_pids or []))
    if b.redis:
        rp = b.redis
        rp.load(keys, values)

        def redis_script() -> int:
            return rp.lookup_script(ns.block_hashes(tokens))

        def redis_pipelined() -> int:
            return rp.lookup_pipelined(ns.block_hashes(tokens))

        lookup.append(Variant("Redis EVALSHA (EXISTS per key)", redis_script, LOOKUP_KEYS, rp.pids))
        lookup.append(Variant("Redis pipelined EXISTS", redis_pipelined, LOOKUP_KEYS, rp.pids))
    if b.mc:
        m = b.mc
        if m.load(keys, m.addrs[1], LOOKUP_VALUE) != LOOKUP_KEYS:
            raise RuntimeError("Mooncake: loading the lookup keys failed")

        def mooncake_lookup() -> int:
            return m.lookup(ns.block_hashes(tokens))

        lookup.append(Variant("Mooncake batch_is_exist", mooncake_lookup, LOOKUP_KEYS, m.pids))
    calls = _lookup_calls(b.store)
    ns.lookup(tokens)
    calls = _lookup_calls(b.store) - calls
    notes.append(f"one ctxstore lookup of {LOOKUP_KEYS} keys made {calls} bulk HTTP call(s) to its one node "
                 "(counted by the client's metrics)")
    measure(lookup, b.args.warmup, b.args.runs, b.args.budget)
    t_hash = min(_timed(lambda: ns.block_hashes(tokens)) for _ in range(5))
    notes.append(f"computing {LOOKUP_KEYS} keys from {len(tokens)} tokens (inside every lookup's timed region) "
                 f"takes {t_hash * 1000:.1f} ms (fastest of 5); 2048 keys: about a quarter of that")
    return Scenario(f"lookup {LOOKUP_KEYS} keys", "lookup", None, lookup)


def _ceiling_variants(ceiling: CeilingPeer, op: str, n: int, size: int) -> list[Variant]:
    pids = [ceiling.server.pid]
    client = [ceiling.client.pid]
    unit = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
    return [
        Variant(f"C loopback, {unit} syscalls", lambda: ceiling.call(op, n, size, size), n, pids, client),
        Variant("C loopback, unbounded syscalls", lambda: ceiling.call(op, n, size, 0), n, pids, client),
    ]


def _check_saved(ns: Namespace, rng: random.Random, blocks: Sequence[memoryview], src: memoryview, view: memoryview,
                 redis_peer: RedisPeer | None, mc: MooncakePeer | None, size: int) -> None:
    """What each system's save stored reads back byte for byte (one more save, outside the rounds)."""
    tokens = fresh_prompt(rng)
    keys = ns.block_hashes(tokens)
    expected = xxhash.xxh3_128_intdigest(src)
    checks: list[tuple[str, Callable[[], object], Callable[[], object], Callable[[], object]]] = [
        ("ctxstore", lambda: ns.save(tokens, blocks), lambda: ns.restore(tokens, out=view), lambda: ns.delete(tokens))]
    if redis_peer:
        checks.append(("Redis", lambda: redis_peer.save(keys, blocks), lambda: redis_peer.restore(keys, view, size),
                       lambda: redis_peer.delete(keys)))
    if mc:
        checks.append(("Mooncake", lambda: mc.save(keys, mc.addrs[1], size),
                       lambda: mc.restore(keys, mc.addrs[0], size, size), lambda: mc.delete(keys)))
    for name, save, restore, delete in checks:
        save()
        view[:] = bytes(len(view))
        restore()
        delete()
        if xxhash.xxh3_128_intdigest(view) != expected:
            raise RuntimeError(f"{name}: the blocks read back after a save differ from the ones saved")


def _expect(got: int, want: int, what: str) -> None:
    if got != want:
        raise RuntimeError(f"{what}: {got}, expected {want}")


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _lookup_calls(store: ContextStore) -> int:
    latency = store.metrics_snapshot().get("latency", {})
    return int(latency.get("lookup", {}).get("count", 0))  # type: ignore[union-attr]


# ---------------------------------------------------------------------------- report


@dataclass
class Row:
    scenario: Scenario
    variant: Variant
    median: float
    p99: float
    ratio: float | None  # this median / ctxstore's median: ctxstore's throughput over this system's
    paired: float | None  # the median of the same-round ratios

    def per_call(self, cpu: float) -> float:
        return cpu / len(self.variant.times)

    def per_gb(self, cpu: float) -> float | None:
        nbytes = self.scenario.nbytes
        return self.per_call(cpu) / (nbytes / 1e9) if nbytes else None


def rows_of(scenarios: Sequence[Scenario]) -> list[Row]:
    rows = []
    for sc in scenarios:
        base = sc.variants[0]
        for v in sc.variants:
            med, p99 = stats(v.times)
            ratio = paired = None
            if v is not base:
                ratio = med / stats(base.times)[0]
                paired = paired_ratio(base.times, v.times)
            rows.append(Row(sc, v, med, p99, ratio, paired))
    return rows


def _f(x: float | None, fmt: str) -> str:
    return "–" if x is None else format(x, fmt)


def print_report(rows: Sequence[Row], header: Sequence[str], notes: Sequence[str]) -> None:
    for line in header:
        print(line)
    print()
    print("| scenario | system | runs | median ms | p99 ms | GB/s | ctxstore ÷ this (same-round) | "
          "node CPU ms/call | client CPU ms/call | node CPU s/GB | client CPU s/GB |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        nbytes = r.scenario.nbytes
        gbps = f"{nbytes / r.median / 1e9:.2f}" if nbytes else "–"
        ratio = "–" if r.ratio is None else f"{r.ratio:.2f} ({r.paired:.2f})"
        print(f"| {r.scenario.label} | {r.variant.system} | {len(r.variant.times)} | {r.median * 1000:.1f} | "
              f"{r.p99 * 1000:.1f} | {gbps} | {ratio} | {r.per_call(r.variant.server_cpu) * 1000:.0f} | "
              f"{r.per_call(r.variant.client_cpu) * 1000:.0f} | {_f(r.per_gb(r.variant.server_cpu), '.3f')} | "
              f"{_f(r.per_gb(r.variant.client_cpu), '.3f')} |")
    print()
    print("Same-round ratios, ctxstore's throughput over each (median of per-round ratios; below 1: ctxstore slower):")
    print()
    by_scenario: dict[str, list[Row]] = {}
    for r in rows:
        by_scenario.setdefault(r.scenario.label, []).append(r)
    for label, group in by_scenario.items():
        parts = [f"{r.paired:.2f}× {r.variant.system}" for r in group if r.paired is not None]
        print(f"- {label}: {', '.join(parts) if parts else 'no peer ran'}")
    print()
    print("ctxstore CPU per GB and the cores it implies at 100 Gb/s (12.5 GB/s) and 400 Gb/s (50 GB/s), "
          "if CPU per GB stays as measured here:")
    print()
    print("| scenario | node CPU s/GB | node cores for 100 / 400 Gb/s | client CPU s/GB | "
          "client cores for 100 / 400 Gb/s |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        if r.ratio is not None or r.scenario.nbytes is None:
            continue
        node, client = r.per_gb(r.variant.server_cpu) or 0.0, r.per_gb(r.variant.client_cpu) or 0.0
        print(f"| {r.scenario.label} | {node:.3f} | {node * GBPS_100:.1f} / {node * GBPS_100 * 4:.1f} | "
              f"{client:.3f} | {client * GBPS_100:.1f} / {client * GBPS_100 * 4:.1f} |")
    print()
    print("Goals (issue): restore ≥ 0.9 of the C ceiling with the same syscall size and ≥ 2.5× Mooncake; save ≥ 0.7 "
          "of the C put ceiling (same syscall size) and ≥ 2× Mooncake.")
    for label, group in by_scenario.items():
        op = label.split()[0]
        if op not in ("restore", "save"):
            continue
        for r in group:
            if r.paired is None:
                continue
            goal = None
            if r.variant.system.startswith("C loopback") and "unbounded" not in r.variant.system:
                goal = 0.9 if op == "restore" else 0.7
            elif r.variant.system.startswith("Mooncake"):
                goal = 2.5 if op == "restore" else 2.0
            if goal is not None:
                met = "met" if r.paired >= goal else "NOT met"
                print(f"- {label} against {r.variant.system}: {r.paired:.2f}× (goal ≥ {goal:g}×) → {met}")
    print()
    for note in notes:
        print(f"- {note}")


def plot(rows: Sequence[Row], path: Path, note: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.6), gridspec_kw={"width_ratios": [2, 2, 1.3]})
    colours = {"ctxstore before": "#aec7e8", "ctxstore": "#1f77b4", "Redis": "#d62728", "Mooncake": "#ff7f0e", "C loopback, unbounded": "#7f7f7f",
               "C loopback": "#bbbbbb"}

    def colour(system: str) -> str:
        for prefix, c in colours.items():
            if system.startswith(prefix):
                return c
        return "#2ca02c"

    for ax, op in zip(axes[:2], ("restore", "save"), strict=True):
        groups = [(label, [r for r in rows if r.scenario.label == f"{op} {label}"]) for label, _, _ in SHAPES]
        width = 0.8 / max(1, max(len(g) for _, g in groups))
        for gi, (label, group) in enumerate(groups):
            for vi, r in enumerate(group):
                gbps = TOTAL / r.median / 1e9
                x = gi + (vi - (len(group) - 1) / 2) * width
                ax.bar(x, gbps, width * 0.92, color=colour(r.variant.system),
                       label=r.variant.system.replace(", 64 KiB", "").replace(", 1 MiB", "") if gi == 0 else None)
                text = f"{gbps:.2f}" if r.paired is None else f"{1 / r.paired:.2f}×"
                ax.text(x, gbps, text, ha="center", va="bottom", fontsize=6, rotation=90)
        ax.set_xticks(range(len(groups)), [g for g, _ in groups])
        ax.set_ylabel("GB/s (median)")
        ax.set_title(f"{op} of 128 MiB (label: peer ÷ ctxstore, same round)", fontsize=8)
        ax.margins(y=0.25)
    handles, labels = axes[0].get_legend_handles_labels()
    families = {"Redis": "Redis (MGET / MSET)", "Mooncake": "Mooncake Store TCP (batch_get_into / batch_put_from)"}
    names = [next((f for p, f in families.items() if s.startswith(p)), s) for s in labels]
    names = [s.replace(" syscalls", ", block-size syscalls") if s.startswith("C ") and "unbounded" not in s else s
             for s in names]
    fig.legend(handles, names, loc="lower center", ncol=len(names), fontsize=7, frameon=False,
               bbox_to_anchor=(0.5, 0.03))
    lk = [r for r in rows if r.scenario.op == "lookup"]
    ax = axes[2]
    ax.barh(range(len(lk)), [r.median * 1000 for r in lk], color=[colour(r.variant.system) for r in lk])
    for i, r in enumerate(lk):
        ax.text(r.median * 1000, i, f" {r.median * 1000:.0f}", va="center", fontsize=6)
    ax.set_yticks(range(len(lk)), [r.variant.system.replace(" (EXISTS per key)", "") for r in lk], fontsize=6)
    ax.invert_yaxis()
    ax.set_xlabel("ms (median)")
    ax.set_title(f"lookup of {LOOKUP_KEYS} keys", fontsize=8)
    ax.margins(x=0.2)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    save_figure(plt, fig, path, note)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20, help="timed rounds per scenario (each times every system)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls per system before the rounds")
    parser.add_argument("--budget", type=float, default=25.0, help="seconds of timed rounds per scenario, at most")
    parser.add_argument("--peers", default="redis,mooncake,ceiling", help="which peers to run (comma-separated)")
    parser.add_argument("--plot", type=Path, default=PLOT, help="where to write the PNG")
    parser.add_argument("--baseline", type=Path, default=None,
                        help="a checkout of an earlier commit: its server runs as one more system (before/after)")
    args = parser.parse_args()
    if not 1 <= args.runs <= 200 or not 0 <= args.warmup <= 10:
        parser.error("--runs must be 1..200 and --warmup 0..10")
    exit_on_sigterm()
    busy = busy_cores()
    pinned = pin_client()
    load0 = os.getloadavg()
    started = time.monotonic()
    notes: list[str] = []
    skipped: list[str] = []
    versions: list[str] = []
    scenarios = run(args, notes, skipped, versions)
    load1 = os.getloadavg()
    client = f"on core {CLIENT_CORE}" if pinned else "NOT pinned"
    state = source_state()
    header = [
        (f"restore_save, {today()}: {os.cpu_count()} CPUs, servers on core {SERVER_CORE}, client {client}; "
         f"{args.runs} rounds after {args.warmup} warm-ups; took {time.monotonic() - started:.0f} s; "
         f"load average {load0[0]:.1f} → {load1[0]:.1f}; cores busy with other work just before: {busy}"),
        f"Python {sys.version.split()[0]}, ctxstore {version('ctxstore')} ({state}); " + "; ".join(versions),
    ]
    header += [f"skipped {s}" for s in skipped]
    rows = rows_of(scenarios)
    print_report(rows, header, notes)
    plot(rows, args.plot, f"benchmarks/restore_save.py, {today()}, {state}, load {load0[0]:.1f}→{load1[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
