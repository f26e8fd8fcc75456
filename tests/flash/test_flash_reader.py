"""Flash reads: O_DIRECT where the file system takes it, page-aligned buffers kept for the next read, and a
buffer never handed out again while a payload view of it is alive."""

from __future__ import annotations

import asyncio
import errno
import fcntl
import gc
import os
from pathlib import Path

import pytest
from flash_support import MiB, append_all, check_payload, record, run, small_store

from ctxstore_server.flash.reader import MIN_POOLED, ReadBuffers
from ctxstore_server.flash.segments import open_reader, pread_exact


def _address(arr: object) -> int:
    return arr.ctypes.data  # type: ignore[attr-defined]


def test_a_buffer_comes_back_only_when_its_last_view_is_gone() -> None:
    pool = ReadBuffers(retain_bytes=4 * MiB)
    first = pool.take(MiB)
    assert len(first) == MiB and _address(first) % 4096 == 0
    first[:4] = 7
    view = first.data[:4]  # what a reply being sent holds
    addr = _address(first)
    del first
    gc.collect()
    second = pool.take(MiB)
    assert _address(second) != addr  # the first is still referenced: not reused
    assert bytes(view) == b"\x07" * 4
    del view, second
    gc.collect()
    assert pool.retained == 2 * MiB
    again = pool.take(MiB - 100)  # rounded up to the same size class
    assert _address(again) in (addr, _address(again)) and pool.retained == MiB
    fresh = pool.fresh
    del again
    pool.take(MiB)
    assert pool.fresh == fresh  # served from the pool


def test_kept_buffers_are_bounded_and_small_reads_bypass_the_pool() -> None:
    pool = ReadBuffers(retain_bytes=MiB)
    bufs = [pool.take(MiB) for _ in range(3)]
    del bufs
    gc.collect()
    assert pool.retained == MiB  # two of three let go
    small = pool.take(MIN_POOLED - 1)
    assert _address(small) % 4096 == 0 and len(small) == MIN_POOLED - 1
    assert pool.fresh == 3
    pool.clear()
    assert pool.retained == 0


def test_kept_buffers_are_trimmed_largest_first_to_what_the_caller_has_room_for() -> None:
    pool = ReadBuffers(retain_bytes=16 * MiB)
    first = pool.take(2 * MiB)
    del first
    gc.collect()
    taken = pool.take(2 * MiB)  # the kept one, handed out again: no 2 MiB buffer is kept now
    bufs = [pool.take(n) for n in (4 * MiB, MiB, MiB, MIN_POOLED)]
    del bufs
    gc.collect()
    assert pool.retained == 6 * MiB + MIN_POOLED
    assert pool.trim(3 * MiB) == 2 * MiB + MIN_POOLED  # the 4 MiB buffer
    assert pool.trim(3 * MiB) == 2 * MiB + MIN_POOLED  # nothing more to do
    fresh = pool.fresh
    pool.take(MiB)
    assert pool.fresh == fresh  # what was kept is still served
    assert pool.trim(MiB) == MIN_POOLED  # both 1 MiB buffers go, the small one fits
    assert pool.trim(0) == 0
    del taken


def test_segments_are_read_with_o_direct_and_the_store_reuses_its_read_buffers(tmp_path: Path) -> None:
    sizes = [1, 4095, 4097, 300_001, 700_000]  # unaligned offsets and lengths everywhere
    recs = [record(f"k{i}", i, sizes[i % len(sizes)]) for i in range(40)]

    async def go() -> None:
        store = small_store(tmp_path, 64 * MiB, segment_bytes=4 * MiB)
        await store.open()
        assert all(r.stored for r in await append_all(store, recs))
        fds = [seg.rfd for seg in store._segments]
        assert fds and all(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT for fd in fds)
        for _ in range(2):
            blocks = await store.read_many("b", [r.key for r in recs])
            assert [check_payload(r.key, b.payload) if b else None for r, b in zip(recs, blocks)] == \
                list(range(40))
            assert [len(b.payload) for b in blocks if b] == [len(r.payload) for r in recs]
            if _ == 0:
                del blocks
                await asyncio.sleep(0)  # the read's done-callbacks (holding its results) run on the next turn
                gc.collect()
                kept, fresh = store.stats().buffer_bytes, store._reads.buffers.fresh
                assert kept > 0
        assert store._reads.buffers.fresh == fresh  # the second read took kept buffers
        await store.close()
        assert store.stats().buffer_bytes == 0

    run(go())


def test_direct_io_off_reads_through_the_page_cache(tmp_path: Path) -> None:
    recs = [record(f"k{i}", i, 5000 + i) for i in range(10)]

    async def go() -> None:
        store = small_store(tmp_path, direct_io=False)
        await store.open()
        await append_all(store, recs)
        assert not any(fcntl.fcntl(seg.rfd, fcntl.F_GETFL) & os.O_DIRECT for seg in store._segments)
        blocks = await store.read_many("b", [r.key for r in recs])
        assert [check_payload(r.key, b.payload) if b else None for r, b in zip(recs, blocks)] == list(range(10))
        await store.close()

    run(go())


def test_a_file_system_without_o_direct_is_read_buffered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Every file system here takes O_DIRECT (tmpfs too, on this kernel): its refusal is simulated, as
    # open(2) gives it elsewhere (EINVAL).
    path = tmp_path / "f"
    path.write_bytes(b"abcdefgh" * 1000)
    real_open = os.open

    def no_direct(file: str | Path, flags: int, *args: int) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(file, flags, *args)

    monkeypatch.setattr(os, "open", no_direct)
    fd = open_reader(path, direct=True)
    try:
        assert not fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT
        assert bytes(pread_exact(fd, 5, 8 * 999 + 3)) == b"defgh"
    finally:
        os.close(fd)


def test_unaligned_reads_of_an_o_direct_descriptor(tmp_path: Path) -> None:
    path = tmp_path / "f"
    data = os.urandom(3 * 4096 + 123)
    path.write_bytes(data)
    fd = open_reader(path, direct=True)
    try:
        assert fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT
        for off, n in [(0, 1), (1, 4096), (4095, 2), (4096, 4096), (5000, 10_000), (len(data) - 5, 100)]:
            assert bytes(pread_exact(fd, n, off)) == data[off:off + n]
    finally:
        os.close(fd)
