"""A namespace's repr says which one it is (bucket, model, fingerprint, block size, scheme), for the sync and
the async client alike, and never shows a fingerprint's secret salt."""

from __future__ import annotations

import asyncio

from support.nodes import ACCESS_KEY, SECRET_KEY, free_port

from ctxstore import AsyncContextStore, ContextStore
from ctxstore.hashing import Fingerprint

NODES = "127.0.0.1:1"  # create=False: no request is made


def test_sync_namespace_repr() -> None:
    with ContextStore(f"127.0.0.1:{free_port()}", access_key=ACCESS_KEY, secret_key=SECRET_KEY) as store:
        ns = store.namespace("kv-llama3", model="meta-llama/Llama-3-8B", block_size=32, scheme="dynamo",
                             create=False, kv_dtype="bfloat16", tenant_salt="s3cr3t-salt")
    digest = Fingerprint(model="meta-llama/Llama-3-8B", block_size=32, kv_dtype="bfloat16",
                         tenant_salt="s3cr3t-salt").hexdigest()
    assert repr(ns) == (f"Namespace(bucket='kv-llama3', model='meta-llama/Llama-3-8B', fingerprint='{digest[:12]}', "
                        "block_size=32, scheme='dynamo')")
    assert "s3cr3t" not in repr(ns)


def test_async_namespace_repr() -> None:
    async def run() -> str:
        async with AsyncContextStore(NODES, access_key=ACCESS_KEY, secret_key=SECRET_KEY) as store:
            return repr(await store.namespace("kv-a", model="m", create=False))

    digest = Fingerprint(model="m").hexdigest()
    assert asyncio.run(run()) == (f"AsyncNamespace(bucket='kv-a', model='m', fingerprint='{digest[:12]}', "
                                  "block_size=16, scheme='xxh3-128')")
