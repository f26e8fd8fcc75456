"""Shared fixtures: a real ctxstore node (uvicorn on a free loopback port, in a subprocess) and real
clients talking to it."""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import boto3
import pytest
from botocore.config import Config

ACCESS_KEY = "CTXTESTACCESSKEY0001"
SECRET_KEY = "ctxstore-test-secret-key-0001"
OTHER_ACCESS_KEY = "CTXTESTACCESSKEY0002"
OTHER_SECRET_KEY = "ctxstore-test-secret-key-0002"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Node:
    """A running ctxstore process."""

    port: int
    proc: subprocess.Popen
    scheme: str = "http"
    log: Path | None = None
    env: dict[str, str] = field(default_factory=dict)

    @property
    def endpoint(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    def stop(self, timeout: float = 15) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_node(tmp: Path, *args: str, env: dict[str, str] | None = None, scheme: str = "http",
               wait: bool = True) -> Node:
    """Start ``ctxstore serve`` on a free loopback port and wait until it answers."""
    port = free_port()
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
    import ssl

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


@pytest.fixture(scope="session")
def tmp_session(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ctxstore")


@pytest.fixture(scope="session")
def server(tmp_session: Path) -> Iterator[Node]:
    tenants = tmp_session / "tenants.json"
    tenants.write_text(
        '[{"tenant": "other", "access_key": "%s", "secret_key": "%s"}]' % (OTHER_ACCESS_KEY, OTHER_SECRET_KEY)
    )
    node = start_node(tmp_session, "--memory", "512MiB", "--default-ttl", "1h",
                      env={"CTXSTORE_TENANTS_FILE": str(tenants), "CTXSTORE_DOMAIN": "s3.ctx.test"})
    yield node
    node.stop()


def make_client(endpoint: str, access: str = ACCESS_KEY, secret: str = SECRET_KEY, **config: object):
    return boto3.client(
        "s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id=access,
        aws_secret_access_key=secret, config=Config(**config) if config else None,
    )


@pytest.fixture(scope="session")
def s3(server: Node):
    return make_client(server.endpoint)


@pytest.fixture(scope="session")
def s3_other(server: Node):
    return make_client(server.endpoint, OTHER_ACCESS_KEY, OTHER_SECRET_KEY)


@pytest.fixture
def bucket(s3) -> Iterator[str]:
    name = "test-" + secrets.token_hex(6)
    s3.create_bucket(Bucket=name)
    yield name
    paginator = s3.get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=name):
        for obj in page.get("Contents", []):
            s3.delete_object(Bucket=name, Key=obj["Key"])
    s3.delete_bucket(Bucket=name)


@pytest.fixture(scope="module")
def pod(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Node]]:
    """Three nodes on loopback ports (a pod), shared by a test module."""
    tmp = tmp_path_factory.mktemp("pod")
    nodes = [start_node(tmp, "--memory", "256MiB", "--default-ttl", "1h", wait=False) for _ in range(3)]
    try:
        for node in nodes:
            wait_ready(node)
        yield nodes
    finally:
        for node in nodes:
            node.stop()
