"""Several receive and send threads for one client: event loops of their own, each with its own connections.

Why: one event loop moves every byte of a call through one thread, and on a 16-core GPU server that thread
was the limit (one client restored 3.06 GB/s; eight clients in eight threads of one process 13.45 GB/s:
docs/benchmarks.md). A bulk call's parts are spread over *lanes*: lane 0 is the loop the call runs on, lanes
1..N-1 are :class:`LoopThread` s started here the first time a part is sent to them. A part's request runs
whole on its lane — the socket reads straight into the caller's buffers and the blocks are verified there —
and only the finished :class:`~ctxstore.transport.Response` comes back to the calling loop. Event loops (not
blocking sockets) because they reuse the one transport the single-thread client is measured with, and
uvloop releases the GIL around every socket read.

Rules that keep it safe inside the process that embeds it:

- A part the caller stops waiting for (its deadline, a cancellation) is cancelled on its lane and waited
  for: once :meth:`Lanes.request` has returned or raised, nothing writes into the caller's buffers.
- Threads start lazily, never at import; :meth:`Lanes.close` stops them all.
- After ``fork()`` the child has none of the parent's threads: the first use in the child starts fresh ones
  with fresh connections (the parent's loops and sockets are left untouched, never shared).
"""

from __future__ import annotations

import asyncio
import os
import ssl
import threading
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

from .errors import ConfigurationError, NodeUnavailable
from .transport import BodyStream, Buffer, Pool, ReaderFactory, Response

T = TypeVar("T")

THREADS_ENV = "CTXSTORE_THREADS"
MAX_THREADS = 64
#: Objects of a parent process's loop threads, kept referenced in a forked child: destroying an event loop
#: whose thread does not exist in this process could touch handles the parent still uses.
_INHERITED: list[object] = []


def default_threads() -> int:
    """``CTXSTORE_THREADS`` when set, else half the cores this process may run on, at most 8: a GPU server
    (16 cores) gets 8, a small machine 1 (there the one thread already fills the loopback's copy rate)."""
    text = os.environ.get(THREADS_ENV, "").strip()
    if text:
        try:
            return check_threads(int(text))
        except ValueError:
            raise ConfigurationError(f"{THREADS_ENV} must be a positive integer, not {text!r}") from None
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(8, cores // 2))


def check_threads(threads: object) -> int:
    if not isinstance(threads, int) or isinstance(threads, bool) or not 1 <= threads <= MAX_THREADS:
        raise ConfigurationError(f"threads must be an integer from 1 to {MAX_THREADS}, not {threads!r}")
    return threads


def new_loop() -> asyncio.AbstractEventLoop:
    """uvloop when installed (about 20 % less client CPU per restore, docs/benchmarks.md), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class LoopThread:
    """An event loop running in a daemon thread, for calling coroutines from other threads. Started on first
    use, and again in a forked child (whose copy of the parent's thread does not run)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._pid = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The running loop (started now if it was not, or if this process is a fork of the one that started it)."""
        loop = self._loop
        if loop is not None and self._pid == os.getpid():
            return loop
        if self._closed:
            raise RuntimeError(f"{self.name}: the client is closed")
        with self._lock:
            if self._loop is not None and self._pid != os.getpid():
                _INHERITED.append((self._loop, self._thread))
                self._loop = self._thread = None
            if self._loop is None:
                self._loop = new_loop()
                self._thread = threading.Thread(target=self._loop.run_forever, name=self.name, daemon=True)
                self._thread.start()
                self._pid = os.getpid()
            return self._loop

    @property
    def started(self) -> bool:
        return self._loop is not None and self._pid == os.getpid()

    def owns_current_thread(self) -> bool:
        return self._thread is threading.current_thread()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop and wait for its result (from any other thread)."""
        try:
            if self.owns_current_thread():
                raise RuntimeError("ContextStore methods cannot be called from its own loop thread")
            loop = self.loop
        except BaseException:
            coro.close()  # never run: no "never awaited" warning on top of the error
            raise
        return asyncio.run_coroutine_threadsafe(coro, loop).result()

    def stop(self) -> None:
        """Cancel what still runs on the loop, stop it and join the thread; no later call starts it again."""
        self._closed = True
        if not self.started:
            return
        loop, thread = self._loop, self._thread
        assert loop is not None and thread is not None
        if thread is not threading.current_thread() and loop.is_running():
            try:
                asyncio.run_coroutine_threadsafe(_cancel_others(), loop).result(5)
            except Exception:  # noqa: BLE001  (stopping regardless)
                pass
            loop.call_soon_threadsafe(loop.stop)
            thread.join(5)
        if not loop.is_running():
            loop.close()
        self._loop = self._thread = None


async def _cancel_others() -> None:
    """Cancel every task on this loop but the caller and wait for them (a part cut short by close() ends as
    a failure its caller sees, not as a task that never finishes)."""
    me = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not me]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


class Lanes:
    """Lanes 1..``count - 1`` of a client (lane 0 is the calling loop, not kept here), each with its own
    connection pool per node. A lane's pools are touched only from its own thread."""

    def __init__(self, count: int, *, pool_size: int, connect_timeout: float, read_timeout: float,
                 tls: ssl.SSLContext | None = None) -> None:
        self.count = count
        # Every lane's pools connect as lane 0's do: the same TLS context (shared: OpenSSL's are thread-safe).
        self._pool_args = dict(limit=pool_size, connect_timeout=connect_timeout, read_timeout=read_timeout,
                               tls=tls)
        self._threads = [LoopThread(f"ctxstore-lane-{i}") for i in range(1, count)]
        self._pools: list[dict[tuple[str, int], Pool]] = [{} for _ in range(1, count)]
        self._pid = os.getpid()
        self._closed = False

    async def request(self, lane: int, host: str, port: int, head: bytes, body: Sequence[Buffer] | BodyStream,
                      factory: ReaderFactory, *, server_hostname: str | None = None) -> Response:
        """One request to ``host:port`` on lane ``lane`` (1 or more), awaited from the calling loop. If the
        caller is cancelled, the request is cancelled on its lane and this returns only once it has ended.
        ``server_hostname``: the name a TLS node's certificate is checked for (default ``host``)."""
        if self._closed:
            raise NodeUnavailable(f"{host}:{port}", "the client is closed")
        if self._pid != os.getpid():  # a forked child: the parent's pools are not ours to use
            self._pools = [{} for _ in range(1, self.count)]
            self._pid = os.getpid()
        thread, pools = self._threads[lane - 1], self._pools[lane - 1]
        lane_loop = thread.loop
        caller = asyncio.get_running_loop()
        ended: asyncio.Future[asyncio.Task[Response]] = caller.create_future()
        box: list[asyncio.Task[Response]] = []

        def deliver(task: asyncio.Task[Response]) -> None:
            if not ended.done():
                ended.set_result(task)

        def failed(exc: BaseException) -> None:
            if not ended.done():
                ended.set_exception(exc)

        def begin() -> None:
            try:
                pool = pools.get((host, port))
                if pool is None:
                    pool = pools[(host, port)] = Pool(host, port, server_hostname=server_hostname,
                                                      **self._pool_args)  # type: ignore[arg-type]
                task = lane_loop.create_task(pool.request(head, body, factory))
            except BaseException as exc:  # noqa: BLE001  (the caller must hear of it, never wait for good)
                _call_soon(caller, failed, exc)
                return
            box.append(task)
            task.add_done_callback(lambda t: _call_soon(caller, deliver, t))

        try:
            lane_loop.call_soon_threadsafe(begin)
        except RuntimeError:  # the lane's loop was closed meanwhile
            raise NodeUnavailable(f"{host}:{port}", "the client is closed") from None
        try:
            task = await asyncio.shield(ended)
        except asyncio.CancelledError:
            # begin() runs before this (one FIFO of callbacks per loop), so the task exists by then, if any.
            lane_loop.call_soon_threadsafe(lambda: box and box[0].cancel())
            await _wait_uncancelled(ended)
            if ended.done() and not ended.cancelled() and ended.exception() is None:
                finished = ended.result()
                if not finished.cancelled():
                    finished.exception()  # looked at: a failure nobody waits for any more is not an error
            raise
        if task.cancelled():  # cancelled on its lane without the caller asking: the client was closed
            raise NodeUnavailable(f"{host}:{port}", "the client was closed during the call")
        return task.result()

    def forget(self, host: str, port: int) -> None:
        """Close every lane's connections to a node (marked down, or gone from the pod)."""
        for thread, pools in zip(self._threads, self._pools):
            if thread.started:
                thread.loop.call_soon_threadsafe(_close_pool, pools, (host, port))

    def close(self) -> None:
        """Stop every lane thread (their calls in progress end as failures) and close their connections."""
        self._closed = True
        for thread, pools in zip(self._threads, self._pools):
            if thread.started:
                for key in list(pools):
                    thread.loop.call_soon_threadsafe(_close_pool, pools, key)
            thread.stop()


def _close_pool(pools: dict[tuple[str, int], Pool], key: tuple[str, int]) -> None:
    pool = pools.pop(key, None)
    if pool is not None:
        pool.close()


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Any, *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the calling loop is closed: nobody waits for this answer any more
        pass


async def _wait_uncancelled(future: asyncio.Future[Any]) -> None:
    """Wait for ``future`` whatever cancellations arrive meanwhile (the lane's task ends within its own
    timeouts once cancelled); they were already acted on."""
    while not future.done():
        try:
            await asyncio.shield(future)
        except asyncio.CancelledError:
            continue
        except Exception:  # noqa: BLE001  (how it ended is not this waiter's business)
            return
