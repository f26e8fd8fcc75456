"""Whether the flash store may still write, and its counters: one I/O error anywhere degrades it (appends are
refused from then on, reads continue), said once in the log and in ``stats().degraded``."""

from __future__ import annotations

import errno
import logging
from pathlib import Path

from .osutil import directory_unwritable
from .types import FlashStats
from .writer import Writer

log = logging.getLogger("ctxstore.flash")


class Health:
    """The store's counters and its degraded state, shared by its parts (all on the event loop)."""

    def __init__(self, path: Path, capacity_bytes: int) -> None:
        self.path = path
        self.stats = FlashStats(capacity_bytes=capacity_bytes)
        self.degraded: str | None = None  # why the store stopped writing
        self.writer: Writer | None = None  # told to stop taking records when the store degrades

    def set_degraded(self, reason: str) -> None:
        if self.degraded is None:
            self.degraded = reason
            log.error("flash: %s: %s; the flash tier is degraded: no more writes, reads continue", self.path, reason)

    def io_error(self, what: str, exc: BaseException) -> None:
        """An I/O error of kind ``what`` ("read", "unlink", "manifest", ...): counted; the store degrades."""
        if what == "read":
            self.stats.read_errors += 1
        else:
            self.stats.write_errors += 1
        msg = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        code = errno.errorcode.get(exc.errno or 0, "") if isinstance(exc, OSError) else ""
        self.set_degraded(f"{what}: {msg}" + (f" ({code})" if code else ""))
        if self.writer is not None and self.writer.failed is None:
            self.writer.failed = self.degraded

    def check_directory(self) -> None:
        """A directory that can no longer take writes degrades the store."""
        e = directory_unwritable(self.path)
        if e is not None:
            self.io_error("directory", e)
