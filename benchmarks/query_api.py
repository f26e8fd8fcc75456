"""Latency of the query API for a 32k-token prompt: what a pod holds of it, per tier, asked by the client
(``Namespace.query``: it hashes the tokens, asks each node about the keys it owns, one call per node at once)
and by a router that sends the tokens to a node and lets it hash them (one bulk ``query`` call naming
``tokens``); the client's ``Namespace.lookup`` of the same prompt (a read) beside them.

Command (from the repository root; results go in docs/benchmarks.md, "Query API"):

    .venv/bin/python benchmarks/query_api.py            # defaults: --tokens 32768 --block-size 16 --runs 300

Method: nodes started as a user starts them (``ctxstore serve --memory 256MiB``), all pinned to core 0, the client
to core 1; a pod of one node and a pod of three. The prompt's 2048 blocks (1 KiB each) are saved once; each
variant then runs ``--warmup`` untimed and ``--runs`` timed calls, round-robin with the others so that
background noise falls on all alike. The router's call is a SigV4-signed ``POST /_ctx/v1/bulk/<bucket>/query``
on one kept-alive connection (as a router's HTTP client would send it), its answer decoded with
:func:`ctxstore.wire.decode_query_response`. Median and p99 per call, in milliseconds.
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import sys
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import ACCESS, SECRET, Node, Processes, exit_on_sigterm, pin_client, source_state, stats, today

from ctxstore import ContextStore, Namespace, wire
from ctxstore.s3 import signed_head
from ctxstore.sigv4 import Signer


class RouterCall:
    """A router's bulk ``query`` naming the tokens, on one kept-alive connection to one node."""

    def __init__(self, port: int, bucket: str, ns: Namespace, tokens: list[int], scheme: str) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)  # bounded, as every load loop
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.host, self.path = f"127.0.0.1:{port}", wire.path(bucket, "query")
        self.body = wire.encode_query_request(wire.QueryRequest(
            tokens=tokens, block_size=ns.block_size, scheme=scheme, fingerprint=ns.fingerprint.hexdigest()))
        self.signer = Signer(ACCESS, SECRET, "us-east-1")
        self.n = len(tokens) // ns.block_size

    def receive(self) -> bytes:
        data = self.sock.recv(65536)
        if not data:
            raise ConnectionError("the node closed the connection mid-answer")
        return data

    def __call__(self) -> wire.QueryResponse:
        head = signed_head(self.signer, "POST", self.host, self.path, len(self.body), content_type=wire.CONTENT_TYPE)
        self.sock.sendall(head + self.body)
        data = b""
        while b"\r\n\r\n" not in data:
            data += self.receive()
        header, _, body = data.partition(b"\r\n\r\n")
        length = int(next(line.split(b":", 1)[1] for line in header.split(b"\r\n")
                          if line.lower().startswith(b"content-length:")))
        while len(body) < length:
            body += self.receive()
        assert header.startswith(b"HTTP/1.1 200"), header
        return wire.decode_query_response(wire.unpack_head(body, wire.answer_schema("query", self.n))[0], self.n)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20)
    args = parser.parse_args()
    exit_on_sigterm()
    pinned = pin_client()
    procs = Processes()
    rng = random.Random(32768)
    tokens = [rng.randrange(1 << 32) for _ in range(args.tokens)]
    n_blocks = args.tokens // args.block_size
    try:
        nodes = [Node(procs, "256MiB") for _ in range(3)]
        variants: dict[str, Callable[[], object]] = {}
        stores = []
        for pod in (nodes[:1], nodes):
            store = ContextStore(",".join(n.endpoint for n in pod), access_key=ACCESS, secret_key=SECRET)
            stores.append(store)
            ns = store.namespace(f"query-bench-{len(pod)}", model="bench", block_size=args.block_size)
            blocks = [os.urandom(1024)] * n_blocks
            assert ns.save(tokens, blocks).stored == n_blocks
            label = f"{len(pod)} node{'s' if len(pod) > 1 else ''}"
            variants[f"client Namespace.query, {label}"] = lambda ns=ns: ns.query(tokens)
            variants[f"client Namespace.lookup (a read), {label}"] = lambda ns=ns: ns.lookup(tokens)
            if len(pod) == 1:
                for scheme in ("xxh3-128", "dynamo", "vllm-sha256-cbor"):
                    sns = store.namespace(f"query-bench-{scheme.replace('-', '')}", model="bench",
                                          block_size=args.block_size, scheme=scheme)
                    assert sns.save(tokens, blocks).stored == n_blocks
                    variants[f"router: tokens to one node ({scheme}), 1 node"] = RouterCall(
                        pod[0].port, sns.bucket, sns, tokens, scheme)
        for name, call in variants.items():
            answer = call()
            prefix = answer if isinstance(answer, int) else getattr(answer, "n_blocks", getattr(answer, "prefix", -1))
            assert prefix == n_blocks, (name, prefix)
        samples: dict[str, list[float]] = {name: [] for name in variants}
        for run in range(args.warmup + args.runs):
            for name, call in variants.items():
                started = time.perf_counter()
                call()
                if run >= args.warmup:
                    samples[name].append(time.perf_counter() - started)
        for store in stores:
            store.close()
    finally:
        procs.stop()
    print(f"# {today()}, {source_state()}; {args.tokens} tokens, {n_blocks} blocks of {args.block_size} tokens; "
          f"{args.runs} runs per variant{'' if pinned else '; client and nodes not pinned apart'}")
    print("| call | p50 ms | p99 ms |")
    print("|---|---:|---:|")
    for name, values in samples.items():
        p50, p99 = stats(values)
        print(f"| {name} | {p50 * 1e3:.2f} | {p99 * 1e3:.2f} |")


if __name__ == "__main__":
    main()
