"""One client over several threads (``threads=N``, ctxstore/lanes.py): a bulk call's parts are received and sent
on N event loops at once. The prefix rule holds across parts, a part that fails (a block that does not
verify, a node killed, stopped or past the call's deadline) is a miss and nothing else, nothing writes into
the caller's buffers after a call returned, ``close()`` leaves no thread, a forked child gets threads of its
own. A part of a save refused with SlowDown is sent again on its thread, a part whose answer is a refusal is
that part's blocks failed and nothing else, and the counters of every thread add up."""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import secrets
import signal
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from support.faultproxy import FaultProxy, Rule, flip, garbage, hang
from support.nodes import ACCESS_KEY, SECRET_KEY, Node, free_port_run, serving, start_node, wait_ready
from ctxstore import AsyncContextStore, ConfigurationError, ContextStore, Namespace, Timeouts
from ctxstore.buffers import Destinations
from ctxstore import core, lanes
from ctxstore.lanes import default_threads

BS = 16
MiB = 1 << 20
TIMEOUTS = Timeouts(connect=0.5, read=1.0, total=5.0)
BOUND = TIMEOUTS.connect + TIMEOUTS.read + 1.5  # seconds: a behavioural bound, not a performance target


def blocks_for(n: int, size: int, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(size) for _ in range(n)]


def tokens_for(n_blocks: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1 << 17) for _ in range(n_blocks * BS)]


def client(nodes: str | list[str], threads: int, **kwargs: object) -> ContextStore:
    options: dict[str, object] = dict(access_key=ACCESS_KEY, secret_key=SECRET_KEY, timeouts=TIMEOUTS,
                                      probe_interval=0.1, threads=threads)
    options.update(kwargs)
    return ContextStore(nodes, **options)  # type: ignore[arg-type]


def namespace(store: ContextStore, bucket: str | None = None, create: bool = True) -> Namespace:
    return store.namespace(bucket or "th-" + secrets.token_hex(6), model="m", block_size=BS, create=create)


def lane_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("ctxstore-")}


# ---------------------------------------------------------------------------- the prefix rule over parts


@pytest.fixture(scope="module")
def topologies(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str | list[str]]]:
    """One node, a pod of three nodes, and one node of two shards (``--workers 2``)."""
    tmp = tmp_path_factory.mktemp("threads")
    args = ("--memory", "256MiB", "--default-ttl", "1h")
    port = free_port_run(2)
    sharded = start_node(tmp, "--memory", "512MiB", "--default-ttl", "1h", "--workers", "2", port=port, wait=False)
    with serving([start_node(tmp, *args, wait=False) for _ in range(4)]) as nodes:
        try:
            for shard in range(2):
                wait_ready(Node(port=port + shard, proc=sharded.proc, log=sharded.log))
            yield {"node": nodes[0].endpoint, "pod": [n.endpoint for n in nodes[1:]],
                   "shards": f"127.0.0.1:{port}-{port + 1}"}
        finally:
            sharded.stop()


@pytest.mark.parametrize("size", [1 << 10, 64 << 10, MiB, 4 * MiB], ids=["1KiB", "64KiB", "1MiB", "4MiB"])
@pytest.mark.parametrize("where", ["node", "pod", "shards"])
@pytest.mark.parametrize("threads", [1, 4])
def test_saves_and_restores_are_whole_and_in_order_over_threads(
        topologies: dict[str, str | list[str]], where: str, threads: int, size: int) -> None:
    n = max(6, (6 * MiB) // size)  # 6 MiB in all: several parts per node, for every thread
    blocks = blocks_for(n, size, seed=size)
    tokens = tokens_for(n, seed=size)
    with client(topologies[where], threads) as store:
        ns = namespace(store)
        saved = ns.save(tokens, blocks)
        assert (saved.stored, saved.failed) == (n, 0)
        assert ns.save(tokens, blocks).existed == n
        assert ns.lookup(tokens) == n
        out = bytearray(n * size)
        assert ns.restore(tokens, out=out).n_blocks == n and out == b"".join(blocks)
        per_block = [bytearray(size) for _ in range(n)]
        assert ns.restore(tokens, out=per_block).n_blocks == n and list(map(bytes, per_block)) == blocks
        fresh = ns.restore(tokens)
        assert [bytes(b) for b in fresh.blocks] == blocks

        # What one thread saved, several read, and the other way round: the same bytes.
        with client(topologies[where], 5 - threads) as other:
            twin = namespace(other, ns.bucket, create=False)
            out2 = bytearray(n * size)
            assert twin.restore(tokens, out=out2).n_blocks == n and out2 == out

        # A hole past the first part ends the prefix there; the blocks after it are not handed out.
        keys = ns.block_hashes(tokens)
        hole = (2 * n) // 3
        assert store.keys_op(ns.bucket, "delete", [keys[hole]]) == 1
        out = bytearray(n * size)
        result = ns.restore(tokens, out=out)
        assert result.n_blocks == hole and out[:hole * size] == b"".join(blocks[:hole])
        assert ns.lookup(tokens) == hole

        # A block of a foreign size (larger than its slot) is a miss and ends the prefix before it.
        foreign = n // 3
        store.put_keys(ns.bucket, [keys[foreign]], [memoryview(b"x" * (size + 1))], if_absent=False)
        result = ns.restore(tokens, out=bytearray(n * size))
        assert result.n_blocks == foreign
        assert store.metrics_snapshot()["oversized_blocks"] >= 1


# ---------------------------------------------------------------------------- a part that fails


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    tmp = tmp_path_factory.mktemp("threads-node")
    with serving([start_node(tmp, "--memory", "256MiB", "--default-ttl", "1h", wait=False)]) as nodes:
        yield nodes[0]


def saved(endpoint: str, n: int, size: int, seed: int) -> tuple[str, list[int], list[bytes]]:
    """``n`` blocks of ``size`` saved on ``endpoint`` (by a client of one thread): bucket, tokens, blocks."""
    blocks, tokens = blocks_for(n, size, seed), tokens_for(n, seed)
    with client(endpoint, 1) as store:
        ns = namespace(store)
        assert ns.save(tokens, blocks).stored == n
    return ns.bucket, tokens, blocks


def test_a_block_failing_verification_in_one_part_is_a_miss_and_every_other_part_lands(node: Node) -> None:
    n, size = 12, MiB  # 12 MiB over 3 threads: parts of 4 blocks
    bucket, tokens, blocks = saved(node.endpoint, n, size, seed=1)
    with FaultProxy(("127.0.0.1", node.port), [flip("payload", offset=0, path="/get", times=1)]) as proxy, \
            client(proxy.address, 3) as store:
        ns = namespace(store, bucket, create=False)
        per_block = [bytearray(size) for _ in range(n)]
        views = store.get_keys(bucket, ns.block_hashes(tokens), Destinations(per_block, n))
        missing = [i for i, v in enumerate(views) if v is None]
        assert len(missing) == 1 and missing[0] % 4 == 0  # the first block of the part whose answer was hit
        assert all(bytes(per_block[i]) == blocks[i] for i in range(n) if i not in missing)
        assert store.metrics_snapshot()["checksum_failures"] == 1

        proxy.set_rules([flip("payload", offset=0, path="/get", times=1)])
        out = bytearray(n * size)
        result = ns.restore(tokens, out=out)
        assert result.n_blocks in (0, 4, 8) and out[:result.n_blocks * size] == b"".join(blocks[:result.n_blocks])
        assert store.metrics_snapshot()["checksum_failures"] == 2
        assert ns.restore(tokens, out=out).n_blocks == n and out == b"".join(blocks)  # a corrupt answer is no outage


def test_a_part_that_stalls_is_missing_within_the_read_timeout_and_the_other_parts_land(node: Node) -> None:
    n, size = 12, MiB
    bucket, tokens, blocks = saved(node.endpoint, n, size, seed=2)
    with FaultProxy(("127.0.0.1", node.port), [hang("payload", offset=1000, path="/get", times=1)]) as proxy, \
            client(proxy.address, 3) as store:
        ns = namespace(store, bucket, create=False)
        per_block = [bytearray(size) for _ in range(n)]
        started = time.monotonic()
        views = store.get_keys(bucket, ns.block_hashes(tokens), Destinations(per_block, n))
        assert time.monotonic() - started < BOUND
        missing = [i for i, v in enumerate(views) if v is None]
        assert len(missing) == 4 and missing == list(range(missing[0], missing[0] + 4))  # one whole part
        assert all(bytes(per_block[i]) == blocks[i] for i in range(n) if i not in missing)
        assert proxy.faults_applied("hang")


def test_the_calls_deadline_holds_over_threads_and_nothing_lands_after_it(node: Node) -> None:
    n, size = 12, MiB
    bucket, tokens, blocks = saved(node.endpoint, n, size, seed=3)
    delay = Rule("delay", seconds=3.0, path="/get", times=1)  # one part's answer comes 3 s late, then whole
    with FaultProxy(("127.0.0.1", node.port), [delay]) as proxy, \
            client(proxy.address, 3, timeouts=Timeouts(connect=0.5, read=10.0, total=1.0)) as store:
        ns = namespace(store, bucket, create=False)
        out = bytearray(n * size)
        started = time.monotonic()
        result = ns.restore(tokens, out=out)
        assert time.monotonic() - started < 1.0 + 1.5
        assert result.n_blocks in (0, 4, 8) and out[:result.n_blocks * size] == b"".join(blocks[:result.n_blocks])
        snapshot = hashlib.sha256(out).digest()
        late = result.n_blocks * size
        assert out[late:late + 4 * size] == bytes(4 * size)  # the late part's slots were never written...
        time.sleep(3.5)  # ...and its answer, sent by now, lands nowhere
        assert proxy.faults_applied("delay")
        assert hashlib.sha256(out).digest() == snapshot


@pytest.mark.parametrize("how", ["sigkill", "sigstop"])
def test_a_node_killed_or_stopped_mid_restore_leaves_a_correct_prefix_in_bounded_time(
        tmp_path: Path, how: str) -> None:
    victim = start_node(tmp_path, "--memory", "256MiB", "--default-ttl", "1h")
    try:
        n, size = 64, MiB  # 64 MiB over 4 threads: parts of 16 blocks
        bucket, tokens, blocks = saved(victim.endpoint, n, size, seed=4)
        whole = b"".join(blocks)
        with client(victim.endpoint, 4) as store:
            ns = namespace(store, bucket, create=False)
            signum = signal.SIGKILL if how == "sigkill" else signal.SIGSTOP
            striker = threading.Timer(0.5, os.kill, (victim.proc.pid, signum))
            striker.start()
            results = []
            try:
                for _ in range(500):
                    out = bytearray(n * size)
                    started = time.monotonic()
                    got = ns.restore(tokens, out=out).n_blocks
                    assert time.monotonic() - started < BOUND
                    assert out[:got * size] == whole[:got * size]
                    results.append(got)
                    if got < n and not striker.is_alive():
                        break
            finally:
                striker.join()
            assert results[0] == n and results[-1] < n and set(results) <= {0, 16, 32, 48, 64}
            if how == "sigstop":
                os.kill(victim.proc.pid, signal.SIGCONT)
                deadline = time.monotonic() + 15
                while ns.restore(tokens, out=out).n_blocks < n and time.monotonic() < deadline:
                    time.sleep(0.1)
                assert out == whole  # the node is used again once it answers
    finally:
        if victim.proc.poll() is None:
            os.kill(victim.proc.pid, signal.SIGCONT)
        victim.stop()


def error_answer(status: str, code: str) -> bytes:
    """A whole HTTP answer carrying an S3 error document, as a node (or what stands in front of it) sends one."""
    body = f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code><Message>injected</Message></Error>"
    return (f"HTTP/1.1 {status}\r\nContent-Type: application/xml\r\nContent-Length: {len(body)}\r\n"
            f"Connection: close\r\n\r\n{body}").encode()


@pytest.fixture
def parts_of_a_few_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Even a call of a few blocks is cut into one part per thread (the threshold is 1 MiB and 16 keys)."""
    monkeypatch.setattr(core, "MIN_PART_BYTES", 1)
    monkeypatch.setattr(core, "MIN_PART_KEYS", 1)


@pytest.mark.usefixtures("parts_of_a_few_blocks")
def test_a_part_refused_with_slowdown_is_sent_again_on_its_thread_and_the_counters_add_up(node: Node) -> None:
    n, size = 12, 16 << 10  # 192 KiB over 3 threads: parts of 4 blocks
    blocks, tokens = blocks_for(n, size, seed=10), tokens_for(n, seed=10)
    with FaultProxy(("127.0.0.1", node.port), [garbage(error_answer("503 Slow Down", "SlowDown"), path="/put",
                                                       times=1)]) as proxy, client(proxy.address, 3) as store:
        ns = namespace(store)
        result = ns.save(tokens, blocks)
        assert proxy.faults_applied("garbage")
        assert result.failed == 0 and result.stored + result.existed == n
        out = bytearray(n * size)
        assert ns.restore(tokens, out=out).n_blocks == n and out == b"".join(blocks)
        metrics = store.metrics_snapshot()  # counted on every thread, into one set of counters
        assert metrics["slowdown_retries"] == 1
        assert (metrics["hits"], metrics["misses"], metrics["bytes_in"]) == (n, 0, n * size)
        assert metrics["bytes_out"] >= n * size


@pytest.mark.usefixtures("parts_of_a_few_blocks")
def test_a_part_of_a_save_whose_answer_is_a_refusal_is_reported_failed_and_nothing_else(node: Node) -> None:
    # The node stored the part; its answer is replaced by a refusal on the way back: the client can only
    # report that part's blocks as failed, count one error, and keep the node (a 4xx is the call's fault).
    n, size = 12, 16 << 10  # parts of 4 blocks
    blocks, tokens = blocks_for(n, size, seed=11), tokens_for(n, seed=11)
    before = lane_threads()
    refusal = error_answer("400 Bad Request", "InvalidRequest")
    with FaultProxy(("127.0.0.1", node.port), [garbage(refusal, path="/put", times=1)]) as proxy:
        store = client(proxy.address, 3)
        ns = namespace(store)
        result = ns.save(tokens, blocks)
        assert proxy.faults_applied("garbage")
        assert (result.stored, result.existed, result.failed) == (n - 4, 0, 4)  # one part, and nothing else
        metrics = store.metrics_snapshot()
        assert metrics["errors"] == 1 and all(health["up"] for health in metrics["nodes"].values())
        assert ns.save(tokens, blocks).existed == n  # the node is used again at once; it had stored them all
        started = time.monotonic()
        store.close()
        assert time.monotonic() - started < BOUND and not any(t.is_alive() for t in lane_threads() - before)


@pytest.mark.usefixtures("parts_of_a_few_blocks")
def test_a_client_whose_node_a_part_marked_down_closes_at_once(node: Node) -> None:
    # Before: the part that failed marked the node down and its pools were closed while another part's request
    # was still in flight on a lane; that request then put its connection back into the closed pool, nobody
    # closed it, and close() spent 30 s failing to close the lane's loop over it (OSError EBUSY).
    n, size = 12, 16 << 10
    blocks, tokens = blocks_for(n, size, seed=12), tokens_for(n, seed=12)
    before = lane_threads()
    failure = error_answer("500 Internal Server Error", "InternalError")
    with FaultProxy(("127.0.0.1", node.port), [garbage(failure, path="/put", times=1)]) as proxy:
        store = client(proxy.address, 3)
        result = namespace(store).save(tokens, blocks)
        assert (result.stored, result.failed) == (n - 4, 4)
        assert not store.metrics_snapshot()["nodes"][proxy.address]["up"]
        started = time.monotonic()
        store.close()
        assert time.monotonic() - started < BOUND and not any(t.is_alive() for t in lane_threads() - before)


# ---------------------------------------------------------------------------- threads: lifetime and setting


def test_a_part_that_cannot_start_on_its_thread_fails_the_call_at_once(node: Node,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # Whatever fails on a lane before its request exists (here: its connection pool cannot be made; nothing a
    # node sends) must reach the waiting caller at once, as it would on the calling loop: before, the caller
    # waited for an answer that never came, past its deadline and for good.
    bucket, tokens, blocks = saved(node.endpoint, 8, MiB, seed=9)

    def no_pool(*args: object, **kwargs: object) -> None:
        raise OSError("no pool here")

    monkeypatch.setattr(lanes, "Pool", no_pool)
    with client(node.endpoint, 2) as store:
        ns = namespace(store, bucket, create=False)
        out = bytearray(8 * MiB)
        started = time.monotonic()
        with pytest.raises(OSError, match="no pool here"):
            store.get_keys(bucket, ns.block_hashes(tokens), Destinations(out, 8))
        assert time.monotonic() - started < BOUND
    monkeypatch.undo()
    with client(node.endpoint, 2) as store:  # the same call, lanes able to start: every block
        assert store.get_keys(bucket, ns.block_hashes(tokens), Destinations(out, 8)).count(None) == 0
        assert out == b"".join(blocks)


def test_threads_start_at_the_first_bulk_call_and_close_stops_them_all(node: Node) -> None:
    bucket, tokens, blocks = saved(node.endpoint, 8, MiB, seed=5)
    before = lane_threads()
    store = client(node.endpoint, 4)
    assert lane_threads() == before  # nothing at construction
    ns = namespace(store, bucket, create=False)
    assert ns.restore(tokens, out=bytearray(8 * MiB)).n_blocks == 8
    mine = lane_threads() - before
    assert {t.name for t in mine} == {"ctxstore-client", "ctxstore-lane-1", "ctxstore-lane-2", "ctxstore-lane-3"}
    store.close()
    assert not any(t.is_alive() for t in mine)
    with pytest.raises(RuntimeError, match="closed"):
        ns.lookup(tokens)


def test_the_async_client_spreads_over_threads_and_aclose_stops_them(node: Node) -> None:
    bucket, tokens, blocks = saved(node.endpoint, 8, MiB, seed=6)
    before = lane_threads()

    async def main() -> set[threading.Thread]:
        async with AsyncContextStore(node.endpoint, access_key=ACCESS_KEY, secret_key=SECRET_KEY,
                                     threads=3) as store:
            ns = await store.namespace(bucket, model="m", block_size=BS, create=False)
            out = bytearray(8 * MiB)
            assert (await ns.restore(tokens, out=out)).n_blocks == 8 and out == b"".join(blocks)
            fresh = [os.urandom(MiB) for _ in range(8)]
            other = tokens_for(8, seed=60)
            assert (await ns.save(other, fresh)).stored == 8
            assert [bytes(b) for b in (await ns.restore(other)).blocks] == fresh
            return lane_threads() - before

    mine = asyncio.run(main())
    assert {t.name for t in mine} == {"ctxstore-lane-1", "ctxstore-lane-2"}
    assert not any(t.is_alive() for t in mine)


def test_a_client_used_before_a_fork_works_in_the_child_and_still_in_the_parent(node: Node) -> None:
    bucket, tokens, blocks = saved(node.endpoint, 8, MiB, seed=7)
    whole = b"".join(blocks)
    with client(node.endpoint, 3) as store:
        ns = namespace(store, bucket, create=False)
        assert ns.restore(tokens, out=bytearray(8 * MiB)).n_blocks == 8  # threads and connections exist now
        read, write = os.pipe()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # fork() of a threaded process, as vLLM does
            pid = os.fork()
        if pid == 0:  # the child: report what it restored, then leave without running anything of the parent's
            code = 1
            try:
                out = bytearray(8 * MiB)
                got = ns.restore(tokens, out=out).n_blocks
                os.write(write, f"{got} {hashlib.sha256(out).hexdigest()}".encode())
                code = 0
            finally:
                os._exit(code)
        os.close(write)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and os.waitpid(pid, os.WNOHANG) == (0, 0):
            time.sleep(0.05)
        else:
            if time.monotonic() >= deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                pytest.fail("the forked child hung")
        answer = os.read(read, 200).decode()
        os.close(read)
        assert answer == f"8 {hashlib.sha256(whole).hexdigest()}"
        out = bytearray(8 * MiB)
        assert ns.restore(tokens, out=out).n_blocks == 8 and out == whole  # the parent's connections are intact


def test_the_default_is_half_the_cores_at_most_8_and_the_environment_overrides_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CTXSTORE_THREADS", raising=False)
    for cores, expected in ((1, 1), (2, 1), (4, 2), (16, 8), (64, 8)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, c=cores: set(range(c)))
        assert default_threads() == expected
    monkeypatch.setenv("CTXSTORE_THREADS", "5")
    assert default_threads() == 5
    assert ContextStore("127.0.0.1:1", access_key="a", secret_key="b").threads == 5
    assert ContextStore("127.0.0.1:1", access_key="a", secret_key="b", threads=2).threads == 2
    for bad in ("0", "many", "-1", "65"):
        monkeypatch.setenv("CTXSTORE_THREADS", bad)
        with pytest.raises(ConfigurationError, match="CTXSTORE_THREADS|threads"):
            default_threads()
    monkeypatch.delenv("CTXSTORE_THREADS")
    for wrong in (0, 65, 1.5, True, "2"):
        with pytest.raises(ConfigurationError, match="threads"):
            ContextStore("127.0.0.1:1", access_key="a", secret_key="b", threads=wrong)
