"""Tests of ctxstore.hashing: frozen golden vectors, upstream equivalence, properties."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import os
import pickle
import struct
import subprocess
import sys
import time
from array import array
from pathlib import Path

import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ctxstore
from ctxstore import hashing
from ctxstore.hashing import (
    DYNAMO_XXH3_SEED,
    SCHEMES,
    Fingerprint,
    _le_bytes,
    _u32_array,
    block_hashes,
    dynamo_salt_hash,
    namespace_seed,
)

U32_MAX = 2**32 - 1
A = list(range(64))  # 4 blocks of 16
B = [U32_MAX - i for i in range(32)]  # 2 blocks of 16, ids near 2**32 - 1
P = [7] * 20  # block_size 8: 2 full blocks + a partial block of 4

# ---------------------------------------------------------------------------
# golden vectors (seed=None); changing any of these changes every stored key

GOLDEN = {
    "xxh3-128": {
        "A": [
            "3ff10ada66d8e18cf9d0a2aa4da337c5",
            "356d74e81d3a6897c4d6d523216c40ff",
            "53aa15c00cff704bc28a2457adcdbd5e",
            "f4a9ff914c9c653d1fbb341ec5c7503a",
        ],
        "B": ["5c1bae2036a8994613f59224d61ac420", "ffda3ef3020c333c288548e7d196784f"],
        "P": ["705935045ccd6bf3c1dc603cb19f2a13", "1e95c72a194478fca4f232b94a530d7a"],
    },
    "dynamo": {
        "A": ["d47a8f41c833328a", "bf15dffb16447f38", "a4dda066f3c1e1a0", "35f7c0d119848950"],
        "B": ["e61392547a7912b7", "b37c5f77e9ad9201"],
        "P": ["3431ea385733772e", "96ff65427f028e55"],
    },
    "vllm-sha256-cbor": {
        "A": [
            "d830de3d42c00f25a2949b5d12d98642664a44872c1614c5b0147556276afc9c",
            "fedd9e4abebebbe6f6cf96b682f08d316063fe2f22a5c552192dd62904fcccac",
            "ee4c34c217da17ac84268f864db16efed5fcefe10fcc4a9625a719adc68e654f",
            "b1f3544e8610283e85cddbae23bfcad68fa546e89c0fd85aed820e94dca2d75f",
        ],
        "B": [
            "23058061e2eafa9fe4530d256cb4c389e8cb01895c58194272e58b234b96baa7",
            "8947f94a9fec5452d16a3e071b5d819a73462c4bdfe519a4b378f2159e6cab91",
        ],
        "P": [
            "4660247d3bc65bfd2796b10a7c3471139444027dd70f2eb029d01e7a51b43d3c",
            "535e347531c40f80e6cb74654bd0a026a2397364582526cc60e162b900f0910b",
        ],
    },
    "sglang-sha256": {
        "A": [
            "5d85718ec594b982c252d0279e5966ffca33a5eaf2a455038d3ab331fde70cea",
            "4681c0107c38f402cd1bc30b0b09a65202dba31f98269d9d7f63f5e0dea6901a",
            "9c9217b40433137e8a734787cbb1fa92045602840c3ab29539366f8ffe21ec2f",
            "2ed4d42143a6fc757f387ac0e0fcf0de99f5d71d1642f3aa73456d8d27c31506",
        ],
        "B": [
            "e1b0d120ba1187cb6b027afb0f3787a210a034641ef560b2e1ce3a0c339a573a",
            "511ac3e0ba06c2aa1a4bf2568ac5d5d52064e5eb8f0121d329d908a673c03b53",
        ],
        "P": [
            "88fac76890256fe5cef0823c2daa9935cc8ad59aacbf3274dbcc5dd235fd84b0",
            "13c25647e9fed354b01032514b1fab3d358d5a5b3ba3e66c818f9171daf7f9fa",
        ],
    },
}
KEY_LEN = {"xxh3-128": 32, "dynamo": 16, "vllm-sha256-cbor": 64, "sglang-sha256": 64}

FP = Fingerprint(
    model="meta-llama/Llama-3.1-8B-Instruct",
    revision="0e9e39f",
    kv_dtype="bfloat16",
    kv_layout="NHD",
    block_size=16,
    tp_rank=1,
    tp_size=2,
    tenant_salt="tenant-a",
    extra={"lora": "none", "b": "x"},
)
FP_CANONICAL = (
    "8caa626c6f636b5f73697a6510a5657874726182a162a178a46c6f7261a46e6f6e65a86b765f6474797065a8"
    "62666c6f61743136a96b765f6c61796f7574a34e4844a56d6f64656cd9206d6574612d6c6c616d612f4c6c61"
    "6d612d332e312d38422d496e737472756374a770705f72616e6b00a770705f73697a6501a87265766973696f"
    "6ea730653965333966ab74656e616e745f73616c74a874656e616e742d61a774705f72616e6b01a774705f73"
    "697a6502a17601"
)
FP_DIGEST = "5fc743792a222c34be5bf7c685f230c3"
FP_KEYS_A = {
    "xxh3-128": [
        "5367c3a2bab48d65151b5cbb824f7e9b",
        "67d33dbff1a884365ccbb00d5987f937",
        "05a9b496f641d57934ddea972fffad3b",
        "3e674cd7425e4029c8e54104bc452ea9",
    ],
    "dynamo": ["2d4aecd46ba9569a", "1a91e0c60efc11d9", "3b957c84960ae2be", "197e2e840fbbfcf3"],
    "vllm-sha256-cbor": [
        "40900a629e5c90dcb0d96423af4dd3d7dfceccf299502fc35ca5be9edbe8d9e2",
        "9a69d4de58b7b6b75af4c1dd2edca3f24ed1ce5f587581553408a7192cbcdc7a",
        "93161a987842a65d178ba5d5a17b19773509c6d50ce89b92836b2dac8643aed3",
        "0aee6094ba6aff1dc4b3b5616ca7cbe93d3fdc3a794d225005821153dc78258d",
    ],
    "sglang-sha256": [
        "fe97550d437ac98caf3501c5e901579eafe4eb38b55c70e9518808493b23b5a4",
        "50ef83532a82145354274654c8f24e5bfff59b2d813fcc2a922f0ce8beef7f5c",
        "0130e2cb2d8260602b9a090dd2a235552c57c505c1b5d9cb42e5450c29363701",
        "abeba18e97b63bc4e35216d41d5a4c5d48597077fe13a614824415280027c54c",
    ],
}


@pytest.mark.parametrize("scheme", SCHEMES)
def test_golden_vectors(scheme):
    assert block_hashes(A, 16, scheme) == GOLDEN[scheme]["A"]
    assert block_hashes(B, 16, scheme) == GOLDEN[scheme]["B"]
    assert block_hashes(P, 8, scheme) == GOLDEN[scheme]["P"]
    assert block_hashes([], 16, scheme) == []
    assert block_hashes(A[:15], 16, scheme) == []  # only a partial block
    assert block_hashes(A[:40], 16, scheme) == GOLDEN[scheme]["A"][:2]  # partial tail ignored
    for key in GOLDEN[scheme]["A"]:
        assert len(key) == KEY_LEN[scheme] and key == key.lower()
        int(key, 16)


def test_fingerprint_golden():
    assert FP.canonical_bytes().hex() == FP_CANONICAL
    assert FP.digest().hex() == FP_DIGEST == FP.hexdigest()
    assert FP.digest() == xxhash.xxh3_128_digest(bytes.fromhex(FP_CANONICAL))
    for scheme in SCHEMES:
        assert FP.block_hashes(A, scheme) == FP_KEYS_A[scheme]
        assert block_hashes(A, 16, scheme, namespace_seed(FP, scheme)) == FP_KEYS_A[scheme]


def test_fingerprint_canonical_encoding_by_hand():
    """The documented encoding, written out with no msgpack library involved."""

    def s(text: str) -> bytes:  # msgpack fixstr / str8
        data = text.encode()
        return (bytes([0xA0 | len(data)]) if len(data) < 32 else bytes([0xD9, len(data)])) + data

    fp = Fingerprint(model="m")
    entries = [  # keys in sorted order; values: positive fixint, empty fixmap or fixstr
        ("block_size", bytes([16])),
        ("extra", bytes([0x80])),
        ("kv_dtype", s("")),
        ("kv_layout", s("")),
        ("model", s("m")),
        ("pp_rank", bytes([0])),
        ("pp_size", bytes([1])),
        ("revision", s("")),
        ("tenant_salt", s("")),
        ("tp_rank", bytes([0])),
        ("tp_size", bytes([1])),
        ("v", bytes([1])),
    ]
    expected = bytes([0x80 | len(entries)]) + b"".join(s(k) + v for k, v in entries)  # fixmap
    assert fp.canonical_bytes() == expected
    assert fp.digest() == xxhash.xxh3_128_digest(expected)


# ---------------------------------------------------------------------------
# independent derivations of the external schemes


def test_dynamo_published_constants():
    # ai-dynamo/dynamo lib/tokens/src/lib.rs, tests: TEST_SALT_HASH = 1337,
    # HASH_1_4 = hash([1,2,3,4], 1337), HASH_5_8, HASH_9_12 and the chained SEQ_HASH_* values;
    # salt 1337 is the kv-router's XXH3_SEED (lib/kv-router/src/protocols.rs).
    keys = block_hashes(list(range(1, 13)), 4, "dynamo")
    assert [int(k, 16) for k in keys] == [
        14643705804678351452,  # SEQ_HASH_1_4 == HASH_1_4
        4945711292740353085,  # SEQ_HASH_5_8
        12583592247330656132,  # SEQ_HASH_9_12
    ]
    # and the local (un-chained) block hashes of the same test
    local = [xxhash.xxh3_64_intdigest(struct.pack("<4I", *range(s, s + 4)), seed=1337) for s in (1, 5, 9)]
    assert local == [14643705804678351452, 16777012769546811212, 483935686894639516]


def test_dynamo_step_by_step():
    # compute_block_hash_for_seq: XXH3-64(le u32 tokens, seed 1337) per full chunk;
    # compute_seq_hash_for_block: seq[0] = local[0], seq[i] = XXH3-64(le u64 [seq[i-1], local[i]], 1337)
    local = [xxhash.xxh3_64_intdigest(struct.pack("<16I", *B[i : i + 16]), seed=1337) for i in (0, 16)]
    seq0 = local[0]
    seq1 = xxhash.xxh3_64_intdigest(struct.pack("<QQ", seq0, local[1]), seed=1337)
    assert block_hashes(B, 16, "dynamo") == [f"{seq0:016x}", f"{seq1:016x}"]


def test_dynamo_salt():
    # lib/kv-hashing/src/salt.rs compute_salt_hash(salt, lora_name):
    # 1337 (+) xxh3_64(lora, 0) (+) xxh3_64(salt, 1), wrapping; the router passes
    # cache_namespace as the salt; the chain seed stays CHAIN_XXH3_SEED = 1337.
    ns, lora = "tenant-a", "my-adapter"
    assert dynamo_salt_hash() == DYNAMO_XXH3_SEED == dynamo_salt_hash("", "")
    expected_seed = (
        1337 + xxhash.xxh3_64_intdigest(lora.encode(), seed=0) + xxhash.xxh3_64_intdigest(ns.encode(), seed=1)
    ) % 2**64
    assert dynamo_salt_hash(ns, lora) == expected_seed
    local = [
        xxhash.xxh3_64_intdigest(struct.pack("<16I", *A[i : i + 16]), seed=expected_seed) for i in (0, 16)
    ]
    seq1 = xxhash.xxh3_64_intdigest(struct.pack("<QQ", local[0], local[1]), seed=1337)
    assert block_hashes(A[:32], 16, "dynamo", seed=expected_seed) == [f"{local[0]:016x}", f"{seq1:016x}"]
    # str / bytes seed = cache_namespace
    ns_seed = dynamo_salt_hash(cache_namespace=ns)
    assert block_hashes(A, 16, "dynamo", seed=ns) == block_hashes(A, 16, "dynamo", seed=ns_seed)
    assert block_hashes(A, 16, "dynamo", seed=ns.encode()) == block_hashes(A, 16, "dynamo", seed=ns_seed)
    assert block_hashes(A, 16, "dynamo", seed="") == GOLDEN["dynamo"]["A"]
    assert block_hashes(A, 16, "dynamo", seed=1337) == GOLDEN["dynamo"]["A"]
    assert namespace_seed(FP, "dynamo") == dynamo_salt_hash(FP.hexdigest())


def test_vllm_by_hand_cbor():
    """vllm/v1/core/kv_cache_utils.py hash_block_tokens + vllm/utils/hashing.py sha256_cbor,
    with the canonical CBOR (RFC 8949) bytes written out by hand."""
    # init_none_hash: NONE_HASH = sha256_cbor(os.getenv("PYTHONHASHSEED")) -> "0" is text(1) "0"
    none_hash = hashlib.sha256(b"\x61\x30").digest()
    # block 0: [NONE_HASH (bytes(32)), (0..15) (array(16) of uints < 24), None]
    block0 = b"\x83" + b"\x58\x20" + none_hash + b"\x90" + bytes(range(16)) + b"\xf6"
    h0 = hashlib.sha256(block0).digest()
    # block 1: tokens 16..23 are one byte, 24..31 are 0x18 followed by one byte
    toks1 = bytes(range(16, 24)) + b"".join(bytes([0x18, t]) for t in range(24, 32))
    h1 = hashlib.sha256(b"\x83\x58\x20" + h0 + b"\x90" + toks1 + b"\xf6").digest()
    assert block_hashes(A[:32], 16, "vllm-sha256-cbor") == [h0.hex(), h1.hex()]
    assert block_hashes(A[:32], 16, "vllm-sha256-cbor", seed="0") == [h0.hex(), h1.hex()]
    assert block_hashes(A[:32], 16, "vllm-sha256-cbor", seed=0) == [h0.hex(), h1.hex()]
    # ids near 2**32 - 1 are uint32 (0x1a + 4 bytes big-endian)
    toks = b"".join(b"\x1a" + t.to_bytes(4, "big") for t in B[:16])
    hb = hashlib.sha256(b"\x83\x58\x20" + none_hash + b"\x90" + toks + b"\xf6").digest()
    assert block_hashes(B, 16, "vllm-sha256-cbor")[0] == hb.hex()


def _vllm_reference(cbor2, tokens, block_size, pythonhashseed="0"):
    """The upstream code path, step by step, with the real cbor2 encoder."""

    def sha256_cbor(obj):  # vllm/utils/hashing.py
        return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()

    none_hash = sha256_cbor(pythonhashseed)  # init_none_hash with PYTHONHASHSEED set
    keys, parent = [], None
    for start in range(0, len(tokens) - block_size + 1, block_size):  # request_block_hasher
        if not parent:  # hash_block_tokens
            parent = none_hash
        parent = sha256_cbor((parent, tuple(tokens[start : start + block_size]), None))
        keys.append(parent.hex())
    return keys


def test_vllm_against_cbor2():
    cbor2 = pytest.importorskip("cbor2")
    assert _vllm_reference(cbor2, A, 16) == GOLDEN["vllm-sha256-cbor"]["A"]
    assert _vllm_reference(cbor2, B, 16) == GOLDEN["vllm-sha256-cbor"]["B"]
    assert _vllm_reference(cbor2, P, 8) == GOLDEN["vllm-sha256-cbor"]["P"]
    assert _vllm_reference(cbor2, A, 16, "12345") == block_hashes(A, 16, "vllm-sha256-cbor", seed=12345)
    assert (
        namespace_seed(FP, "vllm-sha256-cbor")
        == hashlib.sha256(cbor2.dumps(FP.hexdigest(), canonical=True)).digest()
    )


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(
        st.one_of(
            st.integers(0, U32_MAX),
            st.sampled_from([0, 23, 24, 255, 256, 65535, 65536, U32_MAX]),
        ),
        max_size=80,
    ),
    block_size=st.integers(1, 30),
    seed=st.one_of(st.none(), st.integers(0, 2**32 - 1), st.text(max_size=8)),
)
def test_vllm_matches_cbor2_property(tokens, block_size, seed):
    cbor2 = pytest.importorskip("cbor2")
    pyhashseed = "0" if seed is None else str(seed)
    assert block_hashes(tokens, block_size, "vllm-sha256-cbor", seed) == _vllm_reference(
        cbor2, tokens, block_size, pyhashseed
    )


def _sglang_get_hash_str(token_ids, prior_hash=None):
    # python/sglang/srt/mem_cache/hicache_storage.py get_hash_str (int-token path)
    hasher = hashlib.sha256()
    if prior_hash:
        hasher.update(bytes.fromhex(prior_hash))
    for t in token_ids:
        hasher.update(t.to_bytes(4, byteorder="little", signed=False))
    return hasher.hexdigest()


def test_sglang_step_by_step():
    for tokens, page in ((A, 16), (B, 16), (P, 8)):
        keys, last = [], None  # hiradix_cache insert: last_hash starts at None
        for start in range(0, len(tokens) - page + 1, page):
            last = _sglang_get_hash_str(tokens[start : start + page], prior_hash=last)
            keys.append(last)
        assert block_hashes(tokens, page, "sglang-sha256") == keys
    # a str seed is SGLang's prior_hash, a bytes seed its raw bytes
    prior = "ab" * 32
    assert block_hashes(A[:16], 16, "sglang-sha256", seed=prior) == [_sglang_get_hash_str(A[:16], prior)]
    assert block_hashes(A, 16, "sglang-sha256", seed=bytes.fromhex(prior)) == block_hashes(
        A, 16, "sglang-sha256", seed=prior
    )
    assert block_hashes(A, 16, "sglang-sha256", seed="") == GOLDEN["sglang-sha256"]["A"]


def test_xxh3_128_step_by_step():
    seed = b"namespace"
    h0 = xxhash.xxh3_128_digest(seed + struct.pack("<16I", *A[:16]))
    h1 = xxhash.xxh3_128_digest(h0 + struct.pack("<16I", *A[16:32]))
    assert block_hashes(A[:32], 16, seed=seed) == [h0.hex(), h1.hex()]
    g0 = xxhash.xxh3_128_digest(struct.pack("<16I", *B[:16]))
    assert block_hashes(B, 16)[0] == g0.hex() == block_hashes(B, 16, seed=b"")[0]
    assert block_hashes(A, 16, seed="namespace") == block_hashes(A, 16, seed=seed)
    assert block_hashes(A, 16, seed=7) == block_hashes(A, 16, seed=(7).to_bytes(16, "big"))


@pytest.mark.parametrize("scheme", ["xxh3-128", "vllm-sha256-cbor", "sglang-sha256"])
def test_chain_resumes_from_parent_key(scheme):
    # for these schemes the parent digest is the whole chain state: a key used as seed continues it
    keys = GOLDEN[scheme]["A"]
    assert block_hashes(A[16:], 16, scheme, seed=bytes.fromhex(keys[0])) == keys[1:]


# ---------------------------------------------------------------------------
# input handling


def test_le_bytes_and_inputs():
    tokens = [0, 1, 0x01020304, U32_MAX]
    assert _le_bytes(_u32_array(tokens)) == struct.pack("<4I", *tokens)
    for scheme in SCHEMES:
        expected = block_hashes(A, 16, scheme)
        assert block_hashes(tuple(A), 16, scheme) == expected
        assert block_hashes(range(64), 16, scheme) == expected
        assert block_hashes(array("I", A), 16, scheme) == expected


def test_big_endian_host_path(monkeypatch):
    # on a big-endian host the native array holds byte-swapped words; _le_bytes must undo that
    tokens = [0, 1, 0x01020304, U32_MAX]
    native_be = array("I", tokens)
    native_be.byteswap()
    monkeypatch.setattr(hashing, "_BIG_ENDIAN_HOST", True)
    assert _le_bytes(native_be) == struct.pack("<4I", *tokens)


def test_numpy_input():
    np = pytest.importorskip("numpy")
    for dtype in (np.int64, np.uint32, np.int32):
        for scheme in SCHEMES:
            assert block_hashes(np.asarray(A, dtype=dtype), 16, scheme) == GOLDEN[scheme]["A"]
    assert block_hashes(np.asarray(B, dtype=np.uint64), 16) == GOLDEN["xxh3-128"]["B"]
    with pytest.raises(ValueError):
        block_hashes(np.asarray([-1] * 16), 16)
    with pytest.raises(ValueError):
        block_hashes(np.asarray([2**32] * 16, dtype=np.int64), 16)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_invalid_inputs(scheme):
    for bad in ([-1] * 16, [2**32] * 16, [0] * 15 + [2**40]):
        with pytest.raises(ValueError):
            block_hashes(bad, 16, scheme)
    with pytest.raises(ValueError):
        block_hashes([-1], 16, scheme)  # validated even without a full block
    for bad_size in (0, -16, True, 1.5, "16"):
        with pytest.raises(ValueError):
            block_hashes(A, bad_size, scheme)
    for bad_tokens in (b"\x00" * 64, "abcd"):
        with pytest.raises(TypeError):
            block_hashes(bad_tokens, 4, scheme)
    with pytest.raises(TypeError):
        block_hashes([1.5] * 16, 16, scheme)
    with pytest.raises(TypeError):
        block_hashes(A, 16, scheme, seed=1.5)


def test_invalid_scheme_and_seeds():
    with pytest.raises(ValueError):
        block_hashes(A, 16, "md5")
    with pytest.raises(ValueError):
        namespace_seed(FP, "md5")
    with pytest.raises(ValueError):
        block_hashes(A, 16, "xxh3-128", seed=2**128)
    with pytest.raises(ValueError):
        block_hashes(A, 16, "dynamo", seed=-1)
    with pytest.raises(TypeError):
        block_hashes(A, 16, "sglang-sha256", seed=5)
    with pytest.raises(ValueError):
        block_hashes(A, 16, "sglang-sha256", seed="not hex")


def test_fingerprint_validation_and_equality():
    with pytest.raises(ValueError):
        Fingerprint(model="")
    with pytest.raises(TypeError):
        Fingerprint(model=None)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Fingerprint(model="m", block_size=0)
    with pytest.raises(ValueError):
        Fingerprint(model="m", tp_rank=2, tp_size=2)
    with pytest.raises(ValueError):
        Fingerprint(model="m", pp_rank=-1)
    with pytest.raises(TypeError):
        Fingerprint(model="m", tp_rank=True)
    with pytest.raises(TypeError):
        Fingerprint(model="m", extra={"k": 1})  # type: ignore[dict-item]
    a = Fingerprint(model="m", extra={"x": "1", "a": "2"})
    b = Fingerprint(model="m", extra={"a": "2", "x": "1"})
    assert a == b and hash(a) == hash(b) and a.digest() == b.digest()
    assert list(a.extra) == ["a", "x"]
    with pytest.raises(TypeError):
        a.extra["y"] = "3"  # type: ignore[index]
    assert Fingerprint(model="m", extra={"a": "3"}).digest() != b.digest()
    for clone in (pickle.loads(pickle.dumps(FP)), copy.deepcopy(FP), dataclasses.replace(FP)):
        assert clone == FP and clone.digest() == FP.digest()


def test_speed_32k_tokens():
    tokens = [(i * 2654435761) % 200_000 for i in range(32_768)]
    for scheme in SCHEMES:
        start = time.perf_counter()
        keys = block_hashes(tokens, 16, scheme)
        elapsed = time.perf_counter() - start
        assert len(keys) == 2048
        assert elapsed < 0.5, f"{scheme}: {elapsed:.3f}s for 32k tokens"  # ~1-15 ms expected


# ---------------------------------------------------------------------------
# properties

token_lists = st.lists(st.integers(0, U32_MAX), max_size=96)
schemes = st.sampled_from(SCHEMES)
seeds = st.one_of(st.none(), st.binary(max_size=20))


@settings(max_examples=150, deadline=None)
@given(tokens=token_lists, block_size=st.integers(1, 20), scheme=schemes, seed=seeds)
def test_prefix_property(tokens, block_size, scheme, seed):
    keys = block_hashes(tokens, block_size, scheme, seed)
    assert len(keys) == len(tokens) // block_size
    for k in range(len(keys) + 1):
        assert block_hashes(tokens[: k * block_size], block_size, scheme, seed) == keys[:k]
    # a partial tail never matters
    full = tokens[: len(keys) * block_size]
    assert block_hashes(full + [1, 2, 3][: block_size - 1], block_size, scheme, seed) == keys


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), block_size=st.integers(1, 16), scheme=schemes, seed=seeds)
def test_divergence_changes_only_later_keys(data, block_size, scheme, seed):
    n_blocks = data.draw(st.integers(1, 6))
    tokens = data.draw(
        st.lists(st.integers(0, U32_MAX), min_size=n_blocks * block_size, max_size=n_blocks * block_size)
    )
    pos = data.draw(st.integers(0, len(tokens) - 1))
    new = data.draw(st.integers(0, U32_MAX).filter(lambda t: t != tokens[pos]))
    changed = tokens.copy()
    changed[pos] = new
    j = pos // block_size
    a = block_hashes(tokens, block_size, scheme, seed)
    b = block_hashes(changed, block_size, scheme, seed)
    assert a[:j] == b[:j]
    assert all(x != y for x, y in zip(a[j:], b[j:]))


FIELD_CHANGES = {
    "model": {"model": "other-model"},
    "revision": {"revision": "rev2"},
    "kv_dtype": {"kv_dtype": "fp8_e4m3"},
    "kv_layout": {"kv_layout": "HND"},
    "block_size": {"block_size": 32},
    "tp_rank": {"tp_rank": 0},
    "tp_size": {"tp_size": 4},
    "pp_rank": {"pp_rank": 1, "pp_size": 2},
    "tenant_salt": {"tenant_salt": "tenant-b"},
    "extra": {"extra": {"lora": "adapter-1", "b": "x"}},
}


@settings(max_examples=100, deadline=None)
@given(
    tokens=st.lists(st.integers(0, U32_MAX), min_size=32, max_size=128),
    field_name=st.sampled_from(sorted(FIELD_CHANGES)),
    scheme=schemes,
)
def test_fingerprints_give_disjoint_keys(tokens, field_name, scheme):
    fields = {
        "model": FP.model,
        "revision": FP.revision,
        "kv_dtype": FP.kv_dtype,
        "kv_layout": FP.kv_layout,
        "block_size": FP.block_size,
        "tp_rank": FP.tp_rank,
        "tp_size": FP.tp_size,
        "pp_rank": FP.pp_rank,
        "pp_size": FP.pp_size,
        "tenant_salt": FP.tenant_salt,
        "extra": dict(FP.extra),
    }
    other = Fingerprint(**{**fields, **FIELD_CHANGES[field_name]})
    assert other != FP and other.digest() != FP.digest()
    assert namespace_seed(other, scheme) != namespace_seed(FP, scheme)
    keys_a, keys_b = FP.block_hashes(tokens, scheme), other.block_hashes(tokens, scheme)
    assert keys_a and keys_b
    assert not set(keys_a) & set(keys_b)
    assert not set(keys_a) & set(block_hashes(tokens, FP.block_size, scheme))  # unsalted


_SUBPROCESS_CODE = r"""
import json, sys
from ctxstore.hashing import SCHEMES, Fingerprint, block_hashes, namespace_seed
cases = json.loads(sys.stdin.read())
fp = Fingerprint(model="m", kv_dtype="fp8", tenant_salt="t", extra={"z": "1", "a": "2"})
out = {
    "plain": [[block_hashes(t, bs, s) for s in SCHEMES] for t, bs in cases],
    "fp": [[fp.block_hashes(t, s) for s in SCHEMES] for t, _ in cases],
    "seeds": [str(namespace_seed(fp, s)) for s in SCHEMES],
    "digest": fp.hexdigest(),
}
print(json.dumps(out))
"""


def _expected_subprocess_output(cases):
    fp = Fingerprint(model="m", kv_dtype="fp8", tenant_salt="t", extra={"z": "1", "a": "2"})
    return {
        "plain": [[block_hashes(t, bs, s) for s in SCHEMES] for t, bs in cases],
        "fp": [[fp.block_hashes(t, s) for s in SCHEMES] for t, _ in cases],
        "seeds": [str(namespace_seed(fp, s)) for s in SCHEMES],
        "digest": fp.hexdigest(),
    }


@settings(max_examples=3, deadline=None)
@given(
    cases=st.lists(
        st.tuples(st.lists(st.integers(0, U32_MAX), max_size=64), st.integers(1, 16)), min_size=1, max_size=4
    )
)
def test_deterministic_across_processes(cases):
    repo_root = str(Path(ctxstore.__file__).resolve().parent.parent)
    expected = _expected_subprocess_output(cases)
    for hashseed in ("0", "1", "4242", "random"):
        env = dict(os.environ, PYTHONHASHSEED=hashseed)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (repo_root, env.get("PYTHONPATH")) if p)
        proc = subprocess.run(
            [sys.executable, "-c", _SUBPROCESS_CODE],
            input=json.dumps(cases),
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
            check=True,
        )
        assert json.loads(proc.stdout) == expected, hashseed
