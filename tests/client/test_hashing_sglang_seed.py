"""``sglang_namespace_seed``: SGLang 0.5.23's ``storage_namespace_seed``, frozen as golden vectors (computed with
SGLang's own function; tests/integrations/test_sglang.py compares against it live where SGLang is installed)."""

from __future__ import annotations

import pytest

from ctxstore.hashing import block_hashes, sglang_namespace_seed

GOLDEN = [
    ((None, None), None),
    (("", None), "fd649dd130277fa0773e23e84ddfa4ec779d9df77087968a60d7cefb9050ab1d"),
    ((None, ""), "906782eeabf820a68eef4455ab98e5e86e311f658f7d7721723a97a90b81427e"),
    (("lora-a", "tenant-1"), "7d5eebadb5b6d118f6fb1bee6a7270aef93f903baf6224b4d5dc6579365f3491"),
    (("ab", "c"), "3d6b02ff0d7a0ce42a5ac4a58251ee0e63490c7de5eb46aa2eeaa3a0fdff5364"),
    (("a", "bc"), "b8080ec8e713ddb4b5469eaf5874a021a72286a24e6c55d2046f0acfb48a938b"),
    ((None, "tenant-é"), "58c8aeb47a5113a8cfdc4cd097aff88771c2351eb6f6221994e67e2e0605e3e2"),
]


@pytest.mark.parametrize(("args", "seed"), GOLDEN)
def test_seed_matches_sglang(args: tuple[str | None, str | None], seed: str | None) -> None:
    assert sglang_namespace_seed(*args) == seed


def test_seeded_chain_is_sglangs_page_keys() -> None:
    keys = block_hashes(list(range(8)), 4, "sglang-sha256", seed=sglang_namespace_seed(None, "tenant-1"))
    assert keys == ["f56088c5315ba7dd3142fdfd4cc13e05ab8b8978f51984c1ed3eafdcd8f7f156",
                    "14a4befc2d3f542066609f10aa13ec24ff4b5f9613342fcea2895b6b1686de77"]
    assert keys != block_hashes(list(range(8)), 4, "sglang-sha256", seed=sglang_namespace_seed(None, "tenant-2"))
    assert block_hashes(list(range(8)), 4, "sglang-sha256", seed=sglang_namespace_seed()) == \
        block_hashes(list(range(8)), 4, "sglang-sha256")
