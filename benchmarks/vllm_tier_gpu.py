"""On a GPU machine with vLLM (0.32, CUDA): one model run twice with ctxstore as a secondary tier of vLLM's own
KV offloading (``OffloadingConnector`` + ``TieringOffloadingSpec`` + ``ctxstore.integrations.vllm.tier``), the
second run restoring the prompt's prefix from the pod; its greedy tokens compared with a run without offloading.

Command (a prepared check, not CI; vLLM's CPU offloading refuses non-CUDA/XPU platforms, so it cannot run on the
CPU test machines)::

    python benchmarks/vllm_tier_gpu.py --model Qwen/Qwen3-0.6B --start-node
    python benchmarks/vllm_tier_gpu.py --model MODEL --nodes http://kv-0:9000,http://kv-1:9000   # a pod of yours

``--start-node`` starts one ``ctxstore serve`` on a free port (this environment's ctxstore, 4 GiB) and stops it
at the end; else ``--nodes`` and ``CTXSTORE_ACCESS_KEY`` / ``CTXSTORE_SECRET_KEY`` name a pod. Each vLLM runs in
its own process (so the second starts with an empty GPU prefix cache and an empty CPU primary tier):

1. reference, no offloading: prompt + suffix → greedy tokens;
2. run A, with the tier: the prompt alone; then it waits until the pod holds the prompt's chunks (the primary
   tier cascades them to the tier after the request);
3. run B, a fresh process with the tier: prompt + suffix → greedy tokens, ``num_cached_tokens`` and vLLM's
   offloading counters (the tier's ``vllm:kv_offload_ctxstore_*``).

Prints one JSON line per run and a verdict: B restored a prefix (``num_cached_tokens`` > 0: a fresh process
holds nothing itself, so it came from the pod; the tier's ``loaded_chunks`` counter is shown beside it) and B's
tokens equal the reference's. Exit status 0 only then.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import time
import urllib.request
from typing import Any

BUCKET = "vllm-tier-gpu"


def tier_config(nodes: str, cpu_bytes: int) -> dict[str, Any]:
    return {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": cpu_bytes,
            "secondary_tiers": [{"type": "CtxStoreTier", "module_path": "ctxstore.integrations.vllm.tier",
                                 "nodes": nodes, "bucket": BUCKET, "enable_kv_events": False,
                                 "locality": "REMOTE"}]}


def engine(args: argparse.Namespace) -> None:
    """One vLLM process: ``--run reference|a|b``; prints ``RESULT {json}``."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kwargs: dict[str, Any] = {}
    if args.run != "reference":
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="OffloadingConnector", kv_role="kv_both",
            kv_connector_extra_config=tier_config(args.nodes, args.cpu_bytes))
    llm = LLM(model=args.model, max_model_len=args.prompt_tokens + 512, gpu_memory_utilization=0.5, seed=0,
              disable_log_stats=False, **kwargs)
    rng = random.Random(23)
    prompt = [rng.randrange(100, 5000) for _ in range(args.prompt_tokens)]
    suffix = [rng.randrange(100, 5000) for _ in range(32)]
    tokens = prompt if args.run == "a" else prompt + suffix
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    started = time.monotonic()
    out = llm.generate(TokensPrompt(prompt_token_ids=tokens), params, use_tqdm=False)[0]
    wall = time.monotonic() - started
    if args.run == "a":  # the cascade to the tier runs after the request: wait until the pod's count settles
        deadline, last, since = time.monotonic() + 60, -1, time.monotonic()
        while time.monotonic() < deadline:
            held = len(pod_objects(args.nodes))
            if held != last:
                last, since = held, time.monotonic()
            elif held and time.monotonic() - since > 2:
                break
            time.sleep(0.5)
    metrics = {m.name: float(getattr(m, "value", 0) or 0) for m in llm.get_metrics()
               if "kv_offload" in m.name and isinstance(getattr(m, "value", None), (int, float))}
    print("RESULT " + json.dumps({"run": args.run, "tokens": list(out.outputs[0].token_ids),
                                  "num_cached_tokens": out.num_cached_tokens, "wall_s": wall,
                                  "metrics": metrics}), flush=True)


def pod_objects(nodes: str) -> list[str]:
    """The tier's objects in the pod (S3 ListObjectsV2 on every node)."""
    import boto3

    names: list[str] = []
    for endpoint in nodes.split(","):
        s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                          aws_access_key_id=os.environ["CTXSTORE_ACCESS_KEY"],
                          aws_secret_access_key=os.environ["CTXSTORE_SECRET_KEY"])
        try:
            names += [o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET).get("Contents", [])]
        except s3.exceptions.NoSuchBucket:
            pass
    return names


def run_engine(args: argparse.Namespace, run: str) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "engine", "--run", run, "--model", args.model, "--nodes", args.nodes,
           "--prompt-tokens", str(args.prompt_tokens), "--max-tokens", str(args.max_tokens),
           "--cpu-bytes", str(args.cpu_bytes)]
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=1200)
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    if done.returncode != 0 or line is None:
        raise SystemExit(f"run {run} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(line[7:])
    print(json.dumps({k: v for k, v in result.items() if k != "tokens"} | {"tokens": result["tokens"][:8]}),
          flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", nargs="?", default="check", choices=("check", "engine"))
    parser.add_argument("--model", default="Qwen/Qwen3-0.6B")
    parser.add_argument("--nodes", default=os.environ.get("CTXSTORE_NODES", ""))
    parser.add_argument("--start-node", action="store_true")
    parser.add_argument("--run", default="reference")
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--cpu-bytes", type=int, default=4 << 30)
    args = parser.parse_args()
    if args.mode == "engine":
        engine(args)
        return
    node = None
    if args.start_node:
        os.environ.setdefault("CTXSTORE_ACCESS_KEY", "GPUCHECKACCESSKEY001")
        os.environ.setdefault("CTXSTORE_SECRET_KEY", "gpu-check-secret-key-0001")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        node = subprocess.Popen([sys.executable, "-m", "ctxstore.cli", "serve", "--port", str(port), "--memory",
                                 "4GiB", "--log-level", "warning"], env=dict(os.environ))
        args.nodes = f"http://127.0.0.1:{port}"
        for _ in range(300):
            try:
                urllib.request.urlopen(f"{args.nodes}/_ctx/health/ready", timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
    if not args.nodes:
        raise SystemExit("no pod: --start-node, or --nodes / CTXSTORE_NODES")
    try:
        reference = run_engine(args, "reference")
        run_engine(args, "a")
        b = run_engine(args, "b")
    finally:
        if node is not None:
            node.terminate()
            node.wait(10)
    loaded = sum(v for k, v in b["metrics"].items() if "ctxstore_loaded_chunks" in k)
    # A fresh process has an empty GPU prefix cache and an empty CPU primary tier: what it found came from the pod.
    ok = b["tokens"] == reference["tokens"] and b["num_cached_tokens"] > 0
    print(json.dumps({"restored_tokens": b["num_cached_tokens"], "chunks_loaded_from_tier": loaded,
                      "same_greedy_tokens": b["tokens"] == reference["tokens"], "ok": ok}), flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
