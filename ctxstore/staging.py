"""Device staging: KV blocks between the pod and device memory (a GPU's HBM) through a bounded pool of host chunks.

Why: copies of KiB-sized pieces between host and device are launch-bound (32 KiB copies ran at 4.6 GB/s H2D on
an H200, against 51.5 GB/s in 2 MiB copies), and copies from pageable memory run at a sixth of pinned ones. So
blocks travel as they arrive from the pod: *block-compact chunks*, many blocks' bytes end to end. A restore
receives a chunk into a pinned host buffer (the client's receive threads fill it, verifying every block there),
copies it to the device in one copy on a copy stream, and scatters it into the destination with a device-side
copy; meanwhile the next chunk is received into the next host buffer. A save is the mirror: a device-side gather
of a chunk's blocks, one copy to the host, then the sends, while the next chunk is gathered.

Rules:

- Host memory is the pool: ``chunks`` buffers of ``chunk_bytes``, allocated once (pinned on a GPU) and reused,
  however large the restore.
- A block that fails verification, or did not arrive, is never copied to the device: the prefix ends before it.
- When :func:`restore` returns, every copy it made has completed: nothing writes into the destination later.
- Copies are ordered after the caller's stream (an event recorded where the caller asked: :func:`ready`), and
  the caller's work after a restore sees its bytes (the copies completed before it returned).

The device sits behind :class:`CopyBackend`: :class:`CudaBackend` (torch.cuda: pinned memory, a copy stream,
events, non-blocking copies) and :class:`HostBackend`, the same steps in plain host memory, so that everything
above the device calls runs and is tested on a machine without a GPU (``staging="host"`` routes CPU tensors
through it). torch is imported only when a tensor is staged.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from .errors import ConfigurationError

#: ``staging`` modes of a client: ``auto`` stages device tensors (CUDA) and reads CPU buffers directly;
#: ``host`` also stages CPU torch tensors through the host backend (a diagnostic: tests, benchmarks).
MODES = ("auto", "host")


def is_torch(obj: Any) -> bool:
    return type(obj).__module__.startswith("torch") and hasattr(obj, "device")


def is_target(obj: Any) -> bool:
    """A :class:`Target` made by the caller (e.g. a paged KV cache's blocks)."""
    return hasattr(obj, "scatter") and hasattr(obj, "gather") and hasattr(obj, "block_bytes")


def wants_staging(obj: Any, mode: str) -> bool:
    """Whether a destination or a source goes through the stager: a device tensor always, a CPU torch tensor
    in ``host`` mode (a list: judged by its first element)."""
    if isinstance(obj, Ready) or is_target(obj):
        return True
    if isinstance(obj, (list, tuple)):
        return bool(obj) and wants_staging(obj[0], mode)
    return is_torch(obj) and (obj.device.type != "cpu" or mode == "host")


class CopyBackend(Protocol):
    """What the stager needs of a device: work queued in order on the backend's *copy stream* (copies, and a
    target's own device work through :meth:`submit`), events that mark a point in that queue, and waiting for
    one. Device work runs in inference mode: engines make their KV caches as inference tensors (vLLM does),
    which take in-place writes only there, and inference mode is per thread."""

    device: Any

    def host_buffer(self, nbytes: int) -> Any: ...

    def device_buffer(self, nbytes: int) -> Any: ...

    def submit(self, work: Callable[[], None]) -> None: ...

    def after(self, event: Any) -> None: ...

    def record(self) -> Any: ...

    def wait(self, event: Any) -> None: ...

    def close(self) -> None: ...


def copy(backend: CopyBackend, dst: Any, src: Any) -> None:
    """Queue ``dst.copy_(src)`` on the backend's copy stream."""
    backend.submit(lambda: dst.copy_(src, non_blocking=True))


def scatter(backend: CopyBackend, dsts: Sequence[Any], srcs: Sequence[Any]) -> None:
    """Queue one copy per pair (one batched op, not one launch each)."""
    import torch

    backend.submit(lambda: torch._foreach_copy_(list(dsts), list(srcs), non_blocking=True))


class HostBackend:
    """The stager's steps in plain host memory. Its copy stream is one worker thread, so copies overlap the
    receives of the next chunk as a GPU's copy engine does; events are futures in that queue."""

    def __init__(self) -> None:
        import torch

        self.torch: Any = torch
        self.device = torch.device("cpu")
        self._stream = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ctxstore-copy")
        self._failure: BaseException | None = None

    def host_buffer(self, nbytes: int) -> Any:
        return self.torch.empty(nbytes, dtype=self.torch.uint8)  # no pin_memory: CPU-only torch refuses it

    def device_buffer(self, nbytes: int) -> Any:
        return self.torch.empty(nbytes, dtype=self.torch.uint8)

    def submit(self, work: Callable[[], None]) -> None:
        def run() -> None:
            if self._failure is not None:
                return  # the queue failed: what follows in it is not done (wait() raises)
            try:
                with self.torch.inference_mode():
                    work()
            except BaseException as exc:  # noqa: BLE001  (raised by the next wait)
                self._failure = exc

        self._stream.submit(run)

    def after(self, event: Any) -> None:
        pass

    def record(self) -> Any:
        return self._stream.submit(lambda: None)

    def wait(self, event: Any) -> None:
        if event is not None:
            event.result()
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure

    def close(self) -> None:
        self._stream.shutdown(wait=True)


class CudaBackend:
    """One CUDA device: pinned host buffers, a copy stream of its own, events to order and wait."""

    def __init__(self, device: Any) -> None:
        import torch

        self.torch: Any = torch
        self.device = torch.device(device)
        self.stream = self.torch.cuda.Stream(device=self.device)

    def host_buffer(self, nbytes: int) -> Any:
        return self.torch.empty(nbytes, dtype=self.torch.uint8, pin_memory=True)

    def device_buffer(self, nbytes: int) -> Any:
        with self.torch.cuda.stream(self.stream):  # allocated for, and used only on, the copy stream
            return self.torch.empty(nbytes, dtype=self.torch.uint8, device=self.device)

    def submit(self, work: Callable[[], None]) -> None:
        with self.torch.cuda.stream(self.stream), self.torch.inference_mode():
            work()  # kernels and copies are queued on the copy stream; this returns at once

    def after(self, event: Any) -> None:
        if event is not None:
            self.stream.wait_event(event)

    def record(self) -> Any:
        event = self.torch.cuda.Event()
        event.record(self.stream)
        return event

    def wait(self, event: Any) -> None:
        if event is not None:
            event.synchronize()

    def close(self) -> None:
        pass


def backend_for(device: Any) -> CopyBackend:
    if device.type == "cuda":
        return CudaBackend(device)
    if device.type == "cpu":
        return HostBackend()
    raise ConfigurationError(f"tensors on {device.type} devices are not supported (CUDA and CPU are)")


@dataclass
class Ready:
    """Tensors handed to the stager with an event recorded on the caller's stream when it called: the stager's
    copies wait for it (work the caller queued before — the kernels that wrote a cache — comes first)."""

    tensors: Any  # one tensor, or a list of per-block tensors
    event: Any = None

    def __len__(self) -> int:
        return len(self.tensors)


def ready(obj: Any) -> Any:
    """A CUDA tensor (or list of them) marked with the calling thread's current stream (done where the caller
    calls: the sync client's loop runs in another thread, with another current stream). Anything else: as it is."""
    if isinstance(obj, Ready) or not wants_staging(obj, "host"):
        return obj
    first = obj[0] if isinstance(obj, (list, tuple)) else obj
    if getattr(first.device, "type", None) != "cuda":
        return obj
    import torch

    cuda: Any = torch.cuda
    event = cuda.Event()
    event.record(cuda.current_stream(first.device))
    return Ready(obj, event)


# ---------------------------------------------------------------------------------------------- destinations


def _bytes_of(t: Any, what: str) -> Any:
    """A contiguous tensor as a flat uint8 view (no copy)."""
    if not t.is_contiguous():
        raise ConfigurationError(f"{what} must be contiguous")
    import torch

    return t.detach().reshape(-1).view(torch.uint8)


class Target(Protocol):
    """Where restored blocks go on the device, or where saved blocks come from."""

    block_bytes: int  # the most bytes one block may have
    n_blocks: int
    device: Any
    exact: bool  # a block must have exactly block_bytes (else: at most)

    def scatter(self, backend: CopyBackend, staging: Callable[[], Any], chunk: Any, first: int, count: int,
                size: int) -> None: ...

    def gather(self, backend: CopyBackend, staging: Callable[[], Any], chunk: Any, first: int, count: int) -> None: ...

    def block(self, index: int, size: int) -> Any: ...


class FlatTarget:
    """One tensor holding every block in equal slots (``len // n_blocks`` bytes each), as ``out=`` buffers are."""

    def __init__(self, tensor: Any, n_blocks: int) -> None:
        self.flat = _bytes_of(tensor, "out")
        self.device = self.flat.device
        self.exact = False
        self.n_blocks = n_blocks
        self.block_bytes = len(self.flat) // n_blocks if n_blocks else 0

    def scatter(self, backend: CopyBackend, staging: Callable[[], Any], chunk: Any, first: int, count: int,
                size: int) -> None:
        slot = self.block_bytes
        if size == slot:  # slots end to end, as the chunk holds them: one copy, no staging buffer
            copy(backend, self.flat[first * slot:(first + count) * slot], chunk[:count * slot])
            return
        buffer = staging()
        copy(backend, buffer[:count * size], chunk[:count * size])
        rows = self.flat[:self.n_blocks * slot].view(self.n_blocks, slot)
        copy(backend, rows[first:first + count, :size], buffer[:count * size].view(count, size))

    def gather(self, backend: CopyBackend, staging: Callable[[], Any], chunk: Any, first: int, count: int) -> None:
        slot = self.block_bytes
        copy(backend, chunk[:count * slot], self.flat[first * slot:(first + count) * slot])

    def block(self, index: int, size: int) -> Any:
        return self.flat[index * self.block_bytes:index * self.block_bytes + size]


class BlockTensors:
    """One tensor per block (each contiguous; a restore's may be larger than the block)."""

    def __init__(self, tensors: Sequence[Any], n_blocks: int, *, what: str = "out") -> None:
        if len(tensors) < n_blocks:
            raise ConfigurationError(f"{what} has {len(tensors)} tensors for {n_blocks} blocks")
        self.flats = [_bytes_of(t, what) for t in tensors[:n_blocks]]
        devices = {t.device for t in self.flats}
        if len(devices) > 1:
            raise ConfigurationError(f"{what} spans several devices: {sorted(map(str, devices))}")
        self.device = self.flats[0].device if self.flats else None
        self.exact = False
        self.n_blocks = n_blocks
        self.block_bytes = min((len(f) for f in self.flats), default=0)

    def scatter(self, backend: CopyBackend, staging: Callable[[], Any], chunk: Any, first: int, count: int,
                size: int) -> None:
        buffer = staging()
        copy(backend, buffer[:count * size], chunk[:count * size])
        scatter(backend, [self.flats[first + i][:size] for i in range(count)],
                [buffer[i * size:(i + 1) * size] for i in range(count)])

    def gather(self, backend: CopyBackend, staging: Callable[[], Any], chunk: Any, first: int, count: int) -> None:
        size = len(self.flats[first])
        buffer = staging()
        scatter(backend, [buffer[i * size:(i + 1) * size] for i in range(count)], self.flats[first:first + count])
        copy(backend, chunk[:count * size], buffer[:count * size])

    def block(self, index: int, size: int) -> Any:
        return self.flats[index][:size]


def target_of(obj: Any, n_blocks: int, *, what: str = "out") -> tuple[Target, Any]:
    """The device :class:`Target` of a destination or a source and the event to order after."""
    event = obj.event if isinstance(obj, Ready) else None
    tensors = obj.tensors if isinstance(obj, Ready) else obj
    if is_target(tensors):
        if tensors.n_blocks < n_blocks:
            raise ConfigurationError(f"{what} holds {tensors.n_blocks} blocks for {n_blocks} keys")
        return tensors, event
    if isinstance(tensors, (list, tuple)):
        target = BlockTensors(tensors, n_blocks, what=what)
        if what == "blocks" and len({len(f) for f in target.flats}) > 1:
            raise ConfigurationError("blocks on a device must all have the same size")
        return target, event
    return FlatTarget(tensors, n_blocks), event


# ---------------------------------------------------------------------------------------------- the pool


@dataclass
class _Chunk:
    host: Any
    event: Any = None  # the last copy that reads or writes ``host``
    device: Any = None  # a device staging buffer of the same size, made when a target needs one


@dataclass
class Stager:
    """The pool of host chunks for one device (allocated at first use, then reused) and the copy backend."""

    backend: CopyBackend
    chunk_bytes: int
    chunks: int
    _free: asyncio.Queue[_Chunk] | None = field(default=None, repr=False)

    async def acquire(self) -> _Chunk:
        if self._free is None:
            self._free = asyncio.Queue()
            for _ in range(self.chunks):
                self._free.put_nowait(_Chunk(self.backend.host_buffer(self.chunk_bytes)))
        chunk = await self._free.get()
        if chunk.event is not None:  # its last copy must be done before the host buffer is written again
            await asyncio.to_thread(self.backend.wait, chunk.event)
            chunk.event = None
        return chunk

    def release(self, chunk: _Chunk) -> None:
        assert self._free is not None
        self._free.put_nowait(chunk)

    def staging(self, chunk: _Chunk) -> Callable[[], Any]:
        def make() -> Any:
            if chunk.device is None:
                chunk.device = self.backend.device_buffer(self.chunk_bytes)
            return chunk.device
        return make

    def blocks_per_chunk(self, block_bytes: int) -> int:
        if block_bytes > self.chunk_bytes:
            raise ConfigurationError(f"a block of {block_bytes} bytes does not fit a staging chunk of "
                                     f"{self.chunk_bytes} bytes: raise staging_bytes")
        return max(1, self.chunk_bytes // max(1, block_bytes))


#: Receive ``count`` blocks (keys from ``first``) into a host buffer of ``count`` equal slots of ``slot`` bytes;
#: answers each block's received size, or None where it is missing, failed or did not verify.
Fetch = Callable[[int, int, Any, int], Awaitable[list[int | None]]]
#: Send blocks ``first``.. (``count`` of them, ``size`` bytes each) from a host buffer; answers what was stored.
Send = Callable[[int, int, Any, int], Awaitable[Any]]


async def restore(stager: Stager, target: Target, event: Any, fetch: Fetch, *, depth: int | None = None) -> list[int]:
    """The sizes of the leading blocks that arrived whole and verified, each now in ``target``. Chunk after
    chunk: receive into a host chunk (``depth`` chunks at once, by default all but one of the pool's), then one
    copy to the device (and a device-side scatter) on the copy stream while the next chunks are received.
    Returns once every copy made has completed, and once no receive is left running."""
    backend = stager.backend
    backend.after(event)
    per_chunk = stager.blocks_per_chunk(target.block_bytes)
    depth = depth or max(1, stager.chunks - 1)
    loop = asyncio.get_running_loop()

    async def receive(first: int) -> tuple[_Chunk, list[int | None]]:
        chunk = await stager.acquire()
        try:
            return chunk, await fetch(first, min(per_chunk, target.n_blocks - first), chunk.host,
                                      target.block_bytes)
        except BaseException:
            stager.release(chunk)
            raise

    starts = iter(range(0, target.n_blocks, per_chunk))
    pending: list[asyncio.Task[tuple[_Chunk, list[int | None]]]] = []
    copied: list[_Chunk] = []
    sizes: list[int] = []
    try:
        while True:
            while len(pending) < depth and (first := next(starts, None)) is not None:
                pending.append(loop.create_task(receive(first)))
            if not pending:
                break
            first = len(sizes)
            chunk, got = await pending.pop(0)
            try:
                leading = _leading(got)
                size = (got[0] or 0) if leading else 0
                if target.exact and size != target.block_bytes:
                    leading = 0  # a block of another size is not this target's: a miss
                same = next((i for i in range(leading) if got[i] != size), leading)  # one copy: equal sizes
                if same:
                    compact = _compact(chunk.host, target.block_bytes, size, same)
                    target.scatter(backend, stager.staging(chunk), compact, first, same, size)
                    chunk.event = backend.record()
                    copied.append(chunk)
                    sizes += [size] * same
            finally:
                stager.release(chunk)
            if same < len(got):  # a hole, a failed block or a block of another size: the prefix ends here
                break
    finally:
        for task in pending:  # receives past the end of the prefix: not wanted
            task.cancel()
        for task in pending:
            try:
                chunk, _ = await asyncio.shield(task)
                stager.release(chunk)
            except BaseException:  # noqa: BLE001  (cancelled or failed: its chunk went back already)
                pass
        for chunk in copied:  # restore's promise: its copies are done when it returns, even when it raises
            if chunk.event is not None:
                await asyncio.shield(asyncio.to_thread(backend.wait, chunk.event))
    return sizes


async def save(stager: Stager, source: Target, event: Any, send: Send) -> list[Any]:
    """Send ``source``'s blocks chunk by chunk: a device-side gather and one copy to a host chunk, then the
    sends of that chunk, while the next chunk is gathered. Answers each chunk's ``send`` result."""
    backend = stager.backend
    backend.after(event)
    per_chunk = stager.blocks_per_chunk(source.block_bytes)
    sends: list[asyncio.Task[Any]] = []

    async def send_chunk(chunk: _Chunk, first: int, count: int) -> Any:
        try:
            await asyncio.to_thread(backend.wait, chunk.event)
            chunk.event = None
            return await send(first, count, chunk.host, source.block_bytes)
        finally:
            stager.release(chunk)

    try:
        for first in range(0, source.n_blocks, per_chunk):
            count = min(per_chunk, source.n_blocks - first)
            chunk = await stager.acquire()
            try:
                source.gather(backend, stager.staging(chunk), chunk.host, first, count)
                chunk.event = backend.record()
            except BaseException:
                stager.release(chunk)
                raise
            sends.append(asyncio.get_running_loop().create_task(send_chunk(chunk, first, count)))
        return [await task for task in sends]
    finally:
        for task in sends:  # a failure above: the sends already started still end before this returns
            if not task.done():
                await asyncio.wait([task])
            if not task.cancelled():
                task.exception()  # looked at: the first failure is the one raised


def _leading(sizes: Sequence[int | None]) -> int:
    return next((i for i, s in enumerate(sizes) if s is None), len(sizes))


def _compact(host: Any, slot: int, size: int, count: int) -> Any:
    """The first ``count`` blocks of ``size`` bytes received into slots of ``slot`` bytes, end to end (moved
    in place when a block is smaller than its slot; blocks normally fill their slots exactly)."""
    if size == slot:
        return host
    for i in range(1, count):
        host[i * size:(i + 1) * size] = host[i * slot:i * slot + size].clone()
    return host


__all__ = ["MODES", "BlockTensors", "CopyBackend", "CudaBackend", "FlatTarget", "HostBackend", "Ready", "Stager",
           "backend_for", "ready", "restore", "save", "target_of", "wants_staging"]
