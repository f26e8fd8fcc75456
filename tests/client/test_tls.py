"""The client over TLS: ``https://`` nodes (a real ``ctxstore serve --tls-cert/--tls-key`` with a certificate
made for the test) are saved to, looked up and restored from, by the sync client (uvloop) and the async one
(asyncio's loop), on one receive thread and several; the certificate is always verified (against ``tls_ca`` /
``CTXSTORE_TLS_CA`` or the system's CAs), and a certificate the client does not trust is a prompt error that
names TLS verification, never a hang."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import random
import secrets
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.nodes import ACCESS_KEY, SECRET_KEY, Node, start_node
from support.tls import make_self_signed

from ctxstore import AsyncContextStore, ConfigurationError, ContextStore, NodeUnavailable, Timeouts
from ctxstore.lanes import Lanes
from ctxstore.pod import Pod, resolve
from ctxstore.tls import client_context
from ctxstore.transport import BytesReader, request_head

BS = 16
KiB = 1024
TIMEOUTS = Timeouts(connect=2.0, read=5.0, total=20.0)


@pytest.fixture(scope="module")
def tls_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Node, Path]]:
    tmp = tmp_path_factory.mktemp("client-tls")
    cert, key = make_self_signed(tmp)
    node = start_node(tmp, "--tls-cert", str(cert), "--tls-key", str(key), "--memory", "256MiB", scheme="https")
    yield node, cert
    node.stop()


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_self_signed(tmp_path_factory.mktemp("other-ca"))[0]


def prompt(n_blocks: int, size: int, seed: int) -> tuple[list[int], list[bytes]]:
    rng = random.Random(seed)
    return [rng.randrange(1 << 17) for _ in range(n_blocks * BS)], [rng.randbytes(size) for _ in range(n_blocks)]


def client(endpoint: str, **kwargs: object) -> ContextStore:
    options: dict[str, object] = {"access_key": ACCESS_KEY, "secret_key": SECRET_KEY, "timeouts": TIMEOUTS}
    options.update(kwargs)
    return ContextStore(endpoint, **options)  # type: ignore[arg-type]


def bucket() -> str:
    return "tls-" + secrets.token_hex(6)


@pytest.mark.parametrize("threads", [1, 3])
def test_save_lookup_restore_over_https(tls_node: tuple[Node, Path], threads: int) -> None:
    node, cert = tls_node
    assert node.endpoint.startswith("https://")
    tokens, blocks = prompt(48, 64 * KiB, seed=threads)  # 3 MiB: with 3 threads, a part per thread
    with client(node.endpoint, tls_ca=cert, threads=threads) as store:
        ns = store.namespace(bucket(), model="m", block_size=BS)
        assert ns.save(tokens, blocks).stored == 48
        assert ns.lookup(tokens) == 48
        out = bytearray(48 * 64 * KiB)
        result = ns.restore(tokens, out=out)
        assert result.n_blocks == 48 and bytes(out) == b"".join(blocks)
        fresh = ns.restore(tokens)  # into new memory: sizes unknown beforehand
        assert [hashlib.sha256(b).digest() for b in fresh.blocks] == [hashlib.sha256(b).digest() for b in blocks]
        lanes = {t.name for t in threading.enumerate() if t.name.startswith("ctxstore-lane-")}
        assert lanes == {f"ctxstore-lane-{i}" for i in range(1, threads)}  # the parts did cross to the lanes
        snapshot = store.metrics_snapshot()
        assert snapshot["errors"] == 0 and snapshot["checksum_failures"] == 0


def test_the_async_client_on_asyncios_own_loop(tls_node: tuple[Node, Path]) -> None:
    node, cert = tls_node
    tokens, blocks = prompt(8, 16 * KiB, seed=11)

    async def run() -> None:
        async with AsyncContextStore(node.endpoint, access_key=ACCESS_KEY, secret_key=SECRET_KEY, tls_ca=cert,
                                     timeouts=TIMEOUTS, threads=1, strict=True) as store:
            ns = await store.namespace(bucket(), model="m", block_size=BS)
            assert (await ns.save(tokens, blocks)).stored == 8
            assert await ns.lookup(tokens) == 8
            assert [bytes(b) for b in (await ns.restore(tokens)).blocks] == blocks
            assert await ns.delete(tokens) == 8

    asyncio.run(run())


def test_the_ca_bundle_from_the_environment(tls_node: tuple[Node, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    node, cert = tls_node
    monkeypatch.setenv("CTXSTORE_TLS_CA", str(cert))
    tokens, blocks = prompt(2, 4 * KiB, seed=12)
    with client(node.endpoint, strict=True) as store:
        ns = store.namespace(bucket(), model="m", block_size=BS)
        assert ns.save(tokens, blocks).stored == 2 and ns.lookup(tokens) == 2


@pytest.mark.parametrize("ca", ["other", "system"])
def test_a_certificate_the_client_does_not_trust_is_a_prompt_clear_error(
        tls_node: tuple[Node, Path], other_ca: Path, ca: str, monkeypatch: pytest.MonkeyPatch) -> None:
    node, _ = tls_node
    monkeypatch.delenv("CTXSTORE_TLS_CA", raising=False)
    options: dict[str, object] = {"tls_ca": other_ca} if ca == "other" else {}
    with client(node.endpoint, strict=True, **options) as store, \
            pytest.raises(NodeUnavailable, match="TLS verification of 127.0.0.1's certificate failed"):
        store.namespace(bucket(), model="m")
    tokens, _ = prompt(2, 1, seed=13)
    with client(node.endpoint, **options) as lenient:  # the default: a miss, and the reason on record
        assert lenient.namespace(bucket(), model="m", create=False).lookup(tokens) == 0
        health = lenient.metrics_snapshot()["nodes"][f"127.0.0.1:{node.port}"]  # type: ignore[index]
        assert "TLS verification" in health["last_error"] and health["up"] is False  # type: ignore[index]


def test_https_to_a_plain_node_says_the_handshake_failed(server: Node) -> None:
    with client(f"https://127.0.0.1:{server.port}", strict=True) as store, \
            pytest.raises(NodeUnavailable, match="TLS handshake failed"):
        store.namespace(bucket(), model="m")


def test_tls_configuration_mistakes_raise_at_once(tls_node: tuple[Node, Path], tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    node, cert = tls_node
    monkeypatch.delenv("CTXSTORE_TLS_CA", raising=False)
    with pytest.raises(ConfigurationError, match="cannot be loaded"):
        client(node.endpoint, tls_ca=tmp_path / "missing.pem")
    empty = tmp_path / "empty.pem"
    empty.write_text("not a certificate\n")
    with pytest.raises(ConfigurationError, match="cannot be loaded"):
        client(node.endpoint, tls_ca=empty)
    with pytest.raises(ConfigurationError, match="http://"):  # a bundle for nodes that would be reached in clear
        client(f"127.0.0.1:{node.port}", tls_ca=cert)
    with pytest.raises(ConfigurationError, match="mix"):
        client([node.endpoint, "http://127.0.0.1:9"], tls_ca=cert)


# ---------------------------------------------------------------------------- the name a certificate is checked for


def test_a_name_that_resolves_to_several_addresses_keeps_that_name_for_tls(monkeypatch: pytest.MonkeyPatch) -> None:
    # A headless service: one name, one node per address; each address's certificate is checked for the name.
    real = socket.getaddrinfo

    def fake(host: str, port: object, *args: object, **kwargs: object) -> list[Any]:
        if host == "ctxstore.pod.test":
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)) for ip in ("10.0.0.2", "10.0.0.1")]
        return real(host, port, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(socket, "getaddrinfo", fake)
    assert resolve([("ctxstore.pod.test", 9000), ("10.0.0.9", 9000)]) == {
        ("10.0.0.1", 9000): "ctxstore.pod.test", ("10.0.0.2", 9000): "ctxstore.pod.test",
        ("10.0.0.9", 9000): "10.0.0.9"}
    store = AsyncContextStore("https://ctxstore.pod.test:9000", access_key=ACCESS_KEY, secret_key=SECRET_KEY)
    assert [(n.name, n.tls_name, n.pool.server_hostname) for n in store.pod.nodes] == [
        ("10.0.0.1:9000", "ctxstore.pod.test", "ctxstore.pod.test"),
        ("10.0.0.2:9000", "ctxstore.pod.test", "ctxstore.pod.test")]


@pytest.mark.parametrize(("name", "trusted"), [("localhost", True), ("127.0.0.1", True), ("other.test", False)])
def test_every_thread_checks_the_certificate_for_the_nodes_name(tls_node: tuple[Node, Path], name: str,
                                                                trusted: bool) -> None:
    node, cert = tls_node
    context = client_context(cert)
    head = request_head("GET", f"127.0.0.1:{node.port}", "/_ctx/health/ready", [], 0)

    async def run() -> list[int | str]:
        pod = Pod([("127.0.0.1", node.port)], pool_size=1, connect_timeout=2, read_timeout=2, probe_interval=1,
                  tls=context, names={("127.0.0.1", node.port): name})
        lanes = Lanes(2, pool_size=1, connect_timeout=2, read_timeout=2, tls=context)
        try:
            outcomes: list[int | str] = []
            for send in (lambda: pod.nodes[0].pool.request(head, (), lambda s, n: BytesReader(n)),
                         lambda: lanes.request(1, "127.0.0.1", node.port, head, (), lambda s, n: BytesReader(n),
                                               server_hostname=pod.nodes[0].tls_name)):
                try:
                    outcomes.append((await send()).status)
                except NodeUnavailable as exc:
                    outcomes.append(str(exc))
            return outcomes
        finally:
            pod.close()
            lanes.close()

    outcomes = asyncio.run(run())
    if trusted:
        assert outcomes == [200, 200]
    else:
        assert all(isinstance(o, str) and "TLS verification of other.test's certificate failed" in o
                   for o in outcomes), outcomes


def test_bench_over_https(tls_node: tuple[Node, Path]) -> None:
    node, cert = tls_node
    command = str(Path(sys.executable).parent / "ctxstore")
    out = subprocess.run([command, "bench", "--nodes", node.endpoint, "--tls-ca", str(cert), "--namespace",
                          bucket(), "--count", "2", "--blocks", "2", "--block-size", "4KiB", "--object-size", "4KiB",
                          "--json", "--quiet"],
                         env={**os.environ, "CTXSTORE_ACCESS_KEY": ACCESS_KEY, "CTXSTORE_SECRET_KEY": SECRET_KEY},
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert [(op["op"], op["failed"]) for op in report["operations"]] == [
        ("save", 0), ("lookup", 0), ("restore", 0), ("s3-put", 0), ("s3-get", 0)]
    assert report["cleanup"]["errors"] == []
