"""A paged KV cache's blocks as byte pieces: what one ctxstore object per vLLM block is made of.

vLLM registers one tensor per attention layer (``register_kv_caches``). Whatever the backend's physical layout,
block ``b`` of a layer is ``tensor.select(block_dim, b)``; where that is not contiguous (a ``[2, blocks, ...]``
K/V-split layout) it is cut into the fewest contiguous sub-tensors. The object for block ``b`` is the
concatenation of every layer's pieces, in layer order: a restore scatters it straight into those pieces
(:class:`ctxstore.buffers.Scatter`), a save gathers them.

Layouts tested: vLLM's CPU attention backend, ``[num_blocks, kv_heads, block_size, 2 * head_dim]`` per layer
(K and V packed per head; ``KVCacheLayout.LBHNC``), one contiguous piece per layer and block. The splitting
also covers GPU layouts such as FlashAttention's ``[2, num_blocks, block_size, kv_heads, head_dim]`` (two pieces
per layer); moving those bytes through host memory (a pinned bounce buffer and a device copy per block) is the
part a GPU build would add, since the client reads into host memory only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

__all__ = ["PagedLayout", "contiguous_pieces"]


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
        for name, t in kv_caches.items():
            if t.device.type != "cpu":
                raise NotImplementedError(f"KV cache on {t.device}: only host-memory caches are supported")
            if t.shape[0] != num_blocks and t.shape[0] % num_blocks == 0 and t.is_contiguous():
                t = t.unflatten(0, (num_blocks, -1))
            names.append(name)
            tensors.append(t)
            dims.append(_block_dim(t.shape, num_blocks))
        block_bytes = sum(t.select(d, 0).numel() * t.element_size() for t, d in zip(tensors, dims))
        return cls(tuple(names), tuple(tensors), tuple(dims), num_blocks, block_bytes)

    @property
    def num_layers(self) -> int:
        return len(self.tensors)

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
        n = len(block_ids)
        if out is None:
            out = torch.empty((n, self.block_bytes), dtype=torch.uint8)
        index = torch.tensor(list(block_ids), dtype=torch.long)
        offset = 0
        for t, d in zip(self.tensors, self.block_dims):
            layer = t.index_select(d, index).movedim(d, 0)  # [n, ...] in block order
            flat = layer.contiguous().view(n, -1).view(torch.uint8)
            size = flat.shape[1]
            out[:, offset:offset + size].copy_(flat)
            offset += size
        return out
