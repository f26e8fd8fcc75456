"""A request body's deadline: the one rule both body paths (below ASGI, :mod:`.direct`; over ASGI,
:meth:`.asgi.Request.chunks`) apply, as the ``body_timeout`` setting states it.

The rule: once the node waits for a body, the body fails with :class:`BodyTimeout` (RequestTimeout, 408) when
``timeout`` seconds pass with no byte of it arriving, or when a period of ``timeout`` seconds (periods run back to
back from the first wait) brings fewer than ``min_rate`` bytes per second (at least one byte). A stall fails
exactly ``timeout`` after the last byte; a trickle at the end of the first period below the rate.

One timer per body, moved only when it fires (a body of many small reads pays one clock read per read, not a
timer cancel and re-arm): it fires at the earlier of the stall deadline and the period's end, and if bytes came
meanwhile it is set again for what is then the earlier one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

__all__ = ["BodyDeadline", "BodyTimeout"]


class BodyTimeout(Exception):
    """The client stalled while sending its body (or sent it below the minimum rate)."""


class BodyDeadline:
    """One body's deadline, started when the node first waits for the body. :meth:`arrived` counts bytes;
    when the rule above fails the body, ``expired`` turns true and ``on_expire`` is called (once)."""

    __slots__ = ("_loop", "_timeout", "_required", "_last", "_period_end", "_period_bytes", "_timer",
                 "_on_expire", "expired")

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout: float, min_rate: int,
                 on_expire: Callable[[], None]) -> None:
        self._loop = loop
        self._timeout = timeout
        self._required = max(1, int(min_rate * timeout))
        now = loop.time()
        self._last = now  # when the last byte arrived (at first: when the wait began)
        self._period_end = now + timeout
        self._period_bytes = 0
        self._on_expire = on_expire
        self.expired = False
        self._timer: asyncio.TimerHandle | None = loop.call_at(now + timeout, self._check)

    def arrived(self, n: int) -> None:
        if n:
            self._period_bytes += n
            self._last = self._loop.time()

    def _check(self) -> None:
        now = self._loop.time()
        if now >= self._last + self._timeout:
            self._expire()
            return
        if now >= self._period_end:
            if self._period_bytes < self._required:
                self._expire()
                return
            self._period_end += self._timeout
            if self._period_end <= now:  # the loop was held up past a whole period: count from now
                self._period_end = now + self._timeout
            self._period_bytes = 0
        self._timer = self._loop.call_at(min(self._last + self._timeout, self._period_end), self._check)

    def _expire(self) -> None:
        self._timer = None
        self.expired = True
        self._on_expire()

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
