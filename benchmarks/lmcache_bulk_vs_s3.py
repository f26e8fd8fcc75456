"""LMCache retrieve from ctxstore: the bulk-API backend (``ctxstore.integrations.lmcache``) against LMCache's own S3
connector on the same node's S3 endpoint (the path that works without ctxstore code).

Command (results go in docs/benchmarks.md; LMCache comes from scripts/test's install, matplotlib from the
``bench`` extra):

    .venv/bin/python benchmarks/lmcache_bulk_vs_s3.py          # --chunks 8 --rounds 7 --repeats 2 (defaults)

Each run also writes a plot of its rounds, docs/img/lmcache_<chunks>x<MiB>.png, and their figures next to it
(``.json``); ``--plot ''`` writes none.

Setup: one ctxstore node (``--domain localhost``, so LMCache's virtual-hosted S3 requests name the bucket), two
buckets, the same KV tensor (float32, 8 layers, 8 heads x 128, ``--chunks`` chunks of 256 tokens, 16 MiB
each) stored once through each backend by LMCache itself (tests/integrations/lmcache_bulk_worker.py ``store``).
Then, alternately per backend for ``--repeats`` processes each, a fresh LMCache engine runs ``--rounds``
retrieves (``bench``): drop LMCache's local CPU copy, ``lookup`` (with pin) and ``retrieve`` of the whole prompt
into a zero tensor; every round is checked to get every token, and the last one to be bit-exact. Reported:
median and p99 (nearest rank) of lookup+retrieve, and of the lookup alone, and the ratio of medians; and, as
the floor under both, the same chunks fetched by the ctxstore client alone (one bulk get into one buffer).
``--chunk-tokens 64`` gives 4 MiB chunks (4x as many objects for the same bytes).

The machine is a shared 2-vCPU VM (other work runs on it); the output's first line records the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from support.nodes import ACCESS_KEY, SECRET_KEY, make_client, start_node  # noqa: E402

from ctxstore.bench import percentile  # noqa: E402

WORKER = ROOT / "tests" / "integrations" / "lmcache_bulk_worker.py"
HELPERS = ROOT / "tests" / "integrations" / "lmcache_helpers"  # worker.py: private_hosts
LAYERS, HEADS, HEAD = 8, 8, 128
CHUNK = 256  # tokens per LMCache chunk (--chunk-tokens)
DOMAIN = "localhost"


def raw_restore(port: int, bucket: str, keys: list[str], nbytes: int, rounds: int) -> list[float]:
    """The same chunks fetched by the ctxstore client alone into one buffer: the floor under LMCache's retrieve."""
    import time

    from ctxstore import ContextStore
    from ctxstore.buffers import Destinations

    out = bytearray(nbytes)
    times = []
    with ContextStore(f"127.0.0.1:{port}", access_key=ACCESS_KEY, secret_key=SECRET_KEY) as store:
        for _ in range(rounds + 1):
            t0 = time.perf_counter()
            views = store.get_keys(bucket, keys, Destinations(out, len(keys)))
            times.append(time.perf_counter() - t0)
            assert all(v is not None for v in views)
    return times[1:]


def configs(port: int, s3_bucket: str, bulk_bucket: str, cpu_gb: float) -> dict[str, str]:
    common = f"chunk_size: {CHUNK}\nlocal_cpu: true\nmax_local_cpu_size: {cpu_gb}\nremote_serde: \"naive\"\n"
    return {
        "s3": common + f"""remote_url: "s3://{s3_bucket}.{DOMAIN}:{port}"
extra_config:
  s3_region: "us-east-1"
  disable_tls: true
  s3_prefer_http2: false
  s3_num_io_threads: 4
  aws_access_key_id: "{ACCESS_KEY}"
  aws_secret_access_key: "{SECRET_KEY}"
""",
        "bulk": common + f"""remote_storage_plugins: ["ctxstore"]
extra_config:
  remote_storage_plugin.ctxstore.module_path: "ctxstore.integrations.lmcache"
  remote_storage_plugin.ctxstore.class_name: "CtxStoreConnectorAdapter"
  ctxstore.nodes: "127.0.0.1:{port}"
  ctxstore.bucket: "{bulk_bucket}"
""",
    }


def worker(mode: str, config: Path, data: Path, hosts: list[str], rounds: int, log: Path) -> dict:
    with log.open("a") as out:
        proc = subprocess.run([sys.executable, str(WORKER), mode, str(config), str(data), *hosts,
                               "--rounds", str(rounds)], stdout=out, stderr=subprocess.STDOUT, timeout=600,
                              env={**os.environ, "PYTHONHASHSEED": "0", "LMCACHE_TRACK_USAGE": "false",
                                   "CTXSTORE_ACCESS_KEY": ACCESS_KEY, "CTXSTORE_SECRET_KEY": SECRET_KEY,
                                   # the worker's private /etc/hosts helper (for the S3 connector's names)
                                   "PYTHONPATH": os.pathsep.join(filter(None, [str(HELPERS),
                                                                              os.environ.get("PYTHONPATH")]))})
    text = log.read_text()
    if proc.returncode:
        raise SystemExit(f"{mode} failed ({proc.returncode}):\n{text[-4000:]}")
    return json.loads([ln for ln in text.splitlines() if ln.startswith("REPORT ")][-1][len("REPORT "):])


def main() -> None:
    global CHUNK
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--chunk-tokens", type=int, default=CHUNK)
    parser.add_argument("--plot", default=None,
                        help="PNG of the rounds [default docs/img/lmcache_<chunks>x<MiB>.png]; '' for none")
    args = parser.parse_args()
    CHUNK = args.chunk_tokens
    import torch

    tmp = Path(tempfile.mkdtemp(prefix="lmcache-bench-"))
    node = start_node(tmp, "--memory", "2GiB", "--default-ttl", "1h", "--log-level", "warning",
                      env={"CTXSTORE_DOMAIN": DOMAIN})
    try:
        s3 = make_client(node.endpoint)
        s3.create_bucket(Bucket="lmc-s3")
        s3.create_bucket(Bucket="lmc-bulk")
        s3.close()
        chunk_bytes = 2 * LAYERS * CHUNK * HEADS * HEAD * 4
        cpu_gb = round(args.chunks * chunk_bytes * 1.5 / 1e9 + 0.1, 2)
        gen = torch.Generator().manual_seed(11)
        tokens = torch.randint(0, 32000, (args.chunks * CHUNK,), generator=gen).tolist()
        kv = torch.randn(2, LAYERS, len(tokens), HEADS * HEAD, generator=gen, dtype=torch.float32)
        paths: dict[str, tuple[Path, Path, list[str]]] = {}
        for name, text in configs(node.port, "lmc-s3", "lmc-bulk", cpu_gb).items():
            config, data = tmp / f"{name}.yaml", tmp / f"{name}.pt"
            config.write_text(text)
            torch.save({"tokens": tokens, "kv": kv, "stored": len(tokens), "heads": HEADS, "model": "bench/lmc",
                        "backend": "RemoteBackend" if name == "s3" else "RemoteBackend-ctxstore"}, data)
            hosts = [f"127.0.0.1 lmc-s3.{DOMAIN}"] if name == "s3" else []
            paths[name] = (config, data, hosts)
            stored = worker("store", config, data, hosts, 1, tmp / f"{name}.log")
            assert stored["remote_hit_tokens"] == len(tokens), stored
        results: dict[str, dict[str, list[float]]] = {n: {"total_s": [], "lookup_s": []} for n in paths}
        for r in range(args.repeats):
            for name in (["s3", "bulk"] if r % 2 == 0 else ["bulk", "s3"]):
                config, data, hosts = paths[name]
                rep = worker("bench", config, data, hosts, args.rounds, tmp / f"{name}.log")
                assert rep["exact"], name
                for key in ("total_s", "lookup_s"):
                    results[name][key] += rep[key][1:]  # the first round of a process warms its connections
        s3 = make_client(node.endpoint)
        keys = [o["Key"] for o in s3.list_objects_v2(Bucket="lmc-bulk")["Contents"]]
        s3.close()
        raw = raw_restore(node.port, "lmc-bulk", keys, len(keys) * chunk_bytes, args.rounds * args.repeats)
    finally:
        node.stop()
    mib = args.chunks * chunk_bytes / 2**20
    print(f"lmcache_bulk_vs_s3: {args.chunks} chunks x {chunk_bytes >> 20} MiB ({mib:.0f} MiB), "
          f"{args.repeats} processes x {args.rounds - 1} timed rounds per backend; load average "
          f"{os.getloadavg()[0]:.1f}\n")
    print("| LMCache remote | lookup+retrieve median ms | p99 ms | GB/s | lookup median ms |")
    print("|---|---:|---:|---:|---:|")
    for name, label in (("s3", "S3 connector (awscrt) on ctxstore's S3 API"), ("bulk", "ctxstore bulk backend")):
        tot = results[name]["total_s"]
        med = statistics.median(tot)
        print(f"| {label} | {med * 1e3:.1f} | {percentile(sorted(tot), 0.99) * 1e3:.1f} | {mib * 2**20 / med / 1e9:.2f} | "
              f"{statistics.median(results[name]['lookup_s']) * 1e3:.1f} |")
    med = statistics.median(raw)
    print(f"| (ctxstore client alone: bulk get of the same chunks into one buffer) | {med * 1e3:.1f} | "
          f"{percentile(sorted(raw), 0.99) * 1e3:.1f} | {mib * 2**20 / med / 1e9:.2f} | |")
    speed = statistics.median(results["s3"]["total_s"]) / statistics.median(results["bulk"]["total_s"])
    print(f"\nbulk backend speed-up over S3 (ratio of medians): {speed:.2f}x")
    path = args.plot if args.plot is not None else str(
        ROOT / "docs" / "img" / f"lmcache_{args.chunks}x{chunk_bytes >> 20}MiB.png")
    if path:
        rows = {"chunks": args.chunks, "chunk_bytes": chunk_bytes, "load_average": os.getloadavg()[0],
                "s3_total_s": results["s3"]["total_s"], "bulk_total_s": results["bulk"]["total_s"],
                "s3_lookup_s": results["s3"]["lookup_s"], "bulk_lookup_s": results["bulk"]["lookup_s"],
                "client_alone_s": raw}
        Path(path).with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
        plot(rows, path)


def plot(rows: dict, path: str) -> None:
    """Every timed round of each path, as box plots on one time axis (ms)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mib = rows["chunks"] * rows["chunk_bytes"] / 2**20
    fig, ax = plt.subplots(figsize=(7.2, 2.5))
    labels = ["LMCache S3 connector", "LMCache bulk backend", "ctxstore client alone"]
    data = [[t * 1e3 for t in rows[k]] for k in ("s3_total_s", "bulk_total_s", "client_alone_s")]
    ax.boxplot(data, tick_labels=labels, orientation="horizontal")
    ax.set_xlim(left=0)
    ax.set_xlabel(f"ms per lookup + retrieve of {mib:.0f} MiB, {len(data[0])} rounds per backend")
    fig.suptitle(f"LMCache retrieve from ctxstore: {rows['chunks']} chunks x {rows['chunk_bytes'] >> 20} MiB",
                 fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(fig)
    print(f"# plot written to {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
