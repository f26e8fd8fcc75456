"""Parsing a bulk ``get`` answer as it arrives: the frame's head first, then each payload straight into the
buffer it belongs in (the transport's ``recv_into`` writes there), each block verified the moment it lands.

The frame format is :mod:`ctxstore.wire`'s; this is its incremental reader for the one response that carries
payloads."""

from __future__ import annotations

from collections.abc import Sequence

import xxhash

from . import wire
from .buffers import Destinations
from .errors import ProtocolError


class GetReader:
    """Reads a bulk ``get`` response: head first, then each payload straight into its destination."""

    _DISCARD = memoryview(bytearray(256 << 10))

    def __init__(self, n_keys: int, destinations: Destinations, indices: Sequence[int]) -> None:
        self._n_keys = n_keys
        self._dest = destinations
        self._indices = indices  # global block index of each key of this call
        self._prefix = bytearray(4)
        self._head: bytearray | None = None
        self._pos = 0
        self.meta: wire.GetResponse | None = None
        self.views: list[memoryview | None] = []  # per key of this call: where its payload went
        self._queue: list[tuple[memoryview | None, int, int]] = []  # (target or None, size, key index)
        self._q = 0
        # Per key: did its payload verify? Checked the moment a block lands, while it is still in cache
        # (hashing afterwards, once 128 MiB went by, cost twice as much CPU).
        self.verified: list[bool] = []

    def get_buffer(self) -> memoryview:
        if self._head is None:
            return memoryview(self._prefix)[self._pos:]
        if self.meta is None:
            return memoryview(self._head)[self._pos:]
        target, size, _ = self._queue[self._q]
        if target is None:
            return self._DISCARD[:min(size - self._pos, len(self._DISCARD))]
        return target[self._pos:]

    def written(self, n: int) -> None:
        self._pos += n
        if self._head is None:
            if self._pos == 4:
                self._head = bytearray(wire.head_length(self._prefix) - 4)
                self._pos = 0
                if not self._head:
                    raise ProtocolError("", 200, "MalformedFrame", "empty get head")
            return
        if self.meta is None:
            if self._pos == len(self._head):
                head, _ = wire.unpack_head(bytes(self._prefix) + bytes(self._head))
                self.meta = wire.decode_get_head(head, self._n_keys)
                self._plan()
            return
        target, size, j = self._queue[self._q]
        if self._pos == size:
            if target is not None:
                assert self.meta is not None
                self.verified[j] = xxhash.xxh3_64_intdigest(target) == self.meta.xxh3[j]
            self._q += 1
            self._pos = 0
            self._skip_empty()

    def _plan(self) -> None:
        assert self.meta is not None
        self.verified = [False] * len(self.meta.sizes)
        for i, size in enumerate(self.meta.sizes):
            if size == wire.ABSENT:
                self.views.append(None)
                continue
            target = self._dest.view(self._indices[i], size)
            self.views.append(target)
            self._queue.append((target, size, i))
        self._pos = 0
        self._skip_empty()

    def _skip_empty(self) -> None:
        while self._q < len(self._queue) and self._queue[self._q][1] == 0:
            target, _, j = self._queue[self._q]
            if target is not None:
                assert self.meta is not None
                self.verified[j] = xxhash.xxh3_64_intdigest(target) == self.meta.xxh3[j]
            self._q += 1
