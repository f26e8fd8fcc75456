"""KV blocks into and out of GPU memory through the client's staging pool, against the host-only restore and save of
the same run, and a 32k-token time to first token: restore + one decode step against a full prefill.

Command (from the repository root; results go in docs/benchmarks.md):

    .venv/bin/python benchmarks/gpu_restore.py                    # on a machine with one CUDA GPU
    .venv/bin/python benchmarks/gpu_restore.py --device cpu       # the host backend (no GPU): the same pipeline

It starts a local node (``ctxstore serve --workers W``, W = half the cores, pinned to them; the client runs on the
other cores with its default threads) and prints one JSON line (and a table) with, measured in the same run:

- ``ceilings`` (CUDA): pinned and pageable host<->device copies of one ``--big`` buffer and in 2 MiB pieces;
- ``host``: restore and save of ``--big`` bytes in 2 MiB blocks (and 128 MiB in 64 KiB blocks) into and out of
  host memory (pinned on a GPU), no staging: the client alone;
- ``flat``: the same into and out of one device tensor through the staging pool; ``paged``: into and out of a
  vLLM-like paged cache (32 layers of ``[num_blocks, 8 heads, 16 tokens, 256 bytes]`` per block, block ids
  shuffled) through :class:`ctxstore.integrations.vllm.layout.PagedTarget`; each with its ratio to ``host``;
- ``ttft`` (CUDA, ``--ttft``): a Llama-3.1-8B-shaped model (random weights from transformers' own
  initialisation, bf16, SDPA, built on the device: nothing downloaded) prefills 32,769 tokens; its KV is saved
  with ``KVNamespace.save``; then ``KVNamespace.restore(device="cuda")`` + one decode step, with the restored
  bytes and the next-token logits compared bit for bit with the prefill's.

Every restore is checked (XXH3-128 of what landed against what was saved). Rounds: median and p99 of
``--rounds`` after one warm-up. On a machine without internet, bring the server's wheels (listed in
docs/benchmarks.md, "GPU") and run from the checkout with ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import xxhash

from ctxstore.units import parse_size

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import ACCESS, SECRET, Processes, ctxstore_argv, free_port, stats, today, wait_ctxstore

MiB = 1 << 20
BLOCK_TOKENS = 16


def timed(fn: Callable[[], Any], rounds: int, sync: Callable[[], None]) -> tuple[list[float], Any]:
    out = None
    times = []
    for r in range(rounds + 1):
        sync()
        t0 = time.perf_counter()
        out = fn()
        sync()
        if r:
            times.append(time.perf_counter() - t0)
    return times, out


def summary(times: list[float], nbytes: int) -> dict[str, float]:
    med, p99 = stats(times)
    return {"median_ms": round(med * 1e3, 2), "p99_ms": round(p99 * 1e3, 2), "gbps": round(nbytes / med / 1e9, 2)}


def digest(t: torch.Tensor) -> int:
    return xxhash.xxh3_128_intdigest(t.detach().reshape(-1).view(torch.uint8).cpu().numpy())


def ceilings(big: int, device: str, rounds: int) -> dict[str, Any]:
    if device != "cuda":
        return {}
    sync = torch.cuda.synchronize
    dev = torch.empty(big, dtype=torch.uint8, device="cuda")
    out: dict[str, Any] = {}
    for kind, pinned in (("pinned", True), ("pageable", False)):
        host = torch.empty(big, dtype=torch.uint8, pin_memory=pinned)
        host.fill_(1)
        out[f"{kind}_h2d"] = summary(timed(lambda: dev.copy_(host, non_blocking=pinned), rounds, sync)[0], big)
        out[f"{kind}_d2h"] = summary(timed(lambda: host.copy_(dev, non_blocking=pinned), rounds, sync)[0], big)
        if pinned:
            pieces = big // (2 * MiB)

            def pieces_h2d() -> None:
                for i in range(pieces):
                    dev[i * 2 * MiB:(i + 1) * 2 * MiB].copy_(host[i * 2 * MiB:(i + 1) * 2 * MiB], non_blocking=True)

            out["pinned_h2d_2MiB_pieces"] = summary(timed(pieces_h2d, rounds, sync)[0], big)
    return out


def transfers(store: Any, big: int, device: str, rounds: int) -> dict[str, Any]:
    """Host-only, flat and paged restores and saves of the same blocks, in the same run."""
    from ctxstore.integrations.vllm.layout import PagedLayout

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    results: dict[str, Any] = {}
    rng = random.Random(1)
    for label, block_bytes, total in (("2MiB", 2 * MiB, big), ("64KiB", 64 << 10, 128 * MiB)):
        n = total // block_bytes
        tokens = [rng.randrange(128000) for _ in range(n * BLOCK_TOKENS)]
        source = torch.randint(0, 256, (n, block_bytes), dtype=torch.uint8)
        expected = digest(source)
        ns = store.namespace(f"bench-gpu-{label.lower()}", model="bench/gpu", block_size=BLOCK_TOKENS)
        if ns.save(tokens, list(source.numpy())).stored + ns.lookup(tokens) < n:
            raise RuntimeError("loading the blocks failed")
        host_out = torch.empty(n, block_bytes, dtype=torch.uint8, pin_memory=device == "cuda")
        dev_out = torch.empty(n, block_bytes, dtype=torch.uint8, device=device)
        row: dict[str, Any] = {}

        def check(out: torch.Tensor, got: int) -> None:
            if got != n or digest(out) != expected:
                raise RuntimeError(f"{label}: wrong or missing blocks")

        times, got = timed(lambda: ns.restore(tokens, out=host_out.numpy()).n_blocks, rounds, sync)
        check(host_out, got)
        row["host_restore"] = summary(times, total)
        times, got = timed(lambda: ns.restore(tokens, out=dev_out).n_blocks, rounds, sync)
        check(dev_out, got)
        row["flat_restore"] = summary(times, total)
        if device == "cpu":  # the pipeline alone: the host backend's copies skipped (its one cost a GPU does not have)
            from ctxstore.staging import HostBackend

            submit = HostBackend.submit
            HostBackend.submit = lambda self, work: None  # type: ignore[method-assign]
            try:
                row["pipeline_restore"] = summary(
                    timed(lambda: ns.restore(tokens, out=dev_out).n_blocks, rounds, sync)[0], total)
            finally:
                HostBackend.submit = submit  # type: ignore[method-assign]

        # A vLLM-like paged cache: 32 layers, each block [8 heads, 16 tokens, block_bytes / 32 / 128 bytes].
        layers, heads = 32, 8
        content = block_bytes // layers // heads // BLOCK_TOKENS
        num_blocks = n + 7
        caches = {f"l{i}": torch.zeros(num_blocks, heads, BLOCK_TOKENS, content, dtype=torch.uint8, device=device)
                  for i in range(layers)}
        paged = PagedLayout.from_kv_caches(caches, num_blocks)
        ids = list(range(num_blocks))
        random.Random(2).shuffle(ids)
        ids = ids[:n]
        times, sizes = timed(lambda: store.get_keys_staged(ns.bucket, ns.block_hashes(tokens),
                                                           paged.target(ids)), rounds, sync)
        if len(sizes) != n or digest(paged.gather(ids)) != expected:
            raise RuntimeError(f"{label}: the paged restore is wrong")
        row["paged_restore"] = summary(times, total)

        def fresh() -> list[int]:
            return [rng.randrange(128000) for _ in range(n * BLOCK_TOKENS)]

        def save(blocks: Any) -> Callable[[], Any]:
            def run() -> Any:
                new = fresh()
                result = ns.save(new, blocks)
                ns.delete(new)
                return result.stored
            return run

        dev_src = source.to(device)
        row["host_save"] = summary(timed(save(list(source.numpy())), rounds, sync)[0], total)
        row["flat_save"] = summary(timed(save(dev_src), rounds, sync)[0], total)

        def paged_save() -> Any:
            new = fresh()
            keys = ns.block_hashes(new)
            result = store.put_keys_staged(ns.bucket, keys, paged.target(ids))
            store.keys_op(ns.bucket, "delete", keys)
            return result.stored

        row["paged_save"] = summary(timed(paged_save, rounds, sync)[0], total)
        for kind in ("restore", "save"):
            base = row[f"host_{kind}"]["median_ms"]
            for where in ("flat", "paged", "pipeline"):
                if f"{where}_{kind}" in row:
                    row[f"{where}_{kind}"]["over_host"] = round(base / row[f"{where}_{kind}"]["median_ms"], 2)
        results[label] = row
        del source, dev_src, host_out, dev_out, caches, paged
    return results


def pool_run(store: Any, big: int, device: str, rounds: int) -> dict[str, Any]:
    """Flat restore and save of ``big`` bytes in 2 MiB blocks (the blocks ``transfers`` saved), this store's pool."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    n, block_bytes = big // (2 * MiB), 2 * MiB
    rng = random.Random(1)
    tokens = [rng.randrange(128000) for _ in range(n * BLOCK_TOKENS)]  # the same prompt as transfers' first
    ns = store.namespace("bench-gpu-2mib", model="bench/gpu", block_size=BLOCK_TOKENS, create=False)
    out = torch.empty(n, block_bytes, dtype=torch.uint8, device=device)
    times, got = timed(lambda: ns.restore(tokens, out=out).n_blocks, rounds, sync)
    if got != n:
        raise RuntimeError("pool run: missing blocks")
    row = {"flat_restore": summary(times, big)}
    source = out.clone()

    def save() -> Any:
        new = [rng.randrange(128000) for _ in range(n * BLOCK_TOKENS)]
        result = ns.save(new, source)
        ns.delete(new)
        return result

    row["flat_save"] = summary(timed(save, rounds, sync)[0], big)
    return row


def ttft(store: Any, device: str, tokens_n: int, tiny: bool) -> dict[str, Any]:
    """A Llama-3.1-8B-shaped model on the device: a full prefill of ``tokens_n`` tokens against restoring the
    first ``tokens_n - 1`` tokens' KV and one decode step. The decode step's logits are compared with the same
    step run on the cache the prefill of those tokens made (same kernels, same inputs: bit for bit)."""
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    from ctxstore.integrations.transformers import KVNamespace, cache_kwarg

    shape = dict(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2) if tiny else \
        dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
             num_attention_heads=32, num_key_value_heads=8)
    config = LlamaConfig(max_position_embeddings=tokens_n + 8, **shape)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16 on the device: no fp32 copy of 8B parameters
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(default)
    kw = cache_kwarg(model)
    ids = torch.randint(0, config.vocab_size, (1, tokens_n), device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def forward(input_ids: torch.Tensor, cache: Any) -> torch.Tensor:
        return model(input_ids=input_ids, use_cache=True, logits_to_keep=1, **{kw: cache}).logits[0, -1]

    with torch.inference_mode():
        forward(ids[:, :64], DynamicCache())  # warm-up: kernels loaded
        sync()
        t0 = time.perf_counter()
        forward(ids, DynamicCache())
        sync()
        prefill = time.perf_counter() - t0
        cache = DynamicCache()
        forward(ids[:, :-1], cache)  # the prefix's KV, as a worker that served it holds it
        reference_cache = [(k.clone(), v.clone()) for k, v in _pairs(cache)]
    kv = KVNamespace.open(store, "bench-gpu-ttft", model, model_id="bench/llama-8b-shape")
    sync()
    t0 = time.perf_counter()
    saved = kv.save(ids[0, :-1].tolist(), cache)
    sync()
    save_s = time.perf_counter() - t0
    with torch.inference_mode():
        reference = forward(ids[:, -1:], cache)
        del cache
        sync()
        t0 = time.perf_counter()
        restored = kv.restore(ids[0].tolist(), device=device)
        sync()
        restore_s = time.perf_counter() - t0
        step = forward(ids[:, restored.n_tokens:], restored.cache)
        sync()
        first_token = time.perf_counter() - t0
    n_tok = restored.n_tokens
    same_bytes = all(torch.equal(a[0][:, :, :n_tok], b[0][:, :, :n_tok]) and torch.equal(a[1][:, :, :n_tok],
                                                                                         b[1][:, :, :n_tok])
                     for a, b in zip(reference_cache, _pairs(restored.cache)))
    nbytes = kv.layout.block_bytes * restored.n_blocks
    return {"tokens": tokens_n, "model": "tiny" if tiny else "llama-3.1-8b-shape", "prefill_s": round(prefill, 3),
            "save_s": round(save_s, 3), "saved_blocks": saved.stored + saved.existed,
            "restore_s": round(restore_s, 3), "restore_gbps": round(nbytes / restore_s / 1e9, 2),
            "restore_plus_step_s": round(first_token, 3), "ttft_ratio": round(first_token / prefill, 3),
            "restored_tokens": n_tok, "bytes_identical": same_bytes,
            "logits_identical": bool(torch.equal(reference, step))}


def _pairs(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    from ctxstore.integrations.transformers import cache_tensors

    return cache_tensors(cache)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--big", type=parse_size, default=4 << 30, help="bytes of the 2 MiB-block transfers")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    parser.add_argument("--ttft", type=int, default=32769, help="prompt tokens of the TTFT run (0: skip)")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model for the TTFT run (a dry run)")
    parser.add_argument("--pools", type=lambda t: [parse_size(x) for x in t.split(",") if x], default=[],
                        help="staging pool sizes to run the flat restore and save again with, e.g. 1GiB,2GiB")
    args = parser.parse_args()
    if args.device == "cpu" and not args.tiny:
        args.ttft = 0  # an 8B-shaped prefill of 32k tokens is not a CPU job
    cores = os.cpu_count() or 1
    procs = Processes()
    report: dict[str, Any] = {"date": today(), "device": args.device, "cores": cores, "workers": args.workers,
                              "big": args.big, "torch": torch.__version__}
    if args.device == "cuda":
        report["gpu"] = torch.cuda.get_device_name()
    started = time.monotonic()
    try:
        port = free_port()
        memory = f"{(3 * args.big + (1 << 30)) >> 20}MiB"
        env = {**os.environ, "CTXSTORE_ACCESS_KEY": ACCESS, "CTXSTORE_SECRET_KEY": SECRET}
        node_cores = f"0-{args.workers - 1}" if args.workers > 1 else "0"
        node = procs.start("ctxstore", [*ctxstore_argv(port, memory), "--workers", str(args.workers)], env,
                           core=node_cores)
        for i in range(args.workers):
            wait_ctxstore(procs, node, port + i)
        if cores > args.workers:
            os.sched_setaffinity(0, set(range(args.workers, cores)))
            torch.set_num_threads(cores - args.workers)  # the host backend's copies: as many threads as cores
        from ctxstore import ContextStore, Timeouts

        with ContextStore(f"127.0.0.1:{port}-{port + args.workers - 1}", access_key=ACCESS, secret_key=SECRET,
                          strict=True, timeouts=Timeouts(connect=5, read=30, total=300),
                          staging="host" if args.device == "cpu" else "auto") as store:
            report["client_threads"] = store.threads
            report["ceilings"] = ceilings(args.big, args.device, args.rounds)
            report["transfers"] = transfers(store, args.big, args.device, args.rounds)
            for pool in args.pools:  # the flat restore and save again with staging pools of other sizes
                with ContextStore(f"127.0.0.1:{port}-{port + args.workers - 1}",
                                  access_key=ACCESS, secret_key=SECRET, strict=True,
                                  timeouts=Timeouts(connect=5, read=30, total=300), staging_bytes=pool,
                                  staging="host" if args.device == "cpu" else "auto") as other:
                    report[f"pool_{pool >> 20}MiB"] = pool_run(other, args.big, args.device, args.rounds)
            print(json.dumps({"ceilings": report["ceilings"], "transfers": report["transfers"]}), flush=True)
            if args.ttft:
                try:
                    report["ttft"] = ttft(store, args.device, args.ttft, args.tiny)
                except Exception as exc:  # noqa: BLE001  (the figures above stand; say what failed)
                    report["ttft"] = {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        procs.stop()
    report["took_s"] = round(time.monotonic() - started, 1)
    print(json.dumps(report), flush=True)
    print()
    print("| blocks | path | restore GB/s | ÷ host | save GB/s | ÷ host |")
    print("|---|---|---:|---:|---:|---:|")
    for label, row in report["transfers"].items():
        for where in ("host", "flat", "pipeline", "paged"):
            if f"{where}_restore" not in row:
                continue
            r, s = row[f"{where}_restore"], row.get(f"{where}_save", {})
            print(f"| {label} | {where} | {r['gbps']} | {r.get('over_host', 1.0)} | {s.get('gbps', '–')} | "
                  f"{s.get('over_host', '–' if not s else 1.0)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
