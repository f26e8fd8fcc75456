"""Process-level faults for a pod of real nodes: freeze (SIGSTOP), thaw (SIGCONT), kill (SIGKILL) and restart
a node on the port the pod expects it at, plus a recorder for what a load loop saw while that happened."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

from .nodes import Node, start_node, wait_ready


def start_pod(tmp: Path, n: int, *args: str) -> list[Node]:
    """``n`` nodes started together (their start-ups overlap), all ready."""
    nodes = [start_node(tmp, *args, wait=False) for _ in range(n)]
    try:
        for node in nodes:
            wait_ready(node)
    except BaseException:
        for node in nodes:
            node.stop()
        raise
    return nodes


def freeze(node: Node) -> None:
    os.kill(node.proc.pid, signal.SIGSTOP)


def thaw(node: Node) -> None:
    if node.proc.poll() is None:
        os.kill(node.proc.pid, signal.SIGCONT)


def kill(node: Node) -> None:
    """SIGKILL: no drain, connections reset, RAM contents gone."""
    if node.proc.poll() is None:
        node.proc.kill()
    node.proc.wait(10)


def restart(node: Node, tmp: Path, *args: str) -> Node:
    """A new ``ctxstore serve`` on the same port (and environment) as ``node``, once ready."""
    log = tmp / f"node-{node.port}-restart-{os.urandom(2).hex()}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "ctxstore_server.serve", "--port", str(node.port), *args],
                                stdout=out, stderr=subprocess.STDOUT, env=node.env)
    fresh = Node(port=node.port, proc=proc, scheme=node.scheme, log=log, env=node.env)
    wait_ready(fresh, timeout=30)
    return fresh


@dataclass
class Tally:
    """What a load loop saw: calls by kind, the longest of each, wrong blocks, escaped exceptions."""

    calls: dict[str, int] = field(default_factory=dict)
    longest: dict[str, float] = field(default_factory=dict)
    blocks_checked: int = 0
    wrong_blocks: int = 0
    short_restores: int = 0
    exceptions: list[str] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def call(self, kind: str, seconds: float) -> None:
        with self._lock:
            self.calls[kind] = self.calls.get(kind, 0) + 1
            self.longest[kind] = max(self.longest.get(kind, 0.0), seconds)

    def blocks(self, checked: int, wrong: int, short: bool) -> None:
        with self._lock:
            self.blocks_checked += checked
            self.wrong_blocks += wrong
            self.short_restores += short

    def exception(self, text: str) -> None:
        with self._lock:
            self.exceptions.append(text)
