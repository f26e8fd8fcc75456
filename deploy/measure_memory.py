#!/usr/bin/env python3
"""Measure how far a node's resident memory goes above its budget, for your block size (Linux only).

    python3 deploy/measure_memory.py --budget 2GiB --block-bytes 64KiB --overfill 3

Starts ``ctxstore serve`` on a free loopback port with that budget, writes ``overfill`` times the budget in
blocks of that size through the client (so eviction runs), restores each batch, samples the process's
resident size (VmRSS) throughout, and prints the peak next to the budget. docs/deployment.md ("Sizing a
node") lists results and the memory-limit rule they support. Needs the ``server`` extra installed.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from ctxstore import ContextStore
from ctxstore_server.settings import parse_size

MiB = 1 << 20


def resident(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", type=parse_size, default=512 * MiB, help="node budget (default 512MiB)")
    parser.add_argument("--block-bytes", type=parse_size, default=64 << 10, help="block size (default 64KiB)")
    parser.add_argument("--overfill", type=float, default=1.5, help="bytes written / budget (default 1.5)")
    args = parser.parse_args(argv)
    ctxstore = shutil.which("ctxstore", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    if ctxstore is None:
        parser.error("the ctxstore command is not installed")
    port = free_port()
    access, secret = "CTXMEASURE" + secrets.token_hex(5).upper(), secrets.token_urlsafe(30)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CTXSTORE_")}
    env.update(CTXSTORE_ACCESS_KEY=access, CTXSTORE_SECRET_KEY=secret, CTXSTORE_MEMORY=str(args.budget))
    proc = subprocess.Popen([ctxstore, "serve", "--port", str(port)], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/_ctx/health/ready", timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise SystemExit("the node did not start") from None
                time.sleep(0.05)
        baseline = resident(proc.pid)
        peak = baseline
        done = threading.Event()

        def sample() -> None:
            nonlocal peak
            while not done.is_set():
                peak = max(peak, resident(proc.pid))
                time.sleep(0.01)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        payload = os.urandom(args.block_bytes)
        n_blocks = int(args.budget * args.overfill // args.block_bytes)
        # Batches well under the budget: a bulk put bigger than the node's room is refused before its body.
        per_call = max(1, min(64 * MiB, args.budget // 8) // args.block_bytes)
        with ContextStore(f"127.0.0.1:{port}", access_key=access, secret_key=secret) as store:
            ns = store.namespace("measure-memory", model="measure", block_size=16)
            token = 0
            for start in range(0, n_blocks, per_call):
                count = min(per_call, n_blocks - start)
                tokens = list(range(token, token + 16 * count))
                token += 16 * count
                ns.save(tokens, [payload] * count)
                ns.restore(tokens)
        done.set()
        sampler.join()
        peak = max(peak, resident(proc.pid))
    finally:
        proc.terminate()
        proc.wait()
    print(f"budget {args.budget / MiB:,.0f} MiB, blocks of {args.block_bytes:,} B, wrote {args.overfill:g}x: "
          f"resident at start {baseline / MiB:,.0f} MiB, peak {peak / MiB:,.0f} MiB, "
          f"{(peak - args.budget) / MiB:,.0f} MiB above the budget")
    print(f"limit by the rule budget x 1.1 + 256 MiB: {(args.budget * 1.1 + 256 * MiB) / MiB:,.0f} MiB "
          f"({'covers' if args.budget * 1.1 + 256 * MiB >= peak else 'does NOT cover'} this peak)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
