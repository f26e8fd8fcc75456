"""Under memory pressure a node loses chains from their tails, never from the middle: what survives of each
saved chain is a prefix (a hole would end every later block's use). A real node, several namespaces saved one
after another three times over its RAM, read back through the client."""

from __future__ import annotations

from pathlib import Path

from support.nodes import ACCESS_KEY, SECRET_KEY, start_node

from ctxstore import ContextStore, Limits, wire

BLOCK = 64 << 10


def test_what_survives_of_each_chain_is_a_prefix(tmp_path: Path) -> None:
    node = start_node(tmp_path, "--memory", "4MiB")
    store = ContextStore(node.endpoint, access_key=ACCESS_KEY, secret_key=SECRET_KEY, threads=1)
    try:
        chains = []
        for n in range(12):  # 12 chains of 16 blocks of 64 KiB: 12 MiB into 4 MiB
            ns = store.namespace(f"chain-{n:02d}", model="m", block_size=4)
            tokens = [n * 1000 + t for t in range(4 * 16)]
            assert ns.save(tokens, [bytes([n, i]) * (BLOCK // 2) for i in range(16)]).stored == 16
            chains.append((ns, tokens))
            if n % 3 == 2:  # reads rank a chain too: the first block it names becomes the most recent
                old_ns, old_tokens = chains[n - 2]
                old_ns.lookup(old_tokens)
        survived = 0
        for ns, tokens in chains:
            present = [size != wire.ABSENT for size in store.lookup_keys(ns.bucket, ns.block_hashes(tokens))]
            kept = sum(present)
            assert present == [True] * kept + [False] * (16 - kept), f"{ns.bucket}: a hole in {present}"
            survived += kept
        assert 0 < survived < 12 * 16  # eviction did happen, and left whole prefixes
    finally:
        store.close()
        node.stop()


def test_a_chain_saved_in_several_calls_loses_its_tail_first(tmp_path: Path) -> None:
    node = start_node(tmp_path, "--memory", "4MiB")
    store = ContextStore(node.endpoint, access_key=ACCESS_KEY, secret_key=SECRET_KEY, threads=1,
                         limits=Limits(bytes_per_call=1 << 20))
    try:
        ns = store.namespace("long-chain", model="m", block_size=4)
        tokens = list(range(4 * 40))  # 40 blocks of 64 KiB: 2.5 MiB, in three calls
        assert ns.save(tokens, [bytes([i]) * BLOCK for i in range(40)]).stored == 40
        other = store.namespace("other", model="m", block_size=4)
        assert other.save(list(range(4 * 24)), [b"o" * BLOCK] * 24).stored == 24  # 1.5 MiB more: evicts some
        present = [size != wire.ABSENT for size in store.lookup_keys(ns.bucket, ns.block_hashes(tokens))]
        kept = sum(present)
        assert 0 < kept < 40 and present == [True] * kept + [False] * (40 - kept), present
    finally:
        store.close()
        node.stop()
