"""What each digest a PUT computes costs per MiB: MD5 (the S3 ETag), SHA-256 (x-amz-content-sha256 when the
client signs the payload), CRC32/CRC32C/CRC64NVME (x-amz-checksum-*), XXH3-64 (ctxstore's own checksum).

Command (from the repository root; the plot goes to docs/benchmarks-digests.png):

    .venv/bin/python benchmarks/digest_cost.py [--size 1048576] [--repeat 200]

Method: each digest over the same warm buffer, `repeat` times; median and p99 per call, and the implied GB/s.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import time
from pathlib import Path

import xxhash
from awscrt import checksums

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import DOCS, pyplot, save_figure, source_state, today


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=1 << 20)
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--plot", type=Path, default=DOCS / "benchmarks-digests.png", help="where to write the PNG")
    args = parser.parse_args()
    data = os.urandom(args.size)
    digests = {
        "md5 (ETag)": lambda b: hashlib.md5(b).digest(),
        "sha256 (signed payload)": lambda b: hashlib.sha256(b).digest(),
        "crc32": lambda b: checksums.crc32(b),
        "crc32c": lambda b: checksums.crc32c(b),
        "crc64nvme": lambda b: checksums.crc64nvme(b),
        "xxh3-64 (ctxstore)": lambda b: xxhash.xxh3_64_intdigest(b),
    }
    rates: list[tuple[str, float]] = []
    print(f"| digest | median µs per {args.size} B | p99 µs | GB/s |")
    print("|---|---:|---:|---:|")
    for name, fn in digests.items():
        times = []
        for _ in range(args.repeat):
            t = time.perf_counter()
            fn(data)
            times.append(time.perf_counter() - t)
        times.sort()
        med = statistics.median(times)
        p99 = times[int(len(times) * 0.99) - 1]
        print(f"| {name} | {med * 1e6:.0f} | {p99 * 1e6:.0f} | {args.size / med / 1e9:.2f} |")
        rates.append((name, args.size / med / 1e9))
    plot(rates, args.size, args.plot)


def plot(rates: list[tuple[str, float]], size: int, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 2.4))
    ax.barh(range(len(rates)), [r for _, r in rates], color="#1f77b4")
    for i, (_, r) in enumerate(rates):
        ax.text(r, i, f" {r:.2f}", va="center", fontsize=6)
    ax.set_yticks(range(len(rates)), [n for n, _ in rates], fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel(f"GB/s over a warm {size}-byte buffer (median, log scale)")
    ax.margins(x=0.25)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    save_figure(plt, fig, path, f"benchmarks/digest_cost.py, {today()}, {source_state()}")


if __name__ == "__main__":
    main()
