"""The vLLM connector's pure parts, without vLLM: paged-cache layouts as byte pieces, restores scattered into
them through a real pod, and the namespace rules (tests/integrations/test_vllm_connector.py runs vLLM itself)."""

from __future__ import annotations

import secrets

import pytest
from support.nodes import ACCESS_KEY, SECRET_KEY, Node

torch = pytest.importorskip("torch")

from ctxstore import ConfigurationError, ContextStore  # noqa: E402
from ctxstore.buffers import Destinations, Scatter, byte_view  # noqa: E402
from ctxstore.integrations.vllm.keys import KeySpace, hash_seed  # noqa: E402
from ctxstore.integrations.vllm.layout import PagedLayout, contiguous_pieces  # noqa: E402

BLOCKS, HEADS, BS, HEAD = 6, 2, 32, 16


def cpu_caches(layers: int = 3, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """vLLM-CPU's per-layer layout: [num_blocks, kv_heads, block_size, 2 * head_dim]."""
    gen = torch.Generator().manual_seed(1)
    return {f"model.layers.{i}.self_attn.attn": torch.randn(BLOCKS, HEADS, BS, 2 * HEAD, generator=gen).to(dtype)
            for i in range(layers)}


def flash_caches(layers: int = 2) -> dict[str, torch.Tensor]:
    """FlashAttention's layout: [2, num_blocks, block_size, kv_heads, head_dim] (K and V apart)."""
    gen = torch.Generator().manual_seed(2)
    return {f"l{i}": torch.randn(2, BLOCKS, BS, HEADS, HEAD, generator=gen) for i in range(layers)}


def test_cpu_layout_is_one_contiguous_piece_per_layer_and_block() -> None:
    caches = cpu_caches()
    layout = PagedLayout.from_kv_caches(caches, BLOCKS)
    per_layer = HEADS * BS * 2 * HEAD * 2
    assert layout.block_bytes == 3 * per_layer and layout.pieces_per_block == 3
    assert layout.describe() == f"[B,{HEADS},{BS},{2 * HEAD}]bfloat16x3"
    pieces = layout.block_pieces(4)
    for piece, tensor in zip(pieces, caches.values()):
        assert piece.data_ptr() == tensor[4].data_ptr() and piece.is_contiguous()  # views, not copies
    staged = layout.gather([4, 1])
    assert bytes(byte_view(staged[0])) == b"".join(bytes(byte_view(p)) for p in pieces)
    assert bytes(byte_view(staged[1])) == b"".join(bytes(byte_view(t[1])) for t in caches.values())
    with pytest.raises(IndexError):
        layout.block_pieces(BLOCKS)


def test_split_kv_layout_cuts_each_block_into_k_and_v() -> None:
    caches = flash_caches()
    layout = PagedLayout.from_kv_caches(caches, BLOCKS)
    assert layout.block_dims == (1, 1) and layout.pieces_per_block == 4
    pieces = layout.block_pieces(2)
    first = caches["l0"]
    assert [p.data_ptr() for p in pieces[:2]] == [first[0, 2].data_ptr(), first[1, 2].data_ptr()]
    staged = layout.gather([2])
    assert bytes(byte_view(staged[0])) == b"".join(bytes(byte_view(p)) for p in pieces)
    strided = torch.zeros(4, 4)[:, ::2]
    assert [p.shape for p in contiguous_pieces(strided)] == [torch.Size([])] * 8  # element by element


def test_kernel_blocks_are_grouped_into_cache_blocks() -> None:
    # vLLM may split a cache block into kernel blocks: [num_blocks * k, ...] is viewed as [num_blocks, k, ...].
    caches = {"l0": torch.arange(BLOCKS * 2 * 8, dtype=torch.float32).view(BLOCKS * 2, 8)}
    layout = PagedLayout.from_kv_caches(caches, BLOCKS)
    assert layout.block_bytes == 2 * 8 * 4
    assert layout.block_pieces(1)[0].flatten().tolist() == list(range(16, 32))


def test_restore_scatters_each_block_object_into_the_paged_cache(pod: list[Node]) -> None:
    """One object per block holding every layer, saved from one cache and restored into another's blocks."""
    source = PagedLayout.from_kv_caches(cpu_caches(), BLOCKS)
    target_caches = {k: torch.zeros_like(v) for k, v in cpu_caches().items()}
    target = PagedLayout.from_kv_caches(target_caches, BLOCKS)
    bucket = "vllm-layout-" + secrets.token_hex(4)
    keys = [f"ns/{i:064x}" for i in range(3)]
    with ContextStore([n.endpoint for n in pod], access_key=ACCESS_KEY, secret_key=SECRET_KEY) as store:
        store.create_bucket(bucket)
        staged = source.gather([0, 3, 5])
        assert store.put_keys(bucket, keys, [byte_view(row) for row in staged]).stored == 3
        into = [2, 1, 4]  # other block ids in the restoring cache
        views = store.get_keys(bucket, keys + ["ns/absent"],
                               Destinations([Scatter(target.block_pieces(b)) for b in into + [0]], 4))
    assert [v is not None and len(v) == target.block_bytes for v in views] == [True, True, True, False]
    for src, dst in zip([0, 3, 5], into):
        for name in target_caches:
            assert torch.equal(target_caches[name][dst], dict(zip(source.layer_names, source.tensors))[name][src])
    assert not any(t[0].any() or t[3].any() or t[5].any() for t in target_caches.values())  # nothing else written


def test_staged_restore_into_a_paged_cache_of_inference_tensors(pod: list[Node]) -> None:
    """The staging path (a GPU cache's, here with the host backend): vLLM makes its caches under
    torch.inference_mode(), and they take in-place writes only in inference mode, which is per thread."""
    with torch.inference_mode():
        source_caches = cpu_caches()
        target_caches = {k: torch.zeros_like(v) for k, v in source_caches.items()}
    source = PagedLayout.from_kv_caches(source_caches, BLOCKS)
    target = PagedLayout.from_kv_caches(target_caches, BLOCKS)
    bucket = "vllm-staged-" + secrets.token_hex(4)
    keys = [f"ns/{i:064x}" for i in range(4)]
    with ContextStore([n.endpoint for n in pod], access_key=ACCESS_KEY, secret_key=SECRET_KEY, staging="host",
                      staging_bytes=4 * source.block_bytes) as store:  # one block per chunk: the pipeline wraps
        store.create_bucket(bucket)
        assert store.put_keys_staged(bucket, keys[:3], source.gather([0, 3, 5])).stored == 3
        with torch.inference_mode():  # as in vLLM's worker, whose steps run in inference mode
            into = target.target([2, 1, 4, 0])  # the fourth is absent
        sizes = store.get_keys_staged(bucket, keys, into)
    assert sizes == [target.block_bytes] * 3
    for src, dst in zip([0, 3, 5], [2, 1, 4]):
        for name in target_caches:
            assert torch.equal(target_caches[name][dst], source_caches[name][src])
    assert not any(t[0].any() or t[3].any() or t[5].any() for t in target_caches.values())  # nothing else written


def space(**changes: object) -> KeySpace:
    fields: dict[str, object] = dict(model="m", revision="", kv_dtype="auto:bfloat16:scales=NONE",
                                     kv_layout="cpu:LBHNC", block_size=128, block_bytes=1 << 20,
                                     hash_algo="sha256", seed="vllm-none-hash", tp_size=2)
    fields.update(changes)
    return KeySpace(**fields)  # type: ignore[arg-type]


def test_namespace_separates_everything_that_changes_the_bytes() -> None:
    hashes = [bytes([i]) * 32 for i in range(3)]
    base = space()
    keys = base.keys(hashes)
    assert keys == space().keys(hashes)  # deterministic
    assert all(k.startswith(base.namespace() + "/") and k.endswith(h.hex()) for k, h in zip(keys, hashes))
    others = [base.keys(hashes, tp_rank=1), base.keys(hashes, cache_salt="tenant-a"),
              base.keys(hashes, cache_salt="tenant-b"), space(kv_dtype="fp8_e4m3:float8_e4m3fn:scales=TENSOR").keys(
                  hashes), space(block_size=64).keys(hashes), space(kv_layout="cuda:NHD").keys(hashes),
              space(model="m2").keys(hashes), space(seed="42").keys(hashes), space(block_bytes=1 << 19).keys(hashes)]
    prefixes = {k[0].split("/")[0] for k in [keys, *others]}
    assert len(prefixes) == len(others) + 1
    assert base.all_rank_keys(hashes) == [base.keys(hashes, tp_rank=0), base.keys(hashes, tp_rank=1)]


def test_hash_seed_follows_vllm_and_refuses_a_random_one() -> None:
    assert hash_seed("sha256", {}) == "vllm-none-hash"  # vLLM 0.32's fixed seed for the crypto hashes
    assert hash_seed("sha256_cbor", {"PYTHONHASHSEED": "7"}) == "7"
    assert hash_seed("xxhash", {"PYTHONHASHSEED": "0"}) == "0"
    with pytest.raises(ConfigurationError, match="PYTHONHASHSEED"):
        hash_seed("xxhash", {})
    with pytest.raises(ConfigurationError):
        hash_seed("xxhash_cbor", {})
