"""Restore a real model's KV cache from a ctxstore pod instead of recomputing it, one process per worker.

    python examples/restore_demo.py                   # starts a local pod of 3 nodes, runs, stops it
    python examples/restore_demo.py --nodes 127.0.0.1:9001,127.0.0.1:9002,127.0.0.1:9003   # a running pod

1. Worker A prefills a 2,000-token prompt, saves its 125 blocks of 16 tokens, and is killed with SIGKILL.
2. Worker B (a fresh process) gets a request = that prompt + a 37-token question: it restores the cached
   2,000 tokens, prefills only the 37 others and generates 32 tokens greedily; it checks every step's logits
   against a recompute without the pod, and times restore against recompute.
3. B's session calls a tool: B parks its context (long TTL, pinned) and exits. Worker C resumes the session
   with the tool's result appended and generates on, again checked against a recompute.

The workers are ``examples/hf_worker.py``: a small Llama-architecture model with seeded random weights
(nothing is downloaded). Credentials come from CTXSTORE_ACCESS_KEY / CTXSTORE_SECRET_KEY (generated for a
local pod).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PROMPT = {"prompt_seed": 1, "prompt_len": 2000}
QUESTION = {"question_seed": 2, "question_len": 37}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_pod(n: int, env: dict[str, str], logs: Path) -> tuple[list[subprocess.Popen], list[str]]:
    procs, nodes = [], []
    for _ in range(n):
        port = free_port()
        with (logs / f"node-{port}.log").open("wb") as log:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "ctxstore_server.serve", "--port", str(port), "--memory", "512MiB"],
                env=env, stdout=log, stderr=subprocess.STDOUT))
        nodes.append(f"127.0.0.1:{port}")
    deadline = time.monotonic() + 30
    for proc, node in zip(procs, nodes):
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"node {node} exited; see {logs}")
            try:
                with urllib.request.urlopen(f"http://{node}/_ctx/health/ready", timeout=1) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                if time.monotonic() > deadline:
                    raise SystemExit(f"node {node} did not become ready; see {logs}") from None
                time.sleep(0.1)
    return procs, nodes


class Worker:
    """``hf_worker.py`` in its own process, driven with JSON lines."""

    def __init__(self, name: str, env: dict[str, str], args: argparse.Namespace, logs: Path) -> None:
        self.name = name
        cmd = [sys.executable, str(HERE / "hf_worker.py"), "--bucket", args.bucket]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        with (logs / f"worker-{name}.log").open("wb") as err:
            self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=err, text=True, bufsize=1)
        self.ready: dict[str, Any] | None = None

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"worker {self.name} exited ({self.proc.wait()}); see its log")
        return json.loads(line)

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        if self.ready is None:
            self.ready = self.read()
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        return self.read()

    def close(self) -> None:
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None and not pipe.closed:
                pipe.close()
        self.proc.wait(30)


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def run(args: argparse.Namespace, env: dict[str, str], logs: Path) -> None:
    a = Worker("A", env, args, logs)
    b = Worker("B", env, args, logs)  # loads its model while A works, like a worker already serving
    saved = a.call("prefill_save", **PROMPT)
    print(f"worker A (pid {a.ready['pid']}): prefilled {saved['tokens']} tokens in {ms(saved['prefill_s'])}, "
          f"saved {saved['stored']} blocks of {saved['block_bytes'] // 1024} KiB "
          f"({saved['stored'] * saved['block_bytes'] / 2**20:.1f} MiB) in {ms(saved['save_s'])}")
    a.proc.send_signal(signal.SIGKILL)
    print(f"worker A: killed with SIGKILL (exit {a.proc.wait()})")
    a.close()

    served = b.call("serve", **PROMPT, **QUESTION, max_new=32, check=True)
    print(f"worker B (pid {b.ready['pid']}, torch threads: {b.ready['threads']}): request of "
          f"{served['request_tokens']} tokens, pod holds {served['lookup_blocks']} blocks")
    print(f"  restored {served['restored_tokens']} tokens ({served['restored_blocks']} blocks) in "
          f"{ms(served['restore_s'])}, prefilled the other {served['prefilled_tokens']} in "
          f"{ms(served['remainder_prefill_s'])}")
    print(f"  generated {len(served['generated'])} tokens: {served['generated']}")
    print(f"  restored bytes equal a local recompute: {served['restored_bytes_equal_recompute']}")
    print(f"  logits at all {len(served['generated'])} steps vs recompute with the same forward passes: "
          f"{'bitwise equal' if served['chunked_recompute_bitwise_equal'] else 'DIFFERENT'}")
    print(f"  logits vs one forward pass over all {served['request_tokens']} tokens: max |diff| "
          f"{served['one_pass_max_abs_diff']:.2g} (logits up to {served['one_pass_max_logit']:.2g}), "
          f"same tokens: {served['one_pass_tokens_equal']}")
    bench = b.call("bench", **PROMPT, **QUESTION, repeat=args.repeat)
    print(f"  median of {bench['repeat']}: restore of {bench['restored_tokens']} tokens "
          f"{ms(bench['restore_s'])} vs their prefill {ms(bench['prefill_prefix_s'])} "
          f"({bench['prefill_prefix_s'] / bench['restore_s']:.0f}x); first token's logits "
          f"{ms(bench['restore_ttft_s'])} with the pod vs {ms(bench['recompute_ttft_s'])} recomputing all "
          f"{bench['request_tokens']} tokens")

    c = Worker("C", env, args, logs)  # started after the timing, which it would disturb while it loads
    parked = b.call("park", ttl=3600, pin=600)
    print(f"worker B: tool call: parked {parked['parked_tokens']} tokens of its session "
          f"({parked['stored']} new blocks, {parked['existed']} already there; TTL 1 h, pinned 10 min)")
    b.close()
    resumed = c.call("resume", tokens=parked["tokens"], history=parked["history"], tool_seed=3, tool_len=21,
                     max_new=16, check=True, unpin=True)
    print(f"worker C (pid {c.ready['pid']}): resumed the session: restored {resumed['restored_tokens']} "
          f"tokens in {ms(resumed['restore_s'])}, prefilled {resumed['prefilled_tokens']} (the rest of the "
          f"session + the tool's result), generated {resumed['generated']}")
    print(f"  logits vs recompute with the same forward passes: "
          f"{'bitwise equal' if resumed['chunked_recompute_bitwise_equal'] else 'DIFFERENT'}; vs one forward "
          f"pass: max |diff| {resumed['one_pass_max_abs_diff']:.2g}")
    c.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", help="a running pod (host:port,...); default: start 3 local nodes")
    parser.add_argument("--bucket", default="kv-demo-" + secrets.token_hex(4))
    parser.add_argument("--threads", type=int, default=0, help="torch threads per worker (default: torch's)")
    parser.add_argument("--repeat", type=int, default=5, help="rounds of the restore/recompute timing")
    args = parser.parse_args(argv)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.setdefault("CTXSTORE_ACCESS_KEY", "DEMOACCESSKEY" + secrets.token_hex(4).upper())
    env.setdefault("CTXSTORE_SECRET_KEY", secrets.token_urlsafe(24))
    with tempfile.TemporaryDirectory(prefix="ctxstore-demo-") as tmp:
        logs = Path(tmp)
        procs: list[subprocess.Popen] = []
        if args.nodes:
            env["CTXSTORE_NODES"] = args.nodes
        else:
            procs, nodes = start_pod(3, env, logs)
            env["CTXSTORE_NODES"] = ",".join(nodes)
            print(f"pod: 3 local nodes {', '.join(nodes)} (logs in {logs})")
        try:
            run(args, env, logs)
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                proc.wait(15)
    return 0


if __name__ == "__main__":
    sys.exit(main())
