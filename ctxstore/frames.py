"""The bulk frames that carry payloads, as they cross the socket: a ``get`` answer parsed as it arrives (the
frame's head first, then each payload straight into the buffer it belongs in, the transport's ``recv_into``
writing there, each block verified the moment it lands), and a ``put``'s payloads made as they are sent
(each block hashed right before it goes, then the trailer of checksums).

The frame format is :mod:`ctxstore.wire`'s."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import xxhash

from . import wire
from .buffers import Destinations, Scatter, Target
from .errors import ProtocolError


# One read into a run of slots takes at most this much: the blocks it lands are hashed right after, while
# they are still in the CPU's cache (one read of a whole 32 MiB run cost the client 20 % more CPU than one read
# per 64 KiB block; 256 KiB reads cost ~7 % less).
RUN_READ = 256 << 10
MAX_BLOCK_BYTES = 1 << 30  # a get answer announcing a bigger block is malformed (nothing is allocated for it)


class GetReader:
    """Reads a bulk ``get`` response: head first, then each payload straight into its destination (one view,
    or the pieces of a :class:`~ctxstore.buffers.Scatter` in turn). Payloads whose slots follow each other in
    one caller buffer are read together, up to :data:`RUN_READ` at a time, and still verified one by one.

    Whatever bytes arrive, it either places them or raises a :class:`~ctxstore.errors.ProtocolError` (the
    transport then fails the call: a miss), and it never allocates more than the blocks that really arrive:
    a block's buffer (when the caller gave none) is made when its first byte is due, and a head whose sizes
    do not add up to the answer's Content-Length is refused before any payload is read."""

    _DISCARD = memoryview(bytearray(256 << 10))

    def __init__(self, n_keys: int, destinations: Destinations, indices: Sequence[int], *,
                 max_block: int = MAX_BLOCK_BYTES) -> None:
        self._n_keys = n_keys
        self._dest = destinations
        self._indices = indices  # global block index of each key of this call
        self._max_block = max_block
        self._length: int | None = None  # the answer's Content-Length, once known
        self._prefix = bytearray(4)
        self._head: bytearray | None = None
        self._pos = 0
        self.meta: wire.GetResponse | None = None
        self.views: list[Target | None] = [None] * n_keys  # per key of this call: where its payload went
        self._queue: list[int] = []  # key indices with a payload, in answer order
        self._q = 0
        # Per queue position: bytes from that payload's start to the end of the run of payloads whose slots
        # follow each other in the caller's buffer (0: not in such a run). One read may fill a whole run.
        self._run: list[int] = []
        self._target: Target | None = None  # where the current payload goes (None: discarded)
        # A Scatter target: the piece being filled, where it starts in the block, the running digest.
        self._piece = 0
        self._piece_start = 0
        self._hasher = xxhash.xxh3_64()
        # Per key: did its payload verify? Checked the moment a block lands, while it is still in cache
        # (hashing afterwards, once 128 MiB went by, cost twice as much CPU).
        self.verified: list[bool] = [False] * n_keys
        self.oversized: list[int] = []  # keys whose block did not fit the caller's buffer (discarded)

    def begin(self, length: int) -> None:
        """The answer's Content-Length (the transport calls this before the first body byte)."""
        self._length = length

    @property
    def done(self) -> bool:
        return self.meta is not None and self._q == len(self._queue)

    def finish(self) -> GetReader:
        """The reader, once the whole frame arrived; ProtocolError if the answer ended inside it."""
        if not self.done:
            raise ProtocolError("", 200, "IncompleteBody", "the get answer ended inside its frame")
        return self

    def get_buffer(self) -> memoryview:
        if self._head is None:
            return memoryview(self._prefix)[self._pos:]
        if self.meta is None:
            return memoryview(self._head)[self._pos:]
        if self._q == len(self._queue):
            raise ProtocolError("", 200, "ExtraBytes", "bytes beyond the get answer's frame")
        size = self.meta.sizes[self._queue[self._q]]
        if self._target is None:
            return self._DISCARD[:min(size - self._pos, len(self._DISCARD))]
        if isinstance(self._target, Scatter):
            return self._target.pieces[self._piece][self._pos - self._piece_start:]
        run = self._run[self._q] if self._run else 0
        if run > size:
            end = min(run, self._pos + RUN_READ)
            return self._dest.span(self._indices[self._queue[self._q]], end)[self._pos:]
        return self._target[self._pos:]

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
                head, _ = wire.unpack_head(bytes(self._prefix) + bytes(self._head),
                                           wire.answer_schema("get", self._n_keys))
                self._plan(wire.decode_get_head(head, self._n_keys), 4 + len(self._head))
            return
        sizes = self.meta.sizes
        j = self._queue[self._q]
        target = self._target
        if isinstance(target, Scatter):
            piece = target.pieces[self._piece]
            if self._pos - self._piece_start == len(piece):  # a piece is full: hash it while it is in cache
                self._hasher.update(piece)
                self._piece += 1
                self._piece_start = self._pos
        # A read into a run may have gone past this payload into the ones after it.
        while self._pos >= sizes[j]:
            over = self._pos - sizes[j]
            self._landed(j)
            if not over:
                break
            self._pos = over
            j = self._queue[self._q]

    def _plan(self, meta: wire.GetResponse, head_bytes: int) -> None:
        if any(size > self._max_block for size in meta.sizes):
            raise ProtocolError("", 200, "MalformedFrame", f"a block over {self._max_block} bytes")
        if self._length is not None and head_bytes + meta.payload_bytes != self._length:
            raise ProtocolError("", 200, "MalformedFrame",
                                f"the head announces {meta.payload_bytes} payload bytes; the answer has "
                                f"{self._length - head_bytes}")
        self.meta = meta
        self._queue = queue = [i for i, size in enumerate(meta.sizes) if size != wire.ABSENT]
        sizes, indices, dest = meta.sizes, self._indices, self._dest
        run = [0] * len(queue)
        for q in range(len(queue) - 2, -1, -1):
            j, k = queue[q], queue[q + 1]
            if sizes[j] and sizes[k] and dest.follows(indices[j], sizes[j], indices[k], sizes[k]):
                run[q] = sizes[j] + (run[q + 1] or sizes[k])
        self._run = run if any(run) else []
        self._next()

    def _next(self) -> None:
        """Move to the next payload: resolve where it goes; empty ones land at once."""
        meta = self.meta
        if meta is None:
            return
        self._pos = self._piece = self._piece_start = 0
        self._hasher.reset()
        while self._q < len(self._queue):
            j = self._queue[self._q]
            size = meta.sizes[j]
            self._target = self._dest.view(self._indices[j], size)
            if self._target is None:
                self.oversized.append(j)
            if size:
                return
            self._record(j, meta)

    def _landed(self, j: int) -> None:
        if self.meta is not None:
            self._record(j, self.meta)
            self._next()

    def _record(self, j: int, meta: wire.GetResponse) -> None:
        target = self._target
        if target is not None:
            self.views[j] = target
            digest = self._hasher.intdigest() if isinstance(target, Scatter) else xxhash.xxh3_64_intdigest(target)
            self.verified[j] = digest == meta.xxh3[j]
        self._q += 1


# A put's payloads go to the transport this much at a time, each block hashed just before: it is still in the
# CPU's cache when the kernel copies it, and the node has bytes to read before the last block is hashed.
SEND_RUN = 512 << 10


class TrailedPayloads:
    """A put's payloads then its trailer (:data:`ctxstore.wire.TRAILER`): a :class:`~ctxstore.transport.BodyStream`
    whose blocks are hashed one run at a time, right before they are handed to the transport. Hashing every
    block before the first byte went out (the head's ``xxh3``) left the node idle for a fifth of a 128 MiB
    save of 1 MiB blocks (docs/benchmarks.md)."""

    def __init__(self, blocks: Sequence[memoryview]) -> None:
        self.blocks = blocks
        self.length = sum(len(b) for b in blocks) + wire.TRAILER.size * len(blocks)

    def groups(self) -> Iterator[Sequence[memoryview | bytes]]:
        digest = xxhash.xxh3_64_intdigest
        sums: list[int] = []
        run: list[memoryview | bytes] = []
        run_bytes = 0
        for block in self.blocks:
            sums.append(digest(block))
            run.append(block)
            run_bytes += len(block)
            if run_bytes >= SEND_RUN:
                yield run
                run, run_bytes = [], 0
        run.append(wire.encode_trailer(sums))
        yield run
