"""The client against a node that answers garbage: every malformed answer is a miss, counted, and never an
exception in the caller's process (strict mode aside), never wrong bytes, never a crash of the process,
whatever event loop the client runs on.

A scripted node (a socket server in this process) answers each request with bytes the test chose, then
closes the connection, so a truncated answer fails at once instead of at the read timeout.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator

import pytest
import xxhash
from support.raw import loopback_listener, recv_request, serve_in_background

from ctxstore import ContextStore, Timeouts, wire
from ctxstore.hashing import Fingerprint

BS = 16
TOKENS = list(range(BS))  # one full block
BLOCK = os.urandom(256 << 10)
KEY = Fingerprint(model="m", block_size=BS).block_hashes(TOKENS)[0]

Answer = Callable[[bytes], bytes]  # request line -> whole HTTP response


def http(body: bytes, status: int = 200, length: int | None = None) -> bytes:
    return b"HTTP/1.1 %d X\r\nContent-Length: %d\r\n\r\n" % (status, len(body) if length is None else length) + body


def get_answer(payload: bytes = BLOCK, size: int | None = None) -> bytes:
    """A well-formed get answer for the one key (``size`` may lie about the payload)."""
    head = wire.encode_get_head(wire.GetResponse([len(payload) if size is None else size],
                                                 [xxhash.xxh3_64_intdigest(payload)], [0.0]))
    return head + payload


class ScriptedNode:
    """Answers every request with ``answer(request_line)``, then closes the connection."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.sock, self.port = loopback_listener()
        serve_in_background(self.sock, self._connection, concurrent=False)

    def _connection(self, conn: socket.socket) -> None:
        with conn:
            try:
                request = recv_request(conn)
                if request is not None:
                    conn.sendall(self.answer(request[0][0]))
            except OSError:
                pass

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def scripted() -> Iterator[Callable[[Answer], ScriptedNode]]:
    made: list[ScriptedNode] = []

    def make(answer: Answer) -> ScriptedNode:
        made.append(ScriptedNode(answer))
        return made[-1]

    yield make
    for node in made:
        node.close()


def restore_once(port: int, **kwargs: object) -> tuple[int, bytes | None, dict[str, object]]:
    store = ContextStore(f"127.0.0.1:{port}", access_key="AKIDEXAMPLE", secret_key="secret-0000",
                         timeouts=Timeouts(connect=0.5, read=1.0, total=3.0), **kwargs)  # type: ignore[arg-type]
    try:
        ns = store.namespace("bkt", model="m", block_size=BS, create=False)
        result = ns.restore(TOKENS)
        return result.n_blocks, bytes(result.blocks[0]) if result.blocks else None, store.metrics_snapshot()
    finally:
        store.close()


RESTORE_IN_A_CHILD = """
import sys
from ctxstore import ContextStore, Timeouts
loop = sys.argv[2]
store = ContextStore("127.0.0.1:" + sys.argv[1], access_key="AKIDEXAMPLE", secret_key="secret-0000",
                     timeouts=Timeouts(connect=0.5, read=1.0, total=3.0))
print(type(store._loop.loop).__module__.split(".")[0])
ns = store.namespace("bkt", model="m", block_size=16, create=False)
print(ns.restore(list(range(16))).n_blocks, store.metrics_snapshot()["errors"])
store.close()
"""


def test_an_answer_with_one_byte_more_than_its_frame_is_a_miss_not_a_crash(scripted) -> None:  # noqa: ANN001
    """Under uvloop, aborting the transport inside get_buffer made the process die with SIGSEGV."""
    node = scripted(lambda line: http(get_answer() + b"X"))
    out = subprocess.run([sys.executable, "-c", RESTORE_IN_A_CHILD, str(node.port), "uvloop"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    loop_module, result = out.stdout.split("\n")[:2]
    assert loop_module == "uvloop"  # the client picks uvloop when it is installed, as in inference servers
    assert result == "0 1"  # a miss, counted as an error


@pytest.mark.parametrize("answer", [
    pytest.param(lambda: http(get_answer() + b"X"), id="extra-byte"),
    pytest.param(lambda: http(get_answer()[:-1]), id="one-byte-short"),
    pytest.param(lambda: http(get_answer(), length=len(get_answer()) + 10), id="content-length-too-long"),
    pytest.param(lambda: http(b"\x00\x00\x10\x00" + get_answer()[4:]), id="frame-prefix-longer-than-body"),
    pytest.param(lambda: http(get_answer(size=len(BLOCK) + 1)), id="size-one-more-than-sent"),
    pytest.param(lambda: http(get_answer(size=1 << 40)), id="a-terabyte-block"),
    pytest.param(lambda: http(b"not msgpack at all"), id="garbage-body"),
    pytest.param(lambda: b"HTTP/1.1 200 OK\r\nContent-Length: 99999999999999999999\r\n\r\n", id="huge-length"),
    pytest.param(lambda: b"garbage\r\n\r\n", id="garbage-status-line"),
    pytest.param(lambda: http(b"x" * 100, status=500), id="500-not-msgpack"),
])
def test_malformed_get_answers_are_misses(scripted, answer: Callable[[], bytes]) -> None:  # noqa: ANN001
    node = scripted(lambda line: answer())
    n_blocks, data, metrics = restore_once(node.port)
    assert n_blocks == 0 and data is None
    assert metrics["errors"] == 1


def test_every_single_bit_flip_of_an_answer_is_a_miss_or_the_right_block(scripted) -> None:  # noqa: ANN001
    good = http(get_answer())
    cases = len(good.split(b"\r\n\r\n")[0]) * 8 + 100 * 8  # every bit of the HTTP head and the frame's start
    bits = iter(range(cases))

    def answer(line: bytes) -> bytes:
        if b"/get" not in line:  # the client's readiness probes after a node was marked down
            return http(b"")
        bit = next(bits, None)
        if bit is None:
            return good
        damaged = bytearray(good)
        damaged[bit // 8] ^= 1 << (bit % 8)
        return bytes(damaged)

    node = scripted(answer)
    store = ContextStore(f"127.0.0.1:{node.port}", access_key="AKIDEXAMPLE", secret_key="secret-0000",
                         timeouts=Timeouts(connect=0.5, read=0.5, total=2.0), probe_interval=0.01)
    try:
        ns = store.namespace("bkt", model="m", block_size=BS, create=False)
        restored = 0
        for _ in range(cases):
            for node_state in store._async.pod.nodes:  # a 5xx marks the node down: ask it again at once
                node_state.up = True
            result = ns.restore(TOKENS)  # must not raise, whatever the flipped bit
            if result.n_blocks:
                assert bytes(result.blocks[0]) == BLOCK  # never wrong bytes
                restored += 1
        assert restored < cases  # most flips are misses; a few (a header's case, a reason phrase) are harmless
        assert store.metrics_snapshot()["errors"] + store.metrics_snapshot()["checksum_failures"] >= 1
    finally:
        store.close()


def test_strict_mode_raises_a_typed_error_for_a_malformed_answer(scripted) -> None:  # noqa: ANN001
    from ctxstore import ContextStoreError

    node = scripted(lambda line: http(get_answer() + b"X"))
    with pytest.raises(ContextStoreError):
        restore_once(node.port, strict=True)
