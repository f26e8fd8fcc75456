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
        raise ConfigurationError("restore into GPU tensors is not supported: pass a (pinned) CPU tensor and copy")
    if not tensor.is_contiguous():
        raise ConfigurationError("tensors must be contiguous")
    import torch  # only reached when the caller already uses torch

    return tensor.detach().reshape(-1).view(torch.uint8).numpy()


class Destinations:
    """Where restored block ``i`` goes: the caller's per-block buffers, slots of one big buffer, or new memory."""

    def __init__(self, out: Any, n_blocks: int) -> None:
        self.n_blocks = n_blocks
        self.error: str | None = None
        self._per_block: list[memoryview] | None = None
        self._arena: memoryview | None = None
        self._slot = 0
        if out is None:
            return
        if isinstance(out, (list, tuple)):
            if len(out) < n_blocks:
                raise ConfigurationError(f"out has {len(out)} buffers for {n_blocks} blocks")
            self._per_block = [byte_view(b, writable=True) for b in out[:n_blocks]]
        else:
            self._arena = byte_view(out, writable=True)
            self._slot = len(self._arena) // n_blocks if n_blocks else 0

    def view(self, index: int, size: int) -> memoryview | None:
        """A writable view of exactly ``size`` bytes for block ``index``, or None if it cannot hold it."""
        if self._per_block is not None:
            target = self._per_block[index]
            if len(target) < size:
                self.error = f"out[{index}] holds {len(target)} bytes; the block has {size}"
                return None
            return target[:size]
        if self._arena is not None:
            if size > self._slot:
                self.error = f"out holds {self._slot} bytes per block; the block has {size}"
                return None
            start = index * self._slot
            return self._arena[start:start + size]
        return memoryview(bytearray(size))
