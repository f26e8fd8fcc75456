"""Save a Hugging Face causal LM's KV cache as ctxstore blocks; rebuild a cache from the longest prefix.

    from ctxstore import ContextStore
    from ctxstore.integrations.transformers import KVNamespace, cache_kwarg
    from transformers import DynamicCache

    store = ContextStore("node-a:9000,node-b:9000,node-c:9000", access_key=AK, secret_key=SK)
    kv = KVNamespace.open(store, "kv-llama", model, model_id="meta-llama/Llama-3.2-1B", revision=COMMIT)
    kw = cache_kwarg(model)          # "cache" (transformers >= 5.2x) or "past_key_values"

    # worker A, after its prefill:
    cache = DynamicCache()
    model(input_ids, use_cache=True, **{kw: cache})     # transformers fills its own cache object
    kv.save(tokens, cache)                               # one object per full block of tokens

    # worker B, before its prefill:
    restored = kv.restore(tokens)                        # the longest cached prefix, as a DynamicCache
    out = model(input_ids[:, restored.n_tokens:], use_cache=True, **{kw: restored.cache})

Block layout
------------
One object per block of ``block_size`` tokens holds every layer's K and V for those tokens, C-contiguous, in
the cache's dtype (native byte order: little-endian on every platform torch supports)::

    block[t][layer][kv][head][d]     t < block_size, layer < num_layers, kv: 0 = K, 1 = V,
                                     head < num_kv_heads, d < head_dim

so a block is ``block_size * num_layers * 2 * num_kv_heads * head_dim * itemsize`` bytes
(``KVLayout.block_bytes``). K is stored as the cache holds it, after the rotary embedding of its position; a
prefix always starts at position 0, so a restored block is valid exactly where it was saved.

The token axis is outermost on purpose. ``restore`` lands the blocks end to end in one preallocated tensor
(one ``ns.restore(tokens, out=tensor)`` call, one equal slot per block), which is then a single tensor
``[n_tokens, num_layers, 2, num_kv_heads, head_dim]``, so layer ``l``'s keys in transformers' shape
``[1, num_kv_heads, n_tokens, head_dim]`` are the strided *view* ``buffer[:, l, 0].permute(1, 0, 2)[None]``:
the cache is rebuilt without copying a byte. (A head-major block ``[layer][kv][head][t][d]`` would need a
gather copy per layer to join blocks along the token axis.) The next forward pass appends to each layer with
``torch.cat``, which makes the layer contiguous again, as it does in any ``DynamicCache``.

Namespaces
----------
:func:`namespace_fields` derives the namespace fingerprint from the model config: architecture, number of
layers, KV heads, head dim, the KV dtype, this block layout, and a digest of the whole config (rope
parameters, norms, vocabulary...), so two different models never share blocks, even in one bucket. Two
checkpoints with the same config but different weights differ only by ``model_id`` and ``revision``: pass
them (the default ``model_id`` is the config's ``name_or_path``).

Only caches whose every layer holds the full history are supported: ``DynamicLayer`` and ``StaticLayer``
(Llama, Mistral without a sliding window, Qwen2/3, Phi-3...). Sliding-window, chunked, linear-attention and
quantized layers keep only part of the history and are refused with ``NotImplementedError``. One sequence per
call: ``save(..., batch_index=b)`` saves row ``b`` of a batched cache; a restored cache has batch size 1.

:class:`KVNamespace` wraps the synchronous :class:`~ctxstore.Namespace`. With the asyncio client use the same
pieces: ``blocks = layout.pack(cache, n)`` then ``await ans.save(tokens, list(blocks.view(n, -1)))``;
``buf = layout.empty(n)``, ``await ans.restore(tokens, out=buf)``, ``layout.unpack(buf, n_tokens)``.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from ..core import SaveResult
from ..errors import ConfigurationError
from ..sync import ContextStore, Namespace

__all__ = [
    "KV_LAYOUT",
    "KVLayout",
    "KVNamespace",
    "RestoredCache",
    "cache_from_tensors",
    "cache_kwarg",
    "cache_tensors",
    "config_fingerprint",
    "namespace_fields",
]

#: ``Fingerprint.kv_layout`` of blocks written by this module; bump the version if the layout ever changes.
KV_LAYOUT = "hf-token-major/v1:[block_size][layer][k,v][kv_head][head_dim]"

# Config keys that do not change the KV a model computes (bookkeeping, output switches, tokenizer ids, the
# checkpoint's name and dtype, which enter the fingerprint on their own).
_VOLATILE_CONFIG_KEYS = frozenset({
    "_attn_implementation", "_attn_implementation_autoset", "_attn_implementation_internal", "_commit_hash",
    "_experts_implementation", "_name_or_path", "name_or_path", "architectures", "transformers_version",
    "dtype", "torch_dtype", "use_cache", "output_attentions", "output_hidden_states", "output_scores",
    "return_dict", "return_dict_in_generate", "torchscript", "id2label", "label2id", "num_labels",
    "problem_type", "finetuning_task", "task_specific_params", "tokenizer_class", "prefix", "bos_token_id",
    "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id", "chunk_size_feed_forward",
    "tf_legacy_loss", "use_bfloat16",
})


@dataclass(frozen=True)
class KVLayout:
    """The shape of one model's KV blocks (see the module docstring for the byte layout)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int = 16

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {value!r}")
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"KVLayout.dtype must be a torch.dtype, got {self.dtype!r}")

    @classmethod
    def from_config(cls, config: Any, *, dtype: torch.dtype | None = None, block_size: int = 16) -> KVLayout:
        """The layout of a transformers config (its text decoder's, for multimodal configs)."""
        config = _decoder_config(config)
        _check_full_attention(config)
        heads = int(config.num_attention_heads)
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or int(config.hidden_size) // heads
        if dtype is None:
            dtype = _config_dtype(config)
        return cls(int(config.num_hidden_layers), int(kv_heads), int(head_dim), dtype, block_size)

    @property
    def kv_dtype(self) -> str:
        """The dtype's name as it goes into the fingerprint: ``float32``, ``bfloat16``..."""
        return str(self.dtype).removeprefix("torch.")

    @property
    def token_shape(self) -> tuple[int, int, int, int]:
        """``(num_layers, 2, num_kv_heads, head_dim)``: one token's K and V over all layers."""
        return (self.num_layers, 2, self.num_kv_heads, self.head_dim)

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        return (self.block_size, *self.token_shape)

    @property
    def block_elements(self) -> int:
        return self.block_size * self.num_layers * 2 * self.num_kv_heads * self.head_dim

    @property
    def block_bytes(self) -> int:
        return self.block_elements * self.dtype.itemsize

    def empty(self, n_blocks: int, *, pin_memory: bool = False,
              device: torch.device | str | None = None) -> torch.Tensor:
        """An uninitialised buffer for ``n_blocks`` blocks, ``[n_blocks, *block_shape]``, on the CPU (``pin_memory``
        for a buffer whose cache goes on to a GPU) or on ``device``."""
        return torch.empty((n_blocks, *self.block_shape), dtype=self.dtype, pin_memory=pin_memory, device=device)

    def pack(self, cache: Any, n_blocks: int, *, batch_index: int = 0,
             out: torch.Tensor | None = None) -> torch.Tensor:
        """The first ``n_blocks`` blocks of ``cache`` in this layout, ``[n_blocks, *block_shape]``,
        C-contiguous on the cache's device (``result[i]`` is block ``i``): one strided copy per layer and K/V,
        into ``out`` if given (on any device)."""
        pairs = cache_tensors(cache)
        self._check(pairs, batch_index)
        n_tokens = n_blocks * self.block_size
        have = _seq_length(cache, pairs)
        if n_tokens > have:
            raise ValueError(f"{n_blocks} blocks need {n_tokens} tokens; the cache holds {have}")
        device = pairs[0][0].device if pairs else None
        buf = self.empty(n_blocks, device=device) if out is None else self._arena(out, n_blocks)
        flat = buf.view(n_tokens, *self.token_shape)
        for layer, (keys, values) in enumerate(pairs):
            flat[:, layer, 0].copy_(keys[batch_index, :, :n_tokens].transpose(0, 1))
            flat[:, layer, 1].copy_(values[batch_index, :, :n_tokens].transpose(0, 1))
        return buf

    def unpack(self, blocks: torch.Tensor, n_tokens: int, *, device: torch.device | str | None = None) -> Any:
        """A ``DynamicCache`` holding the first ``n_tokens`` tokens of ``blocks`` (a buffer in this layout,
        e.g. from :meth:`empty` after ``ns.restore(tokens, out=buffer)``). On the CPU its tensors are views of
        ``blocks``: nothing is copied. With another ``device`` each layer's K and V are copied there."""
        if blocks.dtype != self.dtype:
            raise ValueError(f"blocks are {blocks.dtype}; the layout is {self.dtype}")
        flat = blocks.reshape(-1, *self.token_shape)  # a view: the buffer is contiguous
        if not 0 <= n_tokens <= flat.shape[0]:
            raise ValueError(f"n_tokens={n_tokens} but the buffer holds {flat.shape[0]} tokens")
        flat = flat[:n_tokens]
        pairs = []
        for layer in range(self.num_layers):
            keys = flat[:, layer, 0].permute(1, 0, 2).unsqueeze(0)  # [1, kv_heads, n_tokens, head_dim] view
            values = flat[:, layer, 1].permute(1, 0, 2).unsqueeze(0)
            if device is not None and torch.device(device) != blocks.device:
                keys, values = keys.to(device), values.to(device)
            pairs.append((keys, values))
        return cache_from_tensors(pairs)

    def _check(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], batch_index: int) -> None:
        if len(pairs) != self.num_layers:
            raise ValueError(f"the cache has {len(pairs)} layers; the layout has {self.num_layers}")
        for layer, (keys, values) in enumerate(pairs):
            for name, t in (("keys", keys), ("values", values)):
                if t.dim() != 4 or t.shape[1] != self.num_kv_heads or t.shape[3] != self.head_dim:
                    raise ValueError(f"layer {layer} {name} have shape {tuple(t.shape)}; expected "
                                     f"[batch, {self.num_kv_heads}, tokens, {self.head_dim}]")
                if t.dtype != self.dtype:
                    raise ValueError(f"layer {layer} {name} are {t.dtype}; the layout is {self.dtype}")
                if not 0 <= batch_index < t.shape[0]:
                    raise ValueError(f"batch_index {batch_index} out of range for batch size {t.shape[0]}")

    def _arena(self, out: torch.Tensor, n_blocks: int) -> torch.Tensor:
        """``out`` (any shape and device; this dtype, contiguous) as ``[n_blocks, *block_shape]``: a view."""
        if not isinstance(out, torch.Tensor):
            raise ConfigurationError(f"out must be a torch tensor, got {type(out).__name__}")
        if out.dtype != self.dtype or not out.is_contiguous():
            raise ConfigurationError(f"out must be a contiguous tensor of {self.dtype}")
        need = n_blocks * self.block_elements
        if out.numel() < need:
            raise ConfigurationError(f"out holds {out.numel()} elements; {n_blocks} blocks need {need}")
        return out.view(-1)[:need].view(n_blocks, *self.block_shape)


@dataclass
class RestoredCache:
    """What :meth:`KVNamespace.restore` rebuilt."""

    #: A ``DynamicCache`` holding the first ``n_tokens`` tokens (empty when nothing was cached).
    cache: Any
    #: Tokens in ``cache``: run the model on ``tokens[n_tokens:]`` with it.
    n_tokens: int
    #: Blocks fetched from the pod (``n_tokens`` may end inside the last one, see ``max_tokens``).
    n_blocks: int
    #: The buffer the blocks landed in, ``[n_blocks, *layout.block_shape]``; on the CPU the cache's tensors
    #: are views of it.
    buffer: torch.Tensor


class KVNamespace:
    """A ctxstore :class:`~ctxstore.Namespace` bound to one model's KV layout: save and restore its caches."""

    def __init__(self, ns: Namespace, layout: KVLayout) -> None:
        if ns.block_size != layout.block_size:
            raise ConfigurationError(f"namespace block_size {ns.block_size} != layout's {layout.block_size}")
        self.ns = ns
        self.layout = layout
        self.block_size = layout.block_size

    @classmethod
    def open(cls, store: ContextStore, bucket: str, model_or_config: Any, *, model_id: str | None = None,
             revision: str = "", dtype: torch.dtype | None = None, block_size: int = 16,
             scheme: str = "xxh3-128", create: bool = True, config_digest: bool = True,
             **fingerprint: Any) -> KVNamespace:
        """The namespace of ``model_or_config`` (a ``PreTrainedModel`` or its config) in ``bucket``.

        Its fingerprint comes from :func:`namespace_fields`; further keywords (``tp_rank``, ``tenant_salt``, a
        LoRA adapter's name...) are added to it as for :meth:`ContextStore.namespace`."""
        layout, fields = namespace_fields(model_or_config, model_id=model_id, revision=revision, dtype=dtype,
                                          block_size=block_size, config_digest=config_digest)
        overlap = set(fields) & set(fingerprint)
        if overlap:
            raise ConfigurationError(f"fingerprint fields set by the model config: {sorted(overlap)}")
        ns = store.namespace(bucket, scheme=scheme, create=create, **fields, **fingerprint)
        return cls(ns, layout)

    def lookup(self, tokens: Any) -> int:
        """Number of leading full blocks of ``tokens`` the pod holds (tokens: ``n * block_size``)."""
        return self.ns.lookup(_token_list(tokens))

    def save(self, tokens: Any, cache: Any, *, ttl: float | None = None, batch_index: int = 0) -> SaveResult:
        """Save the full blocks of ``tokens`` that ``cache`` holds (cache position ``j`` holds ``tokens[j]``).

        ``tokens`` may run past the cache (e.g. the last sampled token, not yet fed back) or stop before its
        end; a trailing partial block is never saved. Blocks the pod already holds are skipped by the pod."""
        tokens, blocks = self._blocks(tokens, cache, batch_index)
        return self.ns.save(tokens, blocks, ttl) if len(blocks) else SaveResult()

    def park(self, tokens: Any, cache: Any, *, ttl: float, pin: float, batch_index: int = 0) -> SaveResult:
        """:meth:`save` with a long ``ttl``, and pin the blocks for ``pin`` seconds: a session waiting on a
        tool call. Blocks the pod already held (a shared prompt saved earlier) get the longer TTL too (a pin
        protects from eviction, not from expiry). Any worker resumes the session with :meth:`restore`."""
        tokens, blocks = self._blocks(tokens, cache, batch_index)
        if not len(blocks):
            return SaveResult()
        result = self.ns.park(tokens, blocks, ttl=ttl, pin=pin)
        if result.existed:
            self.ns.touch(tokens, ttl)  # extends, never shortens
        return result

    def _blocks(self, tokens: Any, cache: Any, batch_index: int) -> tuple[list[int], Any]:
        """The tokens of the full blocks that ``cache`` holds, and those blocks: one tensor, a block per row, on
        the cache's device (from a GPU the client stages it to the host a chunk at a time)."""
        tokens = _token_list(tokens)
        n_blocks = min(len(tokens), _seq_length(cache, cache_tensors(cache))) // self.block_size
        if n_blocks == 0:
            return [], torch.empty((0, self.layout.block_bytes), dtype=torch.uint8)
        packed = self.layout.pack(cache, n_blocks, batch_index=batch_index)
        return tokens[:n_blocks * self.block_size], packed.view(n_blocks, -1)

    def restore(self, tokens: Any, *, max_tokens: int | None = None, out: torch.Tensor | None = None,
                pin: float = 0.0, device: torch.device | str | None = None) -> RestoredCache:
        """Rebuild a cache from the longest cached prefix of ``tokens``, in one ``ns.restore`` call.

        ``max_tokens`` bounds the restored tokens; by default ``len(tokens) - 1``, so at least the last token
        is left for the caller's forward pass, which yields the logits of the next token. The cache is then
        cut inside the last block (a view, no copy). Pass ``max_tokens=len(tokens)`` when you need no logits.

        The blocks land in ``out`` (a contiguous tensor of the layout's dtype with room for the full blocks of
        the first ``max_tokens`` tokens, rounded up to a block; on the CPU, or on a GPU) or in a new tensor on
        ``device`` (default: the CPU). A GPU buffer is filled through the client's staging pool (pinned host
        chunks, one copy per chunk), and the cache's tensors are views of it. ``pin``: protect the fetched blocks
        from eviction for that many seconds. ``device`` with a CPU ``out``: the cache's tensors are copied
        there, layer by layer."""
        tokens = _token_list(tokens)
        limit = len(tokens) - 1 if max_tokens is None else min(max_tokens, len(tokens))
        limit = max(limit, 0)
        bs = self.block_size
        n_fetch = min(len(tokens) // bs, -(-limit // bs))
        if out is None:
            buffer = self.layout.empty(n_fetch, device=device)
        else:
            buffer = self.layout._arena(out, n_fetch)
        if n_fetch == 0:
            return RestoredCache(cache_from_tensors([]), 0, 0, buffer)
        result = self.ns.restore(tokens[:n_fetch * bs], out=buffer, pin=pin)
        n_blocks = 0
        for view in result.blocks:  # a block of a foreign size (not written in this layout) ends the prefix
            if len(view) != self.layout.block_bytes:
                break
            n_blocks += 1
        n_tokens = min(n_blocks * bs, limit)
        target = None if device is None or torch.device(device) == buffer.device else device
        cache = self.layout.unpack(buffer, n_tokens, device=target) if n_tokens else cache_from_tensors([])
        return RestoredCache(cache, n_tokens, n_blocks, buffer[:n_blocks])

    def delete(self, tokens: Any) -> int:
        return self.ns.delete(_token_list(tokens))

    def unpin(self, tokens: Any) -> int:
        return self.ns.unpin(_token_list(tokens))


# ---------------------------------------------------------------------------------------------- fingerprint


def namespace_fields(model_or_config: Any, *, model_id: str | None = None, revision: str = "",
                     dtype: torch.dtype | None = None, block_size: int = 16,
                     config_digest: bool = True) -> tuple[KVLayout, dict[str, Any]]:
    """The KV layout of a model and the keyword arguments of ``store.namespace(bucket, **fields)`` for it.

    ``model``: ``model_id`` (default: the config's ``name_or_path``, else its architecture), ``revision``,
    ``kv_dtype`` (default: the model's parameter dtype, else the config's, else float32), ``kv_layout``
    (:data:`KV_LAYOUT`), ``block_size``; and into ``Fingerprint.extra``: ``arch``, ``n_layers``,
    ``n_kv_heads``, ``head_dim`` and ``config``, the :func:`config_fingerprint` (``config_digest=False``
    leaves it out: workers on different transformers versions, whose configs may list different default keys,
    then share blocks on the explicit fields alone)."""
    config = getattr(model_or_config, "config", model_or_config)
    if dtype is None and isinstance(model_or_config, torch.nn.Module):
        dtype = next(iter(model_or_config.parameters())).dtype
    layout = KVLayout.from_config(config, dtype=dtype, block_size=block_size)
    arch = _architecture(config)
    fields: dict[str, Any] = {
        "model": model_id or getattr(config, "name_or_path", "") or arch,
        "revision": revision,
        "kv_dtype": layout.kv_dtype,
        "kv_layout": KV_LAYOUT,
        "block_size": block_size,
        "arch": arch,
        "n_layers": str(layout.num_layers),
        "n_kv_heads": str(layout.num_kv_heads),
        "head_dim": str(layout.head_dim),
    }
    if config_digest:
        fields["config"] = config_fingerprint(config)
    return layout, fields


def config_fingerprint(config: Any) -> str:
    """16 hex characters: XXH3-64 of the config's canonical JSON (sorted keys) without the keys that do not
    change the KV (bookkeeping, output switches, token ids, name and dtype)."""
    data = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
    text = json.dumps(_strip(data), sort_keys=True, separators=(",", ":"), default=str)
    return xxhash.xxh3_64_hexdigest(text.encode("utf-8"))


def _strip(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _strip(v) for k, v in value.items() if k not in _VOLATILE_CONFIG_KEYS}
    if isinstance(value, (list, tuple)):
        return [_strip(v) for v in value]
    return value


def _architecture(config: Any) -> str:
    archs = getattr(config, "architectures", None)
    if archs:
        return ",".join(archs)
    return str(getattr(config, "model_type", "") or type(config).__name__)


def _decoder_config(config: Any) -> Any:
    getter = getattr(config, "get_text_config", None)
    if getter is None:
        return config
    try:
        return getter(decoder=True)
    except TypeError:
        return getter()


def _config_dtype(config: Any) -> torch.dtype:
    # transformers renamed torch_dtype to dtype (reading the old name warns): read the stored attributes
    for value in (getattr(config, "dtype", None), vars(config).get("torch_dtype")):
        if isinstance(value, torch.dtype):
            return value
        if isinstance(value, str) and isinstance(getattr(torch, value, None), torch.dtype):
            return getattr(torch, value)
    return torch.float32


def _check_full_attention(config: Any) -> None:
    """Refuse configs whose cache keeps only part of the history in some layer (same rule as transformers)."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        other = sorted({t for t in layer_types if t != "full_attention"})
        if other:
            raise NotImplementedError(f"layer types {other}: only full-attention layers are saved as blocks")
        return
    for name in ("sliding_window", "attention_chunk_size"):
        disabled = getattr(config, "use_sliding_window", True) is False
        if getattr(config, name, None) is not None and not disabled:
            raise NotImplementedError(f"config.{name} is set: sliding-window and chunked caches do not hold "
                                      "the full history, which blocks need")


# ---------------------------------------------------------------------------------------------- cache objects


def cache_tensors(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's ``(keys, values)``, shaped ``[batch, kv_heads, tokens, head_dim]``, from a transformers
    cache (``cache.layers`` of ``DynamicLayer``/``StaticLayer``) or the legacy tuple-of-tuples format."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        from transformers.cache_utils import DynamicLayer, StaticLayer

        pairs = []
        for i, layer in enumerate(layers):
            if type(layer) not in (DynamicLayer, StaticLayer):
                raise NotImplementedError(f"cache layer {i} is a {type(layer).__name__}: only DynamicLayer "
                                          "and StaticLayer hold the full history that blocks need")
            if layer.keys is None or not getattr(layer, "is_initialized", True):
                raise ValueError(f"cache layer {i} is empty")
            pairs.append((layer.keys, layer.values))
        return pairs
    if isinstance(cache, (tuple, list)):
        return [(kv[0], kv[1]) for kv in cache]
    raise TypeError(f"not a transformers KV cache: {type(cache).__name__}")


def cache_from_tensors(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    """A ``DynamicCache`` whose layer ``i`` holds ``pairs[i]`` as they are: the tensors are not copied."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    cache = DynamicCache()
    for keys, values in pairs:
        layer = DynamicLayer()
        try:
            layer.lazy_initialization(keys, values)
        except TypeError:  # transformers 4.5x: lazy_initialization(key_states), not the signature installed
            getattr(layer, "lazy_initialization")(keys)  # noqa: B009
        layer.keys, layer.values = keys, values
        cache.layers.append(layer)
    return cache


def cache_kwarg(model: Any) -> str:
    """The forward keyword that takes a cache: ``cache`` (transformers >= 5.2x) or ``past_key_values``."""
    forward = getattr(type(model), "forward", None) or model.forward
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def _seq_length(cache: Any, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> int:
    """Tokens the cache holds (a StaticLayer's tensors are longer than what is filled)."""
    get = getattr(cache, "get_seq_length", None)
    if get is not None:
        return int(get())
    return int(pairs[0][0].shape[-2]) if pairs else 0


def _token_list(tokens: Any) -> list[int]:
    if isinstance(tokens, torch.Tensor):
        if tokens.dim() == 2 and tokens.shape[0] == 1:
            tokens = tokens[0]
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be one sequence, got shape {tuple(tokens.shape)}")
        return tokens.tolist()
    tolist = getattr(tokens, "tolist", None)
    return list(tolist() if tolist is not None else tokens)
