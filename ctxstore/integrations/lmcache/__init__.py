"""LMCache's remote tier on ctxstore's bulk API: a remote-storage plugin for LMCache 0.5.6, no patch to LMCache.

LMCache config (YAML, or the ``LMCACHE_*`` environment)::

    chunk_size: 256
    local_cpu: true
    max_local_cpu_size: 5
    remote_serde: naive
    remote_storage_plugins: ["ctxstore"]
    extra_config:
      remote_storage_plugin.ctxstore.module_path: ctxstore.integrations.lmcache
      remote_storage_plugin.ctxstore.class_name: CtxStoreConnectorAdapter
      ctxstore.nodes: "node-a:9000,node-b:9000,node-c:9000"     # or CTXSTORE_NODES
      ctxstore.bucket: lmcache
      # ctxstore.access_key / ctxstore.secret_key (or CTXSTORE_ACCESS_KEY / CTXSTORE_SECRET_KEY),
      # ctxstore.ttl, ctxstore.pin_seconds, ctxstore.read_timeout, ctxstore.call_timeout

What it does (:mod:`.connector`): LMCache's batched contains is one bulk ``lookup`` per node answering the
longest cached prefix (pinning it when LMCache asks for a pin), batched get is one bulk ``get`` per node read
straight into LMCache's memory objects, batched put one bulk ``put`` per node. Importing this package does not
import LMCache until ``CtxStoreConnectorAdapter`` is looked up.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CtxStoreConnectorAdapter", "CtxStoreRemoteConnector"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import connector

        return getattr(connector, name)
    raise AttributeError(name)
