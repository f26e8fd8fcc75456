"""One client over several threads (``ContextStore(threads=T)``): restore and save throughput against a local node
``ctxstore serve --workers W`` for T = 1, 2, 4, 8, with node and client CPU per GB. Writes
docs/benchmarks-receive-scaling.png.

Command (from the repository root; results go in docs/benchmarks.md):

    .venv/bin/pip install -e '.[bench]'                    # matplotlib for the plot
    .venv/bin/python benchmarks/receive_scaling.py         # defaults: --rounds 5, W = half the cores
    .venv/bin/python benchmarks/receive_scaling.py --baseline /tmp/before   # + the client of another checkout

Scenarios: restore and save of 4 GiB in 2048 x 2 MiB blocks (32k tokens of Llama-3.1-8B in bf16, 16 tokens a
block) and of 128 MiB in 2048 x 64 KiB blocks (``--big`` sets the first size, e.g. ``--big 1GiB`` on a small
machine). The node runs pinned to the first W cores, the clients to the others (all cores when there are no
others). Each variant is a client process of its own (the sync ``ContextStore``, strict mode, default limits),
started once; the blocks and the restore's destination are shared memory (``/dev/shm``) mapped by every
client, so RAM holds them once whatever the number of variants. The restore prompt is saved once before the
rounds; a save stores fresh keys (deleted after the timed call). Rounds are interleaved (variant order reversed
every other round), so a ratio to T=1 compares calls made seconds apart. Every restore is checked: its
destination is zeroed before the call, and after it every block must be there and the XXH3-128 of the
destination must equal that of the blocks.

``--baseline DIR`` (a checkout of an earlier commit, e.g. ``git worktree add /tmp/before <commit>``) adds that
checkout's client as one more variant (one thread, as it was) against the same node.

Reported per scenario and variant: median and p99 wall time of a call, GB/s from the median, the same-round
ratio to T=1, node CPU per GB (all shards) and client CPU per GB (the client process, all its threads).
"""

from __future__ import annotations

import argparse
import mmap
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

from ctxstore.units import parse_size

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
    paired_ratio,
    pyplot,
    save_figure,
    shard_pids,
    source_commit,
    source_state,
    stats,
    today,
    wait_ctxstore,
)

PLOT = DOCS / "benchmarks-receive-scaling.png"
SMALL = 128 << 20
BLOCK_TOKENS = 16
SHM = Path("/dev/shm")


@dataclass(frozen=True)
class Shape:
    name: str  # "big" / "small": the command word
    label: str
    block_bytes: int
    total: int

    @property
    def blocks(self) -> int:
        return self.total // self.block_bytes


def shapes(big: int) -> list[Shape]:
    return [Shape("big", f"{big // (2 << 20)} x 2 MiB", 2 << 20, big),
            Shape("small", f"{SMALL // (64 << 10)} x 64 KiB", 64 << 10, SMALL)]


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(128000) for _ in range(1 << 17)]  # enough tokens for 8192 blocks of 16


def file_bytes(big: int) -> int:
    """The shared blocks and destination hold the larger scenario."""
    return max(big, SMALL)


def shared(path: Path, size: int) -> mmap.mmap:
    with open(path, "r+b") as f:
        return mmap.mmap(f.fileno(), size)


# ---------------------------------------------------------------------------- a client process


def client_main(nodes: str, threads: int, big: int, files: str) -> int:
    """Commands on stdin (``restore big`` / ``save small`` ...), one answer line each: ok, seconds, CPU seconds."""
    import numpy as np

    import ctxstore
    from ctxstore import ContextStore, Timeouts

    source_path, arena_path = files.split(",")
    source, arena = shared(Path(source_path), file_bytes(big)), shared(Path(arena_path), file_bytes(big))
    kwargs: dict[str, object] = {"threads": threads} if threads else {}
    store = ContextStore(nodes, access_key=ACCESS, secret_key=SECRET, strict=True,
                         timeouts=Timeouts(connect=5, read=30, total=300), **kwargs)
    rng = random.Random(threads + 1000)
    spaces = {}
    for shape in shapes(big):
        ns = store.namespace(f"bench-rs-{shape.name}", model="bench/receive", block_size=BLOCK_TOKENS, create=False)
        blocks = [memoryview(source)[i * shape.block_bytes:(i + 1) * shape.block_bytes] for i in range(shape.blocks)]
        expected = xxhash.xxh3_128_intdigest(memoryview(source)[:shape.total])
        spaces[shape.name] = (shape, ns, blocks, expected)
    print(f"ready {Path(ctxstore.__file__).parent}", flush=True)
    for line in sys.stdin:
        op, name = line.split()
        shape, ns, blocks, expected = spaces[name]
        out = memoryview(arena)[:shape.total]
        if op == "restore":
            np.frombuffer(out, dtype=np.uint8)[:] = 0
            tokens = prompt(1)[:shape.blocks * BLOCK_TOKENS]
            c0, t0 = time.process_time(), time.perf_counter()
            got = ns.restore(tokens, out=out).n_blocks
            elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
            ok = got == shape.blocks and xxhash.xxh3_128_intdigest(out) == expected
        else:
            tokens = [rng.randrange(128000) for _ in range(shape.blocks * BLOCK_TOKENS)]
            c0, t0 = time.process_time(), time.perf_counter()
            saved = ns.save(tokens, blocks)
            elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
            ok = saved.stored == shape.blocks
            ns.delete(tokens)
        del out
        print(f"{'ok' if ok else 'bad'} {elapsed:.6f} {cpu:.6f}", flush=True)
    store.close()
    return 0


# ---------------------------------------------------------------------------- the run


@dataclass
class Variant:
    label: str
    threads: int  # 0: the baseline's client, which has no such setting
    pythonpath: str | None = None
    proc: subprocess.Popen[str] | None = None
    times: dict[str, list[float]] = field(default_factory=dict)
    client_cpu: dict[str, float] = field(default_factory=dict)
    node_cpu: dict[str, float] = field(default_factory=dict)

    def ask(self, command: str) -> tuple[bool, float, float]:
        assert self.proc is not None and self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline().split()
        if len(answer) != 3:
            raise RuntimeError(f"{self.label}: no answer to {command!r}")
        return answer[0] == "ok", float(answer[1]), float(answer[2])


def run(args: argparse.Namespace, variants: list[Variant]) -> list[str]:
    cores = os.cpu_count() or 1
    workers = args.workers
    node_cores = f"0-{workers - 1}" if workers > 1 else "0"
    client_cores = f"{workers}-{cores - 1}" if cores > workers else f"0-{cores - 1}"
    procs = Processes()
    tag = f"ctxstore-rs-{os.getpid()}"
    room = os.statvfs(SHM) if SHM.is_dir() else None
    fits = room is not None and room.f_bavail * room.f_frsize > 2 * file_bytes(args.big) + (1 << 30)
    folder = SHM if fits else Path("/tmp")
    if folder != SHM:  # a container's /dev/shm is often 64 MB: file-backed maps then, in the page cache
        print(f"# {SHM} has too little room: the shared blocks live in {folder}", file=sys.stderr)
    source_path, arena_path = folder / f"{tag}-source", folder / f"{tag}-arena"
    try:
        for path in (source_path, arena_path):
            with open(path, "wb") as f:
                f.truncate(file_bytes(args.big))
        source = shared(source_path, file_bytes(args.big))
        for offset in range(0, file_bytes(args.big), 64 << 20):  # random: a misplaced block changes the digest
            source[offset:offset + (64 << 20)] = os.urandom(min(64 << 20, file_bytes(args.big) - offset))
        port = free_port()
        memory = f"{(2 * args.big + 2 * SMALL + (1 << 30)) >> 20}MiB"
        env = {**os.environ, "CTXSTORE_ACCESS_KEY": ACCESS, "CTXSTORE_SECRET_KEY": SECRET}
        node = procs.start("ctxstore", [*ctxstore_argv(port, memory), "--workers", str(workers)], env,
                           core=node_cores)
        for i in range(workers):
            wait_ctxstore(procs, node, port + i)
        pids = shard_pids(node.pid, workers) if workers > 1 else [node.pid]  # --workers 1: the node itself
        nodes = f"127.0.0.1:{port}-{port + workers - 1}"

        from ctxstore import ContextStore

        with ContextStore(nodes, access_key=ACCESS, secret_key=SECRET, strict=True, threads=1) as loader:
            for shape in shapes(args.big):
                ns = loader.namespace(f"bench-rs-{shape.name}", model="bench/receive", block_size=BLOCK_TOKENS)
                blocks = [memoryview(source)[i * shape.block_bytes:(i + 1) * shape.block_bytes]
                          for i in range(shape.blocks)]
                if ns.save(prompt(1)[:shape.blocks * BLOCK_TOKENS], blocks).stored != shape.blocks:
                    raise RuntimeError("loading the restore prompt failed")
                del blocks
        for v in variants:
            env_v = dict(os.environ)
            if v.pythonpath:
                env_v["PYTHONPATH"] = v.pythonpath
            cmd = ["taskset", "-c", client_cores, sys.executable, __file__, "--client", nodes, "--threads-of",
                   str(v.threads), "--big", str(args.big), "--files", f"{source_path},{arena_path}"]
            v.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env_v)
            assert v.proc.stdout is not None
            ready = v.proc.stdout.readline().split()
            if not ready or ready[0] != "ready":
                raise RuntimeError(f"client {v.label} did not start")
            print(f"# {v.label}: ctxstore from {ready[1]}", file=sys.stderr)
        for op in ("restore", "save"):
            for shape in shapes(args.big):
                scenario = f"{op} {shape.label}"
                for r in range(args.rounds + 1):  # the first round warms up
                    for v in (variants if r % 2 == 0 else variants[::-1]):
                        n0 = sum(cpu_seconds(p) for p in pids)
                        ok, seconds, cpu = v.ask(f"{op} {shape.name}")
                        n1 = sum(cpu_seconds(p) for p in pids)
                        if not ok:
                            raise RuntimeError(f"{v.label} {scenario}: wrong or missing blocks")
                        if r:
                            v.times.setdefault(scenario, []).append(seconds)
                            v.client_cpu[scenario] = v.client_cpu.get(scenario, 0.0) + cpu
                            v.node_cpu[scenario] = v.node_cpu.get(scenario, 0.0) + n1 - n0
        return [f"node: --workers {workers} on cores {node_cores}; clients on cores {client_cores}"]
    finally:
        for v in variants:
            if v.proc is not None:
                if v.proc.stdin is not None:
                    v.proc.stdin.close()
                try:
                    v.proc.wait(30)
                except subprocess.TimeoutExpired:
                    v.proc.kill()
                    v.proc.wait()
                if v.proc.stdout is not None:
                    v.proc.stdout.close()
        procs.stop()
        for path in (source_path, arena_path):
            path.unlink(missing_ok=True)


# ---------------------------------------------------------------------------- report


def report(variants: list[Variant], big: int, header: list[str]) -> None:
    for line in header:
        print(line)
    print()
    print("| scenario | client | calls | median ms | p99 ms | GB/s | ÷ T=1, same rounds | node CPU s/GB | "
          "client CPU s/GB |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    base = next(v for v in variants if v.threads == 1)
    for scenario in base.times:
        gb = (big if "2 MiB" in scenario else SMALL) / 1e9
        for v in variants:
            times = v.times[scenario]
            med, p99 = stats(times)
            moved = gb * len(times)
            ratio = paired_ratio(times, base.times[scenario])
            print(f"| {scenario} | {v.label} | {len(times)} | {med * 1000:.1f} | {p99 * 1000:.1f} | {gb / med:.2f} | "
                  f"{ratio:.2f} | {v.node_cpu[scenario] / moved:.3f} | {v.client_cpu[scenario] / moved:.3f} |")


def plot(variants: list[Variant], big: int, path: Path, note: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    scaled = [v for v in variants if v.threads]
    scenarios = list(scaled[0].times)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
    for scenario in scenarios:
        gb = (big if "2 MiB" in scenario else SMALL) / 1e9
        xs = [v.threads for v in scaled]
        axes[0].plot(xs, [gb / stats(v.times[scenario])[0] for v in scaled], marker="o", label=scenario)
        axes[1].plot(xs, [v.client_cpu[scenario] / (gb * len(v.times[scenario])) for v in scaled], marker="o",
                     label=scenario)
    for ax, title in zip(axes, ("GB/s (median) by client threads", "client CPU s per GB"), strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xticks([v.threads for v in scaled], [str(v.threads) for v in scaled])
        ax.set_title(title)
    axes[0].legend()
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    save_figure(plt, fig, path, note)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 1) // 2))
    parser.add_argument("--threads", default="1,2,4,8", help="client thread counts, e.g. 1,2,4")
    parser.add_argument("--big", type=parse_size, default=4 << 30, help="size of the 2 MiB-block scenario")
    parser.add_argument("--baseline", type=Path, help="a checkout of an earlier commit: its client too")
    parser.add_argument("--plot", type=Path, default=PLOT)
    parser.add_argument("--client", help=argparse.SUPPRESS)
    parser.add_argument("--threads-of", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--files", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        return client_main(args.client, args.threads_of, args.big, args.files)
    exit_on_sigterm()
    threads = [int(t) for t in args.threads.split(",")]
    variants = [Variant(f"T={t}", t) for t in threads]
    if 1 not in threads:
        variants.insert(0, Variant("T=1", 1))
    if args.baseline:
        variants.append(Variant(f"before ({source_commit(args.baseline)})", 0, str(args.baseline.resolve())))
    busy = busy_cores()
    load0 = os.getloadavg()
    started = time.monotonic()
    layout = run(args, variants)
    load1 = os.getloadavg()
    state = source_state()
    header = [f"receive_scaling, {today()}: {os.cpu_count()} CPUs; {args.rounds} rounds after 1 warm-up; took "
              f"{time.monotonic() - started:.0f} s; load average {load0[0]:.1f} → {load1[0]:.1f}; cores busy with "
              f"other work just before: {busy}", f"Python {sys.version.split()[0]}, {state}; {layout[0]}"]
    report(variants, args.big, header)
    plot(variants, args.big, args.plot,
         f"benchmarks/receive_scaling.py, {today()}, {state}, {os.cpu_count()} CPUs, "
         f"load {load0[0]:.1f}→{load1[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
