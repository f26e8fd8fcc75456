"""The restore hot path inside a RAM-only node's engine, without sockets: ``Engine.locate`` (a bulk lookup) and
``Engine.fetch_many`` (a bulk get) of 8192 keys, for this checkout's server and (``--before REV``) an earlier
commit's, side by side in one run.

Command (from the repository root; the plot goes to docs/benchmarks-engine-reads.png):

    .venv/bin/python benchmarks/engine_reads.py --before f7137b6 [--keys 8192] [--rounds 15] [--repeat 40]

Method: each side is a process of its own (``--before``: a ``git worktree`` of REV whose ``server/`` is imported as
``ctxstore_server``) holding one engine with ``--keys`` 16 KiB blocks in one bucket. Each round asks every side in
turn for ``--repeat`` calls of each case and takes the median call; the report gives, per case, the median and p99
over rounds of those per-round medians (µs per call) and the median of same-round ratios (after ÷ before: above 1
means slower). Cases: all keys present; the second half absent (a lookup that stops the prefix halfway); all
absent. The engine runs on one asyncio loop as the node's does; nothing is sent, so what is measured is the
engine's own work per call (the part the tier seam could change).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import DOCS, baseline_env, git_worktree, paired_ratio, pyplot, save_figure, source_state, stats, today

CASES = ("locate, all present", "locate, half absent", "locate, all absent",
         "fetch_many, all present", "fetch_many, half absent", "fetch_many, all absent")
BLOCK = 16 << 10


def child(keys: int, repeat: int) -> None:
    """One side: an engine with ``keys`` blocks; per line read on stdin, one round of every case on stdout."""
    import xxhash

    from ctxstore_server.engine import BlockWrite, Engine, EngineConfig

    engine = Engine(EngineConfig(budget=max(1 << 30, 2 * keys * BLOCK), default_ttl=3600.0, max_ttl=7200.0))
    engine.create_bucket("default", "bench")
    data = os.urandom(BLOCK)
    names = [f"k{i:08d}" for i in range(keys)]
    blocks = [BlockWrite(k, data, "etag", xxhash.xxh3_64_intdigest(data), None) for k in names]
    engine.put_blocks("default", "bench", blocks, ttl=None, if_absent=False)
    half = names[: keys // 2] + [f"x{i:08d}" for i in range(keys - keys // 2)]
    absent = [f"x{i:08d}" for i in range(keys)]
    loop = asyncio.new_event_loop()

    def median_of(call) -> float:
        times = []
        for _ in range(repeat):
            t = time.perf_counter()
            call()
            times.append(time.perf_counter() - t)
        return statistics.median(times) * 1e6

    def fetch(keys_: list[str]) -> None:
        loop.run_until_complete(engine.fetch_many("default", "bench", keys_))

    for _line in sys.stdin:
        out = {}
        for case, ks in zip(("all present", "half absent", "all absent"), (names, half, absent), strict=True):
            out[f"locate, {case}"] = median_of(lambda ks=ks: engine.locate("default", "bench", ks))
            out[f"fetch_many, {case}"] = median_of(lambda ks=ks: fetch(ks))
        print(json.dumps(out), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", help="an earlier commit to measure in the same rounds")
    parser.add_argument("--keys", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--repeat", type=int, default=40)
    parser.add_argument("--plot", type=Path, default=DOCS / "benchmarks-engine-reads.png",
                        help="where to write the PNG")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.keys, args.repeat)
        return
    with tempfile.TemporaryDirectory(prefix="engine-reads-") as tmp:
        if args.before:
            with git_worktree(args.before, Path(tmp)) as source:
                run(args, source)
        else:
            run(args, None)


def run(args: argparse.Namespace, source: Path | None) -> None:
    argv = [sys.executable, os.path.abspath(__file__), "--child", "--keys", str(args.keys),
            "--repeat", str(args.repeat)]
    sides: dict[str, subprocess.Popen[str]] = {}
    sides["after"] = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    if source is not None:
        sides["before"] = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                           env={**os.environ, **baseline_env(source)})
    results: dict[str, list[dict[str, float]]] = {name: [] for name in sides}
    deadline = time.monotonic() + 1800
    try:
        for r in range(args.rounds):
            for name in (list(sides) if r % 2 == 0 else list(reversed(sides))):  # alternate who goes first
                proc = sides[name]
                assert proc.stdin is not None and proc.stdout is not None
                proc.stdin.write("round\n")
                proc.stdin.flush()
                line = proc.stdout.readline()
                if not line:
                    raise SystemExit(f"the {name} side stopped (exit {proc.wait()})")
                results[name].append(json.loads(line))
            if time.monotonic() > deadline:
                print(f"stopped after {r + 1} rounds (time)", file=sys.stderr)
                break
    finally:
        for proc in sides.values():
            if proc.stdin is not None:
                proc.stdin.close()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    report(args, results)


def report(args: argparse.Namespace, results: dict[str, list[dict[str, float]]]) -> None:
    print(f"# {today()} {source_state()} — {args.keys} keys of {BLOCK >> 10} KiB, {len(results['after'])} rounds "
          f"of {args.repeat} calls (µs per call: median / p99 over rounds)")
    both = "before" in results
    print("| case | after median | after p99 |" + (" before median | before p99 | after ÷ before |" if both else ""))
    print("|---|---:|---:|" + ("---:|---:|---:|" if both else ""))
    for case in CASES:
        median, p99 = stats([r[case] for r in results["after"]])
        row = f"| {case} | {median:.0f} | {p99:.0f} |"
        if both:
            after, before = ([r[case] for r in results[side]] for side in ("after", "before"))
            b_median, b_p99 = stats(before)
            row += f" {b_median:.0f} | {b_p99:.0f} | {paired_ratio(before, after):.2f} |"
        print(row)
    plot(results, args.plot, f"{today()} {source_state()}")


def plot(results: dict[str, list[dict[str, float]]], path: Path, note: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(results)
    for n, (name, rounds) in enumerate(results.items()):
        ax.bar([i + n * width for i in range(len(CASES))], [statistics.median(r[c] for r in rounds) for c in CASES],
               width, label=name)
    ax.set_xticks([i + width * (len(results) - 1) / 2 for i in range(len(CASES))], CASES, rotation=20, ha="right",
                  fontsize=8)
    ax.set_ylabel("µs per call (median of rounds)")
    ax.set_title("Engine reads on a RAM-only node (no sockets)")
    ax.legend()
    save_figure(plt, fig, path, note)


if __name__ == "__main__":
    main()
