"""Chained prefix hashes over full blocks of token ids.

A prompt's token ids are cut into blocks of ``block_size`` tokens; a trailing
partial block is ignored. Block ``i`` gets a key that depends on the tokens of
blocks ``0..i`` (a hash chain), so two prompts share exactly the keys of the
blocks they have in common from the start: the key of a block names its whole
prefix, and can be used as the object key of the KV data of that block.

Every key is a deterministic function of its inputs: the same on every process,
machine, byte order and Python version (Python's ``hash()`` is never used).

Four schemes (see ``docs/hashing.md`` for exact definitions and sources):

``xxh3-128`` (default, ours)
    ``h[0] = XXH3-128(seed ‖ le_u32(block 0))``, ``h[i] = XXH3-128(h[i-1] ‖ le_u32(block i))``.
    Keys are 32 lowercase hex characters.
``dynamo``
    NVIDIA Dynamo's KV-router hashes: XXH3-64 with seed 1337 of each block
    (the *local* block hash), chained as ``seq[i] = XXH3-64(le_u64(seq[i-1]) ‖
    le_u64(local[i]), seed=1337)``. Keys are 16 lowercase hex characters.
``vllm-sha256-cbor``
    vLLM V1's ``--prefix-caching-hash-algo sha256_cbor``:
    ``SHA-256(canonical CBOR [parent, tokens, null])``, the first parent being
    ``NONE_HASH``. Keys are 64 lowercase hex characters.
``sglang-sha256``
    SGLang HiCache's ``get_hash_str`` chain: ``SHA-256(parent digest ‖ le_u32(tokens))``.
    Keys are 64 lowercase hex characters. A request's namespace (SGLang's ``extra_key`` and ``cache_salt``)
    seeds a new chain: :func:`sglang_namespace_seed`.

Keys of different deployments must never mix: derive the ``seed`` from a
:class:`Fingerprint` (model, revision, KV dtype/layout, block size, parallel
ranks, tenant salt) with :func:`namespace_seed`, or call
:meth:`Fingerprint.block_hashes`.

Only ``msgpack`` and ``xxhash`` are needed (CBOR is encoded here, no ``cbor2``);
numpy is used only when the caller already passes a numpy array.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from types import MappingProxyType

import msgpack
import xxhash

__all__ = [
    "DEFAULT_SCHEME",
    "DYNAMO_XXH3_SEED",
    "FINGERPRINT_VERSION",
    "SCHEMES",
    "Fingerprint",
    "Seed",
    "block_hashes",
    "digest_seed",
    "dynamo_salt_hash",
    "namespace_seed",
    "sglang_namespace_seed",
]

SCHEMES = ("xxh3-128", "dynamo", "vllm-sha256-cbor", "sglang-sha256")
DEFAULT_SCHEME = "xxh3-128"

#: Dynamo's ``XXH3_SEED`` / ``CHAIN_XXH3_SEED`` (block seed when unsalted, and chain seed always).
DYNAMO_XXH3_SEED = 1337
#: Version tag written into the canonical encoding of a :class:`Fingerprint`.
FINGERPRINT_VERSION = 1

Seed = bytes | bytearray | memoryview | int | str | None

_U64_MASK = (1 << 64) - 1
_U32_CODE = next(code for code in "IL" if array(code).itemsize == 4)
_BIG_ENDIAN_HOST = sys.byteorder == "big"
_TOKEN_RANGE_MSG = "token ids must be integers with 0 <= t < 2**32"


# ---------------------------------------------------------------------------
# token ids -> little-endian uint32 bytes (built once for the whole list)


def _u32_array(tokens: Sequence[int]) -> array[int]:
    """Validated token ids as an ``array`` of native-order uint32."""
    if isinstance(tokens, (str, bytes, bytearray, memoryview)):
        raise TypeError("tokens must be a sequence of int token ids, not str or bytes")
    np = sys.modules.get("numpy")  # only if the caller already uses numpy
    if np is not None and isinstance(tokens, np.ndarray):
        if tokens.ndim != 1:
            raise ValueError("tokens must be one-dimensional")
        if tokens.dtype.kind in "iu":
            if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) >= 1 << 32):
                raise ValueError(_TOKEN_RANGE_MSG)
            out = array(_U32_CODE)
            out.frombytes(tokens.astype("=u4", copy=False).tobytes())
            return out
        tokens = tokens.tolist()
    try:
        return array(_U32_CODE, tokens)
    except OverflowError as exc:
        raise ValueError(_TOKEN_RANGE_MSG) from exc


def _le_bytes(arr: array[int]) -> bytes:
    """The uint32 array as little-endian bytes, whatever the host byte order."""
    if _BIG_ENDIAN_HOST:
        arr = array(_U32_CODE, arr)
        arr.byteswap()
    return arr.tobytes()


def _check_block_size(block_size: int) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")


# ---------------------------------------------------------------------------
# seeds


def _seed_bytes(seed: Seed, scheme: str) -> bytes:
    if isinstance(seed, (bytes, bytearray, memoryview)):
        return bytes(seed)
    if isinstance(seed, str):
        return seed.encode("utf-8")
    raise TypeError(f"seed for {scheme!r} must be bytes, int, str or None, got {type(seed).__name__}")


def _xxh3_128_prefix(seed: Seed) -> bytes:
    """``xxh3-128``: None -> b""; bytes verbatim; str -> UTF-8; int -> 16 bytes big-endian."""
    if seed is None:
        return b""
    if isinstance(seed, int) and not isinstance(seed, bool):
        if not 0 <= seed < 1 << 128:
            raise ValueError("an int seed for 'xxh3-128' must satisfy 0 <= seed < 2**128")
        return seed.to_bytes(16, "big")
    return _seed_bytes(seed, "xxh3-128")


def dynamo_salt_hash(cache_namespace: str | bytes | None = None, lora_name: str | bytes | None = None) -> int:
    """Dynamo's block-hash seed for a request (``compute_salt_hash`` in lib/kv-hashing).

    ``1337 + XXH3-64(lora_name, seed=0) + XXH3-64(cache_namespace, seed=1)`` (mod 2**64),
    each term only when that string is non-empty; strings are hashed as UTF-8.
    With neither, this is 1337: Dynamo's unsalted seed.
    """
    seed = DYNAMO_XXH3_SEED
    for value, inner_seed in ((lora_name, 0), (cache_namespace, 1)):
        if value:
            data = value.encode("utf-8") if isinstance(value, str) else bytes(value)
            seed = (seed + xxhash.xxh3_64_intdigest(data, seed=inner_seed)) & _U64_MASK
    return seed


def _dynamo_block_seed(seed: Seed) -> int:
    """``dynamo``: None -> 1337; int -> the raw XXH3 block seed; str/bytes -> Dynamo cache_namespace."""
    if seed is None:
        return DYNAMO_XXH3_SEED
    if isinstance(seed, int) and not isinstance(seed, bool):
        if not 0 <= seed <= _U64_MASK:
            raise ValueError("an int seed for 'dynamo' must satisfy 0 <= seed < 2**64")
        return seed
    return dynamo_salt_hash(cache_namespace=_seed_bytes(seed, "dynamo"))


def _vllm_none_hash(seed: Seed) -> bytes:
    """``vllm-sha256-cbor``: vLLM's NONE_HASH.

    str -> ``sha256_cbor(seed)`` (vLLM with ``PYTHONHASHSEED=seed``); int -> ``str(seed)``;
    None -> ``"0"``; bytes -> used verbatim as NONE_HASH.
    """
    if seed is None:
        seed = "0"
    elif isinstance(seed, int) and not isinstance(seed, bool):
        seed = str(seed)
    if isinstance(seed, str):
        return hashlib.sha256(_cbor_text(seed)).digest()
    return _seed_bytes(seed, "vllm-sha256-cbor")


def _sglang_prior(seed: Seed) -> bytes:
    """``sglang-sha256``: the bytes SGLang would feed first for ``prior_hash``.

    None or "" -> nothing; str -> ``bytes.fromhex(seed)`` (SGLang's prior_hash); bytes verbatim.
    """
    if seed is None:
        return b""
    if isinstance(seed, str):
        try:
            return bytes.fromhex(seed)
        except ValueError as exc:
            raise ValueError("a str seed for 'sglang-sha256' is a prior hash and must be hex") from exc
    if isinstance(seed, int):
        raise TypeError("seed for 'sglang-sha256' must be bytes, a hex str or None")
    return _seed_bytes(seed, "sglang-sha256")


# ---------------------------------------------------------------------------
# minimal canonical CBOR (RFC 8949 §4.2.1): exactly what cbor2.dumps(..., canonical=True)
# emits for the values vLLM hashes here: (bytes, tuple[uint, ...], None) and str.


def _cbor_head(major: int, n: int) -> bytes:
    if n < 24:
        return bytes((major << 5 | n,))
    if n < 0x100:
        return bytes((major << 5 | 24, n))
    if n < 0x10000:
        return bytes((major << 5 | 25,)) + n.to_bytes(2, "big")
    if n < 0x100000000:
        return bytes((major << 5 | 26,)) + n.to_bytes(4, "big")
    return bytes((major << 5 | 27,)) + n.to_bytes(8, "big")


def _cbor_text(text: str) -> bytes:
    data = text.encode("utf-8")
    return _cbor_head(3, len(data)) + data


_PACK_U16 = struct.Struct(">BH").pack
_PACK_U32 = struct.Struct(">BI").pack
_SMALL_UINTS = [bytes((n,)) for n in range(24)] + [bytes((0x18, n)) for n in range(24, 256)]


def _cbor_uints(values: array[int]) -> list[bytes]:
    """CBOR encoding (major type 0, shortest form) of each uint32."""
    small = _SMALL_UINTS
    return [
        small[v] if v < 256 else (_PACK_U16(0x19, v) if v < 0x10000 else _PACK_U32(0x1A, v)) for v in values
    ]


# ---------------------------------------------------------------------------
# the schemes


def _chain_xxh3_128(data: bytes, n: int, step: int, prefix: bytes) -> list[str]:
    view = memoryview(data)
    digest = xxhash.xxh3_128_digest
    keys: list[str] = []
    prev = prefix
    for off in range(0, n * step, step):
        prev = digest(prev + view[off : off + step])
        keys.append(prev.hex())
    return keys


def _chain_dynamo(data: bytes, n: int, step: int, block_seed: int) -> list[str]:
    view = memoryview(data)
    h64 = xxhash.xxh3_64_intdigest
    pack = struct.Struct("<QQ").pack
    local = [h64(view[off : off + step], block_seed) for off in range(0, n * step, step)]
    seq = local[0]
    keys = [f"{seq:016x}"]
    for block_hash in local[1:]:
        seq = h64(pack(seq, block_hash), DYNAMO_XXH3_SEED)
        keys.append(f"{seq:016x}")
    return keys


def _chain_vllm(arr: array[int], n: int, block_size: int, none_hash: bytes) -> list[str]:
    encoded = _cbor_uints(arr[: n * block_size])
    tokens_head = _cbor_head(4, block_size)
    sha256 = hashlib.sha256
    keys: list[str] = []
    parent = none_hash
    for i in range(n):
        payload = b"".join(
            (
                b"\x83",  # array of 3: (parent_block_hash, token_ids, extra_keys)
                _cbor_head(2, len(parent)),
                parent,
                tokens_head,
                *encoded[i * block_size : (i + 1) * block_size],
                b"\xf6",  # extra_keys = None
            )
        )
        parent = sha256(payload).digest()
        keys.append(parent.hex())
    return keys


def _chain_sglang(data: bytes, n: int, step: int, prior: bytes) -> list[str]:
    view = memoryview(data)
    sha256 = hashlib.sha256
    keys: list[str] = []
    prev = prior
    for off in range(0, n * step, step):
        prev = sha256(prev + view[off : off + step]).digest()
        keys.append(prev.hex())
    return keys


def block_hashes(
    tokens: Sequence[int],
    block_size: int,
    scheme: str = DEFAULT_SCHEME,
    seed: Seed = None,
) -> list[str]:
    """Chained keys of the full blocks of ``tokens``, one per block, lowercase hex.

    ``tokens`` is any sequence of ints with ``0 <= t < 2**32`` (a list, ``array``,
    or a 1-D integer numpy array); a trailing partial block gets no key.
    ``seed`` namespaces the chain; what it means depends on ``scheme`` (see
    :func:`namespace_seed` and ``docs/hashing.md``). With ``seed=None`` the
    ``dynamo`` and ``sglang-sha256`` keys are exactly upstream's unsalted values,
    and ``vllm-sha256-cbor`` keys are vLLM's with ``PYTHONHASHSEED=0``.

    Raises ``ValueError`` for an unknown scheme, a non-positive block size or a
    token id out of range, ``TypeError`` for a seed type the scheme does not take.
    """
    if scheme not in SCHEMES:
        raise ValueError(f"unknown hashing scheme {scheme!r}; expected one of {SCHEMES}")
    _check_block_size(block_size)
    arr = _u32_array(tokens)
    n = len(arr) // block_size
    step = 4 * block_size
    if scheme == "xxh3-128":
        prefix = _xxh3_128_prefix(seed)
        return _chain_xxh3_128(_le_bytes(arr), n, step, prefix) if n else []
    if scheme == "dynamo":
        block_seed = _dynamo_block_seed(seed)
        return _chain_dynamo(_le_bytes(arr), n, step, block_seed) if n else []
    if scheme == "vllm-sha256-cbor":
        none_hash = _vllm_none_hash(seed)
        return _chain_vllm(arr, n, block_size, none_hash) if n else []
    prior = _sglang_prior(seed)
    return _chain_sglang(_le_bytes(arr), n, step, prior) if n else []


# ---------------------------------------------------------------------------
# namespaces


@dataclass(frozen=True)
class Fingerprint:
    """Everything that makes KV blocks of equal tokens incompatible.

    Two workers may share a block only if their fingerprints are equal. The
    ranks are the worker's tensor- and pipeline-parallel coordinates, since
    each rank holds a different shard of the KV (data-parallel replicas hold
    the same KV and share one fingerprint; an MLA model whose latent KV is
    replicated across TP ranks should use ``tp_rank=0, tp_size=1``).
    ``tenant_salt`` isolates tenants (use a random secret per tenant);
    ``extra`` holds any other string facts (LoRA adapter, rope scaling, ...).
    """

    model: str
    revision: str = ""
    kv_dtype: str = ""
    kv_layout: str = ""
    block_size: int = 16
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    tenant_salt: str = ""
    extra: Mapping[str, str] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        for name in ("model", "revision", "kv_dtype", "kv_layout", "tenant_salt"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"Fingerprint.{name} must be a str")
        if not self.model:
            raise ValueError("Fingerprint.model must not be empty")
        for name in ("block_size", "tp_rank", "tp_size", "pp_rank", "pp_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"Fingerprint.{name} must be an int")
        _check_block_size(self.block_size)
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError("Fingerprint needs 0 <= tp_rank < tp_size")
        if not 0 <= self.pp_rank < self.pp_size:
            raise ValueError("Fingerprint needs 0 <= pp_rank < pp_size")
        extra = dict(self.extra)
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in extra.items()):
            raise TypeError("Fingerprint.extra must map str to str")
        object.__setattr__(self, "extra", MappingProxyType(dict(sorted(extra.items()))))

    def __reduce__(self) -> tuple[type[Fingerprint], tuple[object, ...]]:
        # a mappingproxy does not pickle: rebuild from plain values
        values = [getattr(self, f.name) for f in fields(self)]
        values[-1] = dict(self.extra)
        return (type(self), tuple(values))

    def canonical_bytes(self) -> bytes:
        """The canonical encoding hashed by :meth:`digest`.

        msgpack of one map whose keys are sorted (bytewise, all ASCII), strings
        as UTF-8 ``str`` types and ints in their shortest form: ``block_size``,
        ``extra`` (a map with sorted keys), ``kv_dtype``, ``kv_layout``,
        ``model``, ``pp_rank``, ``pp_size``, ``revision``, ``tenant_salt``,
        ``tp_rank``, ``tp_size``, ``v`` (= :data:`FINGERPRINT_VERSION`).
        """
        payload = {
            "block_size": self.block_size,
            "extra": dict(self.extra),
            "kv_dtype": self.kv_dtype,
            "kv_layout": self.kv_layout,
            "model": self.model,
            "pp_rank": self.pp_rank,
            "pp_size": self.pp_size,
            "revision": self.revision,
            "tenant_salt": self.tenant_salt,
            "tp_rank": self.tp_rank,
            "tp_size": self.tp_size,
            "v": FINGERPRINT_VERSION,
        }
        return msgpack.packb({k: payload[k] for k in sorted(payload)}, use_bin_type=True)

    def digest(self) -> bytes:
        """16 bytes: XXH3-128 (canonical big-endian digest) of :meth:`canonical_bytes`."""
        return xxhash.xxh3_128_digest(self.canonical_bytes())

    def hexdigest(self) -> str:
        """:meth:`digest` as 32 lowercase hex characters."""
        return self.digest().hex()

    def block_hashes(self, tokens: Sequence[int], scheme: str = DEFAULT_SCHEME) -> list[str]:
        """``block_hashes(tokens, self.block_size, scheme, namespace_seed(self, scheme))``."""
        return block_hashes(tokens, self.block_size, scheme, namespace_seed(self, scheme))


def namespace_seed(fp: Fingerprint, scheme: str) -> bytes | int:
    """The ``seed`` that namespaces ``scheme``'s keys to fingerprint ``fp``.

    - ``xxh3-128``: ``fp.digest()`` (16 bytes), prepended to block 0.
    - ``dynamo``: the int block seed Dynamo derives for ``cache_namespace = fp.hexdigest()``
      (``dynamo_salt_hash(fp.hexdigest())``); the chain seed stays 1337.
    - ``vllm-sha256-cbor``: ``NONE_HASH = sha256(cbor(fp.hexdigest()))`` (32 bytes),
      what vLLM computes from a hash seed string equal to ``fp.hexdigest()``.
    - ``sglang-sha256``: ``fp.digest()``, i.e. SGLang's ``prior_hash = fp.hexdigest()``
      for the first page.

    Salted keys of the external schemes no longer equal the engines' own
    (unsalted) keys, but each stays a pure function of the fingerprint and tokens.
    """
    return digest_seed(fp.digest(), scheme)


def digest_seed(digest: bytes, scheme: str) -> bytes | int:
    """:func:`namespace_seed` of the fingerprint whose :meth:`Fingerprint.digest` is ``digest``.

    The seed depends on a fingerprint through its digest alone, so a node can hash a namespace's tokens
    knowing only the digest (the query op: never the tenant salt, nor the rest of the fingerprint).
    """
    if scheme == "xxh3-128" or scheme == "sglang-sha256":
        return bytes(digest)
    if scheme == "dynamo":
        return dynamo_salt_hash(cache_namespace=digest.hex())
    if scheme == "vllm-sha256-cbor":
        return _vllm_none_hash(digest.hex())
    raise ValueError(f"unknown hashing scheme {scheme!r}; expected one of {SCHEMES}")


def sglang_namespace_seed(extra_key: str | None = None, cache_salt: str | None = None) -> str | None:
    """The ``sglang-sha256`` seed SGLang (0.5.23) gives a new chain of a request: ``storage_namespace_seed``.

    ``SHA-256("sglang-cache-namespace-v1" ‖ part(extra_key) ‖ part(cache_salt))`` as 64 hex characters, where
    ``part(None) = 0x00`` and ``part(s) = 0x01 ‖ le_u64(len(utf8(s))) ‖ utf8(s)``; None when both are None (the
    unnamespaced chain). ``block_hashes(tokens, page_size, "sglang-sha256", seed=sglang_namespace_seed(...))``
    are then SGLang's HiCache storage keys of those tokens, so two tenants' (``cache_salt``) chains never share a
    key. Source: ``python/sglang/srt/mem_cache/utils.py``, ``storage_namespace_seed``.
    """
    if extra_key is None and cache_salt is None:
        return None
    digest = hashlib.sha256(b"sglang-cache-namespace-v1")
    for part in (extra_key, cache_salt):
        if part is None:
            digest.update(b"\x00")
            continue
        encoded = part.encode("utf-8")
        digest.update(b"\x01" + len(encoded).to_bytes(8, "little") + encoded)
    return digest.hexdigest()
