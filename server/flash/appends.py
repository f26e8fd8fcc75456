"""The writing side of the flash store on the event loop: ``append`` hands records to the writer thread
(:mod:`.writer`), and the writer's messages come back here — segment opened or sealed, records written — to
be put in the index and reported to each append's callback. Also the loop's way to the writer's other work:
the dead log and the state file.

A record queued for writing is *pending* (``fp -> ticket``): a later append, delete or bucket drop of the same
key replaces or cancels it, and when its write lands it is indexed only if it is still the latest.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .buckets import BucketTable
from .catalog import Catalog
from .format import fingerprint, record_size
from .health import Health
from .options import FlashOptions
from .segment_table import SegmentTable
from .state import dead_keys, encode_state
from .types import ALREADY_EXPIRED, DEGRADED, QUEUE_FULL, SUPERSEDED, TOO_LARGE, FlashRecord, Location, WriteResult
from .writer import Pending, Writer, Written

log = logging.getLogger("ctxstore.flash")

DoneCallback = Callable[[list[WriteResult]], None]


@dataclass
class Call:
    """One append() call: its callback runs once every record it queued has a result."""

    done: DoneCallback | None
    remaining: int
    results: list[WriteResult] = field(default_factory=list)


class Appends:
    """Pending appends, the writer thread they go to, and what comes back from it."""

    def __init__(self, path: Path, options: FlashOptions, clock: Callable[[], float], health: Health,
                 buckets: BucketTable, segments: SegmentTable, catalog: Catalog,
                 need_space: Callable[[int], None]) -> None:
        self._path = path
        self._options = options
        self._clock = clock
        self._health = health
        self._stats = health.stats
        self._buckets = buckets
        self._segments = segments
        self._catalog = catalog
        self._need_space = need_space  # the writer waits for this many free bytes
        self.writer: Writer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending: dict[int, tuple[int, int]] = {}  # fp -> (ticket, bucket id) of the latest queued append
        self._tickets = 0
        self._inflight = 0  # records queued or being written
        self._idle = asyncio.Event()
        self.dead_entries = 0  # entries in the dead log

    def start(self, loop: asyncio.AbstractEventLoop, first_segment: int, first_seq: int) -> None:
        o = self._options
        self._loop = loop
        self.writer = Writer(
            self._path, segment_bytes=o.segment_bytes, batch_bytes=o.batch_bytes, queue_bytes=o.queue_bytes,
            max_open=o.max_open_segments, seal_idle=o.seal_idle, space=self._segments.space, post=self._post,
            first_segment=first_segment, first_seq=first_seq, direct=o.direct_io)
        self._health.writer = self.writer
        self.writer.start()
        self._idle.set()

    async def stop(self) -> None:
        """Write what is queued, seal the open segments, stop the writer thread."""
        writer = self.writer
        assert writer is not None and self._loop is not None
        writer.stop()
        await self._loop.run_in_executor(None, writer.join)
        await asyncio.sleep(0)  # let the writer's last posts run

    async def flush(self) -> None:
        """Wait until every record appended so far has been written (or failed)."""
        while self._inflight:
            self._idle.clear()
            try:
                await asyncio.wait_for(self._idle.wait(), 1.0)
            except TimeoutError:
                if self.writer is None or not self.writer.is_alive():
                    return

    @property
    def queued_bytes(self) -> int:
        return self.writer.queued_bytes if self.writer is not None else 0

    @property
    def next_seq(self) -> int:
        assert self.writer is not None
        return self.writer.next_seq

    # ------------------------------------------------------------------------------------------ appending

    def append(self, records: Sequence[FlashRecord], done: DoneCallback | None, force: bool) -> list[str | None]:
        """FlashStore.append on an open store."""
        if self._health.degraded is not None:
            self._stats.refused += len(records)
            return [DEGRADED] * len(records)
        now = self._clock()
        out: list[str | None] = []
        items: list[Pending] = []
        call = Call(done, 0)
        for rec in records:
            reason, item = self.pending_item(rec, now, call)
            out.append(reason)
            if item is not None:
                items.append(item)
        if items:
            assert self.writer is not None
            taken = self.writer.submit(items, force=force)
            j = 0
            for i, reason in enumerate(out):
                if reason is None:
                    if taken[j]:
                        item = items[j]
                        self._pending[item.fp] = (item.ticket, self._buckets.id(item.record.bucket))
                        call.remaining += 1
                        self._inflight += 1
                    else:
                        out[i] = QUEUE_FULL if self._health.degraded is None else DEGRADED
                    j += 1
        self._stats.refused += sum(r is not None for r in out)
        return out

    def pending_item(self, rec: FlashRecord, now: float, call: Call | None,
                     move_from: tuple[int, int] | None = None) -> tuple[str | None, Pending | None]:
        """``rec`` made ready for the writer, or why it cannot be written. ``move_from``: the (segment,
        offset) of the copy it replaces (compaction): indexed only if the index still points there."""
        b, k = rec.bucket.encode(), rec.key.encode()
        if not self._options.fits(b, k, rec.metadata, len(rec.payload)):
            return TOO_LARGE, None
        if rec.expires_at <= now:
            return ALREADY_EXPIRED, None
        _, rlen = record_size(b, k, rec.metadata, len(rec.payload))
        self._buckets.id(rec.bucket)
        self._tickets += 1
        fp = fingerprint(self._buckets.seed(rec.bucket), k)
        return None, Pending(rec, self._tickets, b, k, fp, self._options.window(rec.expires_at, now), rlen, call,
                             move_from)

    def submit_moves(self, items: list[Pending], call: Call) -> list[bool]:
        """Queue copies of records already on flash (compaction, hot re-appends), whatever the queue holds."""
        assert self.writer is not None
        taken = self.writer.submit(items, force=True)
        call.remaining = sum(taken)
        return taken

    def contains(self, fp: int) -> bool:
        """Whether a write of ``fp`` is pending."""
        return fp in self._pending

    def cancel(self, bucket: str, keys: Sequence[str]) -> np.ndarray:
        """Cancel the pending writes of ``keys`` (their callbacks say superseded); returns which had one."""
        fps = [self._buckets.fingerprint(bucket, k) for k in keys]
        return np.array([self._pending.pop(fp, None) is not None for fp in fps], bool)

    def cancel_bucket(self, bid: int) -> None:
        for fp in [fp for fp, (_t, b) in self._pending.items() if b == bid]:
            del self._pending[fp]

    # ------------------------------------------------------------------------------------------ from the writer

    def _post(self, kind: str, *args: Any) -> None:
        """Called on the writer thread: hand a message to the event loop."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self._on_message, kind, args)
        except RuntimeError:  # the loop closed under us: nothing left to tell
            pass

    def _on_message(self, kind: str, args: tuple[Any, ...]) -> None:
        try:
            if kind == "written":
                self._on_written(args[0])
            elif kind == "opened":
                self._segments.opened(args[0])
            elif kind == "sealed":
                self._segments.sealed(args[0], args[1])
            elif kind == "wrote":
                self._stats.bytes_written += args[0]
            elif kind == "need_space":
                self._need_space(args[0])
            elif kind == "failed":
                self._stats.write_errors += 1
                self._health.set_degraded(args[0])
            elif kind == "control":
                done, result, exc = args
                done(result, exc)
        except Exception:  # a bug here must not kill the loop's callback machinery silently
            log.exception("flash: handling %s failed", kind)

    def _on_written(self, results: list[Written]) -> None:
        ok: list[Written] = []
        dead: list[tuple[int, int]] = []
        for w in results:
            item = w.item
            if item.move_from is None:
                self._inflight -= 1
            if w.error is not None:
                if item.move_from is None and self._pending.get(item.fp, (0, 0))[0] == item.ticket:
                    del self._pending[item.fp]
                _finish(item, WriteResult(item.record, False, w.error))
                continue
            self._stats.writes += 1
            seg = self._segments.get(w.segment)
            if seg is not None:
                seg.data_bytes += item.nbytes
            valid = seg is not None
            if item.move_from is None:
                valid = valid and self._pending.get(item.fp, (0, 0))[0] == item.ticket
                if valid:
                    del self._pending[item.fp]
            else:
                valid = valid and self._catalog.location(item.fp) == item.move_from
            if valid:
                ok.append(w)
            else:
                dead.append((w.segment, w.offset))
                _finish(item, WriteResult(item.record, False, SUPERSEDED))
        if ok:
            dead.extend(self._index_written(ok))
        self.log_dead(dead)
        if self._inflight == 0:
            self._idle.set()

    def _index_written(self, ok: list[Written]) -> list[tuple[int, int]]:
        """Put written records in the index; returns the (segment, offset) of the records now dead."""
        dead: list[tuple[int, int]] = []
        # the same key twice in one batch: the later one wins, the earlier one is dead on disk
        last: dict[int, Written] = {}
        for w in ok:
            prev = last.get(w.item.fp)
            if prev is not None:
                dead.append((prev.segment, prev.offset))
                _finish(prev.item, WriteResult(prev.item.record, False, SUPERSEDED))
            last[w.item.fp] = w
        batch = list(last.values())
        bids = [self._buckets.id(w.item.record.bucket) for w in batch]
        dead.extend(self._catalog.put(
            np.array([w.item.fp for w in batch], np.uint64),
            np.array([w.segment for w in batch], np.uint32),
            np.array([w.offset for w in batch], np.uint32),
            np.array([len(w.item.record.payload) for w in batch], np.uint32),
            np.array([w.header_len for w in batch], np.uint32),
            np.array([w.item.record.expires_at for w in batch], np.float64),
            np.array(bids, np.uint32)))
        for w, bid in zip(batch, bids):
            rec = w.item.record
            self._segments.add_live(w.segment, w.item.nbytes, rec.expires_at)
            self._buckets.changed(bid)
            if w.item.move_from is None:
                self._buckets.stat(bid).bytes_written += len(rec.payload)
            _finish(w.item, WriteResult(rec, True, None, Location(w.segment, w.offset, w.header_len,
                                                                  len(rec.payload))))
        return dead

    # ------------------------------------------------------------------------------------------ dead log, state

    def log_dead(self, locs: list[tuple[int, int]]) -> None:
        """Records at these (segment, offset) are no longer valid: log them so a restart does not revive them."""
        if locs:
            arr = np.array(locs, np.uint64)
            self.log_dead_keys(dead_keys(arr[:, 0], arr[:, 1]))

    def log_dead_keys(self, keys: np.ndarray) -> None:
        if keys.size and self.writer is not None:
            self.dead_entries += int(keys.size)
            self.writer.dead(keys)

    async def save_state(self, manifest: dict[str, object] | None, floors: dict[str, int]) -> bool:
        """Replace the state file (manifest + bucket floors) on the writer thread. False if it failed."""
        data = encode_state(manifest, floors)
        writer = self.writer
        loop = self._loop
        if writer is None or loop is None or not writer.is_alive():
            return False
        fut: asyncio.Future[bool] = loop.create_future()

        def done(_result: object, exc: BaseException | None) -> None:
            if exc is not None:
                if isinstance(exc, OSError):
                    self._health.io_error("manifest", exc)
                else:
                    log.error("flash: saving the manifest failed: %r", exc)
            if not fut.done():
                fut.set_result(exc is None)

        writer.control(lambda: writer.save_state(data), done)
        return await fut


def _finish(item: Pending, result: WriteResult) -> None:
    call = item.call
    if not isinstance(call, Call):
        return
    call.results.append(result)
    call.remaining -= 1
    if call.remaining == 0 and call.done is not None:
        try:
            call.done(call.results)
        except Exception:
            log.exception("flash: append callback failed")
