"""One LMCache process for tests/integrations/test_lmcache.py, talking to ctxstore through LMCache's own, unmodified S3
code (awscrt, virtual-hosted style: the bucket is in the Host header ``<bucket>.<domain>:<port>``).

Usage: ``python worker.py MODE CONFIG.yaml DATA.pt [HOSTS_LINE ...]``, MODE one of

* ``store``: an ``LMCacheEngine`` (CONFIG = a plain LMCache engine config with ``remote_url: s3://...``)
  stores ``data["kv"][:, :, :stored]`` for ``data["tokens"][:stored]`` and waits until LMCache's remote
  backend has every chunk.
* ``retrieve``: a fresh engine (another OS process, so nothing in its local CPU cache) looks up all of
  ``data["tokens"]``, retrieves into a zero KV tensor and saves that tensor to ``DATA.pt.out``.
* ``l2``: LMCache's multiprocess-mode ``S3L2Adapter`` (CONFIG = its adapter config): store, lookup+lock,
  load, ``ListObjectsV2`` by model prefix, ``DELETE``, lookup and list again.

Each mode prints one ``REPORT {json}`` line. Exit status 77 means "cannot run here" (the reason is printed).

``HOSTS_LINE`` (``"127.0.0.1 bucket.localhost"``): awscrt resolves ``<bucket>.<domain>`` itself, with
getaddrinfo, and not every resolver maps ``*.localhost`` to loopback (glibc without nss-myhostname does not).
If a name does not resolve already, the process moves into a private mount namespace (and a user namespace
when not root) and bind-mounts a copy of /etc/hosts with the lines added over /etc/hosts: only this process
sees it; nothing on the system changes.

The one piece that is not LMCache's is :class:`CPUKVConnector`: LMCache 0.5.6 ships no GPU connector for CPU
tensors (``CreateGPUConnector`` ends in ``No supported cpu connector found`` on a CPU-only torch; its
``MockGPUConnector`` copies nothing), so this one plays the serving engine's part, copying token ranges
between a CPU KV tensor ``[2, layers, tokens, hidden]`` and LMCache's ``KV_2LTD`` memory objects.
"""

from __future__ import annotations

import ctypes
import json
import os
import select
import socket
import sys
import tempfile
import time

CANNOT_RUN = 77
CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18


def resolves_to_loopback(name: str) -> bool:
    try:
        infos = socket.getaddrinfo(name, 80, type=socket.SOCK_STREAM)
    except OSError:
        return False
    return bool(infos) and all(info[4][0].startswith("127.") or info[4][0] == "::1" for info in infos)


def private_hosts(lines: list[str]) -> None:
    """Make ``lines`` (``"127.0.0.1 name"``) part of /etc/hosts for this process alone."""
    names = [line.split()[1] for line in lines]
    if all(resolves_to_loopback(name) for name in names):
        return  # e.g. systemd-resolved or nss-myhostname already map *.localhost to loopback
    libc = ctypes.CDLL(None, use_errno=True)

    def check(rc: int, what: str) -> None:
        if rc != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{what}: {os.strerror(err)}")

    uid, gid = os.geteuid(), os.getegid()
    check(libc.unshare(CLONE_NEWNS if uid == 0 else CLONE_NEWNS | CLONE_NEWUSER), "unshare")
    if uid != 0:  # an unprivileged user namespace: map ourselves to root inside it
        for path, text in (("/proc/self/setgroups", "deny"), ("/proc/self/uid_map", f"0 {uid} 1"),
                           ("/proc/self/gid_map", f"0 {gid} 1")):
            with open(path, "w") as f:
                f.write(text)
    check(libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "mount --make-rprivate /")
    with open("/etc/hosts") as f:
        current = f.read()
    fd, path = tempfile.mkstemp(prefix="ctxstore-hosts-")
    with os.fdopen(fd, "w") as f:
        f.write(current.rstrip("\n") + "\n" + "\n".join(lines) + "\n")
    os.chmod(path, 0o644)
    try:
        check(libc.mount(path.encode(), b"/etc/hosts", None, MS_BIND, None), "bind-mount over /etc/hosts")
    finally:
        os.unlink(path)  # the mount keeps the inode alive
    missing = [name for name in names if not resolves_to_loopback(name)]
    if missing:
        raise OSError(f"still not resolved with the private /etc/hosts: {missing}")


def run_engine(mode: str, config_path: str, data_path: str) -> dict:
    import torch
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
    from lmcache.v1.metadata import LMCacheMetadata

    class CPUKVConnector(GPUConnectorInterface):
        """Copies ``kvcaches[:, :, start:end, :]`` to or from a ``KV_2LTD`` memory object
        ``[2, layers, tokens, hidden]``."""

        def __init__(self, num_layers: int, hidden: int):
            self.num_layers, self.hidden = num_layers, hidden
            self.kvcaches = None

        def get_shape(self, num_tokens: int) -> torch.Size:
            return torch.Size([2, self.num_layers, num_tokens, self.hidden])

        def from_gpu(self, memory_obj, start, end, **kwargs):
            memory_obj.tensor.copy_(kwargs["kvcaches"][:, :, start:end, :])

        def to_gpu(self, memory_obj, start, end, **kwargs):
            kwargs["kvcaches"][:, :, start:end, :].copy_(memory_obj.tensor)

        def batched_from_gpu(self, memory_objs, starts, ends, **kwargs):
            for obj, start, end in zip(memory_objs, starts, ends):
                self.from_gpu(obj, start, end, **kwargs)

        def batched_to_gpu(self, memory_objs=None, starts=None, ends=None, **kwargs):
            for obj, start, end in zip(memory_objs, starts, ends):
                self.to_gpu(obj, start, end, **kwargs)

    data = torch.load(data_path)
    tokens: list[int] = data["tokens"]
    kv: torch.Tensor = data["kv"]
    stored: int = data["stored"]
    _, layers, _, hidden = kv.shape
    heads = data["heads"]

    config = LMCacheEngineConfig.from_file(config_path)
    metadata = LMCacheMetadata(
        model_name=data["model"], world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
        kv_dtype=kv.dtype, kv_shape=(layers, 2, config.chunk_size, heads, hidden // heads),
        chunk_size=config.chunk_size,
    )
    engine = LMCacheEngineBuilder.get_or_create(
        f"ctxstore-{mode}", config, metadata, CPUKVConnector(layers, hidden),
        broadcast_fn=lambda *args: None, broadcast_object_fn=lambda obj, *args: obj,
    )
    engine.post_init()
    report: dict = {"mode": mode}
    if mode == "store":
        engine.store(torch.tensor(tokens[:stored]), kvcaches=kv[:, :, :stored, :].contiguous())
        # The remote backend uploads in the background and, once an upload succeeded, answers from its own
        # size cache: wait until it has every chunk.
        deadline, hit = time.monotonic() + 30, 0
        while time.monotonic() < deadline:
            hit = engine.lookup(tokens=tokens[:stored], search_range=["RemoteBackend"])
            if hit == stored:
                break
            time.sleep(0.1)
        report["remote_hit_tokens"] = hit
    else:
        out = torch.zeros_like(kv)
        report["lookup_hit_tokens"] = engine.lookup(tokens=tokens, lookup_id="req-1", pin=True)
        mask = engine.retrieve(torch.tensor(tokens), kvcaches=out, req_id="req-1")
        engine.lookup_unpin("req-1")
        report["retrieved_tokens"] = int(mask.sum())
        torch.save(out, data_path + ".out")
    # No LMCacheEngineBuilder.destroy(): in lmcache 0.5.6 it never returns with an s3:// remote
    # (S3Connector.close awaits the synchronous AsyncPQExecutor.shutdown, which blocks the event loop it
    # needs: LMCache/LMCache#4489). main() leaves with os._exit instead; nothing is pending by then.
    return report


def run_l2(config_path: str, data_path: str) -> dict:
    import torch
    import yaml
    from lmcache.v1.distributed.api import ObjectKey
    from lmcache.v1.distributed.l2_adapters.s3_l2_adapter import S3L2Adapter, S3L2AdapterConfig
    from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj

    data = torch.load(data_path)
    blobs: dict[str, torch.Tensor] = data["blobs"]  # chunk hash (hex) -> uint8 payload
    model: str = data["model"]
    with open(config_path) as f:
        adapter = S3L2Adapter(S3L2AdapterConfig.from_dict(yaml.safe_load(f)))

    def memobj(n: int, fill: torch.Tensor | None = None) -> TensorMemoryObj:
        raw = fill.clone() if fill is not None else torch.zeros(n, dtype=torch.uint8)
        meta = MemoryObjMetadata(shape=torch.Size([n]), dtype=torch.uint8, address=0, phy_size=n, ref_count=1,
                                 fmt=MemoryFormat.BINARY_BUFFER)
        return TensorMemoryObj(raw, meta, None)

    def poll(query, task_id):
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            result = query(task_id)
            if result is not None:
                return result
            time.sleep(0.02)
        raise TimeoutError(f"L2 task {task_id}")

    def lookup() -> list[bool]:
        bitmap = poll(adapter.query_lookup_and_lock_result, adapter.submit_lookup_and_lock_task(keys, {}))
        adapter.submit_unlock(keys)
        return [bitmap.test(i) for i in range(len(keys))]

    keys = [ObjectKey(chunk_hash=bytes.fromhex(name), model_name=model, kv_rank=0) for name in blobs]
    report: dict = {"mode": "l2"}
    task = adapter.submit_store_task(keys, [memobj(len(b), b) for b in blobs.values()])
    done: dict = {}
    deadline = time.monotonic() + 30
    while task not in done and time.monotonic() < deadline:
        select.select([adapter.get_store_event_fd()], [], [], 1)
        done.update(adapter.pop_completed_store_tasks())
    report["store_ok"] = task in done and int(done[task]) >= 0  # L2StoreResult: -1 is failure
    report["lookup"] = lookup()
    outs = [memobj(len(b)) for b in blobs.values()]
    loaded = poll(adapter.query_load_result, adapter.submit_load_task(keys, outs))
    report["load"] = [loaded.test(i) for i in range(len(keys))]
    report["equal"] = [torch.equal(o.raw_data, b) for o, b in zip(outs, blobs.values())]
    report["listed"] = sorted(e.size_bytes for e in adapter.list_l2_keys(model_name=model).entries)
    adapter.delete(keys[:1])
    report["lookup_after_delete"] = lookup()
    listed = adapter.list_l2_keys(model_name=model).entries
    report["listed_after_delete"] = sorted(e.size_bytes for e in listed)
    adapter.close()
    return report


def main() -> None:
    mode, config_path, data_path, *hosts_lines = sys.argv[1:]
    try:
        private_hosts(hosts_lines)
    except OSError as exc:
        print(f"CANNOT RUN: the virtual-hosted name does not resolve to loopback and a private /etc/hosts "
              f"is not possible here ({exc})", flush=True)
        os._exit(CANNOT_RUN)
    try:
        import lmcache.v1.cache_engine  # noqa: F401  (what an install without its compiled deps lacks)
    except Exception as exc:  # noqa: BLE001
        print(f"CANNOT RUN: lmcache does not import: {type(exc).__name__}: {exc}", flush=True)
        os._exit(CANNOT_RUN)
    report = run_l2(config_path, data_path) if mode == "l2" else run_engine(mode, config_path, data_path)
    print("REPORT " + json.dumps(report), flush=True)
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown: see run_engine (LMCache/LMCache#4489)


if __name__ == "__main__":
    main()
