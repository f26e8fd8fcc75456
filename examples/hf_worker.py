"""A toy inference worker: a small Llama-architecture model that saves and restores its KV cache in a ctxstore
pod through ``ctxstore.integrations.transformers``.

The model is built from ``LlamaConfig`` with seeded random weights (nothing is downloaded): 4 layers, hidden
size 256, 4 attention heads, 2 KV heads (grouped-query attention), head dim 64, vocabulary 1000, float32.
Every worker process that uses the same ``--model-seed`` holds bit-identical weights. Prompts are seeded
random token ids.

One worker is one OS process, driven with JSON lines: it loads the model, prints ``{"event": "ready", ...}``,
then answers each command read from stdin with one JSON line on stdout (``restore_demo.py`` and
``tests/integrations/test_real_model.py`` drive it). The pod comes from ``CTXSTORE_NODES``, ``CTXSTORE_ACCESS_KEY`` and
``CTXSTORE_SECRET_KEY``.

Commands (``op``):

``prefill_save``  prefill a prompt in one forward pass and save its full blocks (answers ``"saved"``).
``serve``         a request = the cached prompt + a question: restore the longest cached prefix, prefill only
                  the remainder, generate greedily; with ``check``, also recompute everything without the pod
                  and compare logits. The session (tokens and cache) stays in the worker for ``park``.
``park``          a tool call starts: park the session's blocks (long TTL, pinned); answers its tokens and the
                  chunk boundaries of the forward passes that computed its cache.
``resume``        another worker takes the session over: restore it, prefill the tool result, generate, and
                  (with ``check``) compare against a recompute.
``probe``         negative cases: a prompt whose first block differs, and namespaces of other model configs.
``bench``         median restore and recompute times for the ``serve`` request.

Why a "recompute with the same chunks": a forward pass over ``n`` tokens computes the K/V of a prefix with
reductions (softmax, attention @ V) whose blocking depends on ``n``, so layers >= 1 of a prefix's K/V differ
in the last bits between a 2,000-token and a 2,037-token pass -- without any cache involved. A cache restored
from the pod is bit-identical to the one the saving worker computed, so the restored path is compared bitwise
with a recompute that cuts the sequence into the same forward passes (what the saving and the restoring worker
ran), and with a tolerance against a single forward pass over the whole prompt.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach the Hugging Face hub
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from ctxstore import ContextStore
from ctxstore.integrations.transformers import KVNamespace, cache_kwarg

MODEL_ID = "ctxstore-examples/tiny-llama"
VOCAB = 1000


def tiny_config(*, layers: int = 4, rms_norm_eps: float = 1e-6) -> LlamaConfig:
    return LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                       max_position_embeddings=4096, rms_norm_eps=rms_norm_eps, tie_word_embeddings=False)


def build_model(seed: int) -> LlamaForCausalLM:
    """The tiny model with weights drawn from a seeded generator (independent of transformers' own init)."""
    model = LlamaForCausalLM(tiny_config()).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
            else:
                param.copy_(0.05 * torch.randn(param.shape, generator=gen))
    return model


def seeded_tokens(seed: int, n: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class Worker:
    def __init__(self, args: argparse.Namespace) -> None:
        started = time.perf_counter()
        if args.threads:
            torch.set_num_threads(args.threads)
        self.model = build_model(args.model_seed)
        self.cache_kw = cache_kwarg(self.model)  # "cache" in transformers >= 5.2x, else "past_key_values"
        self.store = ContextStore()  # nodes and credentials from the environment
        self.bucket = args.bucket
        self.kv = KVNamespace.open(self.store, args.bucket, self.model, model_id=MODEL_ID,
                                   revision=f"seed-{args.model_seed}")
        self.session: dict[str, Any] | None = None
        self.load_s = time.perf_counter() - started

    # ------------------------------------------------------------------ model steps

    def forward(self, ids: list[int], cache: Any) -> torch.Tensor:
        """One forward pass over ``ids`` appending to ``cache``; the logits of the last position."""
        out = self.model(input_ids=torch.tensor([ids]), use_cache=True, logits_to_keep=1,
                         **{self.cache_kw: cache})
        return out.logits[0, -1]

    def forward_chunks(self, tokens: list[int], bounds: list[int]) -> tuple[Any, torch.Tensor | None]:
        """A new cache for ``tokens``, computed by forward passes cut at ``bounds`` (each chunk's end), and
        the logits of the last position (None for no tokens)."""
        cache, start, logits = DynamicCache(), 0, None
        for end in [*bounds, len(tokens)]:
            if end > start:
                logits = self.forward(tokens[start:end], cache)
                start = end
        return cache, logits

    def generate(self, cache: Any, logits: torch.Tensor, n: int) -> tuple[list[int], torch.Tensor]:
        """Greedy decoding of ``n`` tokens; the logits each token was chosen from, ``[n, vocab]``."""
        steps, out = [logits], []
        for i in range(n):
            out.append(int(steps[-1].argmax()))
            if i < n - 1:
                steps.append(self.forward([out[-1]], cache))
        return out, torch.stack(steps)

    # ------------------------------------------------------------------ commands

    def prefill_save(self, cmd: dict[str, Any]) -> dict[str, Any]:
        tokens = seeded_tokens(cmd["prompt_seed"], cmd["prompt_len"])
        with torch.inference_mode():
            t0 = time.perf_counter()
            cache, _ = self.forward_chunks(tokens, [])
            t1 = time.perf_counter()
            result = self.kv.save(tokens, cache)
            t2 = time.perf_counter()
        return {"event": "saved", "tokens": len(tokens), "stored": result.stored, "existed": result.existed,
                "failed": result.failed, "prefill_s": t1 - t0, "save_s": t2 - t1,
                "block_bytes": self.kv.layout.block_bytes}

    def serve(self, cmd: dict[str, Any]) -> dict[str, Any]:
        prompt = seeded_tokens(cmd["prompt_seed"], cmd["prompt_len"])
        tokens = prompt + seeded_tokens(cmd["question_seed"], cmd["question_len"])
        n_new = cmd["max_new"]
        with torch.inference_mode():
            t0 = time.perf_counter()
            cached_blocks = self.kv.lookup(tokens)
            t1 = time.perf_counter()
            restored = self.kv.restore(tokens)
            t2 = time.perf_counter()
            logits = self.forward(tokens[restored.n_tokens:], restored.cache)
            t3 = time.perf_counter()
            generated, step_logits = self.generate(restored.cache, logits, n_new)
            t4 = time.perf_counter()
        # The session's cache holds every token but the last generated one; its forward passes ended at:
        history = [restored.n_tokens, len(tokens)] + [len(tokens) + i + 1 for i in range(n_new - 1)]
        self.session = {"tokens": tokens + generated, "cache": restored.cache, "history": history}
        answer = {"event": "served", "request_tokens": len(tokens), "lookup_blocks": cached_blocks,
                  "restored_tokens": restored.n_tokens, "restored_blocks": restored.n_blocks,
                  "prefilled_tokens": len(tokens) - restored.n_tokens, "generated": generated,
                  "lookup_s": t1 - t0, "restore_s": t2 - t1, "remainder_prefill_s": t3 - t2,
                  "decode_s": t4 - t3}
        if cmd.get("check"):
            # the prefix came from one forward pass over the prompt (worker A's prefill)
            answer.update(self._check(tokens, restored, step_logits, [], n_new))
        return answer

    def _check(self, tokens: list[int], restored: Any, step_logits: torch.Tensor, prefix_bounds: list[int],
               n_new: int) -> dict[str, Any]:
        """Recompute without the pod: (1) with the forward passes cut where the restored path's were, bitwise;
        (2) one forward pass over the whole request, to a tolerance. Also: the restored bytes equal a local
        recompute of the same blocks."""
        with torch.inference_mode():
            t0 = time.perf_counter()
            # the part the pod supplied, recomputed with the forward passes that first computed it
            cache, _ = self.forward_chunks(tokens[:restored.n_tokens], prefix_bounds)
            t1 = time.perf_counter()
            local_blocks = self.kv.layout.pack(cache, restored.n_blocks)
            logits = self.forward(tokens[restored.n_tokens:], cache)
            _, chunked = self.generate(cache, logits, n_new)
            t2 = time.perf_counter()
            one_cache, one_logits = self.forward_chunks(tokens, [])
            t3 = time.perf_counter()
            one_tokens, one_pass = self.generate(one_cache, one_logits, n_new)
        return {
            "restored_bytes_equal_recompute": torch.equal(local_blocks, restored.buffer),
            "chunked_recompute_bitwise_equal": torch.equal(step_logits, chunked),
            "chunked_recompute_max_abs_diff": (step_logits - chunked).abs().max().item(),
            "one_pass_bitwise_equal": torch.equal(step_logits, one_pass),
            "one_pass_max_abs_diff": (step_logits - one_pass).abs().max().item(),
            "one_pass_max_logit": one_pass.abs().max().item(),
            "one_pass_tokens_equal": one_tokens == [int(x) for x in step_logits.argmax(-1)],
            "recompute_prefix_s": t1 - t0,
            "recompute_full_s": t3 - t2,
        }

    def bench(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Median times over ``repeat`` rounds for the request of ``serve``: restore of the cached prefix vs
        its prefill, and time to the first token's logits with and without the pod."""
        prompt = seeded_tokens(cmd["prompt_seed"], cmd["prompt_len"])
        tokens = prompt + seeded_tokens(cmd["question_seed"], cmd["question_len"])
        rounds: dict[str, list[float]] = {"restore_s": [], "restore_ttft_s": [], "prefill_prefix_s": [],
                                          "recompute_ttft_s": []}
        with torch.inference_mode():
            for _ in range(cmd.get("repeat", 5)):
                t0 = time.perf_counter()
                restored = self.kv.restore(tokens)
                t1 = time.perf_counter()
                self.forward(tokens[restored.n_tokens:], restored.cache)
                t2 = time.perf_counter()
                self.forward_chunks(tokens[:restored.n_tokens], [])
                t3 = time.perf_counter()
                self.forward_chunks(tokens, [])
                t4 = time.perf_counter()
                for key, value in zip(rounds, (t1 - t0, t2 - t0, t3 - t2, t4 - t3)):
                    rounds[key].append(value)
        answer: dict[str, Any] = {"event": "bench", "restored_tokens": restored.n_tokens,
                                  "request_tokens": len(tokens), "repeat": len(rounds["restore_s"])}
        answer.update({key: statistics.median(values) for key, values in rounds.items()})
        return answer

    def park(self, cmd: dict[str, Any]) -> dict[str, Any]:
        assert self.session is not None, "park needs a served session"
        tokens, cache = self.session["tokens"], self.session["cache"]
        t0 = time.perf_counter()
        result = self.kv.park(tokens, cache, ttl=cmd["ttl"], pin=cmd["pin"])
        parked = (min(len(tokens), cache.get_seq_length()) // self.kv.block_size) * self.kv.block_size
        return {"event": "parked", "tokens": tokens, "history": self.session["history"],
                "parked_tokens": parked, "stored": result.stored, "existed": result.existed,
                "failed": result.failed, "park_s": time.perf_counter() - t0}

    def resume(self, cmd: dict[str, Any]) -> dict[str, Any]:
        tokens = cmd["tokens"] + seeded_tokens(cmd["tool_seed"], cmd["tool_len"])
        n_new = cmd["max_new"]
        with torch.inference_mode():
            t0 = time.perf_counter()
            restored = self.kv.restore(tokens, pin=cmd.get("pin", 0.0))
            t1 = time.perf_counter()
            logits = self.forward(tokens[restored.n_tokens:], restored.cache)
            generated, step_logits = self.generate(restored.cache, logits, n_new)
        answer = {"event": "resumed", "request_tokens": len(tokens), "restored_tokens": restored.n_tokens,
                  "restored_blocks": restored.n_blocks, "prefilled_tokens": len(tokens) - restored.n_tokens,
                  "generated": generated, "restore_s": t1 - t0}
        if cmd.get("check"):
            bounds = [b for b in cmd["history"] if b < restored.n_tokens]
            answer.update(self._check(tokens, restored, step_logits, bounds, n_new))
        if cmd.get("unpin"):
            self.kv.unpin(tokens)
        return answer

    def probe(self, cmd: dict[str, Any]) -> dict[str, Any]:
        prompt = seeded_tokens(cmd["prompt_seed"], cmd["prompt_len"])
        first_differs = list(prompt)
        first_differs[7] = (first_differs[7] + 1) % VOCAB
        answer: dict[str, Any] = {"event": "probed", "same_prompt_lookup": self.kv.lookup(prompt)}
        restored = self.kv.restore(first_differs)
        answer["first_block_differs"] = {"lookup": self.kv.lookup(first_differs),
                                         "restored_tokens": restored.n_tokens,
                                         "cache_tokens": restored.cache.get_seq_length()}
        others = {"3_layers": tiny_config(layers=3), "other_rms_norm_eps": tiny_config(rms_norm_eps=1e-5)}
        for name, config in others.items():
            other = KVNamespace.open(self.store, self.bucket, config, model_id=MODEL_ID,
                                     revision=self.kv.ns.fingerprint.revision)
            restored = other.restore(prompt)
            answer[name] = {"lookup": other.lookup(prompt), "restored_tokens": restored.n_tokens,
                            "fingerprint_differs": other.ns.fingerprint != self.kv.ns.fingerprint}
        return answer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bucket", default="kv-tiny-llama")
    parser.add_argument("--model-seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    args = parser.parse_args(argv)
    worker = Worker(args)
    print(json.dumps({"event": "ready", "pid": os.getpid(), "load_s": worker.load_s,
                      "torch": torch.__version__, "threads": torch.get_num_threads()}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        answer = getattr(worker, cmd["op"])(cmd)
        print(json.dumps(answer), flush=True)
    worker.store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
