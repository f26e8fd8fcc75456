"""SGLang HiCache L3 on one ctxstore node: the native backend (``ctxstore.integrations.sglang``) against SGLang's
own ``seaweedfs`` backend (boto3, one S3 request per page) on the same node's S3 endpoint.

Command (results go in docs/benchmarks.md; SGLang comes from scripts/test's install, matplotlib from the
``bench`` extra):

    .venv/bin/python benchmarks/sglang_hicache.py          # --pages 128 --rounds 30 (defaults)

Writes a plot of its rounds, docs/img/sglang_hicache.png, and the figures next to it (``.json``); ``--plot ''``
writes none.

Setup: one node (``--memory 1GiB``); SGLang 0.5.23's storage modules and a host pool laid out as SGLang's
(tests/support/sglang_cpu.py: page-first, bf16, 8 layers x 4 KV heads x 128, 16-token pages: 256 KiB a page).
Both backends are created by SGLang's ``StorageBackendFactory`` and store the same ``--pages`` pages (each
under its own key prefix) with their ``batch_set_v1``. Then each round runs, for each backend in turn (the
order alternating), SGLang's two prefetch calls: ``batch_exists`` of the pages (the hit query) and
``batch_get_v1`` of all of them into other host slots (the load); every load is checked to get every page,
and the last one to be byte-exact. Reported: median, p99 (nearest rank) and max of each, the ratio of the
medians, and the median of the per-round ratios (the two backends measured in the same round).

The machine is a shared 2-vCPU VM (other work runs on it); the output's first line records the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _common import paired_ratio, pyplot, save_figure, stats  # noqa: E402
from support import sglang_cpu  # noqa: E402
from support.nodes import ACCESS_KEY, SECRET_KEY, start_node  # noqa: E402

PAGE_TOKENS, LAYERS, HEADS, HEAD_DIM = 16, 8, 4, 128


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pages", type=int, default=128, help="pages per call (SGLang sends at most 128)")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--plot", default=str(ROOT / "docs" / "img" / "sglang_hicache.png"))
    args = parser.parse_args()
    reason = sglang_cpu.load()
    if reason:
        sys.exit(reason)
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    from ctxstore.hashing import block_hashes

    print(f"# load average {os.getloadavg()}; {args.pages} pages of 256 KiB, {args.rounds} rounds")
    n = args.pages
    with tempfile.TemporaryDirectory() as tmp:
        node = start_node(Path(tmp), "--memory", "1GiB", "--default-ttl", "1h")
        try:
            src = sglang_cpu.HostPool("page_first", pages=2 * n, page_size=PAGE_TOKENS, layer_num=LAYERS,
                                      head_num=HEADS, head_dim=HEAD_DIM)
            src.fill_random(1)
            common = {"access_key": ACCESS_KEY, "secret_key": SECRET_KEY}
            native_extra = {"backend_name": "ctxstore", "module_path": "ctxstore.integrations.sglang",
                            "class_name": "CtxStoreHiCacheStorage", "interface_v1": 1,
                            "nodes": f"127.0.0.1:{node.port}", **common}
            stock_extra = {"endpoint": f"http://127.0.0.1:{node.port}", "bucket": "sglang-seaweedfs", **common}
            backends = {
                "ctxstore": StorageBackendFactory.create_backend(
                    "dynamic", sglang_cpu.storage_config(native_extra), src),
                "seaweedfs": StorageBackendFactory.create_backend(
                    "seaweedfs", sglang_cpu.storage_config(stock_extra), src),
            }
            keys = block_hashes(list(range(n * PAGE_TOKENS)), PAGE_TOKENS, "sglang-sha256")
            for backend in backends.values():
                backend.register_mem_pool_host(src)
                assert all(backend.batch_set_v1(keys, src.indices(0, n))), "store failed"
            expected = src.page_bytes(src.indices(0, n))
            times: dict[str, dict[str, list[float]]] = {b: {"exists": [], "get": []} for b in backends}
            for r in range(args.rounds):
                order = list(backends) if r % 2 == 0 else list(backends)[::-1]
                for name in order:
                    backend = backends[name]
                    last = r == args.rounds - 1
                    if last:  # the destination slots zeroed: the last load must bring every byte
                        src.kv_buffer[:, n * PAGE_TOKENS:].zero_()
                    t0 = time.perf_counter()
                    hits = backend.batch_exists(keys)
                    t1 = time.perf_counter()
                    got = backend.batch_get_v1(keys, src.indices(n, n))
                    t2 = time.perf_counter()
                    assert hits == n and all(got), f"{name}: {hits} hits, {got.count(True)} pages"
                    times[name]["exists"].append(t1 - t0)
                    times[name]["get"].append(t2 - t1)
                    if last:
                        assert src.page_bytes(src.indices(n, n)) == expected, f"{name}: pages differ"
            backends["ctxstore"].close()
        finally:
            node.stop()

    summary: dict[str, object] = {"pages": n, "page_bytes": len(expected[0]), "rounds": args.rounds}
    print(f"{'call':<14}{'backend':<11}{'median ms':>10}{'p99 ms':>9}{'max ms':>9}")
    for call in ("exists", "get"):
        for name in backends:
            med, p99 = stats(times[name][call])
            print(f"{call:<14}{name:<11}{med * 1e3:>10.2f}{p99 * 1e3:>9.2f}{max(times[name][call]) * 1e3:>9.2f}")
            summary[f"{call}_{name}_ms"] = {"median": med * 1e3, "p99": p99 * 1e3,
                                            "max": max(times[name][call]) * 1e3}
        ratio = statistics.median(times["seaweedfs"][call]) / statistics.median(times["ctxstore"][call])
        same_round = paired_ratio(times["ctxstore"][call], times["seaweedfs"][call])
        summary[f"{call}_ratio"] = {"of_medians": ratio, "same_round_median": same_round}
        print(f"# {call}: seaweedfs / ctxstore = {ratio:.1f}x (medians), {same_round:.1f}x (median same-round)")
    gbps = n * len(expected[0]) / statistics.median(times["ctxstore"]["get"]) / 1e9
    print(f"# native batch_get_v1: {gbps:.2f} GB/s")
    if args.plot:
        path = Path(args.plot)
        path.with_suffix(".json").write_text(json.dumps({"summary": summary, "seconds": times}, indent=1) + "\n")
        plot(times, n, path)


def plot(times: dict[str, dict[str, list[float]]], n: int, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(7.5, 2.8))
    titles = {"exists": f"batch_exists, {n} pages", "get": f"batch_get_v1, {n} x 256 KiB"}
    for ax, call in zip(axes, ("exists", "get")):
        for name, colour in (("ctxstore", "tab:blue"), ("seaweedfs", "tab:orange")):
            ax.plot([t * 1e3 for t in times[name][call]], marker=".", lw=0.8, color=colour,
                    label=f"{name} (median {statistics.median(times[name][call]) * 1e3:.1f} ms)")
        ax.set_yscale("log")
        ax.set_xlabel("round")
        ax.set_ylabel("ms")
        ax.set_title(titles[call])
        ax.legend()
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    save_figure(plt, fig, path, f"benchmarks/sglang_hicache.py, {time.strftime('%Y-%m-%d')}, shared 2-vCPU VM")


if __name__ == "__main__":
    main()
