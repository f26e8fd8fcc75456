"""The catalog: the RAM index seen by bucket and key — lookups, touch, delete, and keeping the segment table's
live figures in step with every row that enters or leaves the index. No I/O (deletes reach the dead log through
the ``log_dead`` callback)."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence

import numpy as np
import xxhash

from .buckets import BucketTable
from .index import FREE_SEG, FlashIndex
from .recovery import Recovered
from .segment_table import SegmentTable
from .state import dead_keys
from .types import Entry

# tuple.__new__ straight from the columns: a third of the cost of calling Entry(...) per key
_new_entry: Callable[[tuple[int, float, int, int, int]], Entry] = functools.partial(tuple.__new__, Entry)


class Catalog:
    """The index (``index``) with the bucket and segment tables it refers to."""

    def __init__(self, buckets: BucketTable, segments: SegmentTable, clock: Callable[[], float],
                 log_dead: Callable[[np.ndarray], None]) -> None:
        self.index = FlashIndex()
        self._buckets = buckets
        self._segments = segments
        self._clock = clock
        self._log_dead = log_dead

    def install(self, rec: Recovered) -> None:
        """Load what recovery found: the index, and each segment's live count, bytes and latest expiry."""
        self.index = FlashIndex(int(rec.fp.size * 1.25) + 1024)
        self.index.bulk_load(rec.fp, rec.seg, rec.off, rec.plen, rec.hlen, rec.exp, rec.bkt)
        if rec.fp.size:
            rlen = rec.hlen.astype(np.int64) + rec.plen
            ids, inv = np.unique(rec.seg, return_inverse=True)
            counts = np.bincount(inv)
            sums = np.bincount(inv, weights=rlen)
            maxe = np.full(ids.size, -np.inf)
            np.maximum.at(maxe, inv, rec.exp)
            for sid, c, b, m in zip(ids.tolist(), counts.tolist(), sums.tolist(), maxe.tolist()):
                self._segments.set_live(sid, c, int(b), m)

    # ------------------------------------------------------------------------------------------ lookups

    def row(self, bucket: str, key: str) -> int:
        """:meth:`rows` for one key, without arrays (the engine asks about one key on every write)."""
        bid = self._buckets.get(bucket)
        if bid is None:
            return -1
        idx = self.index
        r = idx.find_one(xxhash.xxh3_64_intdigest(key.encode(), self._buckets.seed(bucket)))
        if r < 0 or int(idx.bkt[r]) != bid or not float(idx.exp[r]) > self._clock():
            return -1
        return r

    def rows(self, bucket: str, keys: Sequence[str]) -> np.ndarray:
        """The rows of the live (unexpired) blocks ``keys`` of ``bucket``; -1 where there is none."""
        bid = self._buckets.get(bucket)
        if bid is None or not keys:
            return np.full(len(keys), -1, np.int64)
        seed = self._buckets.seed(bucket)
        # == format.fingerprint, inlined and mapped in C: hashing the keys is most of a lookup's cost
        fps = np.array(list(map(xxhash.xxh3_64_intdigest, map(str.encode, keys), itertools.repeat(seed))),
                       np.uint64)
        rows, _ = self.index.find(fps)
        hit = rows >= 0
        r = rows[hit]
        good = (self.index.bkt[r] == bid) & (self.index.exp[r] > self._clock())
        rows[np.flatnonzero(hit)[~good]] = -1
        return rows

    def lookup(self, bucket: str, key: str) -> Entry | None:
        r = self.row(bucket, key)
        if r < 0:
            return None
        idx = self.index
        return _new_entry((int(idx.plen[r]), float(idx.exp[r]), int(idx.seg[r]), int(idx.off[r]), int(idx.hlen[r])))

    def lookup_many(self, bucket: str, keys: Sequence[str]) -> list[Entry | None]:
        rows = self.rows(bucket, keys)
        out: list[Entry | None] = [None] * len(keys)
        idx = self.index
        hit = np.flatnonzero(rows >= 0)
        r = rows[hit]
        made = map(_new_entry, zip(idx.plen[r].tolist(), idx.exp[r].tolist(), idx.seg[r].tolist(),
                                   idx.off[r].tolist(), idx.hlen[r].tolist()))
        for i, e in zip(hit.tolist(), made):
            out[i] = e
        return out

    def present_many(self, bucket: str, keys: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        rows = self.rows(bucket, keys)
        present = rows >= 0
        sizes = np.zeros(len(keys), np.int64)
        sizes[present] = self.index.plen[rows[present]]
        return present, sizes

    def location(self, fp: int) -> tuple[int, int] | None:
        """(segment, offset) the index holds for fingerprint ``fp``, live or not."""
        r = self.index.find_one(fp)
        return None if r < 0 else (int(self.index.seg[r]), int(self.index.off[r]))

    def bucket_ids(self) -> list[int]:
        """Ids of the buckets that have rows in the index."""
        idx = self.index
        return [int(b) for b in np.unique(idx.bkt[idx.used_rows()]).tolist()]

    def live_rows(self, now: float, bid: int | None = None) -> np.ndarray:
        """Rows of unexpired blocks (of bucket ``bid`` only, if given)."""
        idx = self.index
        hi = idx.high
        live = (idx.seg[:hi] != FREE_SEG) & (idx.exp[:hi] > now)
        if bid is not None:
            live &= idx.bkt[:hi] == bid
        return np.flatnonzero(live)

    def expired_rows(self, now: float, limit: int) -> np.ndarray:
        """At most ``limit`` rows of expired blocks still in the index."""
        idx = self.index
        hi = idx.high
        return np.flatnonzero((idx.exp[:hi] <= now) & (idx.seg[:hi] != FREE_SEG))[:limit]

    # ------------------------------------------------------------------------------------------ changes

    def put(self, fps: np.ndarray, segs: np.ndarray, offs: np.ndarray, plen: np.ndarray, hlen: np.ndarray,
            exp: np.ndarray, bkt: np.ndarray) -> list[tuple[int, int]]:
        """Index written records (the callers adds them to their segments' live figures); returns the
        (segment, offset) of the records they replaced, dead from now on."""
        _where, oseg, ooff, obytes = self.index.put(fps, segs, offs, plen, hlen, exp, bkt)
        dead = []
        for s, o, n in zip(oseg.tolist(), ooff.tolist(), obytes.tolist()):
            dead.append((s, o))
            self._segments.unlive(s, n)
        return dead

    def touch_many(self, bucket: str, keys: Sequence[str], expires_at: float) -> int:
        rows = self.rows(bucket, keys)
        rows = rows[rows >= 0]
        self.index.exp[rows] = expires_at
        self._segments.extend_expiry(np.unique(self.index.seg[rows]).tolist(), expires_at)
        return int(rows.size)

    def delete_many(self, bucket: str, keys: Sequence[str]) -> np.ndarray:
        """Remove the live blocks ``keys`` (logged dead); returns which keys were found."""
        rows = self.rows(bucket, keys)
        hit = rows >= 0
        found = np.unique(rows[hit])
        if found.size:
            self.remove_rows(found, log_dead=True)
            bid = self._buckets.get(bucket)
            assert bid is not None
            self._buckets.changed(bid)
        return hit

    def drop_bucket(self, bid: int) -> int:
        """Remove every row of bucket ``bid`` (not logged: the bucket's floor covers them)."""
        rows = self.index.rows_of_bucket(bid)
        self.remove_rows(rows, log_dead=False)
        self._buckets.changed(bid)
        return int(rows.size)

    def remove_rows(self, rows: np.ndarray, *, log_dead: bool) -> None:
        """Remove rows from the index and from their segments' live figures; ``log_dead``: also in the dead
        log, so a restart does not bring them back."""
        if rows.size == 0:
            return
        idx = self.index
        segs = idx.seg[rows].copy()
        rlen = idx.hlen[rows].astype(np.int64) + idx.plen[rows]
        if log_dead:
            self._log_dead(dead_keys(segs, idx.off[rows]))
        idx.remove(rows)
        ids, inv = np.unique(segs, return_inverse=True)
        counts = np.bincount(inv)
        sums = np.bincount(inv, weights=rlen)
        for sid, c, b in zip(ids.tolist(), counts.tolist(), sums.tolist()):
            self._segments.unlive(sid, int(b), c)
