"""One vLLM process for tests/integrations/test_vllm_connector.py and benchmarks/vllm_ttft.py, run by the vLLM
venv's python (scripts/_venv.sh ``ensure_vllm``); the test process itself never imports vLLM.

``python vllm_driver.py make-model DIR [--layers N --hidden H ...]``
    Writes a random-weight Llama (transformers, seeded) and a word-level tokenizer (tokenizers) to DIR: nothing
    is downloaded. Prints ``REPORT {json}``.

``python vllm_driver.py serve DIR [--connector JSON] [--max-model-len N] ...``
    Starts ``vllm.LLM`` on DIR (with ``--connector``: the ctxstore connector, JSON = kv_connector_extra_config),
    prints ``DRIVER {"event": "ready", ...}``, then answers one ``DRIVER {json}`` line per command line on stdin
    (vLLM logs to stdout as well):

    * ``{"op": "generate", "prompt": [ids], "max_tokens": n, "cache_salt": s?}`` → ``{"tokens": [...],
      "num_cached_tokens": n, "ttft_s": t, "metrics": {...}}``: greedy decoding; ``metrics`` are vLLM's Prometheus
      counters (its own ``external_prefix_cache_*`` and the connector's ``ctxstore_*``) after the request.

``python vllm_driver.py layouts NODES BUCKET``
    Every ``KVCacheLayout`` of vLLM (with kernel blocks that split a cache block, padded pages, MLA and fp8 KV),
    as CPU caches made by vLLM's own ``create_kv_cache_views`` over flat buffers: blocks saved from one cache
    and restored into other block ids of a second one, through the connector's layout code and the client's
    staging pool (host backend, ``staging="host"``), the same calls ``wait_for_save`` and ``start_load_kv``
    make. Prints ``REPORT {json}``: per case, whether the restored layers equal the saved ones bit for bit and
    nothing else of the second buffer changed (or why vLLM itself refuses the combination).

vLLM's own prefix cache is off, so every request asks the connector. The engine core runs in a process of its
own (spawned: hence the ``__main__`` guard).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

ANSWER = "DRIVER "


def make_model(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, args.vocab)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(args.dir)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 2,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads,
                         max_position_embeddings=args.max_positions, rms_norm_eps=1e-5, tie_word_embeddings=False,
                         initializer_range=args.init_range, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config).to(getattr(torch, args.dtype)).eval()
    model.save_pretrained(args.dir)
    params = sum(p.numel() for p in model.parameters())
    return {"dir": args.dir, "params": params, "layers": args.layers, "dtype": args.dtype}


def metrics_snapshot(llm: Any) -> dict[str, float]:
    """vLLM's counters whose names say KV transfer: its own external-prefix-cache ones and the connector's."""
    out: dict[str, float] = {}
    for metric in llm.get_metrics():
        name = metric.name
        if "ctxstore" in name or "external_prefix_cache" in name:
            value = getattr(metric, "value", None)
            if isinstance(value, (int, float)):
                out[name.removeprefix("vllm:")] = out.get(name.removeprefix("vllm:"), 0) + float(value)
    return out


def say(answer: dict[str, Any]) -> None:
    """One answer line; vLLM logs to stdout too, so answers carry a prefix the reader looks for."""
    print(ANSWER + json.dumps(answer), flush=True)


def serve(args: argparse.Namespace) -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kwargs: dict[str, Any] = {}
    if args.connector is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="CtxStoreConnector", kv_connector_module_path="ctxstore.integrations.vllm",
            kv_role="kv_both", kv_connector_extra_config=json.loads(args.connector))
        # kv_load_failure_policy is left at vLLM's default ("fail"): the connector switches it to "recompute",
        # and the test's fault cases would fail their requests if it did not.
    if args.one_process:  # engine core and model runner in this process: two fewer vLLM imports to start
        kwargs["distributed_executor_backend"] = "uni"
    started = time.monotonic()
    llm = LLM(model=args.dir, tokenizer=args.dir, dtype=args.dtype, max_model_len=args.max_model_len,
              max_num_batched_tokens=args.max_batched_tokens, enable_prefix_caching=False, enforce_eager=True,
              disable_log_stats=False, seed=0, **kwargs)
    say({"event": "ready", "load_s": time.monotonic() - started})
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        if cmd["op"] != "generate":
            say({"error": f"unknown op {cmd['op']}"})
            continue
        params = SamplingParams(temperature=0.0, max_tokens=cmd["max_tokens"], ignore_eos=True)
        prompt = TokensPrompt(prompt_token_ids=cmd["prompt"])
        if cmd.get("cache_salt"):
            prompt["cache_salt"] = cmd["cache_salt"]
        t0 = time.monotonic()
        out = llm.generate(prompt, params, use_tqdm=False)[0]
        wall = time.monotonic() - t0
        metrics = out.metrics
        ttft = getattr(metrics, "first_token_latency", None) if metrics is not None else None
        say({"tokens": list(out.outputs[0].token_ids), "num_cached_tokens": out.num_cached_tokens,
             "wall_s": wall, "ttft_s": ttft, "metrics": metrics_snapshot(llm)})


def layouts(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheTensor,
        MLAAttentionSpec,
        compute_layout_strides,
        create_kv_cache_views,
        group_kernel_blocks,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from ctxstore import ContextStore
    from ctxstore.integrations.vllm.layout import PagedLayout
    from ctxstore.staging import ready

    n_layers, num_blocks, block_size = 3, 12, 16
    cases: dict[str, Any] = {
        "bf16": (FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=32, dtype=torch.bfloat16), None),
        "kernel-split": (FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=32,
                                           dtype=torch.bfloat16), block_size // 2),
        "padded": (FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=32, dtype=torch.bfloat16,
                                     page_size_padded=2 * 2 * 32 * 2 * block_size + 512), None),
        "mla": (MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=96, dtype=torch.bfloat16), None),
        "fp8": (FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=32,
                                  dtype=torch.float8_e4m3fn), None),
    }
    report: dict[str, Any] = {}
    with ContextStore(args.nodes, staging="host", staging_bytes=64 << 10, threads=2) as store:
        store.create_bucket(args.bucket)
        for layout in KVCacheLayout:
            for name, (spec, kernel) in cases.items():
                case = f"{layout.name}/{name}"
                page = spec.page_size_bytes
                bytes_per_block = page * n_layers
                block_stride = bytes_per_block if layout.is_block_outermost else None
                if block_stride is None and page != spec.real_page_size_bytes:
                    if not layout.is_block_compact:
                        report[case] = "vLLM refuses: cannot pad pages"
                        continue
                    block_stride = page
                try:
                    layer_stride, block_stride, *_ = compute_layout_strides(
                        spec, num_blocks, n_layers, layout, fixed_strides=(None, block_stride, None, None, None))
                    tensor = KVCacheTensor(size=bytes_per_block * num_blocks,
                                           layers=[f"layer.{i}" for i in range(n_layers)],
                                           layer_stride=layer_stride, block_stride=block_stride)
                    gen = torch.Generator().manual_seed(len(report))
                    source = torch.randint(-128, 128, (tensor.size,), dtype=torch.int8, generator=gen)
                    views_a = create_kv_cache_views(source, spec, num_blocks, layout, tensor, kernel)
                    dest = torch.zeros(tensor.size, dtype=torch.int8)
                    views_b = create_kv_cache_views(dest, spec, num_blocks, layout, tensor, kernel)
                except (ValueError, AssertionError) as exc:
                    report[case] = f"vLLM refuses: {str(exc)[:120]}"
                    continue
                paged_a = PagedLayout.from_kv_caches(dict(zip(tensor.layers, views_a)), num_blocks)
                paged_b = PagedLayout.from_kv_caches(dict(zip(tensor.layers, views_b)), num_blocks)
                saved, restored = [1, 4, 5, 7, 10], [9, 0, 3, 11, 2]
                keys = [f"{case}/{i}" for i in range(len(saved))]
                put = store.put_keys_staged(args.bucket, keys, ready(paged_a.gather(saved)))
                sizes = store.get_keys_staged(args.bucket, keys, ready(paged_b.target(restored)))

                def layer_bytes(view: Any, block: int) -> bytes:  # a cache block's bytes (kernel blocks grouped)
                    return bytes(group_kernel_blocks(view.view(torch.uint8), num_blocks)[block].contiguous()
                                 .numpy().tobytes())

                exact = all(layer_bytes(va, s) == layer_bytes(vb, r)
                            for va, vb in zip(views_a, views_b) for s, r in zip(saved, restored))
                # The same bytes as the host path's per-block pieces, and nothing else of the buffer written.
                pieces = all(bytes(torch.cat([p.reshape(-1).view(torch.uint8) for p in paged_a.block_pieces(s)])
                                   .numpy().tobytes()) == bytes(paged_a.gather([s])[0].numpy().tobytes())
                             for s in saved)
                for vb in views_b:  # clear what was restored: the rest of the buffer must still be zero
                    for r in restored:
                        group_kernel_blocks(vb.view(torch.uint8), num_blocks)[r].zero_()
                report[case] = {"stored": put.stored, "restored": len(sizes), "exact": exact,
                                "same_as_pieces": pieces, "nothing_else_written": bool((dest == 0).all().item()),
                                "block_bytes": paged_a.block_bytes, "object_bytes": sizes[0] if sizes else 0}
    return report


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="mode", required=True)
    mk = sub.add_parser("make-model")
    mk.add_argument("dir")
    mk.add_argument("--layers", type=int, default=2)
    mk.add_argument("--hidden", type=int, default=128)
    mk.add_argument("--heads", type=int, default=4)
    mk.add_argument("--kv-heads", type=int, default=2)
    mk.add_argument("--vocab", type=int, default=512)
    mk.add_argument("--max-positions", type=int, default=4096)
    mk.add_argument("--init-range", type=float, default=0.2)
    mk.add_argument("--dtype", default="float32")
    mk.add_argument("--seed", type=int, default=0)
    sv = sub.add_parser("serve")
    sv.add_argument("dir")
    sv.add_argument("--connector", default=None, help="kv_connector_extra_config as JSON")
    sv.add_argument("--dtype", default="float32")
    sv.add_argument("--max-model-len", type=int, default=4096)
    sv.add_argument("--max-batched-tokens", type=int, default=8192)
    sv.add_argument("--one-process", action="store_true",
                    help="no engine-core or worker process (for a reference run without a connector)")
    ly = sub.add_parser("layouts")
    ly.add_argument("nodes")
    ly.add_argument("bucket")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache: vLLM-CPU's default is far larger
    if getattr(args, "one_process", False):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if args.mode == "make-model":
        print("REPORT " + json.dumps(make_model(args)), flush=True)
    elif args.mode == "layouts":
        print("REPORT " + json.dumps(layouts(args)), flush=True)
    else:
        serve(args)


if __name__ == "__main__":  # vLLM spawns its engine-core process, which imports this module again
    main()
