"""Resident memory of a node under mixed concurrent load (objects of 1 KiB to 4 MiB), against its budget.

Command (results go in docs/hardening.md, "Memory under load"):

    .venv/bin/python benchmarks/rss_mixed_load.py                # --memory 256MiB --seconds 120 --clients 12 --rounds 3

It also writes the plot docs/hardening.md shows (RSS and ``used`` over time, every round:
docs/img/rss_mixed_load.png; ``--plot ''`` for none; matplotlib comes with the ``bench`` extra).

Why: operators size pods by RSS, the node accounts by ``--memory``; the two must stay close (SPEC §3: "the
process's RSS stays close to the budget"). Target: RSS ≤ 1.1 × budget + the fixed base.

Method, per round: start one node (``ctxstore serve --memory M``; pinned to core 0 with ``taskset`` when it is
installed, the load to the other cores); read its idle RSS after a few small requests: the *fixed base*
(interpreter, libraries, empty engine). Then ``--clients`` threads, each on its own keep-alive connection, for
``--seconds``: PUT (60 %) objects whose sizes are drawn log-uniformly from 1 KiB to 4 MiB under random keys of
a key space holding about 3x the budget (so eviction runs all the time), GET (30 %) random keys, DELETE
(5 %), bulk get of 8 random keys (5 %). Every 0.25 s: RSS (``VmRSS`` of ``/proc/<pid>/status``) and ``used``
(admin stats). Peak RSS is ``VmHWM``. Figures per round, over the second half of the run (steady state):
median and p99 of RSS, RSS / budget, (RSS − base) / budget, the peak, and the largest ``used`` / budget (the
accounting must stay ≤ 1). The table gives the median over rounds and each round's values.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import random
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import msgpack

from ctxstore.sigv4 import Signer
from ctxstore.units import parse_size

ACCESS, SECRET = "BENCHACCESSKEY000001", "bench-secret-key-000001"
TOKEN = "bench-admin-token-" + os.urandom(6).hex()
MiB = 1 << 20
MIN_SIZE, MAX_SIZE = 1 << 10, 4 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def status_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def start_node(memory: str, log: Path) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    env = {**os.environ, "CTXSTORE_ACCESS_KEY": ACCESS, "CTXSTORE_SECRET_KEY": SECRET, "CTXSTORE_ADMIN_TOKEN": TOKEN}
    cmd = [sys.executable, "-m", "ctxstore_server.serve", "--port", str(port), "--memory", memory,
           "--log-level", "warning"]
    if shutil.which("taskset") and (os.cpu_count() or 1) > 1:
        cmd = ["taskset", "-c", "0", *cmd]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/_ctx/health/ready", timeout=1)
            return proc, port
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(log.read_text()) from None
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("the node did not come up")


def server_pid(proc: subprocess.Popen[bytes]) -> int:
    """The Python process itself (taskset execs it, so the PID is the same)."""
    return proc.pid


class Connection:
    """One keep-alive connection, requests signed with UNSIGNED-PAYLOAD (cheap: the client must not be the
    bottleneck)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.host = f"127.0.0.1:{port}"
        self.signer = Signer(ACCESS, SECRET)
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)

    def request(self, method: str, path: str, body: bytes | memoryview = b"", query: str = "") -> tuple[int, bytes]:
        headers = dict(self.signer.headers(method, self.host, path, query))
        headers["Content-Length"] = str(len(body))
        target = path + ("?" + query if query else "")
        for attempt in (0, 1):
            try:
                self.conn.request(method, target, body=body, headers=headers)
                resp = self.conn.getresponse()
                return resp.status, resp.read()
            except (http.client.HTTPException, OSError):
                self.conn.close()
                self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
                if attempt:
                    raise
        raise AssertionError("unreachable")


def admin_used(port: int) -> int:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/_ctx/v1/admin/stats",
                                 headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return int(json.loads(resp.read())["used"])


def log_uniform(rng: random.Random) -> int:
    return int(math.exp(rng.uniform(math.log(MIN_SIZE), math.log(MAX_SIZE))))


def load(port: int, bucket: str, keys: int, seconds: float, seed: int, counts: dict[str, int],
         lock: threading.Lock) -> None:
    rng = random.Random(seed)
    source = memoryview(os.urandom(MAX_SIZE))
    conn = Connection(port)
    done: dict[str, int] = {}
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        key = f"k{rng.randrange(keys)}"
        roll = rng.random()
        if roll < 0.60:
            size = log_uniform(rng)
            start = rng.randrange(MAX_SIZE - size + 1)
            status, _ = conn.request("PUT", f"/{bucket}/{key}", source[start:start + size])
            kind = "put" if status == 200 else f"put-{status}"
        elif roll < 0.90:
            status, _ = conn.request("GET", f"/{bucket}/{key}")
            kind = "get" if status in (200, 404) else f"get-{status}"
        elif roll < 0.95:
            status, _ = conn.request("DELETE", f"/{bucket}/{key}")
            kind = "delete"
        else:
            head = msgpack.packb({"v": 1, "keys": [f"k{rng.randrange(keys)}" for _ in range(8)], "pin": 0.0})
            status, _ = conn.request("POST", f"/_ctx/v1/bulk/{bucket}/get", struct.pack(">I", len(head)) + head)
            kind = "bulk-get" if status == 200 else f"bulk-get-{status}"
        done[kind] = done.get(kind, 0) + 1
    with lock:
        for kind, n in done.items():
            counts[kind] = counts.get(kind, 0) + n


def one_round(args: argparse.Namespace, index: int, tmp: Path) -> dict[str, object]:
    budget = parse_size(args.memory)
    proc, port = start_node(args.memory, tmp / f"node-{index}.log")
    pid = server_pid(proc)
    try:
        conn = Connection(port)
        bucket = "rss-bench"
        assert conn.request("PUT", f"/{bucket}")[0] == 200
        for i in range(20):  # warm the code paths with small requests, then take the base
            conn.request("PUT", f"/{bucket}/warm{i}", b"x" * 1024)
            conn.request("GET", f"/{bucket}/warm{i}")
            conn.request("DELETE", f"/{bucket}/warm{i}")
        time.sleep(1.0)
        base = status_kib(pid, "VmRSS") << 10
        mean_size = (MAX_SIZE - MIN_SIZE) / math.log(MAX_SIZE / MIN_SIZE)
        keys = max(16, int(3 * budget / mean_size))
        counts: dict[str, int] = {}
        lock = threading.Lock()
        threads = [threading.Thread(target=load, args=(port, bucket, keys, args.seconds, 1000 * index + c, counts,
                                                       lock), daemon=True) for c in range(args.clients)]
        samples: list[tuple[float, int, int]] = []
        started = time.monotonic()
        for thread in threads:
            thread.start()
        while any(t.is_alive() for t in threads):
            samples.append((time.monotonic() - started, status_kib(pid, "VmRSS") << 10, admin_used(port)))
            time.sleep(0.25)
        for thread in threads:
            thread.join()
        peak = status_kib(pid, "VmHWM") << 10
        steady = [s for s in samples if s[0] >= args.seconds / 2] or samples
        rss_values = sorted(s[1] for s in steady)
        p99 = rss_values[min(len(rss_values) - 1, int(0.99 * len(rss_values)))]
        median = statistics.median(rss_values)
        return {
            "base": base, "budget": budget, "rss_median": median, "rss_p99": p99, "peak": peak,
            "rss_over_budget": median / budget, "above_base_over_budget": (median - base) / budget,
            "peak_over_budget": peak / budget, "used_max_over_budget": max(s[2] for s in samples) / budget,
            "requests": counts, "samples": samples,
        }
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def summary(r: dict[str, object]) -> str:
    def mib(name: str) -> str:
        return f"{float(r[name]) / MiB:.0f} MiB"  # type: ignore[arg-type]

    return (f"RSS {mib('rss_median')} (p99 {mib('rss_p99')}, peak {mib('peak')}) = {r['rss_over_budget']:.2f} x "
            f"budget; above the {mib('base')} base: {r['above_base_over_budget']:.2f} x; used max "
            f"{r['used_max_over_budget']:.3f} x; requests {r['requests']}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memory", default="256MiB", help="the node's --memory budget")
    parser.add_argument("--seconds", type=float, default=120.0, help="load duration per round")
    parser.add_argument("--clients", type=int, default=12, help="concurrent connections")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--plot", default=str(Path(__file__).resolve().parent.parent / "docs" / "img" /
                                              "rss_mixed_load.png"),
                        help="PNG of RSS and used over time [default docs/img/rss_mixed_load.png]; '' for none")
    parser.add_argument("--json", help="write every round's figures and samples here")
    args = parser.parse_args()
    if (os.cpu_count() or 1) > 1:
        os.sched_setaffinity(0, set(range(1, os.cpu_count() or 2)))
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        for index in range(args.rounds):
            rounds.append(one_round(args, index, Path(tmp)))
            print(f"round {index + 1}: {summary(rounds[-1])}", flush=True)

    def med(name: str) -> float:
        return statistics.median(float(r[name]) for r in rounds)  # type: ignore[arg-type]

    budget = float(rounds[0]["budget"])  # type: ignore[arg-type]
    print()
    print("| budget | fixed base | RSS (median) | RSS p99 | peak RSS | RSS / budget | (RSS - base) / budget "
          "| used max / budget |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| {budget / MiB:.0f} MiB | {med('base') / MiB:.0f} MiB | {med('rss_median') / MiB:.0f} MiB "
          f"| {med('rss_p99') / MiB:.0f} MiB | {med('peak') / MiB:.0f} MiB | {med('rss_over_budget'):.2f} "
          f"| {med('above_base_over_budget'):.2f} | {med('used_max_over_budget'):.3f} |")
    print(f"\n{args.rounds} rounds x {args.seconds:g} s, {args.clients} clients, objects 1 KiB-4 MiB log-uniform; "
          "medians over rounds.")
    if args.json:
        Path(args.json).write_text(json.dumps(rounds, indent=1))
    if args.plot:
        try:
            import matplotlib  # type: ignore[import-not-found]

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt  # type: ignore[import-not-found]
        except ImportError:
            print("--plot: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
            return 0
        fig, ax = plt.subplots(figsize=(8, 4))
        for i, r in enumerate(rounds):
            samples: list[tuple[float, int, int]] = r["samples"]  # type: ignore[assignment]
            ax.plot([s[0] for s in samples], [s[1] / MiB for s in samples], label=f"RSS, round {i + 1}")
            ax.plot([s[0] for s in samples], [s[2] / MiB for s in samples], "--", label=f"used, round {i + 1}")
        ax.axhline(budget / MiB, color="k", lw=0.8, label="budget")
        ax.axhline((1.1 * budget + med("base")) / MiB, color="r", lw=0.8, label="1.1 x budget + base")
        ax.set_xlabel("seconds")
        ax.set_ylabel("MiB")
        ax.set_ylim(bottom=0)
        ax.set_title(f"node RSS and used under mixed load: --memory {args.memory}, {args.clients} clients, "
                     f"load average {os.getloadavg()[0]:.1f}", fontsize=9)
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=100, metadata={"Software": None})
        print(f"# plot written to {args.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
