"""What each digest a PUT computes costs per MiB: MD5 (the S3 ETag), SHA-256 (x-amz-content-sha256 when the
client signs the payload), CRC32/CRC32C/CRC64NVME (x-amz-checksum-*), XXH3-64 (ctxstore's own checksum).

Command:  .venv/bin/python benchmarks/digest_cost.py [--size 1048576] [--repeat 200]

Method: each digest over the same warm buffer, `repeat` times; median and p99 per call, and the implied GB/s.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import time

import xxhash
from awscrt import checksums


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=1 << 20)
    parser.add_argument("--repeat", type=int, default=200)
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


if __name__ == "__main__":
    main()
