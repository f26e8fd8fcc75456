"""A node's shards (``ctxstore serve --workers N``): restore and save throughput with 1 and 2 shards, the CPU
each GB costs a shard and a client, and from it the cores a node needs for 100 and 400 Gb/s. Writes
docs/benchmarks-workers.png.

Command (from the repository root; results go in docs/benchmarks.md):

    .venv/bin/pip install -e '.[bench]'                 # matplotlib for the plot
    .venv/bin/python benchmarks/workers_scaling.py      # defaults: --rounds 10

Configurations, all on 127.0.0.1 (a 2-core machine: what it can show):

- ``1 shard, 1 client``: ``ctxstore serve --workers 1`` (one process, as without the flag) on core 0; one
  client process on core 1.
- ``2 shards, 1 client``: ``--workers 2``, shard *i* on core *i*; one client process (its one event-loop
  thread fans every call out over both shards' connections), not pinned.
- ``2 shards, 2 clients``: the same node; two client processes, not pinned, each restoring (saving) its own
  prompt at the same moment: the aggregate is what the node served.

Each client is the sync ``ctxstore.ContextStore`` given the node list ``127.0.0.1:P-P+N-1`` (strict mode,
``Limits(bytes_per_call=256 MiB)``). Scenarios: restore and save of a 32k-token prompt, 2048 × 64 KiB and
128 × 1 MiB blocks (128 MiB per client). Saves store fresh keys (a new prompt made before the timed call,
deleted after it). Every restore is checked against the blocks saved (XXH3-128 of the arena).

Reported per configuration and scenario: median and p99 wall time of a round (for two clients: from the
moment both were told to go until the later one finished), aggregate GB/s from the median, node CPU per GB
(all shards together, and per shard) and client CPU per GB, from /proc/<pid>/stat summed over the rounds.
The core estimate for 100 Gb/s (12.5 GB/s) and 400 Gb/s (50 GB/s) multiplies the measured CPU per GB; it
assumes the per-GB cost of a shard stays what it is here when shards run on cores of their own.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (
    ACCESS,
    DOCS,
    SECRET,
    Processes,
    busy_cores,
    cpu_seconds,
    ctxstore_argv,
    exit_on_sigterm,
    free_port,
    pyplot,
    save_figure,
    shard_pids,
    source_state,
    stats,
    today,
    wait_ctxstore,
)

PROMPT_TOKENS = 32768
SHAPES = (("2048 × 64 KiB", 16, 64 << 10), ("128 × 1 MiB", 256, 1 << 20))
TOTAL = 128 << 20
PLOT = DOCS / "benchmarks-workers.png"
GBPS_100 = 100e9 / 8 / 1e9
CONFIGS = (("1 shard, 1 client", 1, 1), ("2 shards, 1 client", 2, 1), ("2 shards, 2 clients", 2, 2))


# ---------------------------------------------------------------------------- a client process


def client_main(nodes: str, seed: int) -> int:
    """Commands on stdin (``restore SHAPE`` / ``save SHAPE``), one answer line each: seconds and CPU seconds."""
    from ctxstore import ContextStore, Limits, Timeouts

    store = ContextStore(nodes, access_key=ACCESS, secret_key=SECRET, strict=True,
                         timeouts=Timeouts(connect=5, read=30, total=120), limits=Limits(bytes_per_call=256 << 20))
    rng = random.Random(seed)
    source = bytearray(os.urandom(TOTAL))
    expected = xxhash.xxh3_128_intdigest(source)
    arena = bytearray(TOTAL)
    state = {}
    for label, block_tokens, block_bytes in SHAPES:
        ns = store.namespace(f"bench-workers-{seed}-{block_tokens}", model="bench/workers", block_size=block_tokens)
        blocks = [memoryview(source)[i * block_bytes:(i + 1) * block_bytes] for i in range(TOTAL // block_bytes)]
        prompt = [rng.randrange(128000) for _ in range(PROMPT_TOKENS)]
        if ns.save(prompt, blocks).stored != len(blocks):
            raise RuntimeError("loading the restore prompt failed")
        state[str(block_tokens)] = (ns, blocks, prompt)
    print("ready", flush=True)
    for line in sys.stdin:
        op, shape = line.split()
        ns, blocks, prompt = state[shape]
        if op == "restore":
            c0, t0 = time.process_time(), time.perf_counter()
            got = ns.restore(prompt, out=arena).n_blocks
            elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
            ok = got == len(blocks) and xxhash.xxh3_128_intdigest(arena) == expected
        else:
            tokens = [rng.randrange(128000) for _ in range(PROMPT_TOKENS)]
            c0, t0 = time.process_time(), time.perf_counter()
            saved = ns.save(tokens, blocks)
            elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
            ok = saved.stored == len(blocks)
            ns.delete(tokens)
        print(f"{'ok' if ok else 'bad'} {elapsed:.6f} {cpu:.6f}", flush=True)
    store.close()
    return 0


# ---------------------------------------------------------------------------- the node and its clients


@dataclass
class Row:
    config: str
    scenario: str
    times: list[float] = field(default_factory=list)
    node_cpu: float = 0.0
    shard_cpu: list[float] = field(default_factory=list)
    client_cpu: float = 0.0
    clients: int = 1

    @property
    def gb(self) -> float:  # GB moved per round
        return self.clients * TOTAL / 1e9


def run_config(label: str, shards: int, clients: int, rounds: int, workdir: Path) -> list[Row]:
    procs = Processes()
    rows: list[Row] = []
    try:
        port = free_port()
        while any(_busy(p) for p in range(port, port + shards)):
            port = free_port()
        env = {**os.environ, "CTXSTORE_ACCESS_KEY": ACCESS, "CTXSTORE_SECRET_KEY": SECRET}
        node = procs.start("ctxstore", [*ctxstore_argv(port, f"{2 * shards}GiB"), "--workers", str(shards)], env)
        for i in range(shards):
            wait_ctxstore(procs, node, port + i)
        pids = shard_pids(node.pid, shards) if shards > 1 else [node.pid]  # --workers 1: the node itself
        for i, pid in enumerate(pids):  # shard i on core i (the parent only supervises)
            os.sched_setaffinity(pid, {i % (os.cpu_count() or 1)})
        nodes = f"127.0.0.1:{port}-{port + shards - 1}"
        workers = []
        for c in range(clients):
            cmd = [sys.executable, __file__, "--client", nodes, "--seed", str(100 + c)]
            if shards == 1 and clients == 1:
                cmd = ["taskset", "-c", "1", *cmd]
            workers.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
        for w in workers:
            assert w.stdout is not None
            if w.stdout.readline().strip() != "ready":
                raise RuntimeError("a client did not start")
        for scenario_op in ("restore", "save"):
            for shape_label, block_tokens, _ in SHAPES:
                row = Row(label, f"{scenario_op} {shape_label}", clients=clients)
                for r in range(rounds + 1):  # the first round warms up
                    s0 = [cpu_seconds(p) for p in pids]
                    t0 = time.perf_counter()
                    for w in workers:
                        assert w.stdin is not None
                        w.stdin.write(f"{scenario_op} {block_tokens}\n")
                        w.stdin.flush()
                    answers = [w.stdout.readline().split() for w in workers if w.stdout is not None]
                    elapsed = time.perf_counter() - t0
                    s1 = [cpu_seconds(p) for p in pids]
                    if any(a[0] != "ok" for a in answers):
                        raise RuntimeError(f"{label} {row.scenario}: a client failed: {answers}")
                    if r == 0:
                        continue
                    row.times.append(elapsed)
                    spent = [b - a for a, b in zip(s0, s1, strict=True)]
                    row.shard_cpu = [x + y for x, y in zip(row.shard_cpu or [0.0] * shards, spent, strict=True)]
                    row.node_cpu += sum(spent)
                    row.client_cpu += sum(float(a[2]) for a in answers)
                rows.append(row)
        for w in workers:
            assert w.stdin is not None
            w.stdin.close()
            w.wait(30)
    finally:
        procs.stop()
    return rows


def _busy(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


# ---------------------------------------------------------------------------- report


def report(rows: list[Row], header: list[str]) -> None:
    for line in header:
        print(line)
    print()
    print("| configuration | scenario | rounds | median ms | p99 ms | GB/s (all clients) | node CPU s/GB | "
          "per shard s/GB | client CPU s/GB |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        med, p99 = stats(r.times)
        gbs = r.gb * len(r.times)
        per_shard = " / ".join(f"{c / (gbs / len(r.shard_cpu)):.3f}" for c in r.shard_cpu)
        print(f"| {r.config} | {r.scenario} | {len(r.times)} | {med * 1000:.1f} | {p99 * 1000:.1f} | "
              f"{r.gb / med:.2f} | {r.node_cpu / gbs:.3f} | {per_shard} | {r.client_cpu / gbs:.3f} |")
    print()
    print("Cores for 100 Gb/s (12.5 GB/s) and 400 Gb/s (50 GB/s) at the CPU per GB measured here (node: all "
          "shards; client: all client processes):")
    print()
    print("| configuration | scenario | node cores 100 / 400 Gb/s | client cores 100 / 400 Gb/s |")
    print("|---|---|---:|---:|")
    for r in rows:
        gbs = r.gb * len(r.times)
        node, client = r.node_cpu / gbs, r.client_cpu / gbs
        print(f"| {r.config} | {r.scenario} | {node * GBPS_100:.1f} / {node * GBPS_100 * 4:.1f} | "
              f"{client * GBPS_100:.1f} / {client * GBPS_100 * 4:.1f} |")
    base = {r.scenario: r for r in rows if r.config == CONFIGS[0][0]}
    print()
    for r in rows:
        if r.config == CONFIGS[0][0]:
            continue
        b = base[r.scenario]
        print(f"- {r.config}, {r.scenario}: {(r.gb / stats(r.times)[0]) / (b.gb / stats(b.times)[0]):.2f}× the "
              f"throughput of {CONFIGS[0][0]}")


def plot(rows: list[Row], path: Path, note: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    scenarios = list(dict.fromkeys(r.scenario for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
    width = 0.8 / len(CONFIGS)
    colours = ("#1f77b4", "#2ca02c", "#ff7f0e")
    for ci, (config, _, _) in enumerate(CONFIGS):
        group = [next(r for r in rows if r.config == config and r.scenario == s) for s in scenarios]
        xs = [i + (ci - 1) * width for i in range(len(scenarios))]
        gbps = [r.gb / stats(r.times)[0] for r in group]
        axes[0].bar(xs, gbps, width * 0.92, color=colours[ci], label=config)
        per_gb = [r.node_cpu / (r.gb * len(r.times)) for r in group]
        axes[1].bar(xs, per_gb, width * 0.92, color=colours[ci], label=config)
    for ax, title in zip(axes, ("GB/s, all clients (median)", "node CPU s per GB (all shards)"), strict=True):
        ax.set_xticks(range(len(scenarios)), [s.replace(" × ", "×\n") for s in scenarios], fontsize=6)
        ax.set_title(title, fontsize=8)
    axes[0].legend(fontsize=6)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    save_figure(plt, fig, path, note)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--plot", type=Path, default=PLOT)
    parser.add_argument("--client", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        return client_main(args.client, args.seed)
    exit_on_sigterm()
    busy = busy_cores()
    load0 = os.getloadavg()
    started = time.monotonic()
    rows: list[Row] = []
    workdir = Path("/tmp")
    for label, shards, clients in CONFIGS:
        rows += run_config(label, shards, clients, args.rounds, workdir)
    load1 = os.getloadavg()
    state = source_state()
    header = [f"workers_scaling, {today()}: {os.cpu_count()} CPUs; {args.rounds} rounds after 1 warm-up; took "
              f"{time.monotonic() - started:.0f} s; load average {load0[0]:.1f} → {load1[0]:.1f}; cores busy with "
              f"other work just before: {busy}", f"Python {sys.version.split()[0]}, {state}"]
    report(rows, header)
    plot(rows, args.plot, f"benchmarks/workers_scaling.py, {today()}, {state}, load {load0[0]:.1f}→{load1[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
