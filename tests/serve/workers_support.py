"""A ``ctxstore serve --workers N`` node for the tests (its shards on consecutive ports) and one of its shards as a
node of its own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from support.nodes import ACCESS_KEY, SECRET_KEY, Node, free_port_run, wait_ready
from support.probes import ADMIN_TOKEN


def start_workers(tmp: Path, n: int, *args: str, env: dict[str, str] | None = None, credentials: bool = True,
                  port: int | None = None) -> Node:
    """A node of ``n`` shards, once every shard is ready; its ``port`` is shard 0's (a free run of ``n`` ports
    unless given)."""
    port = port or free_port_run(n)
    log = tmp / f"workers-{port}.log"
    full_env = {**os.environ, "CTXSTORE_ADMIN_TOKEN": ADMIN_TOKEN, **(env or {})}
    if credentials:
        full_env.update(CTXSTORE_ACCESS_KEY=ACCESS_KEY, CTXSTORE_SECRET_KEY=SECRET_KEY)
    else:
        full_env.pop("CTXSTORE_ACCESS_KEY", None)
        full_env.pop("CTXSTORE_SECRET_KEY", None)
    cmd = [sys.executable, "-m", "ctxstore_server.serve", "--port", str(port), "--workers", str(n), *args]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=full_env)
    node = Node(port=port, proc=proc, log=log, env=full_env)
    for i in range(n):
        wait_ready(Node(port=port + i, proc=proc, log=log))
    return node


def shard(node: Node, i: int) -> Node:
    """Shard ``i`` of a ``--workers`` node, addressed alone."""
    return Node(port=node.port + i, proc=node.proc, log=node.log, env=node.env)


def shard_pids(node: Node) -> list[int]:
    """The shard processes of a ``--workers`` node (its parent's children)."""
    out = subprocess.run(["pgrep", "-P", str(node.proc.pid)], capture_output=True, text=True).stdout
    return sorted(int(p) for p in out.split())
