"""SGLang's HiCache storage layer on a CPU, without SGLang's CUDA stack (tests/integrations/test_sglang.py).

``scripts/test`` installs ``sglang==0.5.23`` with ``--no-deps`` (scripts/_venv.sh, ``ensure_sglang``). Its storage
modules (``mem_cache/hicache_storage.py``, ``mem_cache/storage/backend_factory.py``, the ``seaweedfs`` backend)
import only torch, boto3, msgspec and ``sglang.srt.environ``; the package's own ``__init__`` imports the whole
runtime (Triton, orjson, IPython, the kernels). :func:`load` registers the ``sglang`` package without running
that ``__init__`` — the modules under test are SGLang's own, imported from the installed wheel.

SGLang's real host pool (``MHATokenToKVPoolHost``) allocates through its CUDA/CPU kernels module, which needs
Triton. :class:`HostPool` is the smallest faithful stand-in: the same buffer shapes as its ``init_kv_buffer``
and SGLang's own ``get_page_buffer_meta`` (the zero-copy interface's page map), compiled from the installed
source, running on the stand-in's buffer.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
import types
from pathlib import Path
from typing import Any

SGLANG_VERSION = "0.5.23"


def load() -> str | None:
    """Make SGLang's storage modules importable; the reason they are not, or None."""
    if "sglang" not in sys.modules:
        spec = importlib.util.find_spec("sglang")
        if spec is None or not spec.submodule_search_locations:
            return "sglang is not installed (scripts/test installs it: scripts/_venv.sh, ensure_sglang)"
        package = types.ModuleType("sglang")
        package.__path__ = list(spec.submodule_search_locations)
        package.__spec__ = spec
        sys.modules["sglang"] = package
    try:
        import sglang.srt.mem_cache.storage.backend_factory  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        return f"SGLang's storage modules do not import here: {exc!r}"
    return None


def source_path(relative: str) -> Path:
    return Path(sys.modules["sglang"].__path__[0]) / relative


def sglang_function(relative: str, name: str, cls: str | None = None, namespace: dict[str, Any] | None = None
                    ) -> Any:
    """Function ``name`` (a method of class ``cls``) from SGLang's installed source ``relative``, compiled alone."""
    tree = ast.parse(source_path(relative).read_text())
    body = tree.body
    if cls is not None:
        body = next(n for n in body if isinstance(n, ast.ClassDef) and n.name == cls).body
    node = next(n for n in body if isinstance(n, ast.FunctionDef) and n.name == name)
    scope: dict[str, Any] = dict(namespace or {})
    exec(compile(ast.Module([node], []), str(source_path(relative)), "exec"), scope)
    return scope[name]


_page_buffer_meta = None
_flat_page: dict[str, Any] = {}


class HostPool:
    """An MHA host KV pool as SGLang lays it out (``MHATokenToKVPoolHost.init_kv_buffer``), with its
    ``get_page_buffer_meta``."""

    def __init__(self, layout: str, *, pages: int = 256, page_size: int = 4, layer_num: int = 3,
                 head_num: int = 2, head_dim: int = 16, dtype: Any = None) -> None:
        import torch

        global _page_buffer_meta
        if _page_buffer_meta is None:
            _page_buffer_meta = sglang_function("srt/mem_cache/pool_host/mha.py", "get_page_buffer_meta",
                                                "MHATokenToKVPoolHost")
        self.layout = layout
        self.page_size, self.layer_num, self.head_num, self.head_dim = page_size, layer_num, head_num, head_dim
        self.dtype = dtype or torch.bfloat16
        self.size = pages * page_size
        if layout == "layer_first":
            dims = (2, layer_num, self.size, head_num, head_dim)
        elif layout == "page_first":
            dims = (2, self.size, layer_num, head_num, head_dim)
        else:
            raise ValueError(layout)
        self.kv_buffer = torch.zeros(dims, dtype=self.dtype)

    def get_page_buffer_meta(self, indices: Any) -> tuple[list[int], list[int]]:
        return _page_buffer_meta(self, indices)  # type: ignore[misc]

    # The copying interface's flat pages, SGLang's own methods (what its controller hands batch_set/batch_get).
    def get_data_page(self, index: int, flat: bool = True) -> Any:
        return self._sglang("get_data_page")(self, index, flat)

    def get_dummy_flat_data_page(self) -> Any:
        self.device, self.pin_memory = "cpu", False
        return self._sglang("get_dummy_flat_data_page")(self)

    @staticmethod
    def _sglang(name: str) -> Any:
        if name not in _flat_page:
            import torch

            _flat_page[name] = sglang_function("srt/mem_cache/pool_host/mha.py", name, "MHATokenToKVPoolHost",
                                               namespace={"torch": torch})
        return _flat_page[name]

    def fill_random(self, seed: int) -> None:
        import torch

        gen = torch.Generator().manual_seed(seed)
        raw = self.kv_buffer.view(-1).view(torch.int16)
        raw.copy_(torch.randint(-2**12, 2**12, raw.shape, generator=gen, dtype=torch.int16))

    def indices(self, first_page: int, n_pages: int) -> Any:
        import torch

        return torch.arange(first_page * self.page_size, (first_page + n_pages) * self.page_size, dtype=torch.int64)

    def page_bytes(self, host_indices: Any) -> list[bytes]:
        """Each page's buffers back to back (what one object holds)."""
        import ctypes

        pointers, sizes = self.get_page_buffer_meta(host_indices)
        n = len(host_indices) // self.page_size
        per = len(pointers) // n
        return [b"".join(ctypes.string_at(p, s) for p, s in zip(pointers[i * per:(i + 1) * per],
                                                               sizes[i * per:(i + 1) * per])) for i in range(n)]


def storage_config(extra: dict[str, Any], *, layout: str = "page_first", model: str = "Qwen/Qwen3-0.6B",
                   tp_rank: int = 0, tp_size: int = 1, mla: bool = False) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=mla,
        enable_storage_metrics=False, is_page_first_layout=layout.startswith("page_first"), model_name=model,
        extra_config=dict(extra))
