"""On a GPU machine with SGLang (0.5.23) installed: one model run twice with the native HiCache L3 backend, the
second engine starting empty, showing the prefix restored from ctxstore and identical greedy tokens.

Command (a ctxstore node is started here unless ``--nodes`` names a pod):

    python benchmarks/sglang_gpu_check.py --model Qwen/Qwen3-0.6B          # --prompt-tokens 4096 --new 32

Steps: (1) a node (``--memory 8GiB --default-ttl 1h``); (2) engine A (``sglang.Engine``) with
``enable_hierarchical_cache``, ``hicache_storage_backend="dynamic"`` and the extra config of
docs/integrations.md ("SGLang HiCache"), ``hicache_write_policy="write_through"``: one greedy generation of a
long prompt, then shut down (its pages are in ctxstore); (3) engine B, a new process with empty GPU and host
caches: the same prompt. Reported: B's ``meta_info["cached_tokens"]`` (and ``cached_tokens_details`` where
SGLang gives them: the storage share), the node's objects and bytes before and after, and whether A's and B's
output token ids are identical. Exit status 0 only when B restored at least half the prompt and the tokens match.

Not run in CI: it needs a GPU and SGLang's CUDA stack. Exit status 77 where either is missing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

ADMIN_TOKEN = "sglang-gpu-check"


def node_stats(endpoint: str) -> dict:
    req = urllib.request.Request(f"{endpoint}/_ctx/v1/admin/stats",
                                 headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


def run_engine(args: argparse.Namespace, nodes: str, prompt_ids: list[int]) -> dict:
    import sglang

    extra = {"backend_name": "ctxstore", "module_path": "ctxstore.integrations.sglang",
             "class_name": "CtxStoreHiCacheStorage", "interface_v1": 1, "nodes": nodes,
             "bucket": "sglang-gpu-check", "ttl": 3600}
    engine = sglang.Engine(
        model_path=args.model, page_size=args.page_size, mem_fraction_static=0.6,
        enable_hierarchical_cache=True, hicache_ratio=2.0, hicache_write_policy="write_through",
        hicache_mem_layout=args.layout, hicache_storage_backend="dynamic",
        hicache_storage_backend_extra_config=json.dumps(extra), hicache_storage_prefetch_policy="wait_complete")
    try:
        out = engine.generate(input_ids=prompt_ids, sampling_params={"temperature": 0, "max_new_tokens": args.new})
        time.sleep(args.settle)  # write-through backups to L3 finish in the background
        return out
    finally:
        engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="Qwen/Qwen3-0.6B")
    parser.add_argument("--nodes", default="", help="a running pod (its admin token: CTXSTORE_ADMIN_TOKEN)")
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--layout", default="page_first", choices=["page_first", "layer_first", "page_first_direct"])
    parser.add_argument("--settle", type=float, default=5.0, help="seconds for engine A's backups to finish")
    args = parser.parse_args()
    try:
        import sglang  # noqa: F401
        import torch

        if not torch.cuda.is_available():
            raise ImportError("no CUDA device")
    except ImportError as exc:
        print(f"skipped: {exc}")
        sys.exit(77)

    import random

    rng = random.Random(0)
    prompt_ids = [rng.randrange(1000, 20000) for _ in range(args.prompt_tokens)]
    with tempfile.TemporaryDirectory() as tmp:
        node = None
        nodes = args.nodes
        if not nodes:
            from support.nodes import ACCESS_KEY, SECRET_KEY, start_node

            os.environ.setdefault("CTXSTORE_ACCESS_KEY", ACCESS_KEY)
            os.environ.setdefault("CTXSTORE_SECRET_KEY", SECRET_KEY)
            node = start_node(Path(tmp), "--memory", "8GiB", "--default-ttl", "1h",
                              env={"CTXSTORE_ADMIN_TOKEN": ADMIN_TOKEN})
            nodes = f"127.0.0.1:{node.port}"
        endpoint = f"http://{nodes.split(',')[0]}"
        try:
            before = node_stats(endpoint)
            first = run_engine(args, nodes, prompt_ids)
            middle = node_stats(endpoint)
            second = run_engine(args, nodes, prompt_ids)
            after = node_stats(endpoint)
        finally:
            if node is not None:
                node.stop()
    cached = second["meta_info"].get("cached_tokens", 0)
    same = first["output_ids"] == second["output_ids"]
    report = {
        "model": args.model, "prompt_tokens": args.prompt_tokens, "layout": args.layout,
        "engine_b_cached_tokens": cached, "engine_b_cached_details": second["meta_info"].get("cached_tokens_details"),
        "identical_greedy_tokens": same, "node_before": before, "node_after_a": middle, "node_after_b": after,
        "output_ids": first["output_ids"],
    }
    print(json.dumps(report, indent=1, default=str))
    sys.exit(0 if same and cached >= args.prompt_tokens // 2 else 1)


if __name__ == "__main__":
    main()
