"""A flash node under write pressure and under a prefetch followed by a load: what a save of three times RAM
keeps, how fast it goes, what it costs a small read meanwhile, and how often a prefetched block is read from
the device, for this checkout's server and (``--before REV``) an earlier commit's, side by side in one run.

Command (results go in docs/benchmarks.md, the plot in docs/benchmarks-flash-pressure.png, the raw figures in
benchmarks/flash_pressure.json):

    .venv/bin/pip install -e '.[bench]'
    .venv/bin/python benchmarks/flash_pressure.py --dir /var/tmp/ctxstore-flash-pressure --before 770ed8f
        # defaults: --rounds 3 --memory 64MiB --disk-size 1GiB --blocks 768 --block-kib 256 --call-mib 8
        #           --read-blocks 512 --timeout 300; without --before only this checkout's server runs

770ed8f is the parent of aa2d928, the commit that brought the flash tier's backpressure (a write waits, then
is refused with SlowDown, instead of its victims being dropped) and its joined reads.

``--before REV``: a ``git worktree`` of REV (detached, under the run's folder in ``--dir``) whose server runs
as ``python -m ctxstore_server.serve`` with ``PYTHONPATH=<worktree>:<shim>`` (the shim holds the link
``ctxstore_server -> <worktree>/server``), so it runs with its own shared definitions; this checkout's client
drives both servers. The worktree is removed at the end. Every node runs pinned to core 0 with
``CTXSTORE_ADMIN_TOKEN`` set (its figures come from ``GET /_ctx/v1/admin/stats``); this process, its threads
and ``dd`` run on core 1. Each round starts fresh nodes (``--disk-reset true``) in a fresh folder; the order of
the systems is reversed every other round.

1. **Save of 3× RAM into a flash node.** A node ``--memory 64MiB --disk DIR --disk-size 1GiB``; one client
   (``ContextStore(threads=1)``, long timeouts so that a slow call shows in the figures instead of becoming a
   failure) saves ``--blocks`` blocks of ``--block-kib`` KiB of one chain (one namespace) in prefix order, as
   fast as it can: ``put_keys`` calls of ``--call-mib`` MiB one after another (``--call-mib 0``: one
   ``Namespace.save`` of the whole chain, with the client's default call size). Meanwhile a second client
   (``ContextStore(threads=1)``, default timeouts, as a worker) in a thread restores one 4 KiB block, saved and
   pinned before, so in RAM, as fast as it can, until the save returns (``--get-max`` gets at most); the same
   for ``--idle-get-seconds`` before the save gives the idle figures. Reported: the blocks kept
   (``Namespace.lookup``: the cached prefix; ``locate_keys``: the blocks present anywhere, in RAM, on
   flash), the blocks the client was told were not stored (``SaveResult.failed``), save GB/s (payload bytes
   over the time of the save), demotion GB/s (the node's ``disk_bytes_written`` over the time from the start
   of the save until ``disk_queued_bytes`` is 0) and its ratio to the device's sequential write ceiling
   measured in the same round (``dd if=/dev/zero of=<file in DIR> bs=1M count=<payload MiB> oflag=direct``,
   interleaved with the saves), p50 / p99 of the small restore (each round's; the table gives their median
   over rounds), the put calls' times, the node's ``disk_write_waits`` / ``disk_write_refusals`` and the
   client's ``slowdown_retries``.
2. **Flash read amplification with prefetch.** A node with ``--disk-direct-size 1`` (every block straight to
   flash); ``--read-blocks`` blocks of 64 KiB saved and waited for until all are on flash; then
   ``prefetch_keys`` followed at once by ``get_keys`` of the same keys. Reported: the node's
   ``disk_bytes_read`` (counted until it has not moved for 0.5 s) over the payload bytes (goal 1.0: each
   record read once), and the get's time.

Every load is bounded: a save stops issuing calls after ``--timeout`` s, every wait for the node gives up after
``--timeout`` s, the small restores stop at ``--get-max``. The table gives medians and p99 (nearest rank; with
few rounds p99 is the worst round) and same-round ratios (after ÷ before, demotion ÷ dd ceiling: the median
of the per-round ratios). GB = 10^9 bytes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    ACCESS,
    DOCS,
    SECRET,
    Node,
    Processes,
    busy_cores,
    distinct_blocks,
    exit_on_sigterm,
    git_worktree,
    pin_client,
    pyplot,
    save_figure,
    source_commit,
    source_state,
    stats,
    timed_dd,
    today,
)

from ctxstore import ContextStore, Limits, Namespace, SaveResult, Timeouts  # noqa: E402
from ctxstore.buffers import Destinations  # noqa: E402
from ctxstore.units import parse_size  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
GB = 1e9
BUCKET = "pressure"
BLOCK_TOKENS = 16
SMALL_BYTES = 4 * KiB
READ_BLOCK = 64 * KiB
SETTLE_SECONDS = 0.5  # disk_bytes_read unchanged this long: the prefetch's reads are done
POLL_SECONDS = 0.02
#: The node's counters kept per round (a key an older node lacks is left out).
NODE_COUNTERS = ("objects", "disk_objects", "demotions", "evictions", "disk_write_waits", "disk_write_refusals",
                 "disk_dropped_short_ttl", "disk_dropped_too_large", "disk_dropped_over_share",
                 "disk_dropped_not_writing", "disk_bytes_written", "disk_bytes_read", "prefetches", "promotions")


@dataclass
class System:
    """A server under test: this checkout's (``source`` None) or a worktree's."""

    name: str  # "after" or "before"
    commit: str
    source: Path | None


@dataclass
class Run:
    """Where this run's files go, and its settings."""

    base: Path
    args: argparse.Namespace
    procs: Processes = field(default_factory=Processes)

    def folder(self, prefix: str) -> Path:
        return Path(tempfile.mkdtemp(prefix=prefix, dir=self.base))

    def node(self, system: System, *extra: str) -> Node:
        shim = self.folder("shim-") if system.source is not None else None
        return Node(self.procs, self.args.memory, *extra, source=system.source, shim=shim)

    def client(self, node: Node, *, call_bytes: int = 0, patient: bool = True) -> ContextStore:
        limits = Limits(bytes_per_call=call_bytes) if call_bytes else Limits()
        timeouts = Timeouts(connect=5, read=60, total=120) if patient else Timeouts()
        return ContextStore(node.endpoint, access_key=ACCESS, secret_key=SECRET, threads=1, limits=limits,
                            timeouts=timeouts)


def wait_for(what: str, node: Node, done: Callable[[dict[str, Any]], bool], timeout: float) -> dict[str, Any]:
    """Poll the node's stats until ``done(stats)``; the last stats (RuntimeError after ``timeout`` s)."""
    deadline = time.monotonic() + timeout
    while True:
        s = node.stats()
        if done(s):
            return s
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not after {timeout:g} s: {s}")
        time.sleep(POLL_SECONDS)


def idle_writer(s: dict[str, Any]) -> bool:
    """Nothing waits to be written to flash."""
    return bool(s["disk_queued_bytes"] == 0 and s.get("disk_direct_waiting", 0) == 0)


def percentiles(samples: Sequence[float]) -> dict[str, float]:
    """count, p50, p90, p99 (nearest rank), max of ``samples`` (seconds); {} when there are none."""
    if not samples:
        return {}
    ordered = sorted(samples)

    def rank(q: float) -> float:
        return ordered[max(0, math.ceil(q * len(ordered)) - 1)]

    return {"count": len(ordered), "p50": statistics.median(ordered), "p90": rank(0.9), "p99": rank(0.99),
            "max": ordered[-1]}


# ---------------------------------------------------------------------------- 1. save of 3x RAM


class SmallGets(threading.Thread):
    """Restores of one 4 KiB block, one after another, until :meth:`stop`, ``limit`` restores or ``seconds``."""

    def __init__(self, store: ContextStore, tokens: list[int], limit: int, seconds: float) -> None:
        super().__init__(name="small-gets", daemon=True)
        self.ns = store.namespace(BUCKET, model="flash-pressure-small", block_size=BLOCK_TOKENS)
        self.tokens, self.limit, self.seconds = tokens, limit, seconds
        self.latencies: list[float] = []
        self.misses = 0
        self.error: str | None = None
        self._halt = threading.Event()

    def run(self) -> None:
        buffer = bytearray(SMALL_BYTES)
        deadline = time.monotonic() + self.seconds
        try:
            while not self._halt.is_set() and len(self.latencies) < self.limit and time.monotonic() < deadline:
                t0 = time.perf_counter()
                got = self.ns.restore(self.tokens, out=buffer)
                self.latencies.append(time.perf_counter() - t0)
                self.misses += got.n_blocks != 1
        except Exception as exc:  # reported with the round's figures; the save goes on
            self.error = f"{type(exc).__name__}: {exc}"

    def stop(self) -> None:
        self._halt.set()
        self.join(30)


def idle_gets(store: ContextStore, tokens: list[int], run: Run) -> dict[str, float]:
    load = SmallGets(store, tokens, run.args.get_max, run.args.idle_get_seconds)
    load.start()
    load.join(run.args.idle_get_seconds + 30)
    return percentiles(load.latencies)


def save(run: Run, store: ContextStore, ns: Namespace, tokens: list[int], blocks: list[memoryview]
         ) -> tuple[SaveResult, list[float], int]:
    """The chain saved as fast as one client thread can: the result, each call's seconds, blocks not sent
    (the ``--timeout`` came first)."""
    call_bytes = run.args.call_mib * MiB
    if not call_bytes:
        t0 = time.perf_counter()
        result = ns.save(tokens, blocks)
        return result, [time.perf_counter() - t0], 0
    keys = ns.block_hashes(tokens)
    per_call = max(1, call_bytes // len(blocks[0]))
    total = SaveResult()
    calls: list[float] = []
    deadline = time.monotonic() + run.args.timeout
    for first in range(0, len(blocks), per_call):
        if time.monotonic() > deadline:
            print(f"# save stopped after {run.args.timeout:g} s, {len(blocks) - first} blocks not sent",
                  file=sys.stderr)
            return total, calls, len(blocks) - first
        t0 = time.perf_counter()
        got = store.put_keys(BUCKET, keys[first:first + per_call], blocks[first:first + per_call])
        calls.append(time.perf_counter() - t0)
        total.stored, total.existed, total.failed = (total.stored + got.stored, total.existed + got.existed,
                                                     total.failed + got.failed)
    return total, calls, 0


def save_round(run: Run, system: System, blocks: list[memoryview]) -> dict[str, Any]:
    args = run.args
    n = len(blocks)
    tokens = list(range(BLOCK_TOKENS * n))
    small_tokens = list(range(10**6, 10**6 + BLOCK_TOKENS))
    node = run.node(system, "--disk", str(run.folder(f"save-{system.name}-")), "--disk-size", args.disk_size,
                    "--disk-reset", "true")
    saver = run.client(node, call_bytes=args.call_mib * MiB)
    getter = run.client(node, patient=False)
    try:
        small = getter.namespace(BUCKET, model="flash-pressure-small", block_size=BLOCK_TOKENS)
        if (small.save(small_tokens, [bytes(range(256)) * (SMALL_BYTES // 256)]).stored != 1
                or small.pin(small_tokens, 3600) != 1):
            raise RuntimeError(f"{system.name}: the 4 KiB block was not stored and pinned")
        idle = idle_gets(getter, small_tokens, run)
        ns = saver.namespace(BUCKET, model="flash-pressure", block_size=BLOCK_TOKENS)
        ns.lookup(tokens[:BLOCK_TOKENS])  # the connection is open before the clock starts
        written0 = node.stats()["disk_bytes_written"]
        load = SmallGets(getter, small_tokens, args.get_max, args.timeout)
        load.start()
        t0 = time.perf_counter()
        try:
            result, calls, unsent = save(run, saver, ns, tokens, blocks)
            save_seconds = time.perf_counter() - t0
        finally:
            load.stop()
        s = wait_for("demotion", node, idle_writer, args.timeout)
        demoted_seconds = time.perf_counter() - t0
        located = saver.locate_keys(BUCKET, ns.block_hashes(tokens))
        small_tier = getter.locate_keys(BUCKET, small.block_hashes(small_tokens))[0]
        return {
            "blocks": n, "payload_bytes": sum(map(len, blocks)), "save_seconds": save_seconds,
            "demoted_seconds": demoted_seconds, "disk_bytes_written": s["disk_bytes_written"] - written0,
            "stored": result.stored, "existed": result.existed, "failed": result.failed, "unsent": unsent,
            "prefix": ns.lookup(tokens), "present": sum(f is not None for f in located),
            "in_ram": sum(f is not None and f[1] == "ram" for f in located),
            "on_flash": sum(f is not None and f[1] == "disk" for f in located),
            "calls": percentiles(calls), "slowdown_retries": saver.metrics_snapshot().get("slowdown_retries", 0),
            "get": {**percentiles(load.latencies), "misses": load.misses, "error": load.error},
            "get_idle": idle, "small_block_tier": None if small_tier is None else small_tier[1],
            "node": {k: s[k] for k in NODE_COUNTERS if k in s},
        }
    finally:
        saver.close()
        getter.close()
        run.procs.stop()


def dd_round(run: Run, payload_bytes: int) -> dict[str, Any]:
    mib = -(-payload_bytes // MiB)
    target = run.folder("dd-") / "write.bin"
    seconds = timed_dd("if=/dev/zero", f"of={target}", "bs=1M", f"count={mib}", "oflag=direct")
    target.unlink()
    return {"bytes": mib * MiB, "seconds": seconds}


def save_bench(run: Run, systems: list[System], out: dict[str, Any]) -> None:
    blocks = distinct_blocks(run.args.block_kib * KiB, run.args.blocks)
    payload = sum(map(len, blocks))
    results: dict[str, list[dict[str, Any]]] = {s.name: [] for s in systems}
    results["dd"] = []
    for r in range(run.args.rounds):
        order: list[System | None] = [*systems, None]
        for system in (order if r % 2 == 0 else order[::-1]):
            if system is None:
                results["dd"].append(dd_round(run, payload))
            else:
                results[system.name].append(save_round(run, system, blocks))
            cleanup(run)
    out["save"] = results


# ---------------------------------------------------------------------------- 2. flash reads with prefetch


def read_round(run: Run, system: System) -> dict[str, Any]:
    n = run.args.read_blocks
    tokens = list(range(BLOCK_TOKENS * n))
    blocks = distinct_blocks(READ_BLOCK, n)
    node = run.node(system, "--disk", str(run.folder(f"reads-{system.name}-")), "--disk-size",
                    run.args.disk_size, "--disk-reset", "true", "--disk-direct-size", "1")
    store = run.client(node)
    try:
        ns = store.namespace(BUCKET, model="flash-pressure-reads", block_size=BLOCK_TOKENS)
        saved = ns.save(tokens, blocks)
        if saved.stored != n:
            raise RuntimeError(f"{system.name}: {saved} of {n} blocks of 64 KiB")
        wait_for("blocks on flash", node, lambda s: s["disk_objects"] >= n and idle_writer(s), run.args.timeout)
        keys = ns.block_hashes(tokens)
        buffer = bytearray(n * READ_BLOCK)
        before = node.stats()
        t0 = time.perf_counter()
        prefetched = store.prefetch_keys(BUCKET, keys)
        views = store.get_keys(BUCKET, keys, Destinations(buffer, n))
        get_seconds = time.perf_counter() - t0
        got = sum(v is not None for v in views)
        if got == n and buffer != b"".join(blocks):
            raise RuntimeError(f"{system.name}: the blocks read differ from those saved")
        after = settled(node, "disk_bytes_read", run.args.timeout)
        return {"blocks": n, "payload_bytes": n * READ_BLOCK, "got": got, "prefetched": prefetched,
                "seconds": get_seconds, "disk_bytes_read": after["disk_bytes_read"] - before["disk_bytes_read"],
                "in_ram_before": before["objects"],
                "node": {k: after[k] for k in NODE_COUNTERS if k in after}}
    finally:
        store.close()
        run.procs.stop()


def settled(node: Node, counter: str, timeout: float) -> dict[str, Any]:
    """The node's stats once ``counter`` has not moved for :data:`SETTLE_SECONDS`."""
    deadline = time.monotonic() + timeout
    last, since = node.stats(), time.monotonic()
    while time.monotonic() - since < SETTLE_SECONDS:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{counter} still moving after {timeout:g} s")
        time.sleep(POLL_SECONDS * 5)
        now = node.stats()
        if now[counter] != last[counter]:
            since = time.monotonic()
        last = now
    return last


def read_bench(run: Run, systems: list[System], out: dict[str, Any]) -> None:
    results: dict[str, list[dict[str, Any]]] = {s.name: [] for s in systems}
    for r in range(run.args.rounds):
        for system in (systems if r % 2 == 0 else systems[::-1]):
            results[system.name].append(read_round(run, system))
            cleanup(run)
    out["reads"] = results


def cleanup(run: Run) -> None:
    """A round's node folders, shims and dd file go once the round is over (1 GiB of flash each)."""
    for path in run.base.iterdir():
        if not path.name.startswith("worktree-"):
            shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------------------- report


def gbps(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / GB


def save_rates(rounds: list[dict[str, Any]]) -> tuple[list[float], list[float]]:
    """Per round: save GB/s and demotion GB/s."""
    return ([gbps(r["payload_bytes"], r["save_seconds"]) for r in rounds],
            [gbps(r["disk_bytes_written"], r["demoted_seconds"]) for r in rounds])


def pooled(rounds: list[dict[str, Any]], key: str, q: str) -> float:
    """A percentile over the rounds (of the small restores, the put calls): the median of the rounds' figures
    (NaN when no round has one)."""
    values = [r[key][q] for r in rounds if q in r[key]]
    return statistics.median(values) if values else math.nan


def ratio(values: Sequence[float | None], bases: Sequence[float | None]) -> str:
    """Median over rounds of value ÷ base (rounds where either is missing or the base is 0 left out)."""
    pairs = [v / b for v, b in zip(values, bases, strict=False) if v is not None and b]
    return f"{statistics.median(pairs):.2f}" if pairs else "–"


def report(out: dict[str, Any]) -> None:
    a = out["args"]
    print(f"# {today()} · {source_state()} · busy before the run: {out['busy']}")
    names = {s["name"]: f"{s['name']} ({s['commit']})" for s in out["systems"]}
    save = out.get("save")
    if save:
        dd = save["dd"]
        dd_rates = [gbps(d["bytes"], d["seconds"]) for d in dd]
        first = next(iter(save[s] for s in names))[0]
        payload = first["payload_bytes"]
        call = f"put_keys calls of {a['call_mib']} MiB" if a["call_mib"] else "one Namespace.save"
        print(f"\n## Save of {first['blocks']} × {a['block_kib']} KiB ({payload / MiB:.0f} MiB, "
              f"{payload / parse_size(a['memory']):.1f}× RAM) into a node with {a['memory']} of RAM and "
              f"{a['disk_size']} of flash ({call}, one client thread; {len(dd)} rounds)\n")
        print("| server | blocks kept: prefix / present, median (worst round) | told not stored | save s median / p99 "
              "| save GB/s | demotion GB/s | ÷ dd ceiling (same round) |")
        print("|---|---|---:|---:|---:|---:|---:|")
        for name, label in names.items():
            rounds = save[name]
            saves, demotions = save_rates(rounds)
            med, p99 = stats([r["save_seconds"] for r in rounds])
            prefix = min(r["prefix"] for r in rounds)
            present = min(r["present"] for r in rounds)
            n = first["blocks"]
            print(f"| {label} | {statistics.median(r['prefix'] for r in rounds):.0f} / "
                  f"{statistics.median(r['present'] for r in rounds):.0f} of {n} "
                  f"({100 * prefix / n:.1f} % / {100 * present / n:.1f} %) | "
                  f"{statistics.median(r['failed'] for r in rounds):.0f} (max {max(r['failed'] for r in rounds)}) | "
                  f"{med:.2f} / {p99:.2f} | {statistics.median(saves):.3f} | {statistics.median(demotions):.3f} | "
                  f"{ratio(demotions, dd_rates)} |")
        med, p99 = stats([d["seconds"] for d in dd])
        print(f"| dd bs=1M oflag=direct, {dd[0]['bytes'] // MiB} MiB | | | {med:.2f} / {p99:.2f} | "
              f"{statistics.median(dd_rates):.3f} | | 1.00 |")
        print("\n| server | small restore during the save: p50 / p99 (count, misses per round) | idle: p50 / p99 | "
              "put call p50 / p99 / max | write waits / refusals | client SlowDown retries | in RAM / on flash |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for name, label in names.items():
            rounds = save[name]
            gets = ", ".join(f"{r['get'].get('count', 0)} / {r['get']['misses']}" for r in rounds)
            errors = [r["get"]["error"] for r in rounds if r["get"]["error"]]
            waits = "/".join(str(r["node"].get("disk_write_waits", "–")) for r in rounds)
            refusals = "/".join(str(r["node"].get("disk_write_refusals", "–")) for r in rounds)
            print(f"| {label} | {1e3 * pooled(rounds, 'get', 'p50'):.2f} / {1e3 * pooled(rounds, 'get', 'p99'):.2f} "
                  f"ms ({gets}) | {1e3 * pooled(rounds, 'get_idle', 'p50'):.2f} / "
                  f"{1e3 * pooled(rounds, 'get_idle', 'p99'):.2f} ms | "
                  f"{1e3 * pooled(rounds, 'calls', 'p50'):.0f} / {1e3 * pooled(rounds, 'calls', 'p99'):.0f} / "
                  f"{1e3 * max(r['calls']['max'] for r in rounds):.0f} ms | {waits} / {refusals} | "
                  f"{'/'.join(str(r['slowdown_retries']) for r in rounds)} | "
                  f"{statistics.median(r['in_ram'] for r in rounds):.0f} / "
                  f"{statistics.median(r['on_flash'] for r in rounds):.0f} |")
            for error in errors:
                print(f"\n{label}: the small restores stopped: {error}")
        if "before" in save:
            after, before = save["after"], save["before"]
            sa, da = save_rates(after)
            sb, db = save_rates(before)
            print("\nafter ÷ before, same round (median): "
                  f"blocks kept (prefix) {ratio([r['prefix'] for r in after], [r['prefix'] for r in before])}, "
                  f"save GB/s {ratio(sa, sb)}, demotion GB/s {ratio(da, db)}, small restore p99 "
                  f"{ratio([r['get'].get('p99') for r in after], [r['get'].get('p99') for r in before])} "
                  "(below 1: faster after)")
    reads = out.get("reads")
    if reads:
        first = next(iter(reads[s] for s in names))[0]
        print(f"\n## Prefetch then get of {first['blocks']} × 64 KiB, every block on flash "
              "(--disk-direct-size 1)\n")
        print("| server | device bytes read ÷ payload, median (max) | get s median / p99 | blocks got | "
              "prefetch said |")
        print("|---|---:|---:|---:|---:|")
        for name, label in names.items():
            rounds = reads[name]
            amp = [r["disk_bytes_read"] / r["payload_bytes"] for r in rounds]
            med, p99 = stats([r["seconds"] for r in rounds])
            print(f"| {label} | {statistics.median(amp):.2f} ({max(amp):.2f}) | {med:.3f} / {p99:.3f} | "
                  f"{min(r['got'] for r in rounds)} of {first['blocks']} | "
                  f"{statistics.median(r['prefetched'] for r in rounds):.0f} |")
        if "before" in reads:
            amp_a = [r["disk_bytes_read"] / r["payload_bytes"] for r in reads["after"]]
            amp_b = [r["disk_bytes_read"] / r["payload_bytes"] for r in reads["before"]]
            print(f"\nafter ÷ before, same round (median): device bytes read {ratio(amp_a, amp_b)}")


def plot(out: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    names = [s["name"] for s in out["systems"]]
    labels = [f"{s['name']}\n{s['commit']}" for s in out["systems"]]
    colors = {"after": "tab:blue", "before": "tab:gray"}
    fig, axes = plt.subplots(1, 4, figsize=(9.0, 2.6))
    save, reads = out.get("save"), out.get("reads")
    if save:
        kept = [statistics.median(100 * r["prefix"] / r["blocks"] for r in save[n]) for n in names]
        axes[0].bar(labels, kept, color=[colors[n] for n in names])
        axes[0].set_ylim(0, 105)
        first = save[names[0]][0]
        axes[0].set_title(f"save of {first['payload_bytes'] / parse_size(out['args']['memory']):.0f}× RAM: kept, %")
        dd = statistics.median(gbps(d["bytes"], d["seconds"]) for d in save["dd"])
        width = 0.38
        for i, n in enumerate(names):
            saves, demotions = save_rates(save[n])
            axes[1].bar([i - width / 2], [statistics.median(saves)], width, color=colors[n],
                        label="save" if i == 0 else None)
            axes[1].bar([i + width / 2], [statistics.median(demotions)], width, color=colors[n], hatch="//",
                        edgecolor="white", label="demotion" if i == 0 else None)
        axes[1].axhline(dd, color="tab:red", linewidth=1, label="dd write ceiling")
        axes[1].set_xticks(range(len(names)), labels)
        axes[1].set_ylim(0, 1.6 * max(dd, *(b.get_height() for b in axes[1].patches)))
        axes[1].set_title("save, demotion: GB/s")
        axes[1].legend(loc="upper center", fontsize=6)
        for i, n in enumerate(names):
            p50, p99 = pooled(save[n], "get", "p50"), pooled(save[n], "get", "p99")
            axes[2].bar([i - width / 2, i + width / 2], [1e3 * p50, 1e3 * p99], width, color=colors[n])
            axes[2].text(i - width / 2, 1e3 * p50, "p50", ha="center", va="bottom", fontsize=6)
            axes[2].text(i + width / 2, 1e3 * p99, "p99", ha="center", va="bottom", fontsize=6)
        axes[2].set_xticks(range(len(names)), labels)
        axes[2].set_title("4 KiB get during it, ms")
    if reads:
        amp = [statistics.median(r["disk_bytes_read"] / r["payload_bytes"] for r in reads[n]) for n in names]
        axes[3].bar(labels, amp, color=[colors[n] for n in names])
        axes[3].axhline(1.0, color="tab:red", linewidth=1)
        axes[3].set_title("prefetch, get: flash read ÷ data")
    else:
        axes[3].set_visible(False)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    save_figure(plt, fig, path, f"{today()} · {source_state()} · {out['args']['rounds']} rounds")


# ---------------------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", type=Path, default=Path("/var/tmp/ctxstore-flash-pressure"),
                        help="a folder on the device under test (this run's files go in a new folder in it)")
    parser.add_argument("--before", metavar="REV", help="an earlier commit whose server runs alongside")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--memory", default="64MiB", help="the nodes' --memory")
    parser.add_argument("--disk-size", default="1GiB", help="the nodes' --disk-size")
    parser.add_argument("--blocks", type=int, default=768, help="blocks of the chain saved in part 1")
    parser.add_argument("--block-kib", type=int, default=256)
    parser.add_argument("--call-mib", type=int, default=8, help="MiB per put_keys call (0: one Namespace.save)")
    parser.add_argument("--read-blocks", type=int, default=512, help="blocks of 64 KiB in part 2 (0: skip it)")
    parser.add_argument("--get-max", type=int, default=1_000_000, help="small restores per save, at most")
    parser.add_argument("--idle-get-seconds", type=float, default=1.0)
    parser.add_argument("--timeout", type=float, default=300, help="bound of each save and each wait, seconds")
    parser.add_argument("--json", type=Path, default=Path(__file__).with_name("flash_pressure.json"))
    parser.add_argument("--png", type=Path, default=DOCS / "benchmarks-flash-pressure.png")
    args = parser.parse_args()
    if args.rounds < 1 or args.blocks < 1 or args.block_kib < 1 or args.call_mib < 0 or args.read_blocks < 0:
        parser.error("--rounds, --blocks and --block-kib must be positive, --call-mib and --read-blocks >= 0")
    exit_on_sigterm()
    pin_client()
    args.dir.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {"date": today(), "source": source_state(), "busy": busy_cores(), "args": {
        k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
    run = Run(Path(tempfile.mkdtemp(prefix="run-", dir=args.dir)), args)
    try:
        with contextlib.ExitStack() as stack:
            state = source_state().removeprefix("source: ")
            systems = [System("after", state.split()[0] + ("+" if "uncommitted" in state else ""), None)]
            if args.before:
                tree = stack.enter_context(git_worktree(args.before, run.base))
                systems.append(System("before", source_commit(tree), tree))
            out["systems"] = [{"name": s.name, "commit": s.commit} for s in systems]
            try:
                save_bench(run, systems, out)
                if args.read_blocks:
                    read_bench(run, systems, out)
            finally:
                run.procs.stop()
    finally:
        run.procs.stop()
        shutil.rmtree(run.base, ignore_errors=True)
        with contextlib.suppress(OSError):
            args.dir.rmdir()  # only if nothing else is in it
    args.json.write_text(json.dumps(out, indent=1))
    report(out)
    plot(out, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
