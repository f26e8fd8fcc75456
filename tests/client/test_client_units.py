"""The client's pieces without a real node: placement, address parsing, signing, the get-response reader, the
error table, and checksum verification against a tiny fake node on loopback."""

from __future__ import annotations

import os

import asyncio
import collections
import time
from collections.abc import Callable
from typing import Any

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from ctxstore import (
    AsyncContextStore,
    ConfigurationError,
    IntegrityError,
    Limits,
    ProtocolError,
    Timeouts,
    errors,
    wire,
)
from ctxstore.buffers import Destinations, Scatter
from ctxstore.core import AsyncNamespace
from ctxstore.frames import GetReader
from ctxstore.hashing import Fingerprint
from ctxstore.pod import Pod, parse_nodes
from ctxstore.sigv4 import Signer
from ctxstore_server.protocol.auth import Credentials, authenticate
from ctxstore_server.protocol.errors import RequestError
from ctxstore_server.s3.errors import as_s3_error

ACCESS = "UNITACCESSKEY0001"
SECRET = "unit-test-secret-0001"


def make_pod(names: list[str]) -> Pod:
    return Pod([(n, 9000) for n in names], pool_size=1, connect_timeout=1, read_timeout=1, probe_interval=1)


def owners(pod: Pod, keys: list[str]) -> list[str]:
    return [pod.owner(k).host for k in keys]


# ---------------------------------------------------------------------------- rendezvous placement

GOLDEN_KEYS = [xxhash.xxh3_128_hexdigest(str(i).encode()) for i in range(12)]
GOLDEN_OWNERS = ["node-c", "node-b", "node-b", "node-c", "node-b", "node-b",
                 "node-b", "node-a", "node-a", "node-a", "node-b", "node-a"]


def test_placement_is_frozen() -> None:
    """Changing the placement function strands every block a running pod holds: it must never change."""
    pod = make_pod(["node-a", "node-b", "node-c"])
    assert owners(pod, GOLDEN_KEYS) == GOLDEN_OWNERS
    # The owner depends on the node names only, not on the order they are listed in.
    assert owners(make_pod(["node-c", "node-a", "node-b"]), GOLDEN_KEYS) == GOLDEN_OWNERS
    # A larger frozen sample, as a digest of the owner sequence.
    many = [xxhash.xxh3_128_hexdigest(f"k{i}".encode()) for i in range(1000)]
    sequence = "".join(o[-1] for o in owners(pod, many))
    assert collections.Counter(sequence) == {"a": 306, "b": 360, "c": 334}
    assert xxhash.xxh3_64_hexdigest(sequence.encode()) == "42a0e72967171ebd"


def test_placement_is_balanced() -> None:
    pod = make_pod(["node-a", "node-b", "node-c"])
    keys = [xxhash.xxh3_128_hexdigest(i.to_bytes(4, "little")) for i in range(10_000)]
    counts = collections.Counter(owners(pod, keys))
    for name in ("node-a", "node-b", "node-c"):
        assert abs(counts[name] - 10_000 / 3) <= 0.10 * 10_000 / 3, counts


def test_adding_a_node_moves_only_its_share_to_it() -> None:
    keys = [xxhash.xxh3_128_hexdigest(i.to_bytes(4, "little")) for i in range(10_000)]
    before = owners(make_pod(["node-a", "node-b", "node-c"]), keys)
    after = owners(make_pod(["node-a", "node-b", "node-c", "node-d"]), keys)
    moved = [(b, a) for b, a in zip(before, after) if b != a]
    assert all(a == "node-d" for _, a in moved)  # nothing moves between the old nodes
    assert abs(len(moved) - 2500) <= 250, len(moved)


def test_group_keeps_key_order_per_node() -> None:
    pod = make_pod(["node-a", "node-b", "node-c"])
    groups = pod.group(GOLDEN_KEYS)
    assert sorted(i for idx in groups.values() for i in idx) == list(range(len(GOLDEN_KEYS)))
    for node, idx in groups.items():
        assert idx == sorted(idx)
        assert all(GOLDEN_OWNERS[i] == node.host for i in idx)


# ---------------------------------------------------------------------------- node addresses


@pytest.mark.parametrize(("given", "expected"), [
    ("a:9001", [("a", 9001)]),
    ("a:9001,b:9002", [("a", 9001), ("b", 9002)]),
    (" a:1 , b ,", [("a", 1), ("b", 9000)]),
    ("node-x", [("node-x", 9000)]),
    ("http://a:9001", [("a", 9001)]),
    ("http://a:9001/", [("a", 9001)]),
    (["http://a:1", "b:2", "c"], [("a", 1), ("b", 2), ("c", 9000)]),
    ("[::1]:9005", [("::1", 9005)]),
    ("[::1]", [("::1", 9000)]),
    ("https://a:9001", [("a", 9001)]),
    ("https://a:1,https://b", [("a", 1), ("b", 9000)]),
])
def test_parse_nodes_forms(given: object, expected: list[tuple[str, int]]) -> None:
    assert parse_nodes(given) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", ["", " , ", [], "https://a:9000,http://b:9000", "a:port", "a:", "a:99999", "a:0",
                                 "ftp://a"])
def test_parse_nodes_rejects_bad_input(bad: object) -> None:
    with pytest.raises(ConfigurationError):
        parse_nodes(bad)  # type: ignore[arg-type]


def test_missing_configuration_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("CTXSTORE_NODES", "CTXSTORE_ACCESS_KEY", "CTXSTORE_SECRET_KEY", "AWS_ACCESS_KEY_ID",
                 "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigurationError, match="CTXSTORE_NODES"):
        AsyncContextStore(access_key=ACCESS, secret_key=SECRET)
    with pytest.raises(ConfigurationError, match="credentials"):
        AsyncContextStore("127.0.0.1:9")
    monkeypatch.setenv("CTXSTORE_NODES", "127.0.0.1:9,127.0.0.2:9")
    monkeypatch.setenv("CTXSTORE_ACCESS_KEY", ACCESS)
    monkeypatch.setenv("CTXSTORE_SECRET_KEY", SECRET)
    store = AsyncContextStore()  # all from the environment
    assert [n.name for n in store.pod.nodes] == ["127.0.0.1:9", "127.0.0.2:9"]
    assert store.signer.access_key == ACCESS and SECRET not in repr(store.signer)


# ---------------------------------------------------------------------------- SigV4


def _lookup(access_key: str) -> Credentials | None:
    return Credentials(ACCESS, SECRET, "unit") if access_key == ACCESS else None


def _verify(headers: list[tuple[str, str]], *, method: str, host: str, path: str, now: float,
            lookup: Callable[[str], Credentials | None] = _lookup):
    lower = {k.lower(): v for k, v in headers}
    lower["host"] = host
    return authenticate(method=method, raw_path=path, query_string=b"", headers=lower, lookup=lookup, now=now)


@pytest.mark.parametrize(("method", "host", "path"), [
    ("POST", "127.0.0.1:9000", wire.path("kv-llama", "get")),
    ("POST", "[::1]:9000", wire.path("a-b.c", "put")),
    ("PUT", "node-a:9000", "/kv-bucket"),
    ("GET", "node-a:9000", "/_ctx/health/ready"),
])
def test_signer_is_accepted_by_the_server_verifier(method: str, host: str, path: str) -> None:
    now = time.time()
    signer = Signer(ACCESS, SECRET)
    auth = _verify(signer.headers(method, host, path, now=now), method=method, host=host, path=path, now=now)
    assert auth.credentials.tenant == "unit"
    assert auth.payload == "unsigned"
    # The cached signing key gives the same answer on a second call (and across a day boundary).
    later = now + 86400
    headers = signer.headers(method, host, path, now=later)
    auth = _verify(headers, method=method, host=host, path=path, now=later)
    assert auth.credentials.tenant == "unit"


def test_signer_with_wrong_secret_or_tampered_request_is_rejected() -> None:
    now = time.time()
    path = wire.path("kv-a", "get")
    bad = Signer(ACCESS, "not-the-secret-000")
    with pytest.raises(RequestError) as info:
        _verify(bad.headers("POST", "h:1", path, now=now), method="POST", host="h:1", path=path, now=now)
    assert as_s3_error(info.value).code == "SignatureDoesNotMatch"
    good = Signer(ACCESS, SECRET).headers("POST", "h:1", path, now=now)
    with pytest.raises(RequestError):  # signed for another path
        _verify(good, method="POST", host="h:1", path=wire.path("kv-a", "put"), now=now)
    with pytest.raises(RequestError) as info:  # unknown access key
        _verify(Signer("NOSUCHKEY0000", SECRET).headers("POST", "h:1", path, now=now),
                method="POST", host="h:1", path=path, now=now)
    assert as_s3_error(info.value).code == "InvalidAccessKeyId"


# ---------------------------------------------------------------------------- the get-response reader


def _get_response(payloads: list[bytes | None], corrupt: int = -1) -> bytes:
    sizes = [wire.ABSENT if p is None else len(p) for p in payloads]
    sums = [0 if p is None else xxhash.xxh3_64_intdigest(p) for p in payloads]
    if corrupt >= 0:
        sums[corrupt] ^= 1
    head = wire.encode_get_head(wire.GetResponse(sizes, sums, [0.0] * len(payloads)))
    return head + b"".join(p for p in payloads if p)


def _feed(reader: GetReader, data: bytes, splits: list[int]) -> None:
    """Deliver ``data`` the way the transport does: into whatever buffer the reader offers, in pieces."""
    pos = 0
    pieces = iter(splits)
    while pos < len(data):
        want = next(pieces, len(data))
        target = reader.get_buffer()
        assert len(target) > 0
        k = min(len(target), max(1, want), len(data) - pos)
        target[:k] = data[pos:pos + k]
        reader.written(k)
        pos += k


_payload = st.one_of(st.none(), st.binary(min_size=0, max_size=300))


@settings(max_examples=150, deadline=None)
@given(payloads=st.lists(_payload, min_size=0, max_size=12),
       splits=st.lists(st.integers(1, 97), max_size=400),
       mode=st.sampled_from(["alloc", "list", "arena", "scatter"]))
def test_get_reader_lands_payloads_whatever_the_splits(payloads: list[bytes | None], splits: list[int],
                                                       mode: str) -> None:
    n = len(payloads)
    out: object = None
    if mode == "list":
        out = [bytearray(300) for _ in range(n)]
    elif mode == "arena":
        out = bytearray(300 * n)
    elif mode == "scatter":  # each block over pieces of 0, 1, 7 and 292 bytes, in that order
        out = [[bytearray(0), bytearray(1), memoryview(bytearray(7)), bytearray(292)] for _ in range(n)]
    dest = Destinations(out, n)
    indices = list(range(n))
    reader = GetReader(n, dest, indices)
    _feed(reader, _get_response(payloads), splits)
    assert reader.meta is not None
    assert dest.error is None
    for i, payload in enumerate(payloads):
        view = reader.views[i]
        if payload is None:
            assert view is None
            continue
        assert view is not None and bytes(view) == payload and len(view) == len(payload)
        assert reader.verified[i] and xxhash.xxh3_64_intdigest(bytes(view)) == reader.meta.xxh3[i]
        if mode == "scatter":  # the caller's pieces hold the block, in order, and nothing else was touched
            pieces = out[i]  # type: ignore[index]
            assert bytes(b"".join(bytes(p) for p in pieces))[:len(payload)] == payload
            assert not any(b"".join(bytes(p) for p in pieces)[len(payload):])
        if mode == "list":
            assert view.obj is out[i]  # type: ignore[index]  # in the caller's buffer, not a copy
        if mode == "arena":
            assert bytes(out[i * 300:i * 300 + len(payload)]) == payload  # type: ignore[index]


@settings(max_examples=150, deadline=None)
@given(kinds=st.lists(st.sampled_from(["full", "full", "full", "short", "absent", "empty", "over"]), max_size=12),
       splits=st.lists(st.integers(1, 2000), max_size=400))
def test_get_reader_fills_runs_of_arena_slots_with_one_read(kinds: list[str], splits: list[int]) -> None:
    """Payloads whose slots follow each other in one buffer are offered as one span: each must still land in
    its own slot, be verified alone, and a block too big for its slot must not spill into the next one."""
    slot = 300
    size = {"full": slot, "short": 123, "absent": None, "empty": 0, "over": slot + 1}
    payloads: list[bytes | None] = [None if size[k] is None else os.urandom(size[k]) for k in kinds]  # type: ignore[arg-type]
    n = len(payloads)
    out = bytearray(b"\xee" * (slot * n))
    dest = Destinations(out, n)
    reader = GetReader(n, dest, list(range(n)))
    offered: list[int] = []
    original = reader.get_buffer

    def get_buffer() -> memoryview:
        view = original()
        offered.append(len(view))
        return view

    reader.get_buffer = get_buffer  # type: ignore[method-assign]
    _feed(reader, _get_response(payloads), splits)
    for i, (kind, payload) in enumerate(zip(kinds, payloads)):
        slot_bytes = bytes(out[i * slot:(i + 1) * slot])
        if kind in ("absent", "over"):
            assert reader.views[i] is None and slot_bytes == b"\xee" * slot  # untouched
            continue
        assert payload is not None and reader.verified[i] and bytes(reader.views[i]) == payload  # type: ignore[arg-type]
        assert slot_bytes == payload + b"\xee" * (slot - len(payload))
    if "full full" in " ".join(kinds) and not splits:
        assert max(offered) > slot  # a run was offered whole


def test_get_reader_byte_by_byte_with_global_indices() -> None:
    payloads: list[bytes | None] = [b"first-block", None, b"", b"x" * 1000]
    out = [bytearray(1000) for _ in range(10)]
    dest = Destinations(out, 10)
    reader = GetReader(4, dest, [6, 7, 8, 9])  # this call's keys are blocks 6..9 of the restore
    _feed(reader, _get_response(payloads), [1] * 10_000)
    assert bytes(out[6][:11]) == b"first-block"
    assert reader.views[1] is None
    assert reader.views[2] is not None and len(reader.views[2]) == 0
    assert bytes(out[9]) == b"x" * 1000


def test_get_reader_discards_a_block_its_destination_cannot_hold() -> None:
    # the middle block is bigger than the reader's discard buffer
    payloads: list[bytes | None] = [b"a" * 10, b"b" * 400_000, b"c" * 10]
    out = [bytearray(10), bytearray(10), bytearray(10)]
    dest = Destinations(out, 3)
    reader = GetReader(3, dest, [0, 1, 2])
    _feed(reader, _get_response(payloads), [7919] * 100)
    assert bytes(out[0]) == b"a" * 10 and bytes(out[2]) == b"c" * 10  # the stream stayed in step
    assert reader.views[1] is None
    assert dest.error is not None and "out[1]" in dest.error


def test_get_reader_scatters_a_block_over_pieces_and_verifies_it_whole() -> None:
    # One object per paged-KV block holding every layer: each layer's piece of the block is its own buffer.
    layers = [bytearray(4 * 64) for _ in range(3)]
    pieces = [[memoryview(layer)[b * 64:(b + 1) * 64] for layer in layers] for b in range(4)]
    payloads: list[bytes | None] = [bytes([b]) * 64 + bytes([b + 10]) * 64 + bytes([b + 20]) * 64 for b in range(4)]
    payloads[2] = None  # absent: its pieces stay untouched
    dest = Destinations([Scatter(p) for p in pieces], 4)
    reader = GetReader(4, dest, range(4))
    _feed(reader, _get_response(payloads, corrupt=3), [50] * 1000)
    assert reader.verified[:2] == [True, True] and reader.views[2] is None
    assert not reader.verified[3]  # the digest covers the whole block, across its pieces
    for b in (0, 1):
        view = reader.views[b]
        assert isinstance(view, Scatter) and len(view) == 192 and bytes(view) == payloads[b]
        for layer in range(3):
            assert bytes(layers[layer][b * 64:(b + 1) * 64]) == bytes([b + 10 * layer]) * 64
    assert not any(layers[0][128:192])
    # a block bigger than its scatter is refused like any other
    dest = Destinations([[bytearray(10), bytearray(10)]], 1)
    reader = GetReader(1, dest, [0])
    _feed(reader, _get_response([b"z" * 21]), [4] * 100)
    assert reader.views[0] is None and dest.error is not None and "21" in dest.error


def test_destinations_validate_out() -> None:
    with pytest.raises(ConfigurationError):
        Destinations([bytearray(4)], 2)  # too few buffers
    with pytest.raises(ConfigurationError):
        Destinations(bytes(8), 2)  # read-only
    with pytest.raises(ConfigurationError):
        Destinations([bytearray(4), b"1234"], 2)
    with pytest.raises(ConfigurationError):
        Destinations(memoryview(bytearray(16))[::2], 2)  # not contiguous
    with pytest.raises(ConfigurationError):
        Destinations(object(), 2)  # no buffer at all
    Destinations(bytearray(0), 0)  # an empty prompt needs no room


# ---------------------------------------------------------------------------- error table


def test_error_codes_cover_the_wire_table() -> None:
    # InternalError and RequestTimeout stay plain ServerError on purpose: neither says anything about the
    # request the caller could fix; a 5xx marks the node down, and RequestTimeout means a body stalled.
    uncovered = set(wire.ERROR_STATUS) - set(errors.ERROR_CODES)
    assert uncovered == {"InternalError", "RequestTimeout"}
    assert set(errors.ERROR_CODES) <= set(wire.ERROR_STATUS)
    for code in ("InternalError", "RequestTimeout", "SomethingNew"):
        exc = errors.server_error("n", 500, code, "m")
        assert type(exc) is errors.ServerError and exc.code == code
    assert isinstance(errors.server_error("n", 403, "SignatureDoesNotMatch", ""), errors.AuthenticationError)
    assert isinstance(errors.server_error("n", 400, "TooManyKeys", ""), errors.LimitExceeded)
    assert isinstance(errors.server_error("n", 405, "MethodNotAllowed", ""), errors.ProtocolError)
    assert issubclass(errors.NodeTimeout, errors.NodeUnavailable)
    assert issubclass(ConfigurationError, ValueError)
    for cls in (errors.NodeUnavailable, errors.ServerError, IntegrityError, ConfigurationError):
        assert issubclass(cls, errors.ContextStoreError)


# ---------------------------------------------------------------------------- a fake node on loopback


class FakeNode:
    """An HTTP/1.1 server on loopback that answers every request with ``respond(method, path, body)``."""

    def __init__(self, respond: Callable[[str, str, bytes], bytes]) -> None:
        self.respond = respond
        self.requests: list[tuple[str, str]] = []
        self.server: asyncio.Server | None = None
        self.port = 0

    async def __aenter__(self) -> FakeNode:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                length = next(int(line.split(":", 1)[1]) for line in lines
                              if line.lower().startswith("content-length:"))
                body = await reader.readexactly(length)
                self.requests.append((method, path))
                writer.write(self.respond(method, path, body))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def http_200(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body) + body


BLOCKS = [bytes([i]) * 1000 for i in range(4)]


def _store(port: int, **kwargs: Any) -> AsyncContextStore:
    """A client of one thread: the fake nodes answer each call with one scripted answer for all its keys."""
    return AsyncContextStore(f"127.0.0.1:{port}", access_key=ACCESS, secret_key=SECRET, **{"threads": 1, **kwargs})


def test_checksum_mismatch_is_a_counted_miss() -> None:
    def respond(method: str, path: str, body: bytes) -> bytes:
        head, _ = wire.unpack_head(body, wire.ANY_HEAD)
        assert path == wire.path("kv-a", "get") and len(head["keys"]) == 4
        return http_200(_get_response(list(BLOCKS), corrupt=2))

    async def main() -> None:
        async with FakeNode(respond) as node, _store(node.port) as store:
            keys = [f"{i:032x}" for i in range(4)]
            views = await store.get_keys("kv-a", keys, Destinations(None, 4))
            assert [None if v is None else bytes(v) for v in views] == [BLOCKS[0], BLOCKS[1], None, BLOCKS[3]]
            snap = store.metrics_snapshot()
            assert snap["checksum_failures"] == 1 and snap["bytes_in"] == 3000

            ns = AsyncNamespace(store, "kv-a", Fingerprint(model="m", block_size=4), "xxh3-128")
            result = await ns.restore(list(range(16)))  # the corrupt block cuts the prefix
            assert result.n_blocks == 2 and result.n_tokens == 8
            assert [bytes(b) for b in result.blocks] == BLOCKS[:2]
            snap = store.metrics_snapshot()
            assert snap["checksum_failures"] == 2 and snap["hits"] == 2 and snap["misses"] == 2
            assert snap["nodes"][f"127.0.0.1:{node.port}"]["up"] is True  # corruption is not an outage

    asyncio.run(main())


def test_checksum_mismatch_in_strict_mode_raises_integrity_error() -> None:
    async def main() -> None:
        async with FakeNode(lambda m, p, b: http_200(_get_response(list(BLOCKS), corrupt=0))) as node:
            async with _store(node.port, strict=True) as store:
                with pytest.raises(IntegrityError):
                    await store.get_keys("kv-a", [f"{i:032x}" for i in range(4)], Destinations(None, 4))
                assert store.metrics_snapshot()["checksum_failures"] == 1

    asyncio.run(main())


@pytest.mark.parametrize("bad", [
    wire.HEAD_LEN.pack(0),  # an empty head
    wire.pack_head({"sizes": [1, 2]}),  # wrong shape
    b"\x00\x00\x00\x03abc",  # not msgpack
    _get_response(list(BLOCKS)) + b"extra",  # more payload bytes than the head announces
])
def test_malformed_get_response_degrades_or_raises_protocol_error(bad: bytes) -> None:
    async def main() -> None:
        async with FakeNode(lambda m, p, b: http_200(bad)) as node:
            keys = [f"{i:032x}" for i in range(4)]
            async with _store(node.port) as store:
                views = await store.get_keys("kv-a", keys, Destinations(None, 4))
                assert views == [None] * 4
                assert store.metrics_snapshot()["errors"] == 1
            async with _store(node.port, strict=True) as store:
                with pytest.raises(ProtocolError):
                    await store.get_keys("kv-a", keys, Destinations(None, 4))

    asyncio.run(main())


def test_lookup_and_counts_against_a_fake_node() -> None:
    def respond(method: str, path: str, body: bytes) -> bytes:
        head, _ = wire.unpack_head(body, wire.ANY_HEAD)
        n = len(head["keys"])
        if path.endswith("/lookup"):
            sizes = [7 if i < 2 else wire.ABSENT for i in range(n)]
            answer = wire.LookupResponse(wire.prefix_length(sizes), sizes)
            return http_200(wire.encode_lookup_response(answer))
        return http_200(wire.encode_count_response(wire.CountResponse(n)))

    async def main() -> None:
        async with FakeNode(respond) as node, _store(node.port) as store:
            ns = AsyncNamespace(store, "kv-a", Fingerprint(model="m", block_size=4), "xxh3-128")
            assert await ns.lookup(list(range(18))) == 2  # 4 full blocks, a partial one ignored
            assert await ns.lookup([]) == 0
            assert await ns.touch(list(range(12))) == 3
            assert await ns.delete(list(range(3))) == 0  # no full block: no call at all
            assert [p for _, p in node.requests] == [wire.path("kv-a", "lookup"), wire.path("kv-a", "touch")]

    asyncio.run(main())


def test_membership_follows_dns_and_keeps_known_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A name that resolves to other addresses later (a headless service) is re-resolved in the background:
    known nodes keep their state, new ones join, departed ones leave, and only their keys move."""
    import ctxstore.core as core_mod
    import ctxstore.pod as pod_mod

    answers = [[("10.0.0.1", 9000), ("10.0.0.2", 9000)], [("10.0.0.2", 9000), ("10.0.0.3", 9000)]]
    monkeypatch.setattr(pod_mod, "expand_dns", lambda spec: list(answers[0]))

    async def scenario() -> None:
        store = core_mod.AsyncContextStore("ctxstore-headless.test:9000", access_key="AK", secret_key="secretsecret",
                                           dns_refresh=0.0)
        keys = [f"k{i}" for i in range(2000)]
        before = {k: store.pod.owner(k).name for k in keys}
        kept = next(n for n in store.pod.nodes if n.host == "10.0.0.2")
        kept.failures = 7  # state that must survive the refresh
        monkeypatch.setattr(pod_mod, "expand_dns", lambda spec: list(answers[1]))
        store._maybe_refresh_membership()
        assert store._resolving is not None
        await store._resolving
        names = [n.name for n in store.pod.nodes]
        assert names == ["10.0.0.2:9000", "10.0.0.3:9000"]
        assert next(n for n in store.pod.nodes if n.host == "10.0.0.2") is kept and kept.failures == 7
        after = {k: store.pod.owner(k).name for k in keys}
        for k in keys:  # a key moves only off the departed node or onto the new one (rendezvous)
            if after[k] != before[k]:
                assert before[k] == "10.0.0.1:9000" or after[k] == "10.0.0.3:9000"
        assert any(before[k] == after[k] == "10.0.0.2:9000" for k in keys)
        await store.aclose()

    asyncio.run(scenario())


def test_ip_only_membership_is_never_re_resolved() -> None:
    async def scenario() -> None:
        store = AsyncContextStore("127.0.0.1:1,127.0.0.1:2", access_key="AK", secret_key="secretsecret", dns_refresh=0.0)
        store._maybe_refresh_membership()
        assert store._resolving is None
        await store.aclose()

    asyncio.run(scenario())


# ---------------------------------------------------------------------------- configuration values


@pytest.mark.parametrize("make", [
    lambda: Timeouts(connect=0), lambda: Timeouts(read=-1.0), lambda: Timeouts(total=float("nan")),
    lambda: Timeouts(total=float("inf")), lambda: Limits(keys_per_call=0), lambda: Limits(bytes_per_call=-5),
    lambda: Limits(bytes_per_get=0), lambda: Limits(keys_per_call=2.5),  # type: ignore[arg-type]
    lambda: Limits(keys_per_call=True),
    lambda: AsyncContextStore("127.0.0.1:1", access_key="a", secret_key="b", pool_size=0),
    lambda: AsyncContextStore("127.0.0.1:1", access_key="a", secret_key="b", probe_interval=0),
    lambda: AsyncContextStore("127.0.0.1:1", access_key="a", secret_key="b", dns_refresh=-1),
])
def test_values_that_would_hang_or_spin_are_refused_at_once(make: Callable[[], object]) -> None:
    with pytest.raises(ConfigurationError, match="must be a positive"):
        make()


def test_the_defaults_and_small_positive_values_are_accepted() -> None:
    assert Limits(keys_per_call=1, bytes_per_call=1, bytes_per_get=1).bytes_per_get == 1
    assert Timeouts(connect=0.01, read=1, total=2).read == 1
