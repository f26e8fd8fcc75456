"""Damage on disk made by the test: a flipped payload byte, a flipped header byte, a truncated tail segment, a
damaged footer, a foreign file. Each is a miss, counted, and never served; the rest keeps working."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
from flash_support import MiB, append_all, check_payload, record, run, small_store

from ctxstore_server.flash import CORRUPT, FlashStore, Removal
from ctxstore_server.flash.format import TRAILER, Trailer, fingerprint


def _seg_file(path: Path, segment: int) -> Path:
    return path / f"seg-{segment:016x}.dat"


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def _keys(n: int) -> list[str]:
    return [f"c{i:03d}" for i in range(n)]


def test_a_flipped_payload_byte_is_a_counted_miss_dropped_and_reported(tmp_path: Path) -> None:
    removed: list[Removal] = []

    async def first() -> None:
        store = small_store(tmp_path, on_remove=removed.extend)
        await store.open()
        await append_all(store, [record(k, 1, 50_000) for k in _keys(40)])
        await store.close()  # sealed: the footer does not know the payload is about to go bad
        store = small_store(tmp_path, on_remove=removed.extend)
        await store.open()
        loc = store.lookup("b", "c007").location  # type: ignore[union-attr]
        _flip(_seg_file(tmp_path, loc.segment), loc.offset + loc.header_len + 1234)
        blocks = await store.read_many("b", _keys(40))
        assert [i for i, b in enumerate(blocks) if b is None] == [7]
        assert all(check_payload(f"c{i:03d}", b.payload) == 1 for i, b in enumerate(blocks) if b is not None)
        assert store.stats().corrupt == 1 and store.stats().buckets["b"].corrupt == 1
        assert removed == [Removal("b", "c007", CORRUPT)]
        assert store.lookup("b", "c007") is None and await store.read("b", "c007") is None
        await store.close()

    async def second() -> None:
        store = small_store(tmp_path)
        report = await store.open()
        assert report.blocks == 39  # the drop was logged: the footer's entry does not come back
        assert await store.read("b", "c007") is None
        await store.close()

    run(first())
    run(second())


def test_a_flipped_header_byte_is_a_counted_miss(tmp_path: Path) -> None:
    async def go() -> None:
        store = small_store(tmp_path)
        await store.open()
        await append_all(store, [record(k, 1, 10_000) for k in _keys(10)])
        loc = store.lookup("b", "c003").location  # type: ignore[union-attr]
        _flip(_seg_file(tmp_path, loc.segment), loc.offset + 58)  # inside the bucket/key bytes
        assert await store.read_meta("b", "c003") is None  # HEAD verifies the header too
        assert store.stats().corrupt == 1
        assert await store.read("b", "c003") is None
        assert (await store.read("b", "c004")) is not None
        await store.close()

    run(go())


def test_a_truncated_tail_segment_loses_only_the_torn_record(tmp_path: Path) -> None:
    live, copy = tmp_path / "live", tmp_path / "copy"

    async def go() -> None:
        store = small_store(live, seal_idle=3600)
        await store.open()
        await append_all(store, [record(k, 1, 30_000) for k in _keys(20)])
        # the segment is still open (unsealed): copy the directory as a crash would leave it
        shutil.copytree(live, copy, ignore=shutil.ignore_patterns("LOCK"))
        last = store.lookup("b", "c019").location  # type: ignore[union-attr]
        await store.close()
        seg = _seg_file(copy, last.segment)
        os.truncate(seg, last.offset + last.header_len + 1000)  # the last record is torn
        store = small_store(copy)
        report = await store.open()
        assert report.tail_segments == 1 and report.discarded_records == 1
        assert report.blocks == 19
        blocks = await store.read_many("b", _keys(20))
        assert blocks[19] is None
        assert all(check_payload(f"c{i:03d}", b.payload) == 1 for i, b in enumerate(blocks[:19]) if b is not None)
        assert all(b is not None for b in blocks[:19])
        await store.close()
        report = (await _reopen(copy))
        assert report.tail_segments == 0 and report.sealed_segments == 1 and report.blocks == 19  # sealed by the scan

    run(go())


async def _reopen(path: Path):  # type: ignore[no-untyped-def]
    store = small_store(path)
    report = await store.open()
    await store.close()
    return report


def test_a_damaged_footer_falls_back_to_scanning_the_segment(tmp_path: Path) -> None:
    async def go() -> None:
        store = small_store(tmp_path)
        await store.open()
        await append_all(store, [record(k, 1, 20_000) for k in _keys(30)])
        await store.close()
        seg = min(tmp_path.glob("seg-*.dat"))
        trailer = Trailer.unpack(seg.read_bytes()[-TRAILER:])
        _flip(seg, trailer.footer_offset + trailer.index_len + 3)  # a key in the footer: listing notices
        store = small_store(tmp_path)
        assert (await store.open()).blocks == 30
        assert await store.list_keys("b") == _keys(30)  # read from the record headers instead
        await store.close()
        _flip(seg, trailer.footer_offset + trailer.index_len - 30)  # an entry: recovery notices
        store = small_store(tmp_path)
        report = await store.open()
        assert report.corrupt_segments == 1 and report.tail_segments == 1 and report.blocks == 30
        assert all(b is not None for b in await store.read_many("b", _keys(30)))
        await store.close()

    run(go())


def test_a_foreign_or_garbled_segment_file_is_removed_and_counted(tmp_path: Path) -> None:
    async def go() -> None:
        store = small_store(tmp_path)
        await store.open()
        await append_all(store, [record("k")])
        await store.close()
        (tmp_path / "seg-00000000000000ff.dat").write_bytes(os.urandom(10_000))
        (tmp_path / "notes.txt").write_text("not ours")
        store = small_store(tmp_path)
        report = await store.open()
        assert report.corrupt_segments == 1 and report.blocks == 1
        assert not (tmp_path / "seg-00000000000000ff.dat").exists() and (tmp_path / "notes.txt").exists()
        await store.close()

    run(go())


def test_a_fingerprint_collision_is_a_miss_and_never_another_keys_bytes(tmp_path: Path) -> None:
    """Force the index to point key "x" at key "y"'s record, as a 64-bit collision would."""

    async def go() -> None:
        store: FlashStore = small_store(tmp_path, 8 * MiB)
        await store.open()
        await append_all(store, [record("y", 1, 5000)])
        loc = store.lookup("b", "y").location  # type: ignore[union-attr]
        fp_x = fingerprint(store._buckets.seed("b"), b"x")
        store.index.put(np.array([fp_x], np.uint64), np.array([loc.segment], np.uint32),
                        np.array([loc.offset], np.uint32), np.array([loc.payload_len], np.uint32),
                        np.array([loc.header_len], np.uint32), np.array([4e9]), np.array([0], np.uint32))
        assert store.lookup("b", "x") is not None  # the index alone cannot tell
        assert await store.read("b", "x") is None  # the record header can
        assert await store.read_meta("b", "x") is None
        assert store.stats().collisions == 2 and store.stats().corrupt == 0
        assert check_payload("y", (await store.read("b", "y")).payload) == 1  # type: ignore[union-attr]
        await store.close()

    run(go())
