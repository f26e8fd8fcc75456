"""Chaos with a real 3-node pod: nodes frozen (SIGSTOP/SIGCONT), killed (SIGKILL) and restarted on their
ports while inference-worker threads save, look up and restore through the ``ctxstore`` client.

Promises: no wrong block, ever (every restored block is compared with the bytes its key was saved with); no
exception escapes a non-strict call; no call outlives the client's deadlines (a lookup or restore: the total
timeout plus slack; a save may re-create its bucket on a node that restarted empty and try once more: twice
the total timeout plus slack); a frozen node's blocks are there again once it thaws; the client uses every
node again once it is back. ``CTXSTORE_SOAK=1`` runs random faults for ``CTXSTORE_SOAK_SECONDS`` (600).
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from support.chaos import Tally, freeze, kill, restart, start_pod, thaw
from support.nodes import ACCESS_KEY, SECRET_KEY, Node
from support.probes import wait_until
from support.soak import SOAK, SOAK_SECONDS, SOAK_TIMEOUT

from ctxstore import AsyncContextStore, ContextStore, Timeouts, wire

BS = 16
SIZE = 16 << 10
SESSIONS = 24
BLOCKS = 8
TIMEOUTS = Timeouts(connect=0.5, read=1.0, total=3.0)
SLACK = 1.5  # scheduling on a shared 2-core machine, on top of the client's own deadlines
NODE_ARGS = ("--memory", "64MiB", "--default-ttl", "1h")


def content(key: str) -> bytes:
    """The bytes block ``key`` is saved with: a function of the key, so any restored block can be checked."""
    return random.Random(key).randbytes(SIZE)


class Workload:
    """Worker threads looping over save / restore / lookup of SESSIONS token sequences until stopped."""

    def __init__(self, store: ContextStore, bucket: str) -> None:
        self.ns = store.namespace(bucket, model="chaos", block_size=BS)
        rng = random.Random("chaos-sessions")
        self.tokens = [[rng.randrange(1 << 17) for _ in range(BLOCKS * BS)] for _ in range(SESSIONS)]
        self.keys = [self.ns.block_hashes(t) for t in self.tokens]
        self.blocks = [[content(k) for k in keys] for keys in self.keys]
        self.tally = Tally()
        self.stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def timed(self, kind: str, call: Callable[[], object]) -> object:
        started = time.monotonic()
        try:
            return call()
        except Exception as exc:  # noqa: BLE001 - nothing may escape a non-strict call
            self.tally.exception(f"{kind}: {exc!r}"[:300])
            return None
        finally:
            self.tally.call(kind, time.monotonic() - started)

    def save(self, s: int) -> None:
        self.timed("save", lambda: self.ns.save(self.tokens[s], self.blocks[s]))

    def restore(self, s: int) -> int:
        result = self.timed("restore", lambda: self.ns.restore(self.tokens[s]))
        if result is None:
            return -1
        blocks = result.blocks  # type: ignore[attr-defined]
        wrong = sum(bytes(b) != self.blocks[s][i] for i, b in enumerate(blocks))
        self.tally.blocks(len(blocks), wrong, len(blocks) < BLOCKS)
        return len(blocks)

    def lookup(self, s: int) -> None:
        n = self.timed("lookup", lambda: self.ns.lookup(self.tokens[s]))
        if n is not None and not 0 <= n <= BLOCKS:  # type: ignore[operator]
            self.tally.exception(f"lookup answered {n}")

    def _loop(self, seed: int) -> None:
        rng = random.Random(seed)
        while not self.stop.is_set():
            s = rng.randrange(SESSIONS)
            roll = rng.random()
            if roll < 0.35:
                self.save(s)
            elif roll < 0.85:
                self.restore(s)
            else:
                self.lookup(s)

    def start(self, threads: int = 2) -> None:
        for i in range(threads):
            thread = threading.Thread(target=self._loop, args=(i,), daemon=True)
            self._threads.append(thread)
            thread.start()

    def join(self) -> None:
        self.stop.set()
        for thread in self._threads:
            thread.join(30)
        assert not any(t.is_alive() for t in self._threads), "a worker thread is stuck in a call"


def all_up(store: ContextStore) -> bool:
    nodes = store.metrics_snapshot()["nodes"]
    assert isinstance(nodes, dict)
    return all(state["up"] for state in nodes.values())


def ci_schedule(nodes: list[Node], tmp: Path) -> None:
    """About ten seconds of faults, each kind at least once, node 0 only ever frozen (never killed)."""
    time.sleep(1.0)
    freeze(nodes[0])  # longer than the read timeout: marked down, then back
    time.sleep(1.8)
    thaw(nodes[0])
    time.sleep(0.5)
    kill(nodes[1])
    time.sleep(0.5)
    nodes[1] = restart(nodes[1], tmp, *NODE_ARGS)
    time.sleep(0.5)
    freeze(nodes[2])
    time.sleep(0.5)
    kill(nodes[2])  # killed while frozen
    nodes[2] = restart(nodes[2], tmp, *NODE_ARGS)
    time.sleep(0.5)
    freeze(nodes[0])  # shorter than the read timeout: calls just wait
    time.sleep(0.4)
    thaw(nodes[0])
    time.sleep(0.5)


def soak_schedule(nodes: list[Node], tmp: Path) -> None:
    rng = random.Random(int(os.environ.get("CTXSTORE_FUZZ_SEED", "1")))
    deadline = time.monotonic() + SOAK_SECONDS
    while time.monotonic() < deadline:
        i = rng.randrange(1, len(nodes))  # node 0 is only frozen, so its blocks can be checked at the end
        action = rng.choice(["freeze", "freeze", "kill", "kill-frozen", "short-freeze"])
        if action == "short-freeze" or i == 0:
            freeze(nodes[0])
            time.sleep(rng.uniform(0.1, 3.0))
            thaw(nodes[0])
        elif action == "freeze":
            freeze(nodes[i])
            time.sleep(rng.uniform(0.1, 4.0))
            thaw(nodes[i])
        else:
            if action == "kill-frozen":
                freeze(nodes[i])
                time.sleep(rng.uniform(0.1, 1.0))
            kill(nodes[i])
            time.sleep(rng.uniform(0.0, 2.0))
            nodes[i] = restart(nodes[i], tmp, *NODE_ARGS)
        time.sleep(rng.uniform(0.2, 2.0))


@pytest.mark.timeout(SOAK_TIMEOUT)
def test_pod_under_sigkill_sigstop_and_restarts(tmp_path: Path) -> None:
    nodes = start_pod(tmp_path, 3, *NODE_ARGS)
    addresses = [f"127.0.0.1:{n.port}" for n in nodes]
    try:
        with ContextStore(addresses, access_key=ACCESS_KEY, secret_key=SECRET_KEY, timeouts=TIMEOUTS,
                          probe_interval=0.1) as store:
            load = Workload(store, "chaos-" + os.urandom(3).hex())
            for s in range(SESSIONS):
                assert load.ns.save(load.tokens[s], load.blocks[s]).failed == 0
            owner = AsyncContextStore(addresses, access_key=ACCESS_KEY, secret_key=SECRET_KEY).pod.owner
            frozen_only = [k for keys in load.keys for k in keys if owner(k).name == addresses[0]]
            assert frozen_only

            load.start()
            try:
                (soak_schedule if SOAK else ci_schedule)(nodes, tmp_path)
            finally:
                for node in nodes:
                    thaw(node)
                load.join()
            tally = load.tally

            # Every node is used again once it is back; node 0, only ever frozen, still holds its blocks.
            assert wait_until(lambda: all_up(store), timeout=15), store.metrics_snapshot()["nodes"]
            sizes = store.lookup_keys(load.ns.bucket, frozen_only)
            assert wire.ABSENT not in sizes, "a frozen node lost blocks"
            for s in range(SESSIONS):
                assert load.ns.save(load.tokens[s], load.blocks[s]).failed == 0
                assert load.restore(s) == BLOCKS

        assert tally.wrong_blocks == 0, f"{tally.wrong_blocks} wrong blocks of {tally.blocks_checked}"
        assert tally.exceptions == [], tally.exceptions[:10]
        assert tally.short_restores > 0, "the faults never showed: the test did not test anything"
        assert sum(tally.calls.values()) > 100
        for kind in ("restore", "lookup"):
            assert tally.longest.get(kind, 0.0) <= TIMEOUTS.total + SLACK, tally.longest
        assert tally.longest.get("save", 0.0) <= 2 * TIMEOUTS.total + SLACK, tally.longest
        logs = sorted(tmp_path.glob("node-*.log"))  # every node's, and each restarted one's
        assert len(logs) >= len(nodes)
        for log in logs:  # a fault is a miss or a clean error answer, never a stack trace
            text = log.read_text(errors="replace")
            assert "Traceback" not in text and "Exception in ASGI" not in text, (log.name, text[-3000:])
        print(f"chaos: {tally.calls} calls, {tally.blocks_checked} blocks checked, {tally.wrong_blocks} wrong, "
              f"{tally.short_restores} short restores, longest {tally.longest}")
    finally:
        for node in nodes:
            thaw(node)
            node.stop()
