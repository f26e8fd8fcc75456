"""The body deadline (server/protocol/deadline.py): one rule for both body paths, as the ``body_timeout``
setting states it — a body fails when ``body_timeout`` passes with no byte of it arriving, or when a
``body_timeout`` period brings less than ``min_body_rate`` per second. Checked on the deadline itself and on the
ASGI path's reader; the path below ASGI is checked against a real node in tests/bulk/test_direct.py."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from ctxstore_server.protocol.asgi import Request
from ctxstore_server.protocol.deadline import BodyDeadline, BodyTimeout
from ctxstore_server.settings import SETTINGS

TIMEOUT = 0.2
SLACK = 0.06  # timers fire a little late on a loaded machine, never early


async def run_deadline(min_rate: int, feed: Callable[[BodyDeadline], Awaitable[None]]) -> tuple[float | None, float]:
    """Start a deadline, run ``feed`` against it; returns (seconds to expiry or None, seconds of the last byte)."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    expired: list[float] = []
    deadline = BodyDeadline(loop, TIMEOUT, min_rate, lambda: expired.append(loop.time()))
    LAST[:] = [start]
    try:
        await feed(deadline)
    finally:
        deadline.stop()
    return (expired[0] - start if expired else None), LAST[0] - start


LAST = [0.0]  # when bytes_every last fed bytes


async def bytes_every(deadline: BodyDeadline, n: int, interval: float, times: int) -> None:
    for _ in range(times):
        await asyncio.sleep(interval)
        if deadline.expired:
            return
        deadline.arrived(n)
        LAST[0] = asyncio.get_running_loop().time()


def test_a_stall_fails_one_timeout_after_the_last_byte() -> None:
    async def feed(deadline: BodyDeadline) -> None:
        await bytes_every(deadline, 100, 0.03, 3)  # bytes at 0.03, 0.06, 0.09, then nothing
        await asyncio.sleep(3 * TIMEOUT)

    expired, last = asyncio.run(run_deadline(0, feed))
    assert expired is not None
    assert TIMEOUT <= expired - last < TIMEOUT + SLACK


def test_a_trickle_below_the_rate_fails_at_the_end_of_the_first_period() -> None:
    async def feed(deadline: BodyDeadline) -> None:
        await bytes_every(deadline, 10, 0.02, 40)  # 500 B/s, never a stall

    expired, _ = asyncio.run(run_deadline(1000, feed))  # 1000 B/s: 200 bytes per period
    assert expired is not None
    assert TIMEOUT <= expired < TIMEOUT + SLACK


def test_a_body_at_the_rate_never_fails() -> None:
    async def feed(deadline: BodyDeadline) -> None:
        await bytes_every(deadline, 40, 0.02, 40)  # 2000 B/s for 0.8 s: four periods

    expired, _ = asyncio.run(run_deadline(1000, feed))
    assert expired is None


def test_a_stopped_deadline_never_fires() -> None:
    async def feed(deadline: BodyDeadline) -> None:
        deadline.stop()
        await asyncio.sleep(2 * TIMEOUT)

    expired, _ = asyncio.run(run_deadline(0, feed))
    assert expired is None


# ---------------------------------------------------------------------------- the ASGI path


def request(messages: list[tuple[float, dict[str, Any] | None]]) -> Request:
    """A request whose receive() returns each message after its delay (None: never returns)."""
    queue = list(messages)

    async def receive() -> dict[str, Any]:
        delay, message = queue.pop(0)
        await asyncio.sleep(delay)
        if message is None:
            await asyncio.Event().wait()
        assert message is not None
        return message

    scope = {"type": "http", "method": "PUT", "path": "/b/k", "raw_path": b"/b/k", "query_string": b"",
             "headers": [(b"content-length", b"1000")]}
    return Request(scope, receive, body_timeout=TIMEOUT, min_body_rate=0)


def body(data: bytes) -> dict[str, Any]:
    return {"type": "http.request", "body": data, "more_body": True}


def test_the_asgi_reader_fails_a_stall_one_timeout_after_the_last_byte() -> None:
    async def scenario() -> float:
        req = request([(0.0, body(b"a")), (0.03, body(b"b")), (0.0, None)])
        loop = asyncio.get_running_loop()
        last = loop.time()
        with pytest.raises(BodyTimeout):
            async for _ in req.chunks():
                last = loop.time()
        return loop.time() - last

    stalled = asyncio.run(scenario())
    assert TIMEOUT <= stalled < TIMEOUT + SLACK


def test_the_asgi_reader_never_interrupts_the_callers_own_work() -> None:
    """The deadline passes while the caller works between two chunks (e.g. waits for room in the budget): the
    caller's await is not cancelled; its next read fails."""
    async def scenario() -> None:
        req = request([(0.0, body(b"a")), (0.0, body(b"b"))])
        chunks = req.chunks()
        assert await chunks.__anext__() == b"a"
        await asyncio.sleep(2 * TIMEOUT)  # not cancelled
        with pytest.raises(BodyTimeout):
            await chunks.__anext__()

    asyncio.run(scenario())


def test_the_setting_states_the_rule() -> None:
    [setting] = [s for s in SETTINGS if s.name == "body_timeout"]
    text = setting.help
    assert "no byte of it arriving" in text and "--min-body-rate over a period this long" in text, text
