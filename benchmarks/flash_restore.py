"""Restores through a node with a flash tier, against the device and against RAM, measured in one run.

Command (as root: it drops the page cache; results go in docs/benchmarks.md, the plot in
docs/flash_restore.png):

    .venv/bin/pip install -e '.[bench]'
    .venv/bin/python benchmarks/flash_restore.py --dir /var/tmp/ctxstore-flash-bench
        # --rounds 5 --demote-mib 512 --rebuild 1000000 (defaults; --rebuild 0 skips the restart part)
        # --bytes-per-get 256MiB: each restore as one call, not the client's default calls of 32 MiB

The node runs pinned to core 0, this client (the ctxstore client, as a worker uses it) to core 1.

- **Restore** of 128 MiB as 2048 × 64 KiB and as 128 × 1 MiB blocks with one ``Namespace.restore`` into a
  preallocated buffer (one bulk get; the node reads its flash tier on its reader threads and verifies every
  block before the answer starts; the client verifies every block's XXH3 again):
  (a) **flash, cold**: a node with ``--disk-direct-size 1 --disk-promote false`` (every block on flash, never
  copied back to RAM) after ``sync; echo 3 > /proc/sys/vm/drop_caches``; (b) **flash, again**: the same
  right after, without dropping the cache (the node reads with O_DIRECT, so this should not differ: it is
  here to show that it does not); (c) **RAM**: a node without a flash tier. The device's ceiling for the
  same bytes and block size: ``dd if=<128 MiB file> of=/dev/null bs=64K|1M iflag=direct``, in the same
  rounds, interleaved.
- **Demotion** (exclusive tiers: these nodes run with ``--disk-write-back false``): ``--demote-mib`` of 1 MiB
  blocks saved (bulk, calls of 8 MiB) into a node with 64 MiB of RAM, so nearly everything is demoted: time
  until nothing waits for a write (``disk_queued_bytes`` 0) and every block is in RAM, on flash, or dropped
  (the count is reported; before backpressure a victim that found the demotion queue full was dropped), against the same save into a node whose RAM holds it all, and against
  ``dd if=/dev/zero of=<file> bs=1M count=<MiB> oflag=direct``. The save is bound by the node's one core
  (receiving, verifying and storing the body): **demotion alone** is the clean stop of a node whose RAM
  holds the same blocks and nothing else (SIGTERM: it writes what only RAM holds before it exits), timed by
  the node itself (its log line) and from the signal to the process's exit.
- **Restart** (``--rebuild N``): N blocks of 256 bytes saved straight to flash, the node stopped with SIGKILL
  and started again: the time from the process start until it answers ready, the index rebuild it reports
  (``disk_recovery.seconds``), and the node's RSS with those blocks on flash minus an empty node's, per block,
  once settled (the recovered blocks are announced as events: the ring of the last ``--events-buffer`` events
  is full then, a fixed cost); then the same restart with ``--events-buffer 1``. ``--rounds 0 --demote-mib 0``
  runs this part alone.

Reported: median and p99 (nearest rank) of each, GB/s = bytes / median time (10^9 bytes per GB), and the
ratio to the ceiling in the same run (ratio of medians; in parentheses the median of per-round ratios).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # noqa: E402
from _common import (  # noqa: E402
    ACCESS,
    DOCS,
    SECRET,
    Processes,
    busy_cores,
    exit_on_sigterm,
    paired_ratio,
    pin_client,
    pyplot,
    save_figure,
    source_state,
    stats,
    timed_dd,
    today,
)

from ctxstore import ContextStore, Limits, Timeouts  # noqa: E402
from ctxstore.units import parse_size  # noqa: E402

MiB = 1 << 20
GB = 1e9
BLOCK_TOKENS = 16
SHAPES = ((64 << 10, "2048 × 64 KiB", "64K"), (MiB, "128 × 1 MiB", "1M"))
RESTORE_BYTES = 128 * MiB


def drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class Node(_common.Node):
    """One ``ctxstore serve`` started by this benchmark (pinned to the server core); its restarts may take a
    while (an index rebuild of millions of blocks)."""

    def __init__(self, procs: Processes, memory: str, *extra: str) -> None:
        super().__init__(procs, memory, *extra, timeout=600)

    def wait_on_flash(self, blocks: int, *, settled: bool = False, timeout: float = 600) -> float:
        """Seconds until nothing waits for a write and ``blocks`` are on flash; with ``settled``, until each of
        ``blocks`` saved is in RAM, on flash or dropped (for one of the documented reasons: docs/flash.md)."""
        t0 = time.perf_counter()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            s = self.stats()
            placed = s["disk_objects"] + (s["objects"] + s["evictions"] if settled else 0)
            if s["disk_queued_bytes"] == 0 and placed >= blocks:
                return time.perf_counter() - t0
            time.sleep(0.01)
        raise RuntimeError(f"{blocks} blocks not on flash after {timeout} s: {self.stats()}")

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)


def client(node: Node, bytes_per_get: int = Limits.bytes_per_get) -> ContextStore:
    # Long timeouts: a slow call must show in the figures, not turn into a miss.
    return ContextStore(node.endpoint, access_key=ACCESS, secret_key=SECRET,
                        limits=Limits(bytes_per_call=8 * MiB, bytes_per_get=bytes_per_get),
                        timeouts=Timeouts(connect=5, read=60, total=120))


def blocks_of(size: int, n: int, seed: int) -> list[bytes]:
    base = os.urandom(size + n)
    return [base[i:i + size] for i in range(n)]  # distinct blocks without n × size of urandom


def restore_bench(base: Path, rounds: int, procs: Processes, out: dict[str, Any], bytes_per_get: int) -> None:
    ref = base / "ref-128MiB.bin"
    timed_dd("if=/dev/urandom", f"of={ref}", "bs=1M", "count=128", "oflag=direct")
    can_drop = drop_caches()
    if not can_drop:
        print("# not root: no cold reads (the page cache cannot be dropped)", file=sys.stderr)
    for size, label, dd_bs in SHAPES:
        n = RESTORE_BYTES // size
        tokens = list(range(BLOCK_TOKENS * n))
        blocks = blocks_of(size, n, size)
        flash = Node(procs, "512MiB", "--disk", str(base / f"restore-{size}"), "--disk-size", "1GiB",
                     "--disk-reset", "true", "--disk-direct-size", "1", "--disk-promote", "false")
        ram = Node(procs, "1GiB")
        stores = {"flash": client(flash, bytes_per_get), "ram": client(ram, bytes_per_get)}
        try:
            spaces = {name: s.namespace("bench", model="flash-bench", block_size=BLOCK_TOKENS)
                      for name, s in stores.items()}
            for name, ns in spaces.items():
                assert ns.save(tokens, blocks).stored == n, name
            flash.wait_on_flash(n)
            assert flash.stats()["objects"] == 0, "a block stayed in RAM"
            buffer = bytearray(RESTORE_BYTES)
            times: dict[str, list[float]] = {"cold": [], "page cache": [], "ram": [], "dd": []}

            def restore(ns: Any) -> float:
                t0 = time.perf_counter()
                got = ns.restore(tokens, out=buffer)
                elapsed = time.perf_counter() - t0
                if got.n_blocks != n:
                    raise RuntimeError(f"restored {got.n_blocks} of {n} blocks")
                return elapsed

            restore(spaces["flash"]), restore(spaces["ram"])  # warm-up (connections, code paths)
            for r in range(rounds):
                order = ["flash", "ram", "dd"] if r % 2 == 0 else ["dd", "ram", "flash"]
                for what in order:
                    if what == "flash":
                        if can_drop:
                            drop_caches()
                            times["cold"].append(restore(spaces["flash"]))
                        times["page cache"].append(restore(spaces["flash"]))
                    elif what == "ram":
                        times["ram"].append(restore(spaces["ram"]))
                    else:
                        drop_caches()
                        times["dd"].append(timed_dd(f"if={ref}", "of=/dev/null", f"bs={dd_bs}", "iflag=direct"))
            s = flash.stats()
            assert s["disk_corrupt"] == 0 and s["promotions"] == 0
            out["restore"][label] = {k: v for k, v in times.items() if v}
            out["restore_cpu"][label] = s
        finally:
            for st in stores.values():
                st.close()
            procs.stop()


def demote_bench(base: Path, mib: int, procs: Processes, out: dict[str, Any]) -> None:
    n = mib
    blocks = blocks_of(MiB, n, 7)
    tokens = list(range(BLOCK_TOKENS * n))
    results: dict[str, float] = {}
    # Exclusive tiers (no write-back copies): what is measured is demotion at eviction, then at shutdown.
    for name, memory, extra in (("demote", "64MiB", ("--disk", str(base / "demote"), "--disk-size",
                                                     f"{2 * mib + 256}MiB", "--disk-reset", "true",
                                                     "--disk-write-back", "false")),
                                ("ram", f"{mib + 256}MiB", ())):
        node = Node(procs, memory, *extra)
        store = client(node)
        try:
            ns = store.namespace("bench", model="flash-bench", block_size=BLOCK_TOKENS)
            t0 = time.perf_counter()
            saved = ns.save(tokens, blocks)
            if name == "demote":
                node.wait_on_flash(n, settled=True)  # what RAM keeps (64 MiB) need not be on flash
            results[name] = time.perf_counter() - t0
            assert saved.stored == n, saved
            if name == "demote":
                s = node.stats()
                results["demoted"] = s["demotions"]
                results["dropped"] = s["evictions"]
        finally:
            store.close()
            procs.stop()
    # Demotion alone: the blocks in RAM only, then a clean stop that writes them to flash before exiting.
    node = Node(procs, f"{mib + 256}MiB", "--disk", str(base / "spill"), "--disk-size", f"{2 * mib + 256}MiB",
                "--disk-reset", "true", "--disk-write-back", "false", "--log-level", "info")
    store = client(node)
    try:
        ns = store.namespace("bench", model="flash-bench", block_size=BLOCK_TOKENS)
        assert ns.save(tokens, blocks).stored == n
        assert node.stats()["disk_objects"] == 0, "a block went to flash before the stop"
    finally:
        store.close()
    t0 = time.perf_counter()
    node.proc.send_signal(signal.SIGTERM)
    node.proc.wait(600)
    results["spill_exit"] = time.perf_counter() - t0
    line = re.search(r"(\d+) blocks \(([\d.]+) MiB\) written from RAM at shutdown in ([\d.]+) s",
                     procs.log_tail(node.proc))
    assert line is not None and int(line.group(1)) == n, procs.log_tail(node.proc)
    results["spill"] = float(line.group(3))
    procs.stop()
    target = base / "dd-write.bin"
    results["dd"] = timed_dd("if=/dev/zero", f"of={target}", "bs=1M", f"count={mib}", "oflag=direct")
    target.unlink()
    out["demote"] = {"mib": mib, **results}


def rebuild_bench(base: Path, blocks: int, procs: Processes, out: dict[str, Any]) -> None:
    empty = Node(procs, "2GiB", "--disk", str(base / "empty"), "--disk-size", "1GiB", "--disk-reset", "true")
    time.sleep(1)
    empty_rss = rss(empty.proc.pid)
    procs.stop()
    node = Node(procs, "2GiB", "--disk", str(base / "rebuild"), "--disk-size", f"{blocks // 1_000_000 + 2}GiB",
                "--disk-reset", "true", "--disk-direct-size", "1")
    store = client(node)
    try:
        store.create_bucket("bench")
        payload = memoryview(os.urandom(256 + 8192))
        step = 8192
        for start in range(0, blocks, step):
            count = min(step, blocks - start)
            keys = [f"rebuild/{i:010d}" for i in range(start, start + count)]
            store.put_keys("bench", keys, [payload[i % 8192:i % 8192 + 256] for i in range(start, start + count)])
        node.wait_on_flash(blocks)
    finally:
        store.close()
    node.kill()
    drop_caches()
    node.argv = [a for a in node.argv if a not in ("--disk-reset", "true")]
    node.start()
    node_rss = settled_rss(node.proc.pid)  # once the recovered blocks' events are out
    s = node.stats()
    out["rebuild"] = {"blocks": blocks, "ready_after": node.ready_after, "recovery": s["disk_recovery"],
                      "rss_per_block": (node_rss - empty_rss) / blocks,
                      "index_per_block": s["disk_index_bytes"] / blocks, "recovered": s["disk_objects"]}
    # The same restart without the event ring (a fixed cost: the last --events-buffer events, 100,000 by
    # default, whatever the number of blocks), to tell the per-block cost from it.
    node.kill()
    node.argv = [*node.argv, "--events-buffer", "1"]
    node.start()
    out["rebuild"]["rss_per_block_no_ring"] = (settled_rss(node.proc.pid) - empty_rss) / blocks
    procs.stop()


def settled_rss(pid: int, timeout: float = 60) -> int:
    """The process's RSS once it has not moved by more than 1 % for a second."""
    deadline = time.monotonic() + timeout
    last = rss(pid)
    while time.monotonic() < deadline:
        time.sleep(1)
        now = rss(pid)
        if abs(now - last) <= last // 100:
            return now
        last = now
    return last


def report(out: dict[str, Any]) -> None:
    print(f"# {today()} · {source_state()} · busy before the run: {out['busy']}")
    if out["restore"]:
        print(f"\n## Restore of 128 MiB (one Namespace.restore in calls of at most {out['bytes_per_get']}; node on "
              "core 0, client on core 1)\n")
        print("| shape | from | median | p99 | GB/s | ÷ device ceiling (dd O_DIRECT) |")
        print("|---|---|---:|---:|---:|---:|")
    for label, times in out["restore"].items():
        dd = times["dd"]
        dd_med = stats(dd)[0]
        for what in ("cold", "page cache", "ram", "dd"):
            if what not in times:
                continue
            med, p99 = stats(times[what])
            ratio = "" if what == "dd" else f"{dd_med / med:.2f} ({paired_ratio(times[what], dd):.2f})"
            name = {"cold": "flash, page cache dropped", "page cache": "flash, again (no drop)", "ram": "RAM",
                    "dd": f"dd bs={'64K' if '64' in label else '1M'} iflag=direct"}[what]
            print(f"| {label} | {name} | {med * 1e3:.1f} ms | {p99 * 1e3:.1f} ms | "
                  f"{RESTORE_BYTES / med / GB:.2f} | {ratio} |")
    d = out.get("demote")
    if d:
        nbytes = d["mib"] * MiB
        print(f"\n## Demotion: {d['mib']} × 1 MiB saved into 64 MiB of RAM\n")
        print("| what | seconds | GB/s | ÷ dd write ceiling |")
        print("|---|---:|---:|---:|")
        for key, name in (("demote", "save until all but RAM's share are on flash (or dropped)"),
                          ("ram", "the same save into RAM only"),
                          ("spill", "demotion alone: a clean stop writes them from RAM (node's own time)"),
                          ("spill_exit", "the same, SIGTERM to exit (sealing, manifest, shutdown)"),
                          ("dd", "dd bs=1M oflag=direct")):
            print(f"| {name} | {d[key]:.2f} | {nbytes / d[key] / GB:.2f} | {d['dd'] / d[key]:.2f} |")
        print(f"\n{d['demoted']} blocks demoted, {d['dropped']} dropped (queue full).")
    r = out.get("rebuild")
    if r:
        rec = r["recovery"]
        print(f"\n## Restart with {r['blocks']:,} blocks on flash (SIGKILL, page cache dropped)\n")
        print(f"- ready after {r['ready_after']:.2f} s (process start to readiness); index rebuild "
              f"{rec['seconds']:.2f} s; {r['recovered']:,} blocks recovered")
        print(f"- RAM per flash-resident block: {r['rss_per_block']:.0f} B of RSS over an empty node with the "
              f"event ring full (100,000 events), {r['rss_per_block_no_ring']:.0f} B without the ring; "
              f"index arrays {r['index_per_block']:.0f} B")


def plot(out: dict[str, Any]) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6.4, 2.8))
    labels = list(out["restore"])
    kinds = [k for k in ("cold", "page cache", "ram", "dd") if any(k in out["restore"][lb] for lb in labels)]
    width = 0.8 / len(kinds)
    for j, kind in enumerate(kinds):
        values = [RESTORE_BYTES / stats(out["restore"][lb][kind])[0] / GB if kind in out["restore"][lb] else 0
                  for lb in labels]
        ax.bar([i + j * width for i in range(len(labels))], values, width,
               label={"cold": "flash (cold)", "page cache": "flash (again)", "ram": "RAM",
                      "dd": "device ceiling (dd)"}[kind])
    ax.set_xticks([i + width * (len(kinds) - 1) / 2 for i in range(len(labels))], labels)
    ax.set_ylabel("GB/s")
    ax.set_title("Restore of 128 MiB through a node, by tier")
    ax.legend(loc="upper left")
    save_figure(plt, fig, DOCS / "flash_restore.png", f"{today()} · {source_state()}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", required=True, type=Path, help="a directory on the device under test")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--demote-mib", type=int, default=512)
    parser.add_argument("--rebuild", type=int, default=1_000_000, help="blocks for the restart part (0: skip)")
    parser.add_argument("--bytes-per-get", default=f"{Limits.bytes_per_get // MiB}MiB",
                        help="the client's Limits.bytes_per_get for the restores (256MiB: one call per restore)")
    parser.add_argument("--json", type=Path, default=Path(__file__).with_name("flash_restore.json"))
    args = parser.parse_args()
    exit_on_sigterm()
    pin_client()
    base = args.dir
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    out: dict[str, Any] = {"busy": busy_cores(), "restore": {}, "restore_cpu": {}, "bytes_per_get": args.bytes_per_get}
    procs = Processes()
    try:
        if args.rounds:
            restore_bench(base, args.rounds, procs, out, parse_size(args.bytes_per_get))
        if args.demote_mib:
            demote_bench(base, args.demote_mib, procs, out)
        if args.rebuild:
            rebuild_bench(base, args.rebuild, procs, out)
    finally:
        procs.stop()
        shutil.rmtree(base, ignore_errors=True)
    out.pop("restore_cpu")
    args.json.write_text(json.dumps(out, indent=1))
    report(out)
    if out["restore"]:
        plot(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
