"""The writer thread: turns queued records into large sequential appends, one open segment per expiry window.

Records are streamed into two reusable page-aligned buffers (``batch_bytes`` each, default 8 MiB) and
written with O_DIRECT where the file system allows it (on this kind of VM O_DIRECT writes ran at 1.1–1.5 GB/s
against 0.5–0.95 GB/s for buffered writes plus fdatasync), so a write is one ``pwrite`` of MiBs and demoted
blocks do not fill the page cache. While one buffer is being written by the I/O thread the writer thread
fills the other: copying and hashing overlap the device. Every batch starts on a 4 KiB boundary. No fsync
per record: a segment is fsynced when it is sealed (full, idle, or replaced by a newer window).

Two threads: the writer thread (serialises records, owns the open segments and the dead log) and the I/O
thread (``pwrite``, sealing, closing — one queue, so everything reaches a file in order). They tell the event
loop what happened through ``post`` (``loop.call_soon_threadsafe``): segment opened, records written (or
failed: only after their bytes are in the file), segment sealed, space needed, device failed. Neither
touches the index.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from .format import BLOCK, FOOTER_ENTRY, TRAILER, SegmentHeader, align, pack_record_header, record_size
from .osutil import close_quietly, unlink_quietly
from .segments import footer_bytes, segment_path
from .state import DEAD_LOG, STATE_FILE, atomic_write, encode_dead, fsync_dir
from .types import IO_ERROR, FlashRecord

log = logging.getLogger("ctxstore.flash")

Post = Callable[..., None]


class SpaceAccount:
    """Bytes charged against the capacity, shared by the writer thread and the event loop."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self._cond = threading.Condition()

    def try_reserve(self, n: int) -> bool:
        with self._cond:
            if self.used + n > self.capacity:
                return False
            self.used += n
            return True

    def charge(self, n: int) -> None:
        """Charge without a check (recovery: what is already on disk)."""
        with self._cond:
            self.used += n

    def release(self, n: int) -> None:
        with self._cond:
            self.used -= n
            self._cond.notify_all()

    def wait(self, timeout: float) -> None:
        with self._cond:
            self._cond.wait(timeout)

    @property
    def free(self) -> int:
        return self.capacity - self.used


@dataclass(slots=True)
class Pending:
    """A record in the write queue."""

    record: FlashRecord
    ticket: int  # the loop's token: the write counts only if it is still the latest for this fingerprint
    bucket: bytes
    key: bytes
    fp: int
    window: tuple[int, int]  # (width, index) of the expiry window
    nbytes: int  # record length on disk
    call: Any = None  # the append call's bookkeeping (opaque here)
    move_from: tuple[int, int] | None = None  # compaction: (segment, offset) the index must still point at


@dataclass(slots=True)
class Written:
    """The writer's answer for one record."""

    item: Pending
    segment: int = 0
    offset: int = 0
    header_len: int = 0
    error: str | None = None


@dataclass(slots=True)
class OpenedSegment:
    segment_id: int
    path: Path
    salt: int
    window_hi: float
    reserved: int


@dataclass
class _Open:
    header: SegmentHeader
    path: Path
    fd: int
    start: int  # file offset where the buffer's content begins
    window: tuple[int, int]
    last_write: float
    buckets: list[str] = field(default_factory=list)
    bucket_ids: dict[bytes, int] = field(default_factory=dict)
    rows: list[tuple[int, int, float, int, int, int, int, int, int]] = field(default_factory=list)
    keys: bytearray = field(default_factory=bytearray)
    footer_len: int = 8  # running size of the footer's bucket table + entries + keys
    unacked: list[tuple[int, Written]] = field(default_factory=list)  # (end offset, result) not yet flushed


class Writer(threading.Thread):
    """See the module docstring. ``submit`` and ``stop`` are called from the event loop."""

    def __init__(self, directory: Path, *, segment_bytes: int, batch_bytes: int, queue_bytes: int,
                 max_open: int, seal_idle: float, space: SpaceAccount, post: Post, first_segment: int,
                 first_seq: int, direct: bool = True) -> None:
        super().__init__(name="ctxstore-flash-writer", daemon=True)
        self.directory = directory
        self.segment_bytes = segment_bytes
        self.batch_bytes = align(batch_bytes)
        self.queue_bytes = queue_bytes
        self.max_open = max_open
        self.seal_idle = seal_idle
        self.space = space
        self.post = post
        self.next_segment = first_segment
        self.next_seq = first_seq  # read (never written) by the loop for bucket floors
        self.direct = direct
        self.queued_bytes = 0
        self.failed: str | None = None
        self._queue: deque[Any] = deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._open: dict[tuple[int, int], _Open] = {}
        self._mms = [mmap.mmap(-1, self.batch_bytes), mmap.mmap(-1, self.batch_bytes), mmap.mmap(-1, BLOCK)]
        self._bufs = [memoryview(m) for m in self._mms]
        self._cur = 0  # the buffer being filled (0 or 1); the other may be in flight
        self._buf = self._bufs[0]
        self._busy: list[Future[None] | None] = [None, None]
        self._fill = 0
        self._owner: _Open | None = None  # the segment whose bytes the current buffer holds
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ctxstore-flash-io")
        self._dead_fd = -1
        self._hold: list[Pending] = []

    # ------------------------------------------------------------------------------- loop-side calls

    def submit(self, items: list[Pending], force: bool = False) -> list[bool]:
        """Queue what fits in the byte bound (all of it when ``force``); returns which were taken."""
        taken = []
        with self._cond:
            for item in items:
                ok = self.failed is None and not self._stopping and (
                    force or self.queued_bytes + item.nbytes <= self.queue_bytes)
                if ok:
                    self._queue.append(item)
                    self.queued_bytes += item.nbytes
                taken.append(ok)
            self._cond.notify()
        return taken

    def control(self, fn: Callable[[], object], done: Callable[[object, BaseException | None], None]) -> None:
        """Run ``fn`` on the writer thread after everything queued before it; ``done`` is posted back."""
        with self._cond:
            self._queue.append((fn, done))
            self._cond.notify()

    def dead(self, keys: np.ndarray) -> None:
        """Append (segment << 32 | offset) keys to the dead log (no fsync)."""
        if keys.size:
            with self._cond:
                self._queue.append(keys)
                self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()

    # ------------------------------------------------------------------------------------ the thread

    def run(self) -> None:
        try:
            self._run()
        except Exception as e:  # a bug must not leave callers waiting for writes that will never finish
            log.exception("flash: the writer thread failed")
            self._fail(OSError(errno.EIO, f"writer thread failed: {e!r}"), "writer")
        finally:
            for seg in list(self._open.values()):
                self._io.submit(close_quietly, seg.fd)
            self._io.shutdown(wait=True)
            if self._dead_fd >= 0:
                os.close(self._dead_fd)
            for view, mm in zip(self._bufs, self._mms):
                view.release()
                mm.close()

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._queue and not self._stopping:
                    self._cond.wait(timeout=min(1.0, self.seal_idle))
                batch: list[Any] = []
                size = 0
                while self._queue and size < self.batch_bytes:
                    item = self._queue.popleft()
                    if isinstance(item, Pending):
                        size += item.nbytes
                    batch.append(item)
                stopping = self._stopping and not self._queue
            if batch:
                self._process(batch)
            if self._fill and not self._queue and self._owner is not None:
                # nothing more waiting: write out the partial buffer now. While records keep coming the
                # buffer fills up first, so a busy writer issues full-size writes.
                self._flush(self._owner)
            self._seal_idle(stopping)
            if stopping:
                return

    def _process(self, batch: list[Any]) -> None:
        records: list[Pending] = []
        dead: list[np.ndarray] = []
        for item in batch:
            if isinstance(item, Pending):
                records.append(item)
                continue
            if records:
                self._write(records)
                records = []
            if isinstance(item, np.ndarray):
                dead.append(item)
            else:
                self._flush_dead(dead)
                dead = []
                fn, done = item
                try:
                    result, exc = fn(), None
                except BaseException as e:  # noqa: BLE001  (handed to the caller's future)
                    result, exc = None, e
                self.post("control", done, result, exc)
        if records:
            self._write(records)
        self._flush_dead(dead)

    def _write(self, records: list[Pending]) -> None:
        with self._cond:
            self.queued_bytes -= sum(r.nbytes for r in records)
        if self.failed is not None:
            self.post_results([Written(r, error=IO_ERROR) for r in records])
            return
        groups: dict[tuple[int, int], list[Pending]] = {}
        for r in records:
            groups.setdefault(r.window, []).append(r)
        emitted: set[int] = set()
        try:
            for window, items in groups.items():
                self._write_window(window, items, emitted)
        except OSError as e:
            self._fail(e, "write")
            lost = [w for seg in self._open.values() for _end, w in seg.unacked]
            for seg in self._open.values():
                seg.unacked.clear()
            self._fill = 0
            self._owner = None
            lost += [Written(r, error=IO_ERROR) for r in records if id(r) not in emitted]
            for w in lost:
                w.error = IO_ERROR
            self.post_results(lost)

    def post_results(self, results: list[Written]) -> None:
        if results:
            self.post("written", results)

    def _write_window(self, window: tuple[int, int], items: list[Pending], emitted: set[int]) -> None:
        seg = self._segment_for(window)
        for n, r in enumerate(items):
            if seg is None:
                self.post_results([Written(x, error="no_space") for x in items[n:]])
                return
            self._own(seg)
            rec = r.record
            hlen, rlen = record_size(r.bucket, r.key, rec.metadata, len(rec.payload))
            offset = seg.start + self._fill
            entry_footer = FOOTER_ENTRY.itemsize + len(r.key) + (0 if r.bucket in seg.bucket_ids else
                                                                  2 + len(r.bucket))
            if offset + rlen + align(seg.footer_len + entry_footer + TRAILER) > self.segment_bytes:
                self._seal(seg)
                seg = self._segment_for(window)
                if seg is None:
                    self.post_results([Written(x, error="no_space") for x in items[n:]])
                    return
                self._own(seg)
                offset = seg.start + self._fill
            payload = rec.payload if not isinstance(rec.payload, memoryview) else rec.payload.cast("B")
            pxxh = rec.xxh3 if rec.xxh3 is not None else xxhash.xxh3_64_intdigest(payload)
            seq = self.next_seq
            self.next_seq = seq + 1
            emitted.add(id(r))
            seg.unacked.append((offset + rlen, Written(r, seg.header.segment_id, offset, hlen)))
            direct = self._fill + hlen <= self.batch_bytes  # the usual case: straight into the batch buffer
            head = self._buf if direct else memoryview(bytearray(hlen))
            pack_record_header(head, self._fill if direct else 0, seg.header.salt, seq=seq, created=rec.created,
                               expires_at=rec.expires_at, payload_len=len(payload), payload_xxh3=pxxh,
                               bucket=r.bucket, key=r.key, meta=rec.metadata)
            if direct:
                self._fill += hlen
                if self._fill == self.batch_bytes:
                    self._flush(seg)
            else:
                self._emit(seg, head)
            self._emit(seg, payload)
            pad = rlen - hlen - len(payload)
            if pad:
                self._emit(seg, _ZEROS[:pad])
            bid = seg.bucket_ids.get(r.bucket)
            if bid is None:
                bid = seg.bucket_ids[r.bucket] = len(seg.buckets)
                seg.buckets.append(r.bucket.decode())
            seg.rows.append((r.fp, seq, rec.expires_at, offset, len(payload), hlen, bid, 0, len(r.key)))
            seg.keys += r.key
            seg.footer_len += entry_footer
        if seg is not None:
            seg.last_write = time.monotonic()

    def _own(self, seg: _Open) -> None:
        """Make the current buffer ``seg``'s: write out another segment's bytes first."""
        if self._owner is not seg:
            if self._fill and self._owner is not None:
                self._flush(self._owner)
            self._owner = seg

    def _emit(self, seg: _Open, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data)
        while view:
            take = min(len(view), self.batch_bytes - self._fill)
            self._buf[self._fill:self._fill + take] = view[:take]
            self._fill += take
            view = view[take:]
            if self._fill == self.batch_bytes:
                self._flush(seg)

    def _flush(self, seg: _Open) -> None:
        """Hand the filled buffer to the I/O thread (padded to 4 KiB) and switch to the other one."""
        if self._fill == 0:
            return
        assert seg is self._owner
        length = align(self._fill)
        if length > self._fill:
            self._buf[self._fill:length] = bytes(length - self._fill)
        end = seg.start + length
        acks = [w for e, w in seg.unacked if e <= end]
        if acks:
            seg.unacked = [(e, w) for e, w in seg.unacked if e > end]
        self._busy[self._cur] = self._io.submit(self._io_write, seg.fd, self._buf[:length], seg.start, acks)
        seg.start = end
        self._fill = 0
        self._cur ^= 1
        self._buf = self._bufs[self._cur]
        busy = self._busy[self._cur]
        if busy is not None:
            busy.result()  # the buffer we are about to fill has reached the file

    def _io_write(self, fd: int, view: memoryview, pos: int, acks: list[Written]) -> None:
        """I/O thread: write one buffer; only then are the records that end in it acknowledged."""
        if self.failed is not None:
            for w in acks:
                w.error = IO_ERROR
            self.post_results(acks)
            return
        length = len(view)
        try:
            while view:
                n = os.pwrite(fd, view, pos)
                view, pos = view[n:], pos + n
        except OSError as e:
            self._fail(e, "write")
            for w in acks:
                w.error = IO_ERROR
        else:
            self.post("wrote", length)
        self.post_results(acks)

    # ------------------------------------------------------------------------------------ segments

    def _segment_for(self, window: tuple[int, int]) -> _Open | None:
        seg = self._open.get(window)
        if seg is not None:
            return seg
        if len(self._open) >= self.max_open:
            oldest = min(self._open.values(), key=lambda s: s.last_write)
            self._seal(oldest)
        while not self.space.try_reserve(self.segment_bytes):
            if self.failed is not None:
                return None
            self.post("need_space", self.segment_bytes)
            with self._cond:
                if self._stopping:
                    return None
            self.space.wait(0.2)
        sid = self.next_segment
        self.next_segment += 1
        width, index = window
        header = SegmentHeader(sid, secrets.randbits(64), time.time(), float(width * index),
                               float(width * (index + 1)), self.segment_bytes)
        path = segment_path(self.directory, sid)
        try:
            fd = self._create(path)
            try:
                try:
                    os.posix_fallocate(fd, 0, self.segment_bytes)
                except OSError as e:
                    if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                        raise
                self._bufs[2][:BLOCK] = header.pack()  # its own aligned block: both batch buffers may be busy
                os.pwrite(fd, self._bufs[2], 0)
            except OSError:
                os.close(fd)
                unlink_quietly(path)
                raise
        except OSError:
            self.space.release(self.segment_bytes)
            raise
        seg = _Open(header, path, fd, BLOCK, window, time.monotonic())
        self._open[window] = seg
        self.post("opened", OpenedSegment(sid, path, header.salt, header.window_hi, self.segment_bytes))
        return seg

    def _create(self, path: Path) -> int:
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL
        if self.direct:
            try:
                return os.open(path, flags | os.O_DIRECT, 0o644)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                unlink_quietly(path)
                log.info("flash: %s does not support O_DIRECT; writing through the page cache", self.directory)
                self.direct = False
        return os.open(path, flags, 0o644)

    def _seal(self, seg: _Open) -> None:
        """Footer and trailer after the records; then (I/O thread, after every write before it) truncate,
        fsync, close. The segment is immutable from here on."""
        del self._open[seg.window]
        self._own(seg)
        entries = np.array(seg.rows, dtype=FOOTER_ENTRY) if seg.rows else np.zeros(0, FOOTER_ENTRY)
        self._emit(seg, footer_bytes(seg.header, seg.start + self._fill, seg.buckets, entries, seg.keys))
        self._flush(seg)
        self._owner = None
        self._io.submit(self._io_seal, seg)

    def _io_seal(self, seg: _Open) -> None:
        size = 0
        try:
            if self.failed is None:
                os.ftruncate(seg.fd, seg.start)
                os.fdatasync(seg.fd)
                fsync_dir(self.directory)
                size = seg.start
        except OSError as e:
            self._fail(e, "seal")
        finally:
            close_quietly(seg.fd)
        self.space.release(self.segment_bytes - size if size else 0)
        self.post("sealed", seg.header.segment_id, size)

    def _seal_idle(self, stopping: bool) -> None:
        now = time.monotonic()
        for seg in list(self._open.values()):
            if stopping or now - seg.last_write >= self.seal_idle:
                if self.failed is None:
                    self._seal(seg)
                elif stopping:
                    del self._open[seg.window]
                    self._io.submit(close_quietly, seg.fd)

    # ----------------------------------------------------------------------------- small files, errors

    def _flush_dead(self, dead: list[np.ndarray]) -> None:
        if not dead or self.failed is not None:
            return
        try:
            if self._dead_fd < 0:
                self._dead_fd = os.open(self.directory / DEAD_LOG, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            data = encode_dead(np.concatenate(dead))
            view = memoryview(data)
            while view:
                view = view[os.write(self._dead_fd, view):]
        except OSError as e:
            self._fail(e, "dead log")

    def rewrite_dead(self, keep: np.ndarray) -> None:
        """Replace the dead log with ``keep`` (writer thread, through control())."""
        if self._dead_fd >= 0:
            os.close(self._dead_fd)
            self._dead_fd = -1
        atomic_write(self.directory / DEAD_LOG, encode_dead(keep))

    def save_state(self, data: bytes) -> int:
        atomic_write(self.directory / STATE_FILE, data)
        return len(data)

    def _fail(self, exc: OSError, what: str) -> None:
        if self.failed is None:
            self.failed = f"{what}: {exc.strerror or exc} ({errno.errorcode.get(exc.errno or 0, exc.errno)})"
            self.post("failed", self.failed)
        with self._cond:
            dropped = [i for i in self._queue if isinstance(i, Pending)]
            self._queue = deque(i for i in self._queue if not isinstance(i, Pending))
            self.queued_bytes = 0
        self.post_results([Written(r, error=IO_ERROR) for r in dropped])


_ZEROS = bytes(8)
