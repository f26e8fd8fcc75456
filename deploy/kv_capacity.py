#!/usr/bin/env python3
"""KV-cache capacity arithmetic for sizing a ctxstore pod (docs/deployment.md prints its tables).

    KV bytes per token = 2 (K and V) x layers x KV heads x head dim x bytes per element
    block bytes        = tokens per block x KV bytes per token
    charged per block  = block bytes + key bytes + OBJECT_OVERHEAD (700 B, docs/architecture.md)

Run it with no arguments for the tables in docs/deployment.md, or describe your own model:

    python3 deploy/kv_capacity.py --layers 32 --kv-heads 8 --head-dim 128 --dtype-bytes 2 --budget 64GiB

Standard library only: it runs on an operator's laptop without ctxstore installed.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass

BLOCK_TOKENS = 16  # the client's default block size (ctxstore.Namespace block_size)
KEY_BYTES = 32  # default key: xxh3-128 chain as 32 hex characters
OBJECT_OVERHEAD = 700  # server/engine/objects.py OBJECT_OVERHEAD: fixed charge per stored object
GiB = 1 << 30
KiB = 1 << 10

# (name, layers, KV heads, head dim), from each model's published config.json.
MODELS: tuple[tuple[str, int, int, int], ...] = (
    ("Llama-3.1-8B / Llama-3-8B", 32, 8, 128),
    ("Llama-3.1-70B / Llama-3-70B", 80, 8, 128),
    ("Llama-3.1-405B", 126, 8, 128),
    ("Mistral-7B (v0.1-v0.3)", 32, 8, 128),
    ("Mixtral-8x7B", 32, 8, 128),
    ("Qwen2.5-7B", 28, 4, 128),
    ("Qwen2.5-32B", 64, 8, 128),
    ("Qwen2.5-72B", 80, 8, 128),
    ("Llama-2-7B (no GQA)", 32, 32, 128),
)
DTYPES: tuple[tuple[str, float], ...] = (("bf16/fp16", 2), ("fp8", 1))


@dataclass(frozen=True)
class Shape:
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: float

    @property
    def bytes_per_token(self) -> int:
        return int(2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes)


def block_bytes(shape: Shape, block_tokens: int = BLOCK_TOKENS) -> int:
    return block_tokens * shape.bytes_per_token


def charged_per_block(shape: Shape, block_tokens: int = BLOCK_TOKENS, key_bytes: int = KEY_BYTES) -> int:
    return block_bytes(shape, block_tokens) + key_bytes + OBJECT_OVERHEAD


def blocks_in(budget: int, shape: Shape, block_tokens: int = BLOCK_TOKENS) -> int:
    return budget // charged_per_block(shape, block_tokens)


def tokens_in(budget: int, shape: Shape, block_tokens: int = BLOCK_TOKENS) -> int:
    return blocks_in(budget, shape, block_tokens) * block_tokens


def human(n: float) -> str:
    """Bytes in binary units, exact when they divide evenly (128 KiB, 2 MiB), else to 3 significant digits."""
    for unit, size in (("GiB", GiB), ("MiB", 1 << 20), ("KiB", KiB)):
        if n >= size:
            value = n / size
            return f"{value:g} {unit}" if value == int(value) else f"{value:.3g} {unit}"
    return f"{int(n)} B"


def parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(B|KiB|MiB|GiB|TiB)?\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 512MiB, 64GiB)")
    scale = {None: 1, "B": 1, "KiB": KiB, "MiB": 1 << 20, "GiB": GiB, "TiB": 1 << 40}[match.group(2)]
    return int(float(match.group(1)) * scale)


def shapes_table() -> str:
    header = ("| model | layers | KV heads | head dim | KV per token, bf16 | KV per token, fp8 "
              f"| block of {BLOCK_TOKENS} tokens, bf16 | block, fp8 |")
    rows = [header, "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, layers, heads, dim in MODELS:
        bf16, fp8 = Shape(layers, heads, dim, 2), Shape(layers, heads, dim, 1)
        rows.append(f"| {name} | {layers} | {heads} | {dim} | {human(bf16.bytes_per_token)} "
                    f"({bf16.bytes_per_token:,} B) | {human(fp8.bytes_per_token)} | {human(block_bytes(bf16))} "
                    f"| {human(block_bytes(fp8))} |")
    return "\n".join(rows)


def capacity_table(budget: int, prompt_tokens: int) -> str:
    header = (f"| model | dtype | charged per block | blocks per GiB | tokens per GiB | tokens in {human(budget)} "
              f"| {prompt_tokens:,}-token prompts in {human(budget)} |")
    rows = [header, "|---|---|---:|---:|---:|---:|---:|"]
    for name, layers, heads, dim in MODELS:
        for dtype, nbytes in DTYPES:
            shape = Shape(layers, heads, dim, nbytes)
            per_block = charged_per_block(shape)
            rows.append(f"| {name} | {dtype} | {per_block:,} B | {blocks_in(GiB, shape):,} "
                        f"| {tokens_in(GiB, shape):,} | {tokens_in(budget, shape):,} "
                        f"| {tokens_in(budget, shape) // prompt_tokens:,} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", type=parse_size, default=64 * GiB, help="node or pod budget (default 64GiB)")
    parser.add_argument("--prompt-tokens", type=int, default=8192, help="tokens of a typical prompt (default 8192)")
    parser.add_argument("--layers", type=int, help="describe one model instead of printing the tables")
    parser.add_argument("--kv-heads", type=int)
    parser.add_argument("--head-dim", type=int)
    parser.add_argument("--dtype-bytes", type=float, default=2, help="2 for bf16/fp16, 1 for fp8")
    parser.add_argument("--block-tokens", type=int, default=BLOCK_TOKENS)
    args = parser.parse_args(argv)
    if args.layers is None:
        print(shapes_table())
        print()
        print(capacity_table(args.budget, args.prompt_tokens))
        return 0
    if not (args.kv_heads and args.head_dim):
        parser.error("--layers needs --kv-heads and --head-dim")
    shape = Shape(args.layers, args.kv_heads, args.head_dim, args.dtype_bytes)
    tokens = tokens_in(args.budget, shape, args.block_tokens)
    print(f"KV per token:      {shape.bytes_per_token:,} B ({human(shape.bytes_per_token)})")
    print(f"block ({args.block_tokens} tokens): {block_bytes(shape, args.block_tokens):,} B, "
          f"charged {charged_per_block(shape, args.block_tokens):,} B")
    print(f"in {human(args.budget)}: {blocks_in(args.budget, shape, args.block_tokens):,} blocks, "
          f"{tokens:,} tokens, {tokens // args.prompt_tokens:,} prompts of {args.prompt_tokens:,} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
