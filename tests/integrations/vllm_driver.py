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
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache: vLLM-CPU's default is far larger
    if args.mode == "make-model":
        print("REPORT " + json.dumps(make_model(args)), flush=True)
    else:
        serve(args)


if __name__ == "__main__":  # vLLM spawns its engine-core process, which imports this module again
    main()
