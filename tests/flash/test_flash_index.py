"""The compact index against a dict model, and its RAM per block."""

from __future__ import annotations

import random

import numpy as np

from ctxstore_server.flash import FlashIndex


def _put(idx: FlashIndex, fps: list[int], seg: int) -> None:
    n = len(fps)
    idx.put(np.array(fps, np.uint64), np.full(n, seg, np.uint32), np.arange(n, dtype=np.uint32),
            np.full(n, 7, np.uint32), np.full(n, 64, np.uint32), np.full(n, 1e9), np.zeros(n, np.uint32))


def test_random_operations_agree_with_a_dict() -> None:
    rng = random.Random(1)
    idx = FlashIndex()
    model: dict[int, int] = {}
    universe = [rng.getrandbits(64) for _ in range(20_000)]
    for step in range(60):
        fps = list(dict.fromkeys(rng.sample(universe, rng.randint(1, 2000))))
        if rng.random() < 0.6:
            _put(idx, fps, step)
            model.update((f, step) for f in fps)
        else:
            rows, _ = idx.find(np.array(fps, np.uint64))
            idx.remove(rows)
            for f in fps:
                model.pop(f, None)
        assert idx.count == len(model)
    probe = np.array(universe, np.uint64)
    rows, _ = idx.find(probe)
    for f, r in zip(universe, rows.tolist()):
        if f in model:
            assert r >= 0 and int(idx.fp[r]) == f and int(idx.seg[r]) == model[f]
        else:
            assert r == -1


def test_replacing_returns_the_old_location() -> None:
    idx = FlashIndex()
    _put(idx, [5, 6], 1)
    where, oseg, ooff, obytes = idx.put(np.array([6, 9], np.uint64), np.array([2, 2], np.uint32),
                                        np.array([100, 200], np.uint32), np.array([1, 1], np.uint32),
                                        np.array([10, 10], np.uint32), np.array([1e9, 1e9]), np.zeros(2, np.uint32))
    assert where.tolist() == [0] and oseg.tolist() == [1] and ooff.tolist() == [1] and obytes.tolist() == [71]
    assert idx.count == 3


def test_bulk_load_then_updates() -> None:
    idx = FlashIndex()
    fps = np.arange(1, 50_001, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    n = fps.size
    idx.bulk_load(fps, np.zeros(n, np.uint32), np.arange(n, dtype=np.uint32), np.ones(n, np.uint32),
                  np.ones(n, np.uint32), np.ones(n), np.zeros(n, np.uint32))
    rows, _ = idx.find(fps)
    assert (rows >= 0).all() and (idx.off[rows] == np.arange(n)).all()
    idx.remove(rows[::2])
    rows, _ = idx.find(fps)
    assert (rows[::2] == -1).all() and (rows[1::2] >= 0).all()


def test_ram_per_block_is_well_under_128_bytes() -> None:
    idx = FlashIndex()
    rng = np.random.default_rng(3)
    for _ in range(20):
        fps = np.unique(rng.integers(0, 2**63, 10_000, dtype=np.int64).astype(np.uint64))
        n = fps.size
        idx.put(fps, np.zeros(n, np.uint32), np.zeros(n, np.uint32), np.zeros(n, np.uint32),
                np.zeros(n, np.uint32), np.zeros(n), np.zeros(n, np.uint32))
    assert idx.count >= 199_000
    assert idx.nbytes() / idx.count <= 128
