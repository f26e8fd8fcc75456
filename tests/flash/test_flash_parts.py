"""The flash store's parts: no class grows past the size one reader can hold, each helper is defined once,
and the parts the facade is built from work on their own (settings, bucket table, index bounds)."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

from ctxstore_server.flash import FlashIndex
from ctxstore_server.flash.buckets import BucketTable
from ctxstore_server.flash.format import bucket_seed, fingerprint
from ctxstore_server.flash.index import FREE_SEG
from ctxstore_server.flash.options import MiB, FlashOptions

FLASH = Path(__file__).resolve().parents[2] / "server" / "flash"
MAX_CLASS_LINES = 500


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def test_no_flash_class_is_over_500_lines() -> None:
    big = [(path.name, node.name, node.end_lineno - node.lineno + 1)
           for path in sorted(FLASH.glob("*.py")) for node in ast.walk(_tree(path))
           if isinstance(node, ast.ClassDef) and node.end_lineno is not None
           and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES]
    assert big == []


def test_os_helpers_are_defined_once_in_osutil() -> None:
    defined = [(path.name, node.name) for path in sorted(FLASH.glob("*.py")) for node in ast.walk(_tree(path))
               if isinstance(node, ast.FunctionDef) and node.name.lstrip("_") in
               {"close_quietly", "unlink_quietly", "lock_file", "raise_fd_limit", "trim_heap"}]
    assert sorted(defined) == [("osutil.py", "close_quietly"), ("osutil.py", "lock_file"),
                               ("osutil.py", "raise_fd_limit"), ("osutil.py", "trim_heap"),
                               ("osutil.py", "unlink_quietly")]


def test_only_the_index_reads_its_private_fields() -> None:
    for path in sorted(FLASH.glob("*.py")):
        if path.name == "index.py":
            continue
        text = path.read_text()
        assert "._high" not in text, path.name
        assert "0xFFFFFFFF)" not in text.replace("0xFFFFFFFFFFFFFFFF)", ""), path.name  # FREE_SEG by name


def test_options_validate_and_derive_as_the_store_did() -> None:
    o = FlashOptions(32 * MiB, segment_bytes=1 * MiB, max_open_segments=64)
    assert o.meta_reserve == MiB  # at least 1 MiB, else a 1024th of the capacity
    assert o.max_open_segments == (32 * MiB - MiB) // MiB - 2  # two slots kept free for eviction to work
    assert o.compact_budget == 1 * MiB  # a segment's worth unless given
    assert FlashOptions(32 * MiB, segment_bytes=1 * MiB, compact_bytes=4096).compact_budget == 4096
    assert FlashOptions(4 << 30, segment_bytes=64 * MiB).meta_reserve == (4 << 30) // 1024
    with pytest.raises(ValueError, match="multiple of 4 KiB"):
        FlashOptions(32 * MiB, segment_bytes=1 * MiB + 1)
    with pytest.raises(ValueError, match="at least 3 segments"):
        FlashOptions(3 * MiB, segment_bytes=1 * MiB)


def test_options_share_a_window_between_records_expiring_together() -> None:
    o = FlashOptions(32 * MiB, segment_bytes=1 * MiB)
    now = 1_000_000.0
    assert o.window(now + 10, now) == (64, int((now + 10) // 64))  # short lives: the minimum window
    width, _ = o.window(now + 3600, now)
    assert width == 256  # about a sixteenth of the time to live, a power of two
    assert o.window(now + 3600, now) == o.window(now + 3601, now)


def test_bucket_table_ids_seeds_and_versions() -> None:
    t = BucketTable()
    assert t.get("a") is None and "a" not in t
    assert (t.id("a"), t.id("b"), t.id("a")) == (0, 1, 0)
    assert t.names == ["a", "b"] and "b" in t
    assert t.seed("b") == bucket_seed("b")
    assert t.fingerprint("b", "k") == fingerprint(bucket_seed("b"), b"k")
    assert t.version(0) == 0
    t.changed(0)
    assert (t.version(0), t.version(1)) == (1, 0)
    assert t.stat_if_any(1) is None
    t.stat(1).reads += 1
    assert t.stat_if_any(1) is not None and t.stat(1).reads == 1


def test_index_high_bounds_the_rows_ever_used() -> None:
    idx = FlashIndex()
    assert idx.high == 0
    fps = np.arange(1, 11, dtype=np.uint64)
    n = fps.size
    idx.put(fps, np.full(n, 3, np.uint32), np.arange(n, dtype=np.uint32), np.full(n, 7, np.uint32),
            np.full(n, 64, np.uint32), np.full(n, 1e9), np.zeros(n, np.uint32))
    assert idx.high == 10
    rows, _ = idx.find(fps[:4])
    idx.remove(rows)
    assert idx.high == 10 and int((idx.seg[:idx.high] != FREE_SEG).sum()) == 6  # freed rows stay below high
