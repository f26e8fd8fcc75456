"""The in-RAM index of flash-resident blocks: numpy arrays, about 60 bytes per block, vectorized lookups.

Layout: a dense table of rows (struct of arrays, one row per block) and an open-addressing hash table
(linear probing, load factor 0.25–0.5) of ``uint32`` slots holding ``row + 1`` (0 = empty, ``TOMB`` = deleted). A row holds the
64-bit fingerprint of (bucket, key), never the key: the store confirms the key against the record header on
every read, so a fingerprint collision costs a miss, never another key's bytes.

Rows: fp u64, segment u32, offset u32, payload_len u32, header_len u32, expires f64, bucket u32, flags u8
= 37 bytes, grown by half when full; slots: 4 bytes each, 8–16 per block. Deleted rows go on a free
stack (int32) and are reused. Every method is vectorized over numpy arrays; the store calls them from one
thread (the event loop), so there are no locks.
"""

from __future__ import annotations

import numpy as np

TOMB = np.uint32(0xFFFFFFFF)
FREE_SEG = 0xFFFFFFFF  # segment id of an unused row
HOT = 1  # flags bit: read since it was written (a candidate for re-append when its segment is evicted)

_ROW_FIELDS = {
    "fp": np.uint64, "seg": np.uint32, "off": np.uint32, "plen": np.uint32, "hlen": np.uint32,
    "exp": np.float64, "bkt": np.uint32, "flags": np.uint8,
}
_MIN_ROWS = 1024
_MAX_LOAD = 0.5
_REBUILD_LOAD = 0.25


class FlashIndex:
    """fingerprint -> (segment, offset, lengths, expiry, bucket). See the module docstring."""

    def __init__(self, capacity: int = _MIN_ROWS) -> None:
        cap = max(_MIN_ROWS, int(capacity))
        self.fp = np.zeros(cap, np.uint64)
        self.seg = np.full(cap, FREE_SEG, np.uint32)
        self.off = np.zeros(cap, np.uint32)
        self.plen = np.zeros(cap, np.uint32)
        self.hlen = np.zeros(cap, np.uint32)
        self.exp = np.zeros(cap, np.float64)
        self.bkt = np.zeros(cap, np.uint32)
        self.flags = np.zeros(cap, np.uint8)
        self._free = np.zeros(cap, np.int32)  # stack of free rows below _high
        self._nfree = 0
        self._high = 0  # rows [0, _high) have been used at least once
        self.count = 0
        self._tombs = 0
        self._slots = np.zeros(_pow2(int(cap / _REBUILD_LOAD)), np.uint32)
        self._mask = np.uint64(self._slots.size - 1)

    @property
    def high(self) -> int:
        """Rows ``[0, high)`` have been used at least once (the rest of the arrays is spare capacity): a
        vectorized pass over the rows need not look further. Rows below it may be free (``seg == FREE_SEG``)."""
        return self._high

    # ------------------------------------------------------------------------------------------ lookups

    def find(self, fps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(rows, slot positions) of ``fps`` (uint64); -1 where absent."""
        n = fps.size
        rows = np.full(n, -1, np.int64)
        spos = np.full(n, -1, np.int64)
        if n == 0 or self.count == 0:
            return rows, spos
        slots, rfp, mask = self._slots, self.fp, self._mask
        idx = np.arange(n)
        want = fps
        pos = (fps & mask).astype(np.int64)
        for _ in range(slots.size):
            s = slots[pos]
            empty = s == 0
            live = ~empty & (s != TOMB)
            r = s.astype(np.int64) - 1
            hit = np.zeros(idx.size, bool)
            hit[live] = rfp[r[live]] == want[live]
            rows[idx[hit]] = r[hit]
            spos[idx[hit]] = pos[hit]
            more = ~(hit | empty)
            if not more.any():
                break
            idx, want = idx[more], want[more]
            pos = (pos[more] + 1) & np.int64(mask)
        return rows, spos

    def find_one(self, fp: int) -> int:
        """The row of one fingerprint, or -1: the same probe as :meth:`find` without array set-up (a
        single-key lookup costs about a microsecond instead of tens)."""
        if self.count == 0:
            return -1
        slots, rfp = self._slots, self.fp
        mask = int(self._mask)
        pos = fp & mask
        for _ in range(slots.size):
            s = int(slots[pos])
            if s == 0:
                return -1
            if s != TOMB and int(rfp[s - 1]) == fp:
                return s - 1
            pos = (pos + 1) & mask
        return -1

    def rows_of_segment(self, seg: int) -> np.ndarray:
        """Rows of the blocks held in segment ``seg`` (one vectorized pass over the rows)."""
        return np.flatnonzero(self.seg[:self._high] == seg)

    def rows_of_bucket(self, bucket: int) -> np.ndarray:
        hi = self._high
        return np.flatnonzero((self.bkt[:hi] == bucket) & (self.seg[:hi] != FREE_SEG))

    def used_rows(self) -> np.ndarray:
        return np.flatnonzero(self.seg[:self._high] != FREE_SEG)

    # ---------------------------------------------------------------------------------------- mutations

    def put(self, fps: np.ndarray, seg: np.ndarray, off: np.ndarray, plen: np.ndarray, hlen: np.ndarray,
            exp: np.ndarray, bkt: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Insert or replace the blocks ``fps`` (unique within the call).

        Returns what was replaced: (positions in the arguments, old segment, old offset, old record bytes)."""
        rows, _ = self.find(fps)
        old = rows >= 0
        where = np.flatnonzero(old)
        orow = rows[old]
        replaced = (where, self.seg[orow].copy(), self.off[orow].copy(),
                    self.hlen[orow].astype(np.int64) + self.plen[orow])
        new = np.flatnonzero(~old)
        if new.size:
            nrows = self._alloc(new.size)
            rows[new] = nrows
            self.fp[nrows] = fps[new]
        self.seg[rows] = seg
        self.off[rows] = off
        self.plen[rows] = plen
        self.hlen[rows] = hlen
        self.exp[rows] = exp
        self.bkt[rows] = bkt
        self.flags[rows] = 0
        if new.size:
            self.count += new.size
            if self.count + self._tombs > _MAX_LOAD * self._slots.size:
                self._rehash()
            else:
                self._place(fps[new], rows[new])
        return replaced

    def remove(self, rows: np.ndarray) -> None:
        """Forget the given rows (as returned by find or rows_of_segment)."""
        rows = np.unique(rows[rows >= 0])
        if rows.size == 0:
            return
        _, spos = self.find(self.fp[rows])
        self._slots[spos[spos >= 0]] = TOMB
        self._tombs += int((spos >= 0).sum())
        self.seg[rows] = FREE_SEG
        self.flags[rows] = 0
        self._free[self._nfree:self._nfree + rows.size] = rows
        self._nfree += rows.size
        self.count -= rows.size
        if self._tombs > self.count and self._tombs > _MIN_ROWS:
            self._rehash()

    def bulk_load(self, fps: np.ndarray, seg: np.ndarray, off: np.ndarray, plen: np.ndarray, hlen: np.ndarray,
                  exp: np.ndarray, bkt: np.ndarray) -> None:
        """Fill an empty index with unique fingerprints in one pass (recovery)."""
        assert self.count == 0
        n = fps.size
        self._grow_rows(n)
        self.fp[:n], self.seg[:n], self.off[:n], self.plen[:n] = fps, seg, off, plen
        self.hlen[:n], self.exp[:n], self.bkt[:n] = hlen, exp, bkt
        self._high = self.count = n
        self._rehash()

    # ---------------------------------------------------------------------------------------- internals

    def nbytes(self) -> int:
        """RAM held by the arrays."""
        arrays = (self.fp, self.seg, self.off, self.plen, self.hlen, self.exp, self.bkt, self.flags, self._free,
                  self._slots)
        return sum(a.nbytes for a in arrays)

    def _alloc(self, n: int) -> np.ndarray:
        take = min(n, self._nfree)
        rows = self._free[self._nfree - take:self._nfree].astype(np.int64)
        self._nfree -= take
        rest = n - take
        if rest:
            self._grow_rows(self._high + rest)
            rows = np.concatenate([rows, np.arange(self._high, self._high + rest, dtype=np.int64)])
            self._high += rest
        return rows

    def _grow_rows(self, need: int) -> None:
        cap = self.fp.size
        if need <= cap:
            return
        new = max(need, cap + cap // 2)
        for name, dtype in _ROW_FIELDS.items():
            old = getattr(self, name)
            arr = np.full(new, FREE_SEG, dtype) if name == "seg" else np.zeros(new, dtype)
            arr[:cap] = old
            setattr(self, name, arr)
        free = np.zeros(new, np.int32)
        free[:cap] = self._free
        self._free = free

    def _rehash(self) -> None:
        size = _pow2(max(int(self.count / _REBUILD_LOAD), _MIN_ROWS))
        self._slots = np.zeros(size, np.uint32)
        self._mask = np.uint64(size - 1)
        self._tombs = 0
        rows = self.used_rows()
        self._place(self.fp[rows], rows)

    def _place(self, fps: np.ndarray, rows: np.ndarray) -> None:
        """Put rows whose fingerprints are known to be absent into free slots."""
        slots, mask = self._slots, np.int64(self._mask)
        idx = np.arange(fps.size)
        pos = (fps & self._mask).astype(np.int64)
        while idx.size:
            s = slots[pos]
            free = (s == 0) | (s == TOMB)
            fidx = np.flatnonzero(free)
            uniq, first = np.unique(pos[fidx], return_index=True)
            self._tombs -= int((slots[uniq] == TOMB).sum())
            slots[uniq] = (rows[idx[fidx[first]]] + 1).astype(np.uint32)
            placed = np.zeros(idx.size, bool)
            placed[fidx[first]] = True
            idx = idx[~placed]
            pos = (pos[~placed] + 1) & mask


def _pow2(n: int) -> int:
    return 1 << max(10, (int(n) - 1).bit_length())
