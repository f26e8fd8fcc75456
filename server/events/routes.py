"""What a router's index needs of a block beyond its key: its token ids, its parent's key, the block size and the
namespace's salt, as clients send them with a put (``ctxstore.wire.PutRoute``) to a node that asked for them.

The ZMQ publisher puts them into each ``BlockStored`` (Dynamo hashes the tokens for its radix tree and drops a
stored block without them). They are kept per ``(bucket, key)`` while the block lives, tokens packed as u32
(4 bytes a token: ~100 bytes for a 16-token block). With a flash tier they are also appended to a log beside its
directory (``<disk>/events-routes.log``: a record per route, ``[bucket, key]`` once its block is gone; rewritten
with the live ones at start and when it grows past twice their number), so the blocks a restart recovers are
announced with them again; at start the routes of blocks the node no longer holds are dropped (``retain``)."""

from __future__ import annotations

import contextlib
import logging
import os
from array import array
from collections.abc import Callable
from typing import Any, NamedTuple

import msgpack

from ctxstore import wire

log = logging.getLogger("ctxstore.events")

LOG_NAME = "events-routes.log"
COMPACT_SLACK = 100_000  # records the log may hold beyond twice the live routes before it is rewritten


class Route(NamedTuple):
    """One block's route: what its ``BlockStored`` carries beyond its hash."""

    parent: str | None  # the key of the block before it in its chain; None: the first block
    tokens: bytes  # the block's token ids, u32 in the machine's byte order (array "I")
    block_size: int
    salt: str | None  # the namespace's salt (Dynamo's cache_salt)

    def token_ids(self) -> list[int]:
        return array("I", self.tokens).tolist()


class RouteBook:
    """The live blocks' routes, optionally logged to ``path`` to survive a restart."""

    def __init__(self, path: str = "", *, reset: bool = False, buckets: frozenset[str] | None = None) -> None:
        self.routes: dict[tuple[str, str], Route] = {}
        self.buckets = buckets  # the buckets the publisher reports (None: all); the others' routes are not kept
        self.path = path
        self._file: Any = None
        self._records = 0
        if path:
            if reset:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)
            self._load()
            self._rewrite()

    def __len__(self) -> int:
        return len(self.routes)

    def get(self, bucket: str, key: str) -> Route | None:
        return self.routes.get((bucket, key))

    def remember(self, bucket: str, keys: list[str], route: wire.PutRoute, which: list[int]) -> None:
        """The routes of ``keys[i]`` for every ``i`` in ``which`` (the blocks a put stored)."""
        if self.buckets is not None and bucket not in self.buckets:
            return
        added = []
        packed, step = route.packed, 4 * route.block_size
        for i in which:
            tokens = packed[i * step:(i + 1) * step] if packed is not None else self.pack_tokens(route.tokens[i])
            entry = Route(route.parents[i], tokens, route.block_size, route.salt)
            self.routes[(bucket, keys[i])] = entry
            added.append((bucket, keys[i], entry))
        if self._file is not None and added:
            self._file.write(b"".join(msgpack.packb([b, k, *e], use_bin_type=True) for b, k, e in added))
            self._file.flush()
            self._records += len(added)
            if self._records > 2 * len(self.routes) + COMPACT_SLACK:
                self._rewrite()

    @staticmethod
    def pack_tokens(tokens: list[int]) -> bytes:
        return array("I", tokens).tobytes()

    def forget(self, bucket: str, key: str) -> None:
        """The block is gone: its route too (logged as ``[bucket, key]``, flushed with the next remember)."""
        if self.routes.pop((bucket, key), None) is not None and self._file is not None:
            self._file.write(msgpack.packb([bucket, key], use_bin_type=True))
            self._records += 1

    def retain(self, holds: Callable[[str, list[str]], list[bool]]) -> int:
        """Keep only the routes of blocks the node holds (``holds(bucket, keys)``), and rewrite the log if any
        went. At start, after the flash tier's recovery: blocks lost with RAM, expired while the node was down
        or of buckets it forgot left no removal behind, and their routes would stay for good. Returns how many
        were dropped."""
        by_bucket: dict[str, list[str]] = {}
        for bucket, key in self.routes:
            by_bucket.setdefault(bucket, []).append(key)
        gone = [(bucket, key) for bucket, keys in by_bucket.items()
                for key, held in zip(keys, holds(bucket, keys), strict=True) if not held]
        for pair in gone:
            del self.routes[pair]
        if gone and self.path:
            self._rewrite()
        return len(gone)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _load(self) -> None:
        try:
            with open(self.path, "rb") as f:
                unpacker = msgpack.Unpacker(f, raw=False, use_list=True)
                for record in unpacker:
                    if len(record) == 2:
                        self.routes.pop((record[0], record[1]), None)
                        continue
                    bucket, key, parent, tokens, block_size, salt = record
                    self.routes[(bucket, key)] = Route(parent, tokens, block_size, salt)
        except FileNotFoundError:
            return
        except Exception as exc:  # a torn last record after a crash: keep what came before it
            log.warning("reading %s stopped early: %s", self.path, exc)

    def _rewrite(self) -> None:
        """Write the live routes to a new log and switch to it (dropping the records of blocks gone since)."""
        self.close()
        tmp = self.path + ".tmp"
        with open(tmp, "wb") as f:
            for (bucket, key), entry in self.routes.items():
                f.write(msgpack.packb([bucket, key, *entry], use_bin_type=True))
        os.replace(tmp, self.path)
        self._records = len(self.routes)
        self._file = open(self.path, "ab")  # noqa: SIM115 - kept open for appends until close()

