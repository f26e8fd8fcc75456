"""The bucket table: bucket names and the small ids the index stores, their fingerprint seeds, their floors
(``drop_bucket``), their counters and a version that changes whenever a bucket's keys do."""

from __future__ import annotations

from .format import bucket_seed, fingerprint
from .types import BucketStats


class BucketTable:
    """Names <-> ids (ids are never reused while the store is open), seeds, floors, per-bucket counters."""

    def __init__(self) -> None:
        self._ids: dict[str, int] = {}
        self.names: list[str] = []  # by id
        self._seeds: dict[str, int] = {}
        self.floors: dict[str, int] = {}  # bucket -> lowest sequence number still valid (persisted)
        self._stats: dict[int, BucketStats] = {}
        self._versions: dict[int, int] = {}

    def id(self, name: str) -> int:
        """The id of ``name``, assigned on first use."""
        bid = self._ids.get(name)
        if bid is None:
            bid = self._ids[name] = len(self.names)
            self.names.append(name)
        return bid

    def get(self, name: str) -> int | None:
        """The id of ``name``, or None if it was never used."""
        return self._ids.get(name)

    def __contains__(self, name: str) -> bool:
        return name in self._ids

    def seed(self, name: str) -> int:
        seed = self._seeds.get(name)
        if seed is None:
            seed = self._seeds[name] = bucket_seed(name)
        return seed

    def fingerprint(self, bucket: str, key: str) -> int:
        return fingerprint(self.seed(bucket), key.encode())

    def stat(self, bid: int) -> BucketStats:
        """The counters of bucket ``bid``, made on first use."""
        st = self._stats.get(bid)
        if st is None:
            st = self._stats[bid] = BucketStats()
        return st

    def stat_if_any(self, bid: int) -> BucketStats | None:
        return self._stats.get(bid)

    def changed(self, bid: int) -> None:
        """Bucket ``bid`` gained or lost keys (a listing of it kept from before is stale)."""
        self._versions[bid] = self._versions.get(bid, 0) + 1

    def version(self, bid: int) -> int:
        return self._versions.get(bid, 0)
