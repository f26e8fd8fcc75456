"""Dynamo's own KV indexer (``python -m dynamo.indexer`` of ai-dynamo-runtime 1.6.1) against a ctxstore node.

Run by tests/integrations/test_dynamo.py inside a network namespace of its own (the indexer binds its HTTP port
on every interface): ``python dynamo_scenario.py <dynamo venv python> <scratch dir>``. A node with a flash tier
publishes its events on ZMQ with the defaults; the indexer subscribes to it as worker 1; a client saves prompts
with the ``dynamo`` scheme; Dynamo's ``/query`` must then credit every saved block at the right tier and forget
what the node drops. Exits 0 when every check held, else raises with what the indexer answered."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the support package

from support.nodes import ACCESS_KEY, SECRET_KEY, free_port, start_node, stop_process  # noqa: E402

from ctxstore import ContextStore  # noqa: E402

BLOCK_TOKENS = 16
BLOCK_BYTES = 32 << 10
WORKER = "1"


def main(dynamo_python: str, scratch: Path) -> None:
    pub, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    port = free_port()
    disk = scratch / "disk"
    node_args = ("--memory", "512KiB", "--disk", str(disk), "--disk-size", "64MiB", "--disk-segment-size", "1MiB")
    node_env = {"CTXSTORE_EVENTS_ZMQ_PUB": pub, "CTXSTORE_EVENTS_ZMQ_REPLAY": replay}  # every other event default
    node = start_node(scratch, *node_args, env=node_env, port=port)
    http_port = free_port()
    indexer = subprocess.Popen(
        [dynamo_python, "-m", "dynamo.indexer", "--block-size", str(BLOCK_TOKENS), "--port", str(http_port),
         "--threads", "1"],
        stdout=(scratch / "indexer.log").open("wb"), stderr=subprocess.STDOUT, cwd="/")
    dynamo = Indexer(http_port)
    try:
        dynamo.wait_up(indexer)
        dynamo.register(pub, replay)
        with ContextStore(node.endpoint, access_key=ACCESS_KEY, secret_key=SECRET_KEY) as store:
            run(store, dynamo, node, lambda: start_node(scratch, *node_args, env=node_env, port=port), pub, replay)
        print("dynamo scenario: every check held")
    except BaseException:
        print("---- indexer log (tail) ----\n" + (scratch / "indexer.log").read_text()[-4000:], file=sys.stderr)
        raise
    finally:
        stop_process(indexer)
        node.stop()


def run(store: ContextStore, dynamo: Indexer, node: Any, restart: Callable[[], Any], pub: str, replay: str) -> None:
    ns = store.namespace("dyn", model="llama", block_size=BLOCK_TOKENS, scheme="dynamo")
    other = store.namespace("dyn", model="mistral", block_size=BLOCK_TOKENS, scheme="dynamo")
    salt, other_salt = ns.fingerprint.hexdigest(), other.fingerprint.hexdigest()
    prompt = list(range(1000, 1000 + 8 * BLOCK_TOKENS))  # 8 blocks
    tokens = len(prompt)
    assert ns.save(prompt, blocks(8, 1)).stored == 8

    # Every saved block is credited, in RAM's tier (Dynamo's host tier: cpu and disk count it, gpu does not).
    dynamo.until(lambda: dynamo.match(prompt, salt) == {"longest_matched": tokens, "gpu": 0, "cpu": tokens,
                                                        "disk": tokens}, "the saved prompt credited on the host tier")
    # The salt is the namespace's: a query without it, or with another namespace's, matches nothing.
    assert dynamo.match(prompt, None) is None and dynamo.match(prompt, other_salt) is None

    # Two salted namespaces with the same tokens do not alias: each is credited under its own salt only.
    assert other.save(prompt, blocks(8, 2)).stored == 8
    dynamo.until(lambda: (dynamo.match(prompt, other_salt) or {}).get("longest_matched") == tokens,
                 "the second namespace credited")
    assert other.delete(prompt) == 8
    dynamo.until(lambda: dynamo.match(prompt, other_salt) is None, "the second namespace's blocks forgotten")
    assert (dynamo.match(prompt, salt) or {}).get("longest_matched") == tokens, "a delete of one namespace " \
        "took the other's blocks"

    # A flash demotion moves the blocks to Dynamo's disk tier: fill RAM (512 KiB) with newer blocks.
    for k in range(3):  # three prompts of 256 KiB, one call each (a call must fit the budget)
        filler = list(range(50_000 + k * 1000, 50_000 + k * 1000 + 8 * BLOCK_TOKENS))
        assert ns.save(filler, blocks(8, 3 + k)).stored == 8
    dynamo.until(lambda: dynamo.match(prompt, salt) == {"longest_matched": tokens, "gpu": 0, "cpu": 0,
                                                        "disk": tokens}, "the demoted prompt on the disk tier")

    # A node restart: its recovered blocks are announced again (replayed to the indexer, which re-registers).
    dynamo.unregister()
    assert dynamo.match(prompt, salt) is None, "unregistering a worker keeps its blocks"
    node.stop()
    restarted = restart()
    try:
        dynamo.register(pub, replay)
        # The node announced them at its start, before anyone listened: the indexer fetches them through the
        # replay socket once a live message shows it the gap (any event; here a probe block's).
        probe = list(range(70_000, 70_000 + BLOCK_TOKENS))
        ns.lookup(probe)
        ns.save(probe, blocks(1, 8))
        dynamo.until(lambda: (dynamo.match(prompt, salt) or {}).get("disk") == tokens,
                     "the restarted node's recovered blocks credited again")

        # A delete removes them; an expiry too.
        assert ns.delete(prompt) == 8
        dynamo.until(lambda: dynamo.match(prompt, salt) is None, "the deleted prompt forgotten")
        short = list(range(90_000, 90_000 + 2 * BLOCK_TOKENS))
        assert ns.save(short, blocks(2, 9), ttl=1).stored == 2
        dynamo.until(lambda: (dynamo.match(short, salt) or {}).get("longest_matched") == 2 * BLOCK_TOKENS,
                     "the short-lived prompt credited")
        dynamo.until(lambda: dynamo.match(short, salt) is None, "the expired prompt forgotten", timeout=10)
    finally:
        restarted.stop()


def blocks(n: int, fill: int) -> list[bytes]:
    return [bytes([fill, i]) * (BLOCK_BYTES // 2) for i in range(n)]


class Indexer:
    """Dynamo's standalone indexer over HTTP (loopback of the test's network namespace)."""

    def __init__(self, port: int) -> None:
        self.base = f"http://127.0.0.1:{port}"

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=5) as resp:
                return json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as exc:
            raise AssertionError(f"{method} {path} -> {exc.code}: {exc.read().decode()[:500]}") from None

    def wait_up(self, proc: subprocess.Popen[bytes]) -> None:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, "the indexer exited"
            try:
                self.call("GET", "/workers")
                return
            except OSError:
                assert time.monotonic() < deadline, "the indexer did not come up"
                time.sleep(0.1)

    def register(self, endpoint: str, replay: str) -> None:
        self.call("POST", "/register", {"instance_id": int(WORKER), "endpoint": endpoint, "replay_endpoint": replay,
                                        "model_name": "default", "block_size": BLOCK_TOKENS})

    def unregister(self) -> None:
        self.call("POST", "/unregister", {"instance_id": int(WORKER), "model_name": "default"})

    def match(self, tokens: list[int], salt: str | None) -> dict[str, int] | None:
        """Worker 1's tiers for ``tokens`` (None: nothing of it credited)."""
        body: dict[str, Any] = {"token_ids": tokens, "model_name": "default"}
        if salt is not None:
            body["cache_salt"] = salt
        try:
            answer = self.call("POST", "/query", body)
        except AssertionError as exc:
            if "404" in str(exc):  # no indexer for the model: no worker registered
                return None
            raise
        got = answer.get("instances", {}).get(WORKER)
        if not got or not got.get("longest_matched"):
            return None
        return {k: got[k] for k in ("longest_matched", "gpu", "cpu", "disk")}

    def until(self, check: Callable[[], bool], what: str, timeout: float = 15) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: not within {timeout:g} s; /dump: "
                                     f"{json.dumps(self.call('GET', '/dump'))[:3000]}")
            time.sleep(0.1)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
