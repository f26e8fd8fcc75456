"""The client when the pod misbehaves: a node killed mid-run and restarted, a node that never answers, a node
answering 500s, wrong credentials, and the nodes' own limits. Lookups and restores must return misses within
their timeouts (strict mode raises), and a node that comes back must be used again."""

from __future__ import annotations

import http.server
import os
import random
import secrets
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from support.nodes import ACCESS_KEY, SECRET_KEY, Node, start_node, wait_ready
from ctxstore import (
    AsyncContextStore,
    AuthenticationError,
    ContextStore,
    LimitExceeded,
    Limits,
    NodeUnavailable,
    ServerError,
    Timeouts,
    wire,
)
from ctxstore.hashing import Fingerprint

BS = 16
BLOCK = 4096
TIMEOUTS = Timeouts(connect=0.5, read=1.0, total=3.0)
BOUND = TIMEOUTS.connect + TIMEOUTS.read + 1.0  # seconds: a behavioural bound, not a performance target


def blocks_for(n: int, seed: int = 0, size: int = BLOCK) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(size) for _ in range(n)]


def tokens_for(n_blocks: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1 << 17) for _ in range(n_blocks * BS)]


def new_bucket() -> str:
    return "f-" + secrets.token_hex(6)


def client(addresses: list[str], **kwargs: object) -> ContextStore:
    options: dict[str, object] = dict(access_key=ACCESS_KEY, secret_key=SECRET_KEY, timeouts=TIMEOUTS,
                                      probe_interval=0.1)
    options.update(kwargs)
    return ContextStore(addresses, **options)  # type: ignore[arg-type]


def owners(addresses: list[str], keys: list[str]) -> list[str]:
    """Which node (``host:port``) owns each key: the client's own placement."""
    pod = AsyncContextStore(addresses, access_key=ACCESS_KEY, secret_key=SECRET_KEY).pod
    return [pod.owner(k).name for k in keys]


def first_owned(addresses: list[str], keys: list[str], name: str) -> int:
    return owners(addresses, keys).index(name)


def wait_for(predicate: Callable[[], bool], timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def health(store: ContextStore, name: str) -> dict[str, object]:
    nodes = store.metrics_snapshot()["nodes"]
    assert isinstance(nodes, dict)
    return nodes[name]


def start_on_port(tmp: Path, port: int, *args: str) -> Node:
    """``ctxstore serve`` on a given port (to restart a node where the pod expects it)."""
    log = tmp / f"node-{port}-restart.log"
    env = {**os.environ, "CTXSTORE_ACCESS_KEY": ACCESS_KEY, "CTXSTORE_SECRET_KEY": SECRET_KEY}
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "ctxstore_server.serve", "--port", str(port), *args],
                                stdout=out, stderr=subprocess.STDOUT, env=env)
    node = Node(port=port, proc=proc, log=log, env=env)
    wait_ready(node)
    return node


def start_pod(tmp: Path, *args: str) -> list[Node]:
    nodes = [start_node(tmp, "--memory", "128MiB", *args, wait=False) for _ in range(3)]
    try:
        for node in nodes:
            wait_ready(node)
    except BaseException:
        for node in nodes:
            node.stop()
        raise
    return nodes


def addr(node: Node) -> str:
    return f"127.0.0.1:{node.port}"


# ---------------------------------------------------------------------------- a node killed, then restarted


def test_killed_node_is_a_miss_then_comes_back(tmp_path: Path) -> None:
    nodes = start_pod(tmp_path)
    restarted: Node | None = None
    addresses = [addr(n) for n in nodes]
    try:
        with client(addresses) as store:
            bucket = new_bucket()
            ns = store.namespace(bucket, model="m", block_size=BS)
            tokens = tokens_for(40, seed=1)
            blocks = blocks_for(40, seed=1)
            assert ns.save(tokens, blocks).stored == 40
            keys = ns.block_hashes(tokens)
            # Kill the node whose first block comes latest, so the surviving prefix is not empty.
            victim = max(nodes, key=lambda n: first_owned(addresses, keys, addr(n)))
            j = first_owned(addresses, keys, addr(victim))
            assert j > 0
            # SIGKILL (no drain, connections reset) while restores are running back to back.
            killer = threading.Timer(0.15, victim.proc.kill)
            killer.start()
            key_owners = owners(addresses, keys)
            try:
                for _ in range(400):
                    started = time.monotonic()
                    out = bytearray(40 * BLOCK)
                    n = ns.restore(tokens, out=out).n_blocks
                    assert time.monotonic() - started < BOUND
                    # Every block, or a prefix that ends at one of the victim's blocks (the first, or a later one
                    # whose part was cut short while an earlier part of the victim's had arrived), bytes intact.
                    assert n == 40 or (n >= j and key_owners[n] == addr(victim))
                    assert out[:n * BLOCK] == b"".join(blocks[:n])
                    if n == j and victim.proc.poll() is not None:
                        break
            finally:
                killer.join()
                victim.proc.wait(10)
            assert n == j

            started = time.monotonic()
            assert ns.lookup(tokens) == j
            assert time.monotonic() - started < BOUND
            started = time.monotonic()
            result = ns.restore(tokens)
            assert time.monotonic() - started < BOUND
            assert result.n_blocks == j and [bytes(b) for b in result.blocks] == blocks[:j]

            state = health(store, addr(victim))
            assert state["up"] is False and state["failures"] >= 1 and state["last_error"]
            snap = store.metrics_snapshot()
            assert snap["skipped_down_node_keys"] > 0 or snap["errors"] > 0
            # Blocks on the other nodes are all still there.
            sizes = store.lookup_keys(bucket, keys)
            for key_owner, size in zip(owners(addresses, keys), sizes):
                assert (size == wire.ABSENT) == (key_owner == addr(victim))
            # Saving while the node is down: its share fails, the rest is stored; nothing raises.
            fresh = tokens_for(30, seed=2)
            fresh_owners = owners(addresses, ns.block_hashes(fresh))
            saved = ns.save(fresh, blocks_for(30, seed=2))
            assert saved.failed == fresh_owners.count(addr(victim)) and saved.stored == 30 - saved.failed

            with client(addresses, strict=True) as strict:
                strict_ns = strict.namespace(bucket, model="m", block_size=BS, create=False)
                started = time.monotonic()
                with pytest.raises(NodeUnavailable):
                    strict_ns.lookup(tokens)
                with pytest.raises(NodeUnavailable):
                    strict_ns.restore(tokens)
                assert time.monotonic() - started < 2 * BOUND

            # Restart on the same port: the probe notices, and the client uses the node again.
            restarted = start_on_port(tmp_path, victim.port, "--memory", "128MiB")
            assert wait_for(lambda: health(store, addr(victim))["up"] is True), health(store, addr(victim))
            again = tokens_for(30, seed=3)
            again_blocks = blocks_for(30, seed=3)
            assert addr(victim) in owners(addresses, ns.block_hashes(again))
            assert ns.save(again, again_blocks).__dict__ == {"stored": 30, "existed": 0, "failed": 0}
            assert ns.lookup(again) == 30
            assert [bytes(b) for b in ns.restore(again).blocks] == again_blocks
            assert ns.lookup(tokens) == j  # what the dead process held is gone for good
    finally:
        for node in [*nodes, *([restarted] if restarted else [])]:
            node.stop()


# ---------------------------------------------------------------------------- fake misbehaving nodes


class BlackHole:
    """Accepts TCP connections and reads forever, never answering. Counts connections opened and closed."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.05)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self.closed = 0
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def __enter__(self) -> BlackHole:
        self._spawn(self._accept)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(5)
        self.sock.close()

    def _spawn(self, target: Callable[..., None], *args: object) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            with self._lock:
                self.accepted += 1
            self._spawn(self._drain, conn)

    def _drain(self, conn: socket.socket) -> None:
        conn.settimeout(0.05)
        with conn:
            while not self._stop.is_set():
                try:
                    data = conn.recv(65536)
                except TimeoutError:
                    continue
                except OSError:
                    data = b""
                if not data:
                    with self._lock:
                        self.closed += 1
                    return


class _Answer500(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def _answer(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", "0")))
        body = b"<html><body>upstream exploded</body></html>"
        self.send_response(500)
        self.send_header("content-type", "text/html")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_PUT = _answer

    def log_message(self, *args: object) -> None:
        pass


class Server500:
    def __init__(self) -> None:
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Answer500)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                       daemon=True)

    def __enter__(self) -> Server500:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5)


@pytest.fixture(scope="module")
def pod(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Node]]:
    """Three healthy nodes with small bulk limits (10 keys, 64 KiB per call)."""
    nodes = start_pod(tmp_path_factory.mktemp("limits"), "--bulk-max-keys", "10", "--bulk-max-bytes", "64KiB")
    yield nodes
    for node in nodes:
        node.stop()


SMALL = Limits(keys_per_call=10, bytes_per_call=64 << 10)


def seeded(pod: list[Node], n: int, seed: int) -> tuple[str, list[int], list[bytes]]:
    """A bucket on the healthy nodes holding ``n`` blocks."""
    bucket = new_bucket()
    tokens, blocks = tokens_for(n, seed), blocks_for(n, seed)
    with client([addr(p) for p in pod], limits=SMALL) as store:
        assert store.namespace(bucket, model="m", block_size=BS).save(tokens, blocks).stored == n
    return bucket, tokens, blocks


def _bad_node_case(pod: list[Node], bad_port: int, seed: int) -> tuple[list[str], str, list[int], int]:
    """Two healthy nodes plus a bad one. Returns the mixed pod's addresses, a bucket holding 30 blocks on the
    healthy nodes (where the mixed pod looks for them; the bad node's share is never stored), their tokens,
    and the index of the first block the bad node owns (the prefix a restore can reach)."""
    addresses = [addr(p) for p in pod[:2]] + [f"127.0.0.1:{bad_port}"]
    bucket = new_bucket()
    tokens, blocks = tokens_for(30, seed), blocks_for(30, seed)
    keys = Fingerprint(model="m", block_size=BS).block_hashes(tokens)
    placed = owners(addresses, keys)
    for node_addr in addresses[:2]:
        idx = [i for i, owner in enumerate(placed) if owner == node_addr]
        with client([node_addr], limits=SMALL) as single:
            single.create_bucket(bucket)
            result = single.put_keys(bucket, [keys[i] for i in idx], [memoryview(blocks[i]) for i in idx])
            assert result.stored == len(idx)
    return addresses, bucket, tokens, placed.index(addresses[2])


def test_node_that_never_answers_is_a_miss_within_the_read_timeout(pod: list[Node]) -> None:
    with BlackHole() as hole:
        addresses, bucket, tokens, j = _bad_node_case(pod, hole.port, seed=4)
        with client(addresses, limits=SMALL) as store:
            ns = store.namespace(bucket, model="m", block_size=BS, create=False)
            started = time.monotonic()
            assert ns.lookup(tokens) == j
            assert time.monotonic() - started < TIMEOUTS.read + 1.0
            assert health(store, addresses[2])["up"] is False
            started = time.monotonic()
            assert ns.restore(tokens).n_blocks == j  # marked down: skipped at once
            assert time.monotonic() - started < 0.5
            assert store.metrics_snapshot()["skipped_down_node_keys"] > 0
        with client(addresses, strict=True, limits=SMALL) as strict:
            with pytest.raises(NodeUnavailable):
                strict.namespace(bucket, model="m", block_size=BS, create=False).lookup(tokens)
        # Every connection the client opened (calls and probes) is closed once the store is.
        assert wait_for(lambda: hole.closed == hole.accepted, 5), (hole.accepted, hole.closed)
        assert hole.accepted >= 2


def test_total_deadline_cancels_and_closes_the_connection(pod: list[Node]) -> None:
    with BlackHole() as hole:
        addresses, bucket, tokens, j = _bad_node_case(pod, hole.port, seed=5)
        slow_reads = Timeouts(connect=0.5, read=30.0, total=0.5)  # only the call's deadline can end the wait
        with client(addresses, limits=SMALL, timeouts=slow_reads) as store:
            ns = store.namespace(bucket, model="m", block_size=BS, create=False)
            started = time.monotonic()
            assert ns.lookup(tokens) == j
            assert time.monotonic() - started < slow_reads.total + 1.0
            assert health(store, addresses[2])["up"] is False
            # the abandoned request's connection is closed now, not left to the garbage collector
            assert wait_for(lambda: hole.closed >= 1, 5), (hole.accepted, hole.closed)
        assert wait_for(lambda: hole.closed == hole.accepted, 5), (hole.accepted, hole.closed)


def test_node_answering_500_is_marked_down_and_a_miss(pod: list[Node]) -> None:
    with Server500() as bad:
        addresses, bucket, tokens, j = _bad_node_case(pod, bad.port, seed=6)
        with client(addresses, limits=SMALL) as store:
            ns = store.namespace(bucket, model="m", block_size=BS, create=False)
            started = time.monotonic()
            assert ns.lookup(tokens) == j
            assert time.monotonic() - started < BOUND
            state = health(store, addresses[2])
            assert state["up"] is False and "500" in str(state["last_error"])
            assert ns.restore(tokens).n_blocks == j
            assert store.metrics_snapshot()["errors"] >= 1
            time.sleep(0.3)  # a few probes: the node keeps failing its readiness check
            assert health(store, addresses[2])["up"] is False
        with client(addresses, strict=True, limits=SMALL) as strict:
            with pytest.raises(ServerError) as info:
                strict.namespace(bucket, model="m", block_size=BS, create=False).lookup(tokens)
            assert info.value.status == 500


# ---------------------------------------------------------------------------- credentials


def test_wrong_credentials(pod: list[Node]) -> None:
    bucket, tokens, blocks = seeded(pod, 8, seed=7)
    addresses = [addr(p) for p in pod]
    for access, secret in ((ACCESS_KEY, "wrong-secret-key-000"), ("NOSUCHACCESSKEY00", SECRET_KEY)):
        with client(addresses, access_key=access, secret_key=secret) as store:
            with pytest.raises(AuthenticationError):
                store.namespace(bucket, model="m", block_size=BS)  # creating the bucket fails fast, always
            ns = store.namespace(bucket, model="m", block_size=BS, create=False)
            assert ns.lookup(tokens) == 0
            assert ns.restore(tokens).n_blocks == 0
            assert ns.save(tokens, blocks).failed == 8
            assert ns.touch(tokens) == 0
            snap = store.metrics_snapshot()
            assert snap["errors"] >= 4
            assert all(h["up"] for h in snap["nodes"].values())  # type: ignore[union-attr]  # not an outage
        with client(addresses, access_key=access, secret_key=secret, strict=True) as strict:
            ns = strict.namespace(bucket, model="m", block_size=BS, create=False)
            with pytest.raises(AuthenticationError):
                ns.lookup(tokens)
            with pytest.raises(AuthenticationError):
                ns.restore(tokens)
    with client(addresses) as good:  # nothing was changed by the failed calls
        assert good.namespace(bucket, model="m", block_size=BS, create=False).lookup(tokens) == 8


# ---------------------------------------------------------------------------- the nodes' limits


def test_client_limits_split_calls_under_the_node_limits(pod: list[Node]) -> None:
    addresses = [addr(p) for p in pod]
    tokens = tokens_for(50, seed=8)
    blocks = blocks_for(50, seed=8)
    with client(addresses, limits=SMALL) as store:
        ns = store.namespace(new_bucket(), model="m", block_size=BS)
        assert ns.save(tokens, blocks).__dict__ == {"stored": 50, "existed": 0, "failed": 0}
        assert ns.lookup(tokens) == 50
        out = bytearray(50 * BLOCK)
        assert ns.restore(tokens, out=out).n_blocks == 50 and bytes(out) == b"".join(blocks)
        assert ns.touch(tokens) == 50 and ns.pin(tokens, 5) == 50 and ns.unpin(tokens) == 50
        assert ns.delete(tokens) == 50
        assert store.metrics_snapshot()["errors"] == 0
        # Bigger blocks: the bytes limit splits puts further (64 KiB per call = 4 blocks of 16 KiB).
        big = blocks_for(12, seed=9, size=16 << 10)
        assert ns.save(tokens[:12 * BS], big).stored == 12
        assert [bytes(b) for b in ns.restore(tokens[:12 * BS]).blocks] == big


def test_calls_over_the_node_limits(pod: list[Node]) -> None:
    addresses = [addr(p) for p in pod]
    # 90 blocks over 3 nodes: every node gets far more than its limit of 10 keys per call whatever the ports
    # (placement depends on the node names); with 50, a node sometimes got 10 or fewer and answered.
    tokens = tokens_for(90, seed=10)
    blocks = blocks_for(90, seed=10)
    bucket = new_bucket()
    with client(addresses, limits=SMALL) as store:
        store.namespace(bucket, model="m", block_size=BS).save(tokens, blocks)
    with client(addresses, threads=1) as lax:  # default client limits: thousands of keys per call, in one part
        ns = lax.namespace(bucket, model="m", block_size=BS, create=False)
        assert ns.lookup(tokens) == 0  # every node answers TooManyKeys: misses, not exceptions
        assert ns.restore(tokens).n_blocks == 0
        assert ns.save(tokens, blocks).failed == 90
        assert lax.metrics_snapshot()["errors"] >= 9
        assert all(h["up"] for h in lax.metrics_snapshot()["nodes"].values())  # type: ignore[union-attr]
    with client(addresses, strict=True, threads=1) as strict:
        ns = strict.namespace(bucket, model="m", block_size=BS, create=False)
        with pytest.raises(LimitExceeded) as info:
            ns.lookup(tokens)
        assert info.value.code == "TooManyKeys"
        with pytest.raises(LimitExceeded):
            ns.restore(tokens)
        with pytest.raises(LimitExceeded):
            ns.save(tokens, blocks)
    # Few keys but too many bytes for one put: TooManyBytes.
    with client(addresses, strict=True, limits=Limits(keys_per_call=10, bytes_per_call=1 << 30),
                threads=1) as strict:
        ns = strict.namespace(bucket, model="m", block_size=BS, create=False)
        with pytest.raises(LimitExceeded) as info:
            ns.save(tokens_for(30, seed=11), blocks_for(30, seed=11, size=16 << 10))
        assert info.value.code == "TooManyBytes"
