"""``ctxstore serve --workers N``: N shard processes on one machine, each an independent node.

One Python process serves one core's worth of requests (its event loop, its kernel copies). A node on a
many-core machine with a fast NIC therefore runs N shards: shard *i* listens on ``port + i`` with ``1/N`` of the
budget, and the clients see N nodes (``host:9000-9003`` in their node list, :mod:`ctxstore.endpoints`), so
rendezvous hashing spreads the keys, and one restore's connections (and their kernel copies), over all of them.
The shards share nothing at run time: no lock, no queue, no coordination on the data path.

What differs between shards is declared here, once: settings divided by N (the budgets, including the flash
tier's), settings given a per-shard suffix (the node id, the flash tier's directory: ``<disk>/shard-<i>``).

The parent process resolves the settings and credentials (generated ones are printed once and handed to every
shard through its environment), starts the shards, restarts one that dies (its RAM blocks are gone: misses, as
for any node that restarts; its flash tier comes back), forwards SIGTERM and SIGINT, and exits 0 once every
shard has drained.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from .settings import SETTINGS, Settings

log = logging.getLogger("ctxstore.shards")

_NAMES = {s.name for s in SETTINGS}


def _known(*names: str) -> tuple[str, ...]:
    return tuple(name for name in names if name in _NAMES)


DIVIDED = _known("memory", "tenant_reserve_limit", "disk_size", "disk_queue")  # budget / N
SUFFIXED = _known("node_id", "disk")  # "<value>/shard-<i>"; empty stays empty
PORTED = _known("events_zmq_pub", "events_zmq_replay")  # a bound address: port + i
SHARD_ENV = "CTXSTORE_SHARD"  # "i/N" in a shard's environment (its banner says which it is)
# A shard that died is started again after RESTART_DELAY seconds; one that dies again within STABLE_AFTER
# seconds of its start (it cannot start: e.g. its port was taken meanwhile) waits twice as long each time, up to
# MAX_RESTART_DELAY, while the other shards go on serving.
RESTART_DELAY = 1.0
MAX_RESTART_DELAY = 60.0
STABLE_AFTER = 30.0


def shard_settings(settings: Settings, index: int, count: int) -> dict[str, Any]:
    """The settings shard ``index`` of ``count`` runs with, where they differ from the node's."""
    values: dict[str, Any] = {"port": settings.port + index, "workers": 1}
    for name in DIVIDED:
        value = getattr(settings, name)
        if value:  # 0 means "automatic" (derived from the shard's own budget)
            values[name] = max(1, value // count)
    for name in SUFFIXED:
        value = getattr(settings, name)
        if value:
            values[name] = f"{str(value).rstrip('/')}/shard-{index}"
    for name in PORTED:
        value = getattr(settings, name)
        if value:
            values[name] = offset_port(value, index)
    return values


def offset_port(address: str, index: int) -> str:
    """``tcp://host:5557`` → ``tcp://host:<5557 + index>``; an address that connects (``>...``) or has no
    port is the same for every shard."""
    if address.startswith(">"):
        return address
    head, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        return address
    return f"{head}:{int(port) + index}"


def shard_argv(values: Mapping[str, Any]) -> list[str]:
    """Flags that override the node's settings with a shard's (flags win over the environment)."""
    argv: list[str] = []
    for name, value in values.items():
        argv += ["--" + name.replace("_", "-"), str(value)]
    return argv


class Supervisor:
    """Starts the shards, restarts one that dies, stops them all on SIGTERM/SIGINT."""

    def __init__(self, settings: Settings, argv: Sequence[str], env: Mapping[str, str]) -> None:
        self.settings = settings
        self.count = settings.workers
        self.argv = list(argv)
        self.env = dict(env)
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * self.count
        self.started = [0.0] * self.count  # when each shard was last started (monotonic)
        self.delays = [0.0] * self.count  # the last restart delay of each shard
        self.restart_at: list[float | None] = [None] * self.count  # a dead shard's next start
        self.stopping = False

    def command(self, index: int) -> list[str]:
        # The node's own flags first, the shard's after them: argparse keeps the last value of a flag.
        return [sys.executable, "-m", "ctxstore_server.serve", *self.argv,
                *shard_argv(shard_settings(self.settings, index, self.count))]

    def start(self, index: int) -> None:
        env = {**self.env, SHARD_ENV: f"{index}/{self.count}"}
        self.procs[index] = subprocess.Popen(self.command(index), env=env)
        self.started[index] = time.monotonic()

    def stop(self, signum: int = signal.SIGTERM) -> None:
        self.stopping = True
        for proc in self.procs:
            if proc is not None and proc.poll() is None:
                proc.send_signal(signum)

    def watch(self) -> None:
        """Schedule the start of each shard that died, and start those whose time came."""
        now = time.monotonic()
        for i, proc in enumerate(self.procs):
            if self.stopping:
                return
            due = self.restart_at[i]
            if due is not None:
                if now >= due:
                    self.restart_at[i] = None
                    self.start(i)
            elif proc is not None and proc.poll() is not None:
                ran = now - self.started[i]
                self.delays[i] = restart_delay(self.delays[i], ran)
                self.restart_at[i] = now + self.delays[i]
                log.warning("ctxstore: shard %d (port %d) exited with %s after %.1f s; starting it again in %g s",
                            i, self.settings.port + i, proc.returncode, ran, self.delays[i])

    def run(self) -> int:
        """Until SIGTERM or SIGINT; then every shard drains (``drain_timeout``) and the parent exits 0."""
        previous = {sig: signal.signal(sig, lambda s, f: self.stop(s)) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            for i in range(self.count):
                self.start(i)
            while not self.stopping:
                time.sleep(0.2)
                self.watch()
            deadline = time.monotonic() + self.settings.drain_timeout + 10
            for proc in self.procs:
                if proc is None:
                    continue
                try:
                    proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return 0


def restart_delay(previous: float, ran: float) -> float:
    """Seconds before a shard that died after running ``ran`` seconds starts again; ``previous``: the delay
    before its last start (0 for none)."""
    if ran >= STABLE_AFTER or not previous:
        return RESTART_DELAY
    return min(MAX_RESTART_DELAY, previous * 2)


def shard_banner(env: Mapping[str, str] | None = None) -> str | None:
    """``"shard 2 of 4"`` in a shard's process, else None."""
    value = (os.environ if env is None else env).get(SHARD_ENV, "")
    index, sep, count = value.partition("/")
    if not sep or not index.isdigit() or not count.isdigit():
        return None
    return f"shard {int(index)} of {int(count)}"
