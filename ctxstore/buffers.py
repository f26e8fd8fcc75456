"""Turning what callers hand us (bytes, bytearray, memoryview, numpy arrays, torch CPU tensors) into flat
byte views, without copying and without importing numpy or torch."""

from __future__ import annotations

from typing import Any

from .errors import ConfigurationError


def byte_view(obj: Any, *, writable: bool = False) -> memoryview:
    """A flat, C-contiguous ``memoryview`` of unsigned bytes over ``obj``'s memory (no copy)."""
    if type(obj).__module__.startswith("torch"):
        obj = _torch_to_numpy(obj)
    if hasattr(obj, "__array_interface__") and hasattr(obj, "view"):  # numpy (and ml_dtypes) arrays
        if not obj.flags["C_CONTIGUOUS"]:
            raise ConfigurationError("arrays must be C-contiguous")
        obj = obj.reshape(-1).view("u1")
    try:
        view = memoryview(obj)
    except TypeError:
        raise ConfigurationError(f"{type(obj).__name__} does not expose a buffer") from None
    if not view.c_contiguous:
        raise ConfigurationError("buffers must be C-contiguous")
    if writable and view.readonly:
        raise ConfigurationError(f"{type(obj).__name__} is read-only: pass a writable buffer")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def _torch_to_numpy(tensor: Any) -> Any:
    if tensor.device.type != "cpu":
        raise ConfigurationError(f"a tensor on {tensor.device} has no host buffer: tensors on a GPU go through the "
                                 "staging pool (Namespace.restore/save, get_keys_staged/put_keys_staged)")
    if not tensor.is_contiguous():
        raise ConfigurationError("tensors must be contiguous")
    import torch  # only reached when the caller already uses torch

    return tensor.detach().reshape(-1).view(torch.uint8).numpy()


class Scatter:
    """One block's destination in several pieces, filled in order: the block's first ``len(pieces[0])`` bytes
    land in ``pieces[0]``, the next ones in ``pieces[1]``... (e.g. one piece per layer of a paged KV cache,
    where one object holds a block of every layer). ``len()`` is the total size; ``bytes()`` joins a copy."""

    __slots__ = ("pieces", "nbytes")

    def __init__(self, pieces: list[Any] | tuple[Any, ...]) -> None:
        views = [byte_view(p, writable=True) for p in pieces]
        self.pieces = [v for v in views if len(v)]  # an empty piece would be an empty read buffer
        self.nbytes = sum(len(v) for v in self.pieces)

    def __len__(self) -> int:
        return self.nbytes

    def __bytes__(self) -> bytes:
        return b"".join(self.pieces)

    def head(self, size: int) -> Scatter:
        """The first ``size`` bytes of this destination (``size <= len(self)``), as a Scatter."""
        out = Scatter(())
        left = size
        for piece in self.pieces:
            if left <= 0:
                break
            out.pieces.append(piece[:left])
            left -= len(out.pieces[-1])
        out.nbytes = size
        return out


#: Where one restored block lands: one contiguous view, or a :class:`Scatter` of several.
Target = memoryview | Scatter


class Destinations:
    """Where restored block ``i`` goes: the caller's per-block buffers (each one buffer, or a list of buffers
    the block is scattered over in order), slots of one big buffer, or new memory."""

    def __init__(self, out: Any, n_blocks: int) -> None:
        self.n_blocks = n_blocks
        self.error: str | None = None
        self._per_block: list[Target] | None = None
        self._arena: memoryview | None = None
        self._slot = 0
        if out is None:
            return
        if isinstance(out, (list, tuple)):
            if len(out) < n_blocks:
                raise ConfigurationError(f"out has {len(out)} buffers for {n_blocks} blocks")
            self._per_block = [_target(b) for b in out[:n_blocks]]
        else:
            self._arena = byte_view(out, writable=True)
            self._slot = len(self._arena) // n_blocks if n_blocks else 0

    def capacity(self, index: int) -> int | None:
        """The most bytes block ``index`` can take, or None when new memory is allocated for it."""
        if self._per_block is not None:
            return len(self._per_block[index])
        if self._arena is not None:
            return self._slot
        return None

    def follows(self, index: int, size: int, following: int, following_size: int) -> bool:
        """Whether block ``following`` (of ``following_size`` bytes) fits the slot that starts right where
        ``size`` bytes of block ``index`` end: then both can be received with one read (:meth:`span`). Only
        known for slots of one buffer."""
        return (self._arena is not None and following == index + 1 and size == self._slot
                and following_size <= self._slot)

    def span(self, index: int, nbytes: int) -> memoryview:
        """``nbytes`` of the buffer from block ``index``'s slot on (blocks that :meth:`follows` each other)."""
        assert self._arena is not None
        start = index * self._slot
        return self._arena[start:start + nbytes]

    def view(self, index: int, size: int) -> Target | None:
        """A writable view of exactly ``size`` bytes for block ``index``, or None if it cannot hold it."""
        if self._per_block is not None:
            target = self._per_block[index]
            if len(target) < size:
                self.error = f"out[{index}] holds {len(target)} bytes; the block has {size}"
                return None
            return target.head(size) if isinstance(target, Scatter) else target[:size]
        if self._arena is not None:
            if size > self._slot:
                self.error = f"out holds {self._slot} bytes per block; the block has {size}"
                return None
            start = index * self._slot
            return self._arena[start:start + size]
        return memoryview(bytearray(size))


def _target(obj: Any) -> Target:
    if isinstance(obj, Scatter):
        return obj
    if isinstance(obj, (list, tuple)):
        return Scatter(obj)
    return byte_view(obj, writable=True)
