"""Rebuilding the index when a store opens: footers of sealed segments, a record-by-record scan of the rest.

Runs on a worker thread before the store serves anything. Vectorized with numpy: the cost is reading each
sealed segment's bucket table and entries (44 bytes per record) plus one sort of all entries by sequence
number; payloads of sealed segments are not read. An unsealed segment (the writer was killed) is read whole,
every record verified (header checksum and payload XXH3), and then sealed in place so the next start reads
only its footer.

Which records come back: for every fingerprint the record with the highest sequence number, if it is not in
the dead log, not older than its bucket's floor (``drop_bucket``) and not expired.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .format import FOOTER_ENTRY, FormatError, SegmentHeader
from .osutil import close_quietly
from .segments import (
    list_segment_files,
    open_reader,
    read_footer_index,
    read_header,
    read_trailer,
    scan_records,
    seal_scanned,
)
from .state import DEAD_LOG, STATE_FILE, atomic_write, dead_keys, encode_dead, load_dead, load_state
from .types import RecoveryReport

log = logging.getLogger("ctxstore.flash")


@dataclass
class RecoveredSegment:
    segment_id: int
    path: Path
    fd: int  # read-only descriptor, handed to the store
    header: SegmentHeader
    size: int


@dataclass
class Recovered:
    report: RecoveryReport
    segments: list[RecoveredSegment]
    buckets: list[str]
    floors: dict[str, int]
    # the index, one entry per live block
    fp: np.ndarray
    seg: np.ndarray
    off: np.ndarray
    plen: np.ndarray
    hlen: np.ndarray
    exp: np.ndarray
    bkt: np.ndarray
    next_seq: int
    next_segment: int
    dead_log_entries: int = 0
    removed: list[Path] = field(default_factory=list)

    def release_arrays(self) -> None:
        """Drop the index arrays once installed (whoever still holds this object does not keep them alive)."""
        empty = np.zeros(0, np.uint8)
        self.fp = self.seg = self.off = self.plen = self.hlen = self.exp = self.bkt = empty


def wipe(directory: Path) -> None:
    """Delete everything the store keeps in ``directory`` (``reset``)."""
    for _sid, path in list_segment_files(directory):
        path.unlink(missing_ok=True)
    for name in (DEAD_LOG, STATE_FILE, STATE_FILE + ".tmp", DEAD_LOG + ".tmp"):
        (directory / name).unlink(missing_ok=True)


def recover(directory: Path, now: float, direct: bool = True) -> Recovered:
    """The index, buckets and manifest of ``directory`` as its files hold them; each kept segment comes back
    open for reading (with O_DIRECT if ``direct`` and the file system allows it)."""
    t0 = time.perf_counter()
    report = RecoveryReport()
    manifest, floors, bad_state = load_state(directory)
    report.manifest = manifest
    if bad_state:
        log.warning("flash: %s is unreadable; starting without a manifest", directory / STATE_FILE)
    dead = load_dead(directory)

    names: dict[str, int] = {}
    parts: list[np.ndarray] = []
    part_seg: list[np.ndarray] = []
    part_bkt: list[np.ndarray] = []
    kept: list[RecoveredSegment] = []
    next_segment = 0
    for sid, path in list_segment_files(directory):
        next_segment = max(next_segment, sid + 1)
        seg, buckets, entries = _load_segment(path, sid, report, direct)
        if seg is None:
            continue
        kept.append(seg)
        gids = np.array([names.setdefault(b, len(names)) for b in buckets] or [0], np.uint32)
        parts.append(entries)
        part_seg.append(np.full(entries.size, sid, np.uint32))
        part_bkt.append(gids[entries["bucket"]] if entries.size else np.zeros(0, np.uint32))

    allent = np.concatenate(parts) if parts else np.zeros(0, FOOTER_ENTRY)
    seg_ids = np.concatenate(part_seg) if part_seg else np.zeros(0, np.uint32)
    bkt = np.concatenate(part_bkt) if part_bkt else np.zeros(0, np.uint32)
    if dead.size:  # never reuse the id of a segment the dead log names (its entries would kill new records)
        next_segment = max(next_segment, int((dead >> np.uint64(32)).max()) + 1)
    total = allent.size
    next_seq = max([int(allent["seq"].max()) + 1 if total else 0, *[f for f in floors.values()]], default=0)

    # newest version of every fingerprint wins, whatever became of it
    order = np.argsort(allent["seq"], kind="stable")
    fp_sorted = allent["fp"][order]
    _, last = np.unique(fp_sorted[::-1], return_index=True)
    win = order[total - 1 - last] if total else np.zeros(0, np.int64)
    del order, fp_sorted, last  # recovery's peak RAM is these temporaries: drop them as soon as possible
    alive = np.ones(win.size, bool)
    if dead.size:
        alive &= ~np.isin(dead_keys(seg_ids[win], allent["offset"][win]), dead)
    if floors:
        floor_of = np.zeros(max(len(names), 1), np.uint64)
        for name, f in floors.items():
            if name in names:
                floor_of[names[name]] = f
        alive &= allent["seq"][win] >= floor_of[bkt[win]]
    not_expired = allent["expires"][win] > now
    report.expired = int((alive & ~not_expired).sum())
    alive &= not_expired
    rows = win[alive]
    report.superseded = total - win.size + int((~alive).sum()) - report.expired

    # segments holding nothing live are deleted now
    live_segs = set(np.unique(seg_ids[rows]).tolist())
    removed = []
    for seg in list(kept):
        if seg.segment_id not in live_segs:
            os.close(seg.fd)
            removed.append(seg.path)
            kept.remove(seg)
    for path in removed:
        try:
            path.unlink()
        except OSError as e:
            log.warning("flash: could not remove empty segment %s: %s", path, e)
    report.removed_segments = len(removed)

    # the dead log keeps only entries of segments that are still there
    kept_ids = np.array([s.segment_id for s in kept], np.uint32)
    keep_dead = dead[np.isin((dead >> np.uint64(32)).astype(np.uint32), kept_ids)] if dead.size else dead
    if keep_dead.size != dead.size:
        try:
            atomic_write(directory / DEAD_LOG, encode_dead(keep_dead))
        except OSError as e:
            log.warning("flash: could not rewrite the dead log: %s", e)

    report.blocks = int(rows.size)
    plen = allent["payload_len"][rows]
    report.bytes = int(plen.sum(dtype=np.int64))
    report.segments = len(kept)
    report.seconds = time.perf_counter() - t0
    return Recovered(
        report=report, segments=kept, buckets=list(names), floors=floors,
        fp=allent["fp"][rows], seg=seg_ids[rows], off=allent["offset"][rows], plen=plen,
        hlen=allent["header_len"][rows], exp=allent["expires"][rows], bkt=bkt[rows],
        next_seq=next_seq, next_segment=next_segment, dead_log_entries=int(keep_dead.size), removed=removed,
    )


def _load_segment(path: Path, sid: int, report: RecoveryReport, direct: bool
                  ) -> tuple[RecoveredSegment | None, list[str], np.ndarray]:
    empty = np.zeros(0, FOOTER_ENTRY)
    try:
        fd = os.open(path, os.O_RDWR)
        writable = True
    except OSError:
        fd = os.open(path, os.O_RDONLY)
        writable = False
    try:
        size = os.fstat(fd).st_size
        try:
            header = read_header(fd)
            if header.segment_id != sid:
                raise FormatError("segment id differs from the file name")
        except FormatError as e:
            log.warning("flash: removing %s: %s", path, e)
            report.corrupt_segments += 1
            os.close(fd)
            path.unlink(missing_ok=True)
            return None, [], empty
        try:
            trailer = read_trailer(fd, size)
            if trailer.segment_id != sid:
                raise FormatError("trailer of another segment")
            buckets, entries = read_footer_index(fd, trailer)
            report.sealed_segments += 1
        except FormatError as e:
            if "not sealed" not in str(e):
                log.warning("flash: %s has a damaged footer (%s); scanning its records", path, e)
                report.corrupt_segments += 1
            scanned = scan_records(fd, header, size)
            report.tail_segments += 1
            report.tail_records += int(scanned.entries.size)
            report.discarded_records += scanned.discarded
            buckets, entries = scanned.buckets, scanned.entries
            if writable:
                try:
                    size = seal_scanned(fd, header, scanned)
                except OSError as e2:
                    log.warning("flash: could not seal %s after the scan: %s", path, e2)
        rfd = open_reader(path, direct)
        os.close(fd)
        return RecoveredSegment(sid, path, rfd, header, size), buckets, entries
    except OSError as e:
        log.warning("flash: cannot read %s: %s", path, e)
        report.corrupt_segments += 1
        close_quietly(fd)
        return None, [], empty
