"""The worker's client when a node's answers are corrupted on the way: it never dies, never raises in
non-strict mode, never hands back a wrong block, counts every malformed answer in its metrics, and returns
within its timeouts.

A real node sits behind the fault proxy (``support.faultproxy``); the restoring client runs in its own
process (``support/restore_worker.py``), with the sync ``ContextStore`` on uvloop (as inference servers run
it) and with the asyncio client on asyncio's loop, so a crash is observed as an exit status instead of
taking the test run down.

Issue #1: one ``get`` answer with one extra body byte (Content-Length counting it) killed a uvloop worker
with SIGSEGV. Issue #8: malformed answers raised ``AssertionError`` / ``ConfigurationError`` out of
non-strict restores.
"""

from __future__ import annotations

import json
import random
import secrets
import struct
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import msgpack
import pytest
import xxhash
from support.faultproxy import FaultProxy, Message, Rule, extra, flip, garbage, hang, truncate
from support.nodes import ACCESS_KEY, SECRET_KEY, Node
from support.probes import alive, start_probed_node
from support.soak import scaled

from ctxstore import ContextStore

WORKER = Path(__file__).resolve().parent.parent / "support" / "restore_worker.py"
BS = 16
TIMEOUTS = (0.5, 1.0, 3.0)  # connect, read, total: the worker's client
BOUND = TIMEOUTS[2] + 1.5  # the longest call may take: the total deadline plus scheduling slack


@dataclass
class Dataset:
    bucket: str
    tokens: list[int]
    blocks: list[bytes]

    @property
    def expected(self) -> list[str]:
        return [xxhash.xxh3_128_hexdigest(b) for b in self.blocks]


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    started = start_probed_node(tmp_path_factory.mktemp("adv-client"), "--memory", "64MiB")
    yield started
    assert alive(started), "the node died"
    started.stop()


def seed(node: Node, n_blocks: int, size: int, label: str) -> Dataset:
    rng = random.Random(label)
    tokens = [rng.randrange(1 << 17) for _ in range(n_blocks * BS)]
    blocks = [rng.randbytes(size) for _ in range(n_blocks)]
    bucket = f"adv-cl-{label}-{secrets.token_hex(3)}"
    with ContextStore([f"127.0.0.1:{node.port}"], access_key=ACCESS_KEY, secret_key=SECRET_KEY) as store:
        ns = store.namespace(bucket, model="m", block_size=BS)
        assert ns.save(tokens, blocks).stored == n_blocks
    return Dataset(bucket, tokens, blocks)


@pytest.fixture(scope="module")
def four(node: Node) -> Dataset:
    return seed(node, 4, 4096, "four")


@pytest.fixture(scope="module")
def big(node: Node) -> Dataset:
    return seed(node, 1, 256 << 10, "big")


def run_worker(proxy: FaultProxy, data: Dataset, *, repeat: int, loop: str = "default", strict: bool = False,
               out: str = "slots", threads: int = 1) -> dict[str, object]:
    config = {"nodes": [proxy.address], "access_key": ACCESS_KEY, "secret_key": SECRET_KEY, "bucket": data.bucket,
              "model": "m", "block_size": BS, "tokens": data.tokens, "expected": data.expected, "repeat": repeat,
              "strict": strict, "out": out, "slot": len(data.blocks[0]), "loop": loop, "timeouts": list(TIMEOUTS),
              "threads": threads}
    proc = subprocess.run([sys.executable, str(WORKER), json.dumps(config)], capture_output=True, text=True,
                          timeout=120 + repeat * (TIMEOUTS[2] + 1), check=False)
    assert proc.returncode == 0, f"the worker died with status {proc.returncode}:\n{proc.stderr[-3000:]}"
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["loop"] == ("asyncio" if loop == "asyncio" else "uvloop")
    assert len(report["results"]) == repeat
    return report


def assert_survived(report: dict[str, object], *, strict: bool = False) -> None:
    """Nothing wrong restored, every shortfall counted, no call past its deadline; in non-strict mode no
    exception escaped, in strict mode only the client's own typed errors."""
    assert report["wrong"] == 0
    assert report["longest"] <= BOUND  # type: ignore[operator]
    exceptions = report["exceptions"]
    assert isinstance(exceptions, list)
    if strict:
        assert [e for e in exceptions if not e[1]] == [], "untyped exceptions escaped a strict call"
    else:
        assert exceptions == [], "exceptions escaped non-strict calls"
        assert report["uncounted"] == 0, "misses that the client's metrics did not count"


LOOPS = ["default", "asyncio"]


# ---------------------------------------------------------------------------- #1: one extra body byte


@pytest.mark.parametrize("loop", LOOPS, ids=["uvloop", "asyncio"])
def test_get_answer_with_one_extra_body_byte_is_a_miss_and_the_worker_lives(node: Node, big: Dataset,
                                                                           loop: str) -> None:
    """A 256 KiB block plus one extra body byte, Content-Length counting it: SIGSEGV under uvloop."""
    with FaultProxy(("127.0.0.1", node.port), [extra(b"\x00", path="/get")]) as proxy:
        report = run_worker(proxy, big, repeat=3, loop=loop)
        assert len(proxy.faults_applied("extra")) == 3
    assert_survived(report)
    assert report["results"] == [0, 0, 0]
    assert report["metrics"]["errors"] >= 3  # type: ignore[index]


# ---------------------------------------------------------------------------- #8: malformed answers


def _prefix_longer_than_body(msg: Message) -> bytes:
    """The frame's length prefix promises a head 100 bytes longer than the whole body."""
    msg.body = struct.pack(">I", len(msg.body) + 100) + msg.body[4:]
    return msg.encode()


def _last_block_one_byte_longer(msg: Message) -> bytes:
    """The last block is one byte longer than the caller's slot (head and body agree, Content-Length too)."""
    (n,) = struct.unpack_from(">I", msg.body, 0)
    head = msgpack.unpackb(msg.body[4:4 + n], raw=False)
    head["sizes"][-1] += 1
    packed = msgpack.packb(head, use_bin_type=True)
    msg.body = struct.pack(">I", len(packed)) + packed + msg.body[4 + n:] + b"\x00"
    return msg.encode()


@pytest.mark.parametrize("loop", LOOPS, ids=["uvloop", "asyncio"])
def test_frame_prefix_longer_than_the_body_is_a_counted_miss(node: Node, four: Dataset, loop: str) -> None:
    """Raised AssertionError out of a non-strict restore."""
    with FaultProxy(("127.0.0.1", node.port), [Rule("transform", fn=_prefix_longer_than_body, path="/get")]) as p:
        report = run_worker(p, four, repeat=2, loop=loop)
    assert_survived(report)
    assert report["results"] == [0, 0]


@pytest.mark.parametrize("out", ["slots", "list"])
@pytest.mark.parametrize("loop", LOOPS, ids=["uvloop", "asyncio"])
def test_block_larger_than_its_out_slot_is_a_counted_miss(node: Node, four: Dataset, loop: str, out: str) -> None:
    """Raised ConfigurationError with strict=False. It is that block's miss (the three before it are
    restored) or that node's (nothing is)."""
    rule = Rule("transform", fn=_last_block_one_byte_longer, path="/get")
    with FaultProxy(("127.0.0.1", node.port), [rule]) as proxy:
        report = run_worker(proxy, four, repeat=2, loop=loop, out=out)
    assert_survived(report)
    assert report["results"] in ([3, 3], [0, 0])


def bit_sweep_rules(n_bits: int, seed_label: str, n_random: int) -> list[Rule]:
    """Request i (0-based) gets fault i: each of the first ``n_bits`` bits of the answer's body, then seeded
    random flips in the HTTP head, the frame head and the payloads."""
    rules = [flip("body", offset=b // 8, bit=b % 8, path="/get", nth={b}) for b in range(n_bits)]
    rng = random.Random(seed_label)
    regions = ["http", "head", "payload", "payload"]
    for i in range(n_random):
        rules.append(flip(rng.choice(regions), count=rng.choice([1, 1, 2, 8]), path="/get", nth={n_bits + i}))
    return rules


@pytest.mark.parametrize("loop, threads", [(LOOPS[0], 1), (LOOPS[1], 1), (LOOPS[0], 3)],
                         ids=["uvloop", "asyncio", "uvloop-3-threads"])
def test_bit_flips_in_get_answers_are_counted_misses(node: Node, four: Dataset, loop: str, threads: int) -> None:
    """Flipping each of the first 140 bits of a ``get`` answer gave 6 AssertionErrors and 11
    ConfigurationErrors; flips anywhere else must not do worse. No flip may yield a wrong block. With 3 threads
    every restore is 3 gets, received on 3 event loops."""
    rules = bit_sweep_rules(140, f"sweep-{loop}-{threads}", scaled(40, 2000))
    with FaultProxy(("127.0.0.1", node.port), rules, seed=7) as proxy:
        report = run_worker(proxy, four, repeat=len(rules), loop=loop, threads=threads)
        assert len(proxy.faults_applied("flip")) >= len(rules)
    assert_survived(report)


def structural() -> list[Rule]:
    """Truncated, hung, padded, garbage, reset, late and malformed answers: request i gets fault i."""
    rules = [
        truncate("http", path="/get"),
        truncate("head", path="/get"),
        truncate("payload", path="/get"),
        hang("payload", offset=100, path="/get"),
        extra(b"HTTP/1.1 200 OK\r\n", fix_length=False, path="/get"),  # bytes after the answer
        extra(b"\x00" * 7, path="/get"),  # bytes inside the answer (#1 with more of them)
        garbage(count=300, path="/get"),
        garbage(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello", path="/get"),  # a well-formed lie
        Rule("reset", "message", path="/get"),
        Rule("delay", "message", seconds=1.5, path="/get"),  # longer than the read timeout
        Rule("transform", fn=_prefix_longer_than_body, path="/get"),
        Rule("transform", fn=_last_block_one_byte_longer, path="/get"),
    ]
    for i, rule in enumerate(rules):
        rule.nth = {i}
    return rules


@pytest.mark.parametrize("loop, strict, threads", [("default", False, 1), ("asyncio", False, 1), ("asyncio", True, 1),
                                                   ("default", False, 3)],
                         ids=["uvloop-lenient", "asyncio-lenient", "asyncio-strict", "uvloop-lenient-3-threads"])
def test_cut_stalled_and_garbage_answers(node: Node, four: Dataset, loop: str, strict: bool, threads: int) -> None:
    """Truncated, hung, padded, garbage, reset and late answers, one per request: misses within the
    deadline (lenient), or the client's typed errors (strict). With 3 threads each restore is 3 requests on 3
    event loops, so the faults come 3 to a restore."""
    rules = structural()
    with FaultProxy(("127.0.0.1", node.port), rules, seed=3) as proxy:
        report = run_worker(proxy, four, repeat=len(rules) + 1, loop=loop, strict=strict, threads=threads)
    assert_survived(report, strict=strict)
    results = report["results"]
    assert isinstance(results, list)
    assert results[-1] == 4, "the last, untouched, restore must get everything again"
