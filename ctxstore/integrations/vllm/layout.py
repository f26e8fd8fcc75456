"""A paged KV cache's blocks as byte pieces: what one ctxstore object per vLLM block is made of.

vLLM registers one tensor per attention layer (``register_kv_caches``). Whatever the backend's physical layout,
block ``b`` of a layer is ``tensor.select(block_dim, b)``; where that is not contiguous (a ``[2, blocks, ...]``
K/V-split layout) it is cut into the fewest contiguous sub-tensors. The object for block ``b`` is the
concatenation of every layer's pieces, in layer order: a restore scatters it straight into those pieces
(:class:`ctxstore.buffers.Scatter`), a save gathers them.

Host caches are read into and out of directly (a :class:`ctxstore.buffers.Scatter` per block). Caches on a GPU
(and host caches when staging is forced) go through the client's staging pool (:mod:`ctxstore.staging`) as a
:class:`PagedTarget`: block-compact chunks copied to the device whole, then one ``index_copy_`` per layer into
the cache (``index_select`` per layer for a save), so the bytes of an object are the same either way.

vLLM 0.32 hands every backend's cache over as one ``[B, H, N, C]`` view per layer of a flat buffer, strided by
the ``KVCacheLayout`` (``LBHNC``, ``LBNHC``, ``LHBNC``, ``BLHNC``, ``BLNHC``, ``BHLNC``), with kernel blocks that
subdivide a cache block (grouped here as vLLM's ``group_kernel_blocks`` does) and padded pages (the padding is not
in the view, nor in the object); ``tests/integrations/vllm_driver.py layouts`` checks them all with vLLM's own
``create_kv_cache_views``. Older split layouts (FlashAttention's ``[2, num_blocks, ...]``) are cut into pieces.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["PagedLayout", "PagedTarget", "contiguous_pieces"]


def contiguous_pieces(t: torch.Tensor) -> list[torch.Tensor]:
    """``t`` as the fewest contiguous tensors whose bytes, in order, are ``t``'s elements in row-major order."""
    if t.is_contiguous():  # a 0-d tensor always is
        return [t]
    return [piece for sub in t.unbind(0) for piece in contiguous_pieces(sub)]


def _block_dim(shape: Sequence[int], num_blocks: int) -> int:
    # Blocks are the outermost dimension in vLLM's CPU layout and in most GPU ones; FlashAttention puts K/V first.
    for dim in (0, 1):
        if dim < len(shape) and shape[dim] == num_blocks:
            return dim
    raise ValueError(f"no dimension of {tuple(shape)} holds {num_blocks} blocks")


@dataclass(frozen=True)
class PagedLayout:
    """Where each block's bytes live in the registered KV tensors (one per layer, in model order)."""

    layer_names: tuple[str, ...]
    tensors: tuple[torch.Tensor, ...]
    block_dims: tuple[int, ...]
    num_blocks: int
    block_bytes: int  # one object: every layer's bytes of one block

    @classmethod
    def from_kv_caches(cls, kv_caches: Mapping[str, torch.Tensor], num_blocks: int) -> PagedLayout:
        """The layout of vLLM's registered caches; a layer whose first dimension holds ``k * num_blocks`` kernel
        blocks (vLLM's kernel block size below the cache block size) is viewed as ``[num_blocks, k, ...]``."""
        if not kv_caches:
            raise ValueError("no KV cache tensors were registered")
        names, tensors, dims = [], [], []
        devices = {t.device for t in kv_caches.values()}
        if len(devices) > 1 or next(iter(devices)).type not in ("cpu", "cuda"):
            raise NotImplementedError(f"KV caches on {sorted(map(str, devices))}: one CPU or CUDA device is supported")
        for name, t in kv_caches.items():
            if t.shape[0] > num_blocks and t.shape[0] % num_blocks == 0:
                t = t.unflatten(0, (num_blocks, -1))  # kernel blocks: a view whatever the strides
            names.append(name)
            tensors.append(t)
            dims.append(_block_dim(t.shape, num_blocks))
        block_bytes = sum(t.select(d, 0).numel() * t.element_size() for t, d in zip(tensors, dims))
        return cls(tuple(names), tuple(tensors), tuple(dims), num_blocks, block_bytes)

    @property
    def num_layers(self) -> int:
        return len(self.tensors)

    @property
    def device(self) -> torch.device:
        return self.tensors[0].device

    def target(self, block_ids: Sequence[int]) -> PagedTarget:
        """These blocks as a staging target: object ``i`` of a transfer is cache block ``block_ids[i]``."""
        return PagedTarget(self, block_ids)

    @property
    def pieces_per_block(self) -> int:
        return sum(len(contiguous_pieces(t.select(d, 0))) for t, d in zip(self.tensors, self.block_dims))

    def describe(self) -> str:
        """Shape, dtype and strides of one block of one layer, with the block axis named: for fingerprints."""
        t, d = self.tensors[0], self.block_dims[0]
        shape = ["B" if i == d else str(n) for i, n in enumerate(t.shape)]
        return f"[{','.join(shape)}]{str(t.dtype).removeprefix('torch.')}x{self.num_layers}"

    def block_pieces(self, block_id: int) -> list[torch.Tensor]:
        """Every layer's bytes of block ``block_id``, as views into the KV cache, in object order."""
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block {block_id} outside the cache's {self.num_blocks} blocks")
        return [piece for t, d in zip(self.tensors, self.block_dims)
                for piece in contiguous_pieces(t.select(d, block_id))]

    def gather(self, block_ids: Sequence[int], out: torch.Tensor | None = None) -> torch.Tensor:
        """A copy of the blocks, ``[len(block_ids), block_bytes]`` uint8: what a save sends (one copy per layer)."""
        if out is None:
            out = torch.empty((len(block_ids), self.block_bytes), dtype=torch.uint8, device=self.device)
        self.gather_rows(out, torch.tensor(list(block_ids), dtype=torch.long, device=self.device))
        return out

    @functools.cached_property
    def _byte_layers(self) -> list[tuple[torch.Tensor, int, tuple[int, ...], int]]:
        """Per layer: its bytes (a uint8 view, block axis kept: every vLLM layout keeps the last axis contiguous,
        so fp8 and bf16 caches are handled alike), the block axis, one block's shape in bytes, and its size."""
        layers = []
        for t, d in zip(self.tensors, self.block_dims):
            raw = t.view(torch.uint8)
            block = raw.select(d, 0)
            layers.append((raw, d, tuple(block.shape), block.numel()))
        return layers

    def gather_rows(self, rows: torch.Tensor, index: torch.Tensor) -> None:
        """Block ``index[i]`` of every layer into ``rows[i]`` (``[len(index), block_bytes]`` uint8), in object
        order: one ``index_select`` per layer."""
        offset = 0
        for raw, d, shape, n in self._byte_layers:
            rows[:, offset:offset + n].view(len(index), *shape).copy_(raw.index_select(d, index).movedim(d, 0))
            offset += n

    def scatter_rows(self, rows: torch.Tensor, index: torch.Tensor) -> None:
        """The mirror of :meth:`gather_rows`: object ``rows[i]`` into block ``index[i]``, one ``index_copy_``
        per layer."""
        offset = 0
        for raw, d, shape, n in self._byte_layers:
            raw.index_copy_(d, index, rows[:, offset:offset + n].view(len(index), *shape).movedim(0, d))
            offset += n


class PagedTarget:
    """Blocks of a paged cache as a :class:`ctxstore.staging.Target`: a chunk of objects lands in the device
    staging buffer whole, then :meth:`PagedLayout.scatter_rows` puts each into its block (a save: the chunk's
    blocks gathered into the buffer with :meth:`PagedLayout.gather_rows`, then one copy to the host)."""

    exact = True  # an object of another size was not written in this layout: never copied

    def __init__(self, layout: PagedLayout, block_ids: Sequence[int]) -> None:
        for b in block_ids:
            if not 0 <= b < layout.num_blocks:
                raise IndexError(f"block {b} outside the cache's {layout.num_blocks} blocks")
        self.layout = layout
        self.block_ids = list(block_ids)
        self.n_blocks = len(self.block_ids)
        self.block_bytes = layout.block_bytes
        self.device = layout.device
        self.index = torch.tensor(self.block_ids, dtype=torch.long, device=self.device)

    def scatter(self, backend: Any, staging: Any, chunk: torch.Tensor, first: int, count: int, size: int) -> None:
        buffer = staging()
        rows = buffer[:count * size].view(count, size)
        index = self.index[first:first + count]

        def into_cache() -> None:
            buffer[:count * size].copy_(chunk[:count * size], non_blocking=True)
            self.layout.scatter_rows(rows, index)

        backend.submit(into_cache)

    def gather(self, backend: Any, staging: Any, chunk: torch.Tensor, first: int, count: int) -> None:
        buffer = staging()
        nbytes = count * self.block_bytes
        rows = buffer[:nbytes].view(count, self.block_bytes)
        index = self.index[first:first + count]

        def out_of_cache() -> None:
            self.layout.gather_rows(rows, index)
            chunk[:nbytes].copy_(buffer[:nbytes], non_blocking=True)

        backend.submit(out_of_cache)

    def block(self, index: int, size: int) -> list[torch.Tensor]:
        return self.layout.block_pieces(self.block_ids[index])
