"""Real ctxstore nodes for tests and benchmarks: start ``ctxstore serve`` in a subprocess on a free loopback port,
wait until it is ready, stop it by its PID; and boto3 clients for them."""

from __future__ import annotations

import os
import random
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import boto3
from botocore.config import Config

ACCESS_KEY = "CTXTESTACCESSKEY0001"
SECRET_KEY = "ctxstore-test-secret-key-0001"
OTHER_ACCESS_KEY = "CTXTESTACCESSKEY0002"
OTHER_SECRET_KEY = "ctxstore-test-secret-key-0002"


# The process of every Node made in this process (once, however many Nodes share it: a shard's view, a restart's
# handle), so that what a test leaves running (it failed before its own cleanup) is stopped when the test ends:
# see pytest_runtest_call in tests/conftest.py.
STARTED: list[subprocess.Popen] = []


def _port_slice() -> range | None:
    """The listening ports this test process picks from: below the kernel's ephemeral range, from which every
    outgoing connection takes its local port (so none can take a port chosen here before its node binds it), and
    a slice of their own for each pytest-xdist worker (so two workers never pick the same one). None where the
    ephemeral range leaves too little room below it: then the kernel picks (port 0)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    first = 10000
    workers = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1))
    worker = int((os.environ.get("PYTEST_XDIST_WORKER") or "gw0").removeprefix("gw") or 0) % workers
    span = (low - first) // workers
    if span < 1000:
        return None
    return range(first + worker * span, first + (worker + 1) * span)


_PORTS = _port_slice()
# Where this process starts in its slice: processes of one worker (a test's children) start apart, and a port
# just closed (in TIME_WAIT) is not the next one tried.
_cursor = random.randrange(len(_PORTS)) if _PORTS is not None else 0


def free_port() -> int:
    """A loopback port nothing listens on now, from this process's slice (see :func:`_port_slice`)."""
    return free_port_run(1)


def free_port_run(n: int) -> int:
    """A first port with the n - 1 after it free as well (as far as anyone can tell before binding): for a
    ``--workers n`` node, whose shards take consecutive ports. This process does not hand out any of them again
    before it has gone round its slice."""
    global _cursor
    if _PORTS is None:
        return _kernel_port_run(n)
    for _ in range(len(_PORTS)):
        first = _PORTS[_cursor % len(_PORTS)]
        _cursor += 1
        if first + n > _PORTS.stop:
            continue
        if _bindable(range(first, first + n)):
            _cursor += n - 1
            return first
    raise RuntimeError(f"no run of {n} free ports in {_PORTS}")


def _bindable(ports: range) -> bool:
    socks = []
    try:
        for port in ports:
            socks.append(s := socket.socket())  # closed below even when its bind fails
            s.bind(("127.0.0.1", port))
        return True
    except OSError:
        return False
    finally:
        for s in socks:
            s.close()


def _kernel_port_run(n: int) -> int:
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            first = s.getsockname()[1]
        if first + n <= 65536 and _bindable(range(first, first + n)):
            return first
    raise RuntimeError("no run of free ports")


@dataclass
class Node:
    """A running ctxstore process (remembered in STARTED)."""

    port: int
    proc: subprocess.Popen
    scheme: str = "http"
    log: Path | None = None
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not any(proc is self.proc for proc in STARTED):
            STARTED.append(self.proc)

    @property
    def endpoint(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    def stop(self, timeout: float = 15) -> int:
        return stop_process(self.proc, timeout)


def stop_process(proc: subprocess.Popen, timeout: float = 15) -> int:
    """SIGTERM, then SIGKILL after ``timeout``; returns the exit code."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def start_node(tmp: Path, *args: str, env: dict[str, str] | None = None, scheme: str = "http",
               wait: bool = True, port: int | None = None) -> Node:
    """Start ``ctxstore serve`` on a free loopback port (or ``port``: a restart where clients know the node, nodes
    that must know each other's addresses before they start) and wait until it answers."""
    port = port or free_port()
    log = tmp / f"node-{port}.log"
    full_env = {**os.environ, "CTXSTORE_ACCESS_KEY": ACCESS_KEY, "CTXSTORE_SECRET_KEY": SECRET_KEY,
                **(env or {})}
    cmd = [sys.executable, "-m", "ctxstore_server.serve", "--port", str(port), *args]
    with log.open("wb") as out:  # the child keeps its own descriptor
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=full_env)
    node = Node(port=port, proc=proc, scheme=scheme, log=log, env=full_env)
    if wait:
        wait_ready(node)
    return node


def wait_ready(node: Node, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    ctx = ssl._create_unverified_context()
    while time.monotonic() < deadline:
        if node.proc.poll() is not None:
            raise RuntimeError(f"ctxstore exited early:\n{node.log.read_text() if node.log else ''}")
        try:
            with urllib.request.urlopen(f"{node.endpoint}/_ctx/health/ready", timeout=1, context=ctx) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.05)
    node.stop()
    raise RuntimeError("ctxstore did not become ready")


@contextmanager
def serving(nodes: list[Node]) -> Iterator[list[Node]]:
    """Nodes started with ``wait=False``: wait until each is ready, stop them all when done (a pod fixture)."""
    try:
        for node in nodes:
            wait_ready(node)
        yield nodes
    finally:
        for node in nodes:
            node.stop()


def make_client(endpoint: str, access: str = ACCESS_KEY, secret: str = SECRET_KEY, **config: object):
    return boto3.client(
        "s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id=access,
        aws_secret_access_key=secret, config=Config(**config) if config else None,
    )
