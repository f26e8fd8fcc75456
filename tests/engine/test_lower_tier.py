"""The lower-tier seam: a RAM-only node's engine has a lower tier that holds nothing (NoLowerTier), and every read
that spans the tiers gives RAM's answer through it, counted exactly as before the seam existed."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import xxhash
from support.inprocess import FakeClock

from ctxstore_server.engine import BlockWrite, Engine, EngineConfig, errors
from ctxstore_server.engine import reads as reads_module
from ctxstore_server.engine.lower import NoLowerTier, empty_disk_stats
from ctxstore_server.engine.tier import FlashTier


def _engine(**config: object) -> Engine:
    engine = Engine(EngineConfig(budget=64 << 20, default_ttl=60.0, max_ttl=3600.0, **config),  # type: ignore[arg-type]
                    clock=FakeClock())
    engine.create_bucket("t", "b")
    return engine


def _put(engine: Engine, keys: list[str], size: int = 100) -> None:
    data = bytes(size)
    engine.put_blocks("t", "b", [BlockWrite(k, data, "e", xxhash.xxh3_64_intdigest(data), None) for k in keys],
                      ttl=None, if_absent=False)


def test_a_ram_only_engine_has_a_lower_tier_that_holds_nothing() -> None:
    engine = _engine()
    assert isinstance(engine.tier, NoLowerTier)
    assert engine.store.lower is engine.tier
    assert asyncio.run(engine.open()) is None
    assert engine.disk_degraded is None
    _put(engine, ["a"])
    stats = engine.operator.stats()
    flat = {k: v for k, v in empty_disk_stats().items() if k != "disk_buckets"}  # spread over the buckets
    assert {k: stats[k] for k in flat} == flat
    assert stats["buckets"]["b"]["disk_objects"] == 0


def test_the_empty_stats_name_every_figure_the_flash_tier_reports(tmp_path: Path) -> None:
    engine = Engine(EngineConfig(budget=64 << 20, disk_path=str(tmp_path), disk_size=64 << 20,
                                 disk_segment_size=4 << 20))
    assert isinstance(engine.tier, FlashTier)
    assert set(engine.tier.stats()) == set(empty_disk_stats())


def test_locate_on_a_ram_only_node_counts_hits_and_misses_and_reports_no_tiers() -> None:
    engine = _engine()
    _put(engine, ["k0", "k1", "k2"])
    assert engine.locate("t", "b", ["k0", "k1", "k2"]) == ([100, 100, 100], None)
    assert engine.locate("t", "b", ["k0", "x", "k2", "y"]) == ([100, -1, 100, -1], None)
    stats = engine.operator.stats()["buckets"]["b"]
    assert (stats["hits"], stats["misses"], stats["disk_hits"]) == (5, 2, 0)


def test_fetch_and_fetch_many_on_a_ram_only_node() -> None:
    engine = _engine()
    _put(engine, ["k0", "k1"])
    found = asyncio.run(engine.fetch_many("t", "b", ["k0", "x", "k1"]))
    assert [o.key if o is not None else None for o in found] == ["k0", None, "k1"]
    assert asyncio.run(engine.fetch("t", "b", "k1")).key == "k1"
    with pytest.raises(errors.NoSuchKey):
        asyncio.run(engine.fetch("t", "b", "x"))
    stats = engine.operator.stats()["buckets"]["b"]
    assert (stats["hits"], stats["misses"]) == (3, 2)
    assert engine.existing("t", "b", ["k0", "x"]) == [True, False]
    assert engine.prefetch("t", "b", ["k0", "x"]) == {"ram": 1, "disk": 0, "missing": 1, "started": 0}


def test_listing_a_ram_only_bucket_crosses_chunks_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reads_module, "LIST_CHUNK", 3)
    engine = _engine()
    keys = [f"k{i:02d}" for i in range(10)]
    _put(engine, list(reversed(keys)))

    async def listed(start: str, inclusive: bool) -> list[str]:
        return [o.key async for o in engine.list_objects("t", "b", start, inclusive)]

    assert asyncio.run(listed("", True)) == keys
    assert asyncio.run(listed("k03", True)) == keys[3:]
    assert asyncio.run(listed("k03", False)) == keys[4:]


def test_flush_expire_and_delete_bucket_on_a_ram_only_node() -> None:
    engine = _engine()
    _put(engine, ["a1", "a2", "b1"])
    assert asyncio.run(engine.expire_now("b", "a")) == 2
    assert asyncio.run(engine.flush("b")) == 1
    engine.delete_bucket("t", "b")
    assert engine.store.list_buckets("t") == []
