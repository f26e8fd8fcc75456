"""Object keys for vLLM blocks: vLLM's own block hashes inside a namespace fingerprint.

A key is ``<namespace>/<block hash>``, both lowercase hex: the block hash is vLLM's (``request.block_hashes``,
chained over the request's tokens, the ``cache_salt`` folded into the first block by vLLM itself), the
namespace is a :class:`ctxstore.Fingerprint` digest over everything that makes KV bytes of equal tokens
incompatible: the model and revision, the KV cache dtype and its scale layout, the block size, the physical
attention layout and the number of layers, the tensor/pipeline-parallel rank, vLLM's hash algorithm and seed,
and the request's ``cache_salt`` again (so two tenants never alias even if a hash algorithm ignored salts).

Cross-process determinism (vLLM 0.32): a block hash starts from ``NONE_HASH``, derived from
``PYTHONHASHSEED`` when set, else from a fixed seed for the cryptographic algorithms (``sha256``, the default,
and ``sha256_cbor``), else (``xxhash``, ``xxhash_cbor``) from random bytes per process. :func:`hash_seed`
resolves it the same way and refuses the random case at start-up: two instances would never find each other's
blocks, silently. The resolved seed is part of the namespace.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from ...errors import ConfigurationError
from ...hashing import Fingerprint

__all__ = ["CRYPTO_HASH_ALGOS", "KeySpace", "hash_seed"]

#: vLLM's prefix-caching hash algorithms whose NONE_HASH seed is fixed without PYTHONHASHSEED.
CRYPTO_HASH_ALGOS = frozenset({"sha256", "sha256_cbor"})
#: vLLM's seed for those (``DEFAULT_NONE_HASH_SEED`` in vllm/v1/core/kv_cache_utils.py, 0.32).
VLLM_DEFAULT_SEED = "vllm-none-hash"


def hash_seed(algo: str, environ: dict[str, str] | None = None) -> str:
    """The seed vLLM derives NONE_HASH from, as every process of the deployment must share it."""
    env = os.environ if environ is None else environ
    seed = env.get("PYTHONHASHSEED")
    if seed is not None:
        return seed
    if algo in CRYPTO_HASH_ALGOS:
        return VLLM_DEFAULT_SEED
    raise ConfigurationError(
        f"vLLM's prefix-caching hash {algo!r} starts from a random seed per process unless PYTHONHASHSEED is "
        "set: no other vLLM instance could find this one's blocks. Set PYTHONHASHSEED to the same value in "
        "every instance sharing ctxstore, or use --prefix-caching-hash-algo sha256 (the default)")


@dataclass
class KeySpace:
    """Turns block hashes into object keys for one deployment (one rank's view, or every rank's)."""

    model: str
    revision: str
    kv_dtype: str
    kv_layout: str
    block_size: int
    block_bytes: int
    hash_algo: str
    seed: str
    tp_size: int = 1
    pp_size: int = 1
    _namespaces: dict[tuple[int, int, str], str] = field(default_factory=dict, repr=False)

    def namespace(self, tp_rank: int = 0, pp_rank: int = 0, cache_salt: str | None = None) -> str:
        """The 32-hex-digit namespace of one rank's blocks for requests with this ``cache_salt``."""
        slot = (tp_rank, pp_rank, cache_salt or "")
        ns = self._namespaces.get(slot)
        if ns is None:
            ns = Fingerprint(
                model=self.model, revision=self.revision, kv_dtype=self.kv_dtype, kv_layout=self.kv_layout,
                block_size=self.block_size, tp_rank=tp_rank, tp_size=self.tp_size, pp_rank=pp_rank,
                pp_size=self.pp_size, tenant_salt=cache_salt or "",
                extra={"engine": "vllm", "block_bytes": str(self.block_bytes), "hash_algo": self.hash_algo,
                       "hash_seed": self.seed},
            ).hexdigest()
            self._namespaces[slot] = ns
        return ns

    def keys(self, block_hashes: Sequence[bytes], *, tp_rank: int = 0, pp_rank: int = 0,
             cache_salt: str | None = None) -> list[str]:
        """One key per block hash, for one rank."""
        ns = self.namespace(tp_rank, pp_rank, cache_salt)
        return [f"{ns}/{bytes(h).hex()}" for h in block_hashes]

    def all_rank_keys(self, block_hashes: Sequence[bytes], cache_salt: str | None = None) -> list[list[str]]:
        """The keys of every rank (each saves its own shard): a block is loadable only if all ranks hold it."""
        return [self.keys(block_hashes, tp_rank=t, pp_rank=p, cache_salt=cache_salt)
                for p in range(self.pp_size) for t in range(self.tp_size)]
