"""The flash tier's storage core (ctxstore_server.flash) against the device it runs on, measured in one run.

Command (as root: it drops the page cache; results go in docs/benchmarks.md, the plot in docs/flash_store.png):

    .venv/bin/pip install matplotlib                      # for the plot (the `bench` extra has it)
    .venv/bin/python benchmarks/flash_store.py --dir /var/tmp/ctxstore-flash-bench
        # --rounds 5 --write-mib 512 --rebuild 1,4 (defaults; --rebuild "" skips the index rebuild part)

What it measures (the store's directory and the reference files live in --dir, on the device under test):

- **Read**: 128 MiB stored as 2048 × 64 KiB and as 128 × 1 MiB blocks, read back with one ``read_many`` of all
  keys (every payload verified: header checksum, key, XXH3-64), (a) after ``sync; echo 3 >
  /proc/sys/vm/drop_caches`` ("cold") and (b) again straight after ("page cache"). The device's ceiling for
  the same bytes and block size: ``dd if=<128 MiB file> of=/dev/null bs=64K|1M iflag=direct``, in the same
  rounds, interleaved.
- **Write**: ``--write-mib`` of 64 KiB and of 1 MiB blocks appended as fast as the write queue takes them;
  time from the first append until the last completion callback (every record written and readable), and
  until ``close()`` returned (open segments sealed and fsynced). The records carry their payload's XXH3-64,
  as the engine's do (it computes it on PUT), so the writer does not hash them again; the reads verify
  every payload. Ceiling: ``dd if=/dev/zero of=<file> bs=1M
  count=<same MiB> oflag=direct`` (and bs=8M, the store's batch size), same rounds.
- **Lookup**: ``lookup_many`` and ``present_many`` of 2048 keys on the 2048-block store (median of 200 calls).
- **Rebuild**: a store of 1M (then 4M) small blocks (32-byte payloads, 32-character keys) is closed and
  reopened in a fresh process each time (3 cold with the page cache dropped, 3 warm): the time of ``open()``
  until the store serves (recovery thread + installing the index), and of the recovery thread alone. In
  those processes: RAM per block = tracemalloc's traced bytes held after open ÷ blocks, and the RSS growth
  across open() ÷ blocks (after, and at the peak during recovery).

Reported: median and p99 (nearest rank; with 5 rounds the slowest) of each, GB/s = bytes / median time
(10^9 bytes per GB), and the store's throughput as a fraction of the ceiling in the same run (ratio of the
medians, and in parentheses the median of the per-round ratios).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import xxhash

from ctxstore_server.flash import QUEUE_FULL, FlashRecord, FlashStore

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20
GB = 1e9
READ_BYTES = 128 * MiB


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def timed_dd(*args: str) -> float:
    t0 = time.perf_counter()
    subprocess.run(["dd", *args, "status=none"], check=True)
    return time.perf_counter() - t0


def pct(values: Sequence[float], q: float) -> float:
    s = sorted(values)
    return s[max(0, math.ceil(q * len(s)) - 1)]


def payload_pool(nbytes: int) -> memoryview:
    return memoryview(os.urandom(nbytes))


# ------------------------------------------------------------------------------------------------- reads


async def fill(store: FlashStore, bucket: str, keys: list[str], size: int, pool: memoryview) -> float:
    """Append blocks as fast as the queue takes them; seconds until every completion callback ran."""
    now = time.time()
    remaining = len(keys)
    done = asyncio.Event()

    def cb(results: list[Any]) -> None:
        nonlocal remaining
        remaining -= len(results)
        failed = [r for r in results if not r.stored]
        if failed:
            raise RuntimeError(f"write failed: {failed[0].reason}")
        if remaining == 0:
            done.set()

    span = len(pool) - size
    # the engine has every block's XXH3-64 from the PUT and hands it over; it is computed here, untimed
    backlog = []
    for j, k in enumerate(keys):
        off = (j * 4099 * 16) % span
        view = pool[off:off + size]
        backlog.append(FlashRecord(bucket, k, view, now + 86400, now, b"m" * 40, xxhash.xxh3_64_intdigest(view)))
    t0 = time.perf_counter()
    while backlog:
        chunk, backlog = backlog[:64], backlog[64:]
        refused = store.append(chunk, cb)
        if any(refused):
            if any(why not in (None, QUEUE_FULL) for why in refused):
                raise RuntimeError(f"append refused: {refused}")
            remaining -= sum(why is not None for why in refused)
            retry = [r for r, why in zip(chunk, refused) if why is not None]
            remaining += len(retry)
            backlog = retry + backlog
            await asyncio.sleep(0.001)
        else:
            await asyncio.sleep(0)
    await done.wait()
    return time.perf_counter() - t0


async def read_bench(base: Path, rounds: int, results: dict[str, Any]) -> None:
    pool = payload_pool(64 * MiB)
    ref = base / "ref-128MiB.bin"
    timed_dd("if=/dev/urandom", f"of={ref}", "bs=1M", "count=128", "oflag=direct")
    for size, label, dd_bs in ((64 * 1024, "2048 × 64 KiB", "64K"), (MiB, "128 × 1 MiB", "1M")):
        path = base / f"read-{size}"
        shutil.rmtree(path, ignore_errors=True)
        store = FlashStore(path, 1 << 30, segment_bytes=64 * MiB)
        await store.open(reset=True)
        n = READ_BYTES // size
        keys = [f"{i:032x}" for i in range(n)]
        await fill(store, "bench", keys, size, pool)
        await store.flush()
        await store.close()  # sealed: what a restarted node reads
        store = FlashStore(path, 1 << 30, segment_bytes=64 * MiB)
        await store.open()
        cold, warm, ceil = [], [], []
        for r in range(rounds):
            order = ("store", "dd") if r % 2 == 0 else ("dd", "store")
            for what in order:
                if what == "dd":
                    drop_caches()
                    ceil.append(timed_dd(f"if={ref}", "of=/dev/null", f"bs={dd_bs}", "iflag=direct"))
                else:
                    drop_caches()
                    t0 = time.perf_counter()
                    blocks = await store.read_many("bench", keys)
                    cold.append(time.perf_counter() - t0)
                    assert all(b is not None for b in blocks)
                    del blocks
                    t0 = time.perf_counter()
                    blocks = await store.read_many("bench", keys)
                    warm.append(time.perf_counter() - t0)
                    assert all(b is not None for b in blocks)
                    del blocks
        # lookups on this store
        lk, pm = [], []
        for _ in range(200):
            t0 = time.perf_counter()
            store.lookup_many("bench", keys[:2048])
            lk.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            store.present_many("bench", keys[:2048])
            pm.append(time.perf_counter() - t0)
        st = store.stats()
        await store.close()
        results["read"][label] = {"cold": cold, "page_cache": warm, "ceiling": ceil,
                                  "device_bytes_read": st.device_bytes_read}
        if size == 64 * 1024:
            results["lookup"] = {"lookup_many_2048": lk, "present_many_2048": pm}
        shutil.rmtree(path)
    ref.unlink()


# ------------------------------------------------------------------------------------------------ writes


async def write_bench(base: Path, rounds: int, write_mib: int, results: dict[str, Any]) -> None:
    pool = payload_pool(64 * MiB)
    for size, label in ((64 * 1024, "64 KiB blocks"), (MiB, "1 MiB blocks")):
        acked, durable, ceil1, ceil8 = [], [], [], []
        for r in range(rounds):
            for what in (("store", "dd") if r % 2 == 0 else ("dd", "store")):
                if what == "dd":
                    out = base / "ref-write.bin"
                    ceil1.append(timed_dd("if=/dev/zero", f"of={out}", "bs=1M", f"count={write_mib}", "oflag=direct"))
                    out.unlink()
                    ceil8.append(timed_dd("if=/dev/zero", f"of={out}", "bs=8M", f"count={write_mib // 8}",
                                          "oflag=direct"))
                    out.unlink()
                    continue
                path = base / "write"
                shutil.rmtree(path, ignore_errors=True)
                store = FlashStore(path, (write_mib + 1024) * MiB, segment_bytes=64 * MiB)
                await store.open(reset=True)
                keys = [f"{r}-{i:030x}" for i in range(write_mib * MiB // size)]
                t0 = time.perf_counter()
                acked.append(await fill(store, "bench", keys, size, pool))
                await store.close()
                durable.append(time.perf_counter() - t0)
                shutil.rmtree(path)
                os.sync()
        results["write"][label] = {"acked": acked, "durable": durable, "ceiling_1M": ceil1, "ceiling_8M": ceil8,
                                   "bytes": write_mib * MiB}


# ----------------------------------------------------------------------------------------------- rebuild


async def build_small(path: Path, n_total: int, start: int) -> None:
    store = FlashStore(path, 64 << 30, segment_bytes=64 * MiB)
    await store.open(reset=start == 0)
    pool = payload_pool(1 * MiB)
    keys = [f"{i:032x}" for i in range(start, n_total)]
    now = time.time()
    remaining = len(keys)
    done = asyncio.Event()

    def cb(results: list[Any]) -> None:
        nonlocal remaining
        remaining -= len(results)
        if remaining == 0:
            done.set()

    i = 0
    while i < len(keys):
        chunk = [FlashRecord("bench-bucket", keys[j], pool[(j * 37) % 100_000:(j * 37) % 100_000 + 32],
                             now + 30 * 86400, now) for j in range(i, min(len(keys), i + 1024))]
        refused = store.append(chunk, cb)
        if any(refused):
            remaining -= sum(1 for x in refused if x is not None)
            i += next(k for k, x in enumerate(refused) if x is not None)
            await asyncio.sleep(0.005)
            continue
        i += len(chunk)
        await asyncio.sleep(0)
    if remaining:
        await done.wait()
    await store.close()


def probe(path: Path, cold: bool) -> dict[str, Any]:
    """Run in a fresh process: open the store, report recovery time and RAM per block."""
    cmd = [sys.executable, __file__, "--probe", str(path)] + (["--cold"] if cold else [])
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def peak_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


async def _probe(path: Path, cold: bool) -> dict[str, Any]:
    if cold:
        drop_caches()
    gc.collect()
    rss0 = rss()
    Path("/proc/self/clear_refs").write_text("5\n")  # reset the peak RSS (VmHWM) to now
    tracemalloc.start()
    store = FlashStore(path, 64 << 30, segment_bytes=64 * MiB)
    t0 = time.perf_counter()
    report = await store.open()
    wall = time.perf_counter() - t0
    gc.collect()
    traced, traced_peak = tracemalloc.get_traced_memory()
    rss1, hwm = rss(), peak_rss()
    index_bytes = store.index.nbytes()
    await store.close()
    return {"blocks": report.blocks, "recovery_s": report.seconds, "open_s": wall, "traced": traced,
            "traced_peak": traced_peak, "rss_growth": rss1 - rss0, "rss_peak_growth": hwm - rss0,
            "index_bytes": index_bytes, "segments": report.segments}


async def rebuild_bench(base: Path, millions: list[int], results: dict[str, Any]) -> None:
    path = base / "rebuild"
    built = 0
    for m in millions:
        n = m * 1_000_000
        t0 = time.perf_counter()
        await build_small(path, n, built)
        build_s = time.perf_counter() - t0
        built = n
        cold = [probe(path, True) for _ in range(3)]
        warm = [probe(path, False) for _ in range(3)]
        results["rebuild"][f"{m}M"] = {"cold": cold, "warm": warm, "build_s": build_s,
                                       "disk_bytes": sum(p.stat().st_size for p in path.glob("seg-*"))}
    shutil.rmtree(path)


# ------------------------------------------------------------------------------------------------ report


def summarize(results: dict[str, Any]) -> str:
    lines = []
    lines.append("| what | shape | runs | median ms | p99 ms | GB/s | ÷ ceiling (paired) |")
    lines.append("|---|---|---:|---:|---:|---:|---:|")
    for label, r in results["read"].items():
        ceil = statistics.median(r["ceiling"])
        for name, key in (("flash read, cold", "cold"), ("flash read, page cache", "page_cache"),
                          ("device O_DIRECT read (dd)", "ceiling")):
            v = r[key]
            med = statistics.median(v)
            ratio = "–" if key == "ceiling" else (
                f"{ceil / med:.2f} ({statistics.median(c / s for c, s in zip(r['ceiling'], v)):.2f})")
            lines.append(f"| {name} | {label} | {len(v)} | {med * 1e3:.1f} | {pct(v, .99) * 1e3:.1f} | "
                         f"{READ_BYTES / med / GB:.2f} | {ratio} |")
    for label, r in results["write"].items():
        nbytes = r["bytes"]
        ceil = statistics.median(r["ceiling_1M"])
        for name, key in (("append, all acknowledged", "acked"), ("append + close (sealed, fsynced)", "durable"),
                          ("device O_DIRECT write bs=1M (dd)", "ceiling_1M"),
                          ("device O_DIRECT write bs=8M (dd)", "ceiling_8M")):
            v = r[key]
            med = statistics.median(v)
            ratio = "–" if key.startswith("ceiling") else (
                f"{ceil / med:.2f} ({statistics.median(c / s for c, s in zip(r['ceiling_1M'], v)):.2f})")
            lines.append(f"| {name} | {nbytes // MiB} MiB of {label} | {len(v)} | {med * 1e3:.0f} | "
                         f"{pct(v, .99) * 1e3:.0f} | {nbytes / med / GB:.2f} | {ratio} |")
    out = "\n".join(lines)
    if "lookup" in results:
        lk = results["lookup"]
        out += "\n\n| index call | runs | median µs | p99 µs |\n|---|---:|---:|---:|\n"
        for name, v in lk.items():
            out += f"| {name} | {len(v)} | {statistics.median(v) * 1e6:.0f} | {pct(v, .99) * 1e6:.0f} |\n"
    if results["rebuild"]:
        out += ("\n| blocks | segments on disk | open() cold s (of which recovery thread) | open() warm s | "
                "cold s per million | index B/block | tracemalloc B/block | RSS growth B/block (peak) |\n"
                "|---:|---:|---:|---:|---:|---:|---:|---:|\n")
        for r in results["rebuild"].values():
            c = statistics.median(p["open_s"] for p in r["cold"])
            cr = statistics.median(p["recovery_s"] for p in r["cold"])
            w = statistics.median(p["open_s"] for p in r["warm"])
            p0 = sorted(r["cold"], key=lambda p: p["open_s"])[len(r["cold"]) // 2]
            n = p0["blocks"]
            out += (f"| {n:,} | {r['disk_bytes'] / MiB:.0f} MiB | {c:.2f} ({cr:.2f}) | {w:.2f} | {c / (n / 1e6):.2f} | "
                    f"{p0['index_bytes'] / n:.0f} | {p0['traced'] / n:.0f} | {p0['rss_growth'] / n:.0f} "
                    f"({p0['rss_peak_growth'] / n:.0f}) |\n")
    return out


def plot(results: dict[str, Any], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    ax = axes[0]
    labels = list(results["read"])
    series = [("flash, cold", "cold"), ("flash, page cache", "page_cache"), ("device O_DIRECT (dd)", "ceiling")]
    width = 0.26
    for k, (name, key) in enumerate(series):
        vals = [READ_BYTES / statistics.median(results["read"][lb][key]) / GB for lb in labels]
        ax.bar([i + (k - 1) * width for i in range(len(labels))], vals, width, label=name)
    ax.set_xticks(range(len(labels)), [f"read 128 MiB\n{lb}" for lb in labels])
    ax.set_ylabel("GB/s (median)")
    ax.legend(fontsize=8)
    ax.set_title("Reads (verified)")
    ax = axes[1]
    labels = list(results["write"])
    series = [("append, acknowledged", "acked"), ("append + seal/fsync", "durable"),
              ("device O_DIRECT bs=1M", "ceiling_1M"), ("device O_DIRECT bs=8M", "ceiling_8M")]
    width = 0.2
    for k, (name, key) in enumerate(series):
        vals = [results["write"][lb]["bytes"] / statistics.median(results["write"][lb][key]) / GB for lb in labels]
        ax.bar([i + (k - 1.5) * width for i in range(len(labels))], vals, width, label=name)
    ax.set_xticks(range(len(labels)), [f"write {lb}" for lb in labels])
    ax.set_ylabel("GB/s (median)")
    ax.legend(fontsize=8, loc="lower right", framealpha=0.9)
    ax.set_title("Writes")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


async def main_async(args: argparse.Namespace) -> None:
    base = Path(args.dir)
    base.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"read": {}, "write": {}, "rebuild": {}}
    load0 = os.getloadavg()
    t0 = time.time()
    await read_bench(base, args.rounds, results)
    await write_bench(base, args.rounds, args.write_mib, results)
    if args.rebuild:
        await rebuild_bench(base, [int(x) for x in args.rebuild.split(",")], results)
    load1 = os.getloadavg()
    head = (f"flash_store: {os.cpu_count()} CPUs, Python {sys.version.split()[0]}, took {time.time() - t0:.0f} s, "
            f"load average {load0[0]:.1f} → {load1[0]:.1f}, directory {base} "
            f"({_fs_of(base)}), {args.rounds} rounds")
    text = head + "\n\n" + summarize(results)
    print(text)
    Path(args.json).write_text(json.dumps(results, indent=1))
    if args.png:
        plot(results, Path(args.png))


def _fs_of(path: Path) -> str:
    out = subprocess.run(["df", "-T", str(path)], capture_output=True, text=True, check=False).stdout.splitlines()
    return " ".join(out[-1].split()[:2]) if out else "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/var/tmp/ctxstore-flash-bench")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--write-mib", type=int, default=512)
    ap.add_argument("--rebuild", default="1,4", help="millions of blocks, comma-separated ('' to skip)")
    ap.add_argument("--json", default=str(ROOT / "benchmarks" / "flash_store.json"))
    ap.add_argument("--png", default=str(ROOT / "docs" / "flash_store.png"))
    ap.add_argument("--replot", action="store_true", help="redraw --png from --json without measuring")
    ap.add_argument("--probe", help=argparse.SUPPRESS)
    ap.add_argument("--cold", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.probe:
        print(json.dumps(asyncio.run(_probe(Path(args.probe), args.cold))))
        return
    if args.replot:
        results = json.loads(Path(args.json).read_text())
        print(summarize(results))
        plot(results, Path(args.png))
        return
    if os.geteuid() != 0:
        raise SystemExit("run as root: the cold-read rounds drop the page cache")
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()

