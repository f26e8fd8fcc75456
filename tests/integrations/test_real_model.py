"""A real Hugging Face model's KV cache through a real 3-node pod, every step in its own OS process.

The workers are ``examples/hf_worker.py`` (a small Llama-architecture model with seeded random weights,
nothing downloaded), driven with JSON lines. Worker A prefills a 2,000-token prompt, saves its 125 blocks and
is killed with SIGKILL; worker B restores them, prefills only the rest of its request, generates 32 tokens and
checks every step's logits against recomputes; B then parks its session for a tool call and worker C resumes
it. This test process never imports torch: it only starts processes and reads their answers.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from support import REPO_ROOT
from support.nodes import ACCESS_KEY, SECRET_KEY, Node

pytestmark = pytest.mark.real_model

ROOT = REPO_ROOT
WORKER = ROOT / "examples" / "hf_worker.py"

PROMPT = {"prompt_seed": 1, "prompt_len": 2000}  # 125 blocks of 16 tokens
QUESTION = {"question_seed": 2, "question_len": 37}
MAX_NEW = 32
# One forward pass over a whole request vs the chunks the workers ran: float32 rounding (see hf_worker.py).
ONE_PASS_TOLERANCE = 1e-4


class WorkerProcess:
    """``examples/hf_worker.py`` in its own process; ``call`` sends one command, returns the JSON answer."""

    def __init__(self, pod: list[Node], bucket: str, log: Path) -> None:
        env = {**os.environ, "CTXSTORE_NODES": ",".join(f"127.0.0.1:{n.port}" for n in pod),
               "CTXSTORE_ACCESS_KEY": ACCESS_KEY, "CTXSTORE_SECRET_KEY": SECRET_KEY, "HF_HUB_OFFLINE": "1",
               "TRANSFORMERS_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
        self.log = log
        with log.open("wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, str(WORKER), "--bucket", bucket, "--threads", "1"], env=env,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True, bufsize=1)
        self.ready: dict[str, Any] | None = None

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(10)
            raise AssertionError(f"worker exited ({self.proc.returncode}):\n{self.log.read_text()[-4000:]}")
        return json.loads(line)

    def wait_ready(self) -> dict[str, Any]:
        if self.ready is None:
            self.ready = self.read()
            assert self.ready["event"] == "ready", self.ready
        return self.ready

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        self.wait_ready()
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        return self.read()

    def close(self) -> int:
        """Close stdin (the worker exits at EOF) and wait; returns the exit code."""
        if self.proc.poll() is None and self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            return self.proc.wait(30)
        finally:
            self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None and not pipe.closed:
                pipe.close()


def test_restore_real_model_kv_across_processes(pod: list[Node], tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    started = time.monotonic()
    bucket = "hf-" + secrets.token_hex(6)
    a = WorkerProcess(pod, bucket, tmp_path / "worker-a.log")
    b = WorkerProcess(pod, bucket, tmp_path / "worker-b.log")  # loads its model while A works
    workers = [a, b]
    try:
        # Worker A: prefill, save 125 blocks, say so; then it dies without warning.
        saved = a.call("prefill_save", **PROMPT)
        assert saved["event"] == "saved" and saved["tokens"] == 2000
        assert saved["stored"] == 125 and saved["failed"] == 0
        a.proc.send_signal(signal.SIGKILL)
        assert a.proc.wait(10) == -signal.SIGKILL
        a.kill()  # closes its pipes
        c = WorkerProcess(pod, bucket, tmp_path / "worker-c.log")  # loads while B works
        workers.append(c)

        # Worker B: a new request = the 2,000 cached tokens + a 37-token question.
        served = b.call("serve", **PROMPT, **QUESTION, max_new=MAX_NEW, check=True)
        assert served["request_tokens"] == 2037
        assert served["lookup_blocks"] == 125 and served["restored_blocks"] == 125
        assert served["restored_tokens"] == 2000 and served["prefilled_tokens"] == 37
        assert len(served["generated"]) == MAX_NEW
        assert served["restored_bytes_equal_recompute"]  # the pod returned exactly what A computed
        assert served["chunked_recompute_bitwise_equal"], served["chunked_recompute_max_abs_diff"]
        assert served["one_pass_tokens_equal"]
        assert served["one_pass_max_abs_diff"] <= ONE_PASS_TOLERANCE, served["one_pass_max_abs_diff"]

        # Negative cases: a first block that differs, and other model configs' namespaces, restore nothing.
        probed = b.call("probe", **PROMPT)
        assert probed["same_prompt_lookup"] == 125
        assert probed["first_block_differs"] == {"lookup": 0, "restored_tokens": 0, "cache_tokens": 0}
        for name in ("3_layers", "other_rms_norm_eps"):
            assert probed[name] == {"lookup": 0, "restored_tokens": 0, "fingerprint_differs": True}, name

        # Agentic: B's session calls a tool; B parks the context (long TTL, pinned) and goes away.
        parked = b.call("park", ttl=3600, pin=600)
        assert parked["parked_tokens"] == 2064  # 2037 + 31 fed-back tokens = 2068 in cache: 129 full blocks
        assert parked["stored"] == 4 and parked["existed"] == 125 and parked["failed"] == 0
        assert b.close() == 0

        # Worker C resumes the session with the tool's result and continues generating.
        resumed = c.call("resume", tokens=parked["tokens"], history=parked["history"], tool_seed=3,
                         tool_len=21, max_new=16, check=True, unpin=True)
        assert resumed["request_tokens"] == 2069 + 21
        assert resumed["restored_blocks"] == 129 and resumed["restored_tokens"] == 2064
        assert resumed["prefilled_tokens"] == 26
        assert resumed["restored_bytes_equal_recompute"]
        assert resumed["chunked_recompute_bitwise_equal"], resumed["chunked_recompute_max_abs_diff"]
        assert resumed["one_pass_tokens_equal"]
        assert resumed["one_pass_max_abs_diff"] <= ONE_PASS_TOLERANCE, resumed["one_pass_max_abs_diff"]
        assert c.close() == 0
    finally:
        for worker in workers:
            worker.kill()
    with capsys.disabled():
        print(f"\n[real model] 2,000-token prompt, 125 blocks of {saved['block_bytes'] // 1024} KiB: "
              f"restore {served['restore_s'] * 1e3:.1f} ms + prefill of the last 37 tokens "
              f"{served['remainder_prefill_s'] * 1e3:.1f} ms, vs recompute of the 2,000-token prefix "
              f"{served['recompute_prefix_s'] * 1e3:.1f} ms / of the whole 2,037-token request "
              f"{served['recompute_full_s'] * 1e3:.1f} ms (1 thread); one-pass max |diff| "
              f"{served['one_pass_max_abs_diff']:.2g}; resume restore {resumed['restore_s'] * 1e3:.1f} ms; "
              f"test {time.monotonic() - started:.1f} s (single runs, the first in each process; medians: "
              "python examples/restore_demo.py)")


# ---------------------------------------------------------------------------- the integration in this process


@pytest.fixture(scope="module")
def hf() -> Any:
    """torch, transformers and the integration, imported here only (the workers above import their own)."""
    import importlib
    import types
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # import-time deprecation chatter of third-party modules
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        torch = importlib.import_module("torch")
        transformers = importlib.import_module("transformers")
        integration = importlib.import_module("ctxstore.integrations.transformers")
    torch.set_num_threads(1)
    return types.SimpleNamespace(torch=torch, transformers=transformers, kv=integration)


def small_model(hf: Any, *, seed: int = 0, dtype: Any = None) -> Any:
    config = hf.transformers.LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=16, max_position_embeddings=256)
    hf.torch.manual_seed(seed)
    model = hf.transformers.LlamaForCausalLM(config).eval()
    return model.to(dtype) if dtype is not None else model


def run(hf: Any, model: Any, tokens: list[int], cache: Any) -> Any:
    kw = hf.kv.cache_kwarg(model)
    with hf.torch.inference_mode():
        out = model(input_ids=hf.torch.tensor([tokens]), use_cache=True, logits_to_keep=1, **{kw: cache})
    return out.logits[0, -1]


def test_block_layout_is_token_major_and_restores_as_views(hf: Any) -> None:
    torch = hf.torch
    model = small_model(hf)
    layout = hf.kv.KVLayout.from_config(model.config)
    shape = (layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.dtype)
    assert shape == (2, 2, 16, torch.float32)
    assert layout.block_shape == (16, 2, 2, 2, 16) and layout.block_bytes == 16 * 2 * 2 * 2 * 16 * 4
    tokens = list(range(3, 43))
    cache = hf.transformers.DynamicCache()
    run(hf, model, tokens[:32], cache)
    pairs = hf.kv.cache_tensors(cache)
    blocks = layout.pack(cache, 2)
    # block[i][t][layer][k|v][head][d] = the cache's layer tensors [batch 0, head, 16 i + t, d]
    expected = torch.stack([torch.stack([k[0], v[0]]) for k, v in pairs])  # [layer, kv, head, token, d]
    assert torch.equal(blocks, expected.permute(3, 0, 1, 2, 4).reshape(2, *layout.block_shape))

    restored = layout.unpack(blocks, 30)
    assert restored.get_seq_length() == 30
    for (k, v), (rk, rv) in zip(pairs, hf.kv.cache_tensors(restored)):
        assert torch.equal(rk, k[:, :, :30]) and torch.equal(rv, v[:, :, :30])
        assert rk.untyped_storage().data_ptr() == blocks.untyped_storage().data_ptr()  # a view, not a copy
    # Continuing from the rebuilt cache is bit-identical to continuing from the original one.
    full = layout.unpack(blocks.clone(), 32)
    assert torch.equal(run(hf, model, tokens[32:], full), run(hf, model, tokens[32:], cache))


def test_bfloat16_blocks_round_trip(hf: Any) -> None:
    model = small_model(hf, dtype=hf.torch.bfloat16)
    layout, fields = hf.kv.namespace_fields(model, model_id="t/bf16")
    assert layout.dtype == hf.torch.bfloat16 and fields["kv_dtype"] == "bfloat16"
    cache = hf.transformers.DynamicCache()
    run(hf, model, list(range(20)), cache)
    blocks = layout.pack(cache, 1)
    assert blocks.dtype == hf.torch.bfloat16 and blocks.numel() * 2 == layout.block_bytes
    (k, v), (rk, rv) = hf.kv.cache_tensors(cache)[1], hf.kv.cache_tensors(layout.unpack(blocks, 16))[1]
    assert hf.torch.equal(rk, k[:, :, :16]) and hf.torch.equal(rv, v[:, :, :16])


def test_fingerprint_comes_from_the_model_config(hf: Any) -> None:
    from ctxstore import Fingerprint

    LlamaConfig = hf.transformers.LlamaConfig
    base = {"vocab_size": 100, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}

    def fingerprint(dtype: Any = None, **changes: Any) -> Fingerprint:
        _, fields = hf.kv.namespace_fields(LlamaConfig(**{**base, **changes}), model_id="t/m", dtype=dtype)
        known = {"model", "revision", "kv_dtype", "kv_layout", "block_size"}
        return Fingerprint(**{k: v for k, v in fields.items() if k in known},
                           extra={k: v for k, v in fields.items() if k not in known})

    same = fingerprint()
    assert same == fingerprint() and same.kv_layout == hf.kv.KV_LAYOUT
    assert (same.extra["arch"], same.extra["n_layers"], same.extra["n_kv_heads"], same.extra["head_dim"]) == (
        "llama", "2", "2", "16")
    variants = [fingerprint(num_hidden_layers=3), fingerprint(num_key_value_heads=4), fingerprint(head_dim=32),
                fingerprint(dtype=hf.torch.bfloat16), fingerprint(rms_norm_eps=1e-5),
                fingerprint(vocab_size=101)]
    digests = {f.hexdigest() for f in variants}
    assert len(digests) == len(variants) and same.hexdigest() not in digests
    # Without a model_id the checkpoint's name (name_or_path) is the model; a random model's type stands in.
    _, fields = hf.kv.namespace_fields(LlamaConfig(**base))
    assert fields["model"] == "llama"


def test_caches_without_the_full_history_are_refused(hf: Any) -> None:
    from transformers.cache_utils import DynamicLayer

    config = hf.transformers.MistralConfig(vocab_size=100, hidden_size=64, intermediate_size=128,
                                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                           sliding_window=8)
    with pytest.raises(NotImplementedError, match="sliding"):
        hf.kv.KVLayout.from_config(config)

    class SlidingLayer(DynamicLayer):  # any layer type but the full-history ones
        is_sliding = True

    model = small_model(hf)
    cache = hf.transformers.DynamicCache()
    run(hf, model, list(range(16)), cache)
    cache.layers[1].__class__ = SlidingLayer
    with pytest.raises(NotImplementedError, match="SlidingLayer"):
        hf.kv.KVLayout.from_config(model.config).pack(cache, 1)


@pytest.mark.parametrize("staging", ["auto", "host"])
def test_save_restore_through_the_pod(hf: Any, pod: list[Node], staging: str) -> None:
    # "host": the cache's blocks and the restore buffer go through the client's staging pool (host backend), the
    # path a GPU cache takes, here with CPU tensors.
    from ctxstore import ContextStore

    torch = hf.torch
    model = small_model(hf)
    tokens = [7 + i % 50 for i in range(40)]  # 2 full blocks and 8 tokens
    cache = hf.transformers.DynamicCache()
    run(hf, model, tokens[:39], cache)  # the last token is not fed yet: the cache holds 39
    with ContextStore([n.endpoint for n in pod], access_key=ACCESS_KEY, secret_key=SECRET_KEY,
                      staging=staging) as store:
        kv = hf.kv.KVNamespace.open(store, "hf-" + secrets.token_hex(6), model, model_id="t/small")
        assert kv.save(tokens, cache).stored == 2
        assert kv.save(tokens, cache).existed == 2
        assert kv.lookup(tokens) == 2

        restored = kv.restore(tokens[:32])  # default: leave the last token for the caller's forward pass
        assert (restored.n_blocks, restored.n_tokens, restored.cache.get_seq_length()) == (2, 31, 31)
        restored = kv.restore(tokens[:32], max_tokens=32)
        assert (restored.n_blocks, restored.n_tokens) == (2, 32)
        assert torch.equal(restored.buffer, kv.layout.pack(cache, 2))

        out = kv.layout.empty(4)  # a caller's buffer, larger than needed
        restored = kv.restore(tokens, out=out)
        assert restored.n_tokens == 32
        keys = hf.kv.cache_tensors(restored.cache)[0][0]
        assert keys.untyped_storage().data_ptr() == out.untyped_storage().data_ptr()
        assert torch.equal(run(hf, model, tokens[32:], restored.cache),
                           run(hf, model, tokens[32:], kv.layout.unpack(kv.layout.pack(cache, 2), 32)))

        other = list(tokens)
        other[0] += 1
        miss = kv.restore(other)
        assert (miss.n_blocks, miss.n_tokens, miss.cache.get_seq_length()) == (0, 0, 0)
        parked = kv.park(tokens, cache, ttl=3600, pin=60)
        assert parked.existed == 2 and kv.unpin(tokens) == 2
