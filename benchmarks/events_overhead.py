"""What router-grade events cost a save, and how many events a node publishes per second.

Command (from the repository root; results go in docs/benchmarks.md, "Store events"):

    .venv/bin/python benchmarks/events_overhead.py      # defaults: --runs 10 --warmup 1 --budget 60 --burst 5

Method: two nodes started as a user starts them (``ctxstore serve --memory 2GiB``), pinned to core 0, the client
to core 1: one without a ZMQ publisher (events reach only the HTTP stream's ring; clients send blocks and keys
only), one with ``--events-zmq-pub`` in the default ``vllm`` style (it announces ``put-route``: each save also
sends every block's tokens and parent, and each ``BlockStored`` carries them), with a SUB socket in this process
draining and counting what it publishes. Save: ``Namespace.save`` of a fresh 32k-token prompt, 2048 blocks of
64 KiB (128 MiB; 16-token blocks, the ``dynamo`` scheme) in one call, deleted after each timed save outside the
timed region; the two nodes alternate round by round. GB/s per save (10^9 bytes), median and p90; the ratio is
the median over rounds of on/off. Events per second: for ``--burst`` seconds the client saves 2048-block
prompts of 1 KiB blocks back to back to the publishing node, and the SUB socket counts the messages, the
``BlockStored`` events (a save's chained blocks are one event) and the blocks they announce with their tokens,
per second of the burst. Publisher ceiling: in this process, a ``ZmqPublisher`` bound to a loopback port with
a SUB socket connected publishes hub batches of 1024 routed ``BlockStored`` events of unchained 16-token blocks
(the worst case: one event per block, none joined) for ``--burst`` seconds; events per second of ``publish``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import threading
import time
from typing import Any

import msgpack
import zmq

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import ACCESS, SECRET, Node, Processes, Variant, exit_on_sigterm, free_port, measure, pin_client, \
    source_state, today

from ctxstore import ContextStore, Limits, wire
from ctxstore_server import events

BLOCK_TOKENS = 16
PROMPT_BLOCKS = 2048


class Counter(threading.Thread):
    """A SUB socket on a node's publisher, counting the messages and events it receives, the blocks they
    announce, and how many of those carry tokens."""

    def __init__(self, endpoint: str) -> None:
        super().__init__(daemon=True)
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.setsockopt(zmq.RCVHWM, 0)
        self.sub.connect(endpoint)
        self.messages = 0
        self.events = 0
        self.blocks = 0
        self.routed = 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            if not self.sub.poll(100):
                continue
            _, _, payload = self.sub.recv_multipart()
            self.messages += 1
            for event in msgpack.unpackb(payload, raw=False)[1]:
                self.events += 1
                hashes, tokens = (event["block_hashes"], event.get("token_ids")) if isinstance(event, dict) \
                    else (event[1], event[3] if len(event) > 3 else None)
                self.blocks += len(hashes)
                if tokens:
                    self.routed += len(hashes)

    def close(self) -> None:
        self.stop.set()
        self.join()
        self.sub.close(linger=0)
        self.ctx.term()


async def publisher_ceiling(seconds: float) -> tuple[int, float]:
    """Routed events a publisher sends per second, one event per block (see the module docstring)."""
    book = events.RouteBook()
    keys = [f"{i:016x}" for i in range(1, 1025)]
    book.remember("b", keys, wire.PutRoute(BLOCK_TOKENS, [list(range(BLOCK_TOKENS))] * len(keys),
                                           [f"{0xffff0000 + i:016x}" for i in range(len(keys))], "salt"),
                  list(range(len(keys))))
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    publisher = events.ZmqPublisher(endpoint, "", topic="kv-events", fmt="array", hashes="int", medium="CPU",
                                    buckets=None, buffer_events=100_000, routes=book)
    await publisher.start()
    counter = Counter(endpoint)
    counter.start()
    batch = [events.Event(i, 0.0, events.STORED, "b", "", key, 1024, 0.0, None, "CPU") for i, key in enumerate(keys)]
    sent = 0
    busy = 0.0
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        t0 = time.perf_counter()
        publisher.publish(batch, time.time())
        busy += time.perf_counter() - t0
        sent += len(batch)
        await asyncio.sleep(0)
    await asyncio.sleep(0.5)
    counter.close()
    await publisher.close()
    return sent, busy


def prompt(rng: random.Random, n_blocks: int) -> list[int]:
    return [rng.randrange(1 << 31) for _ in range(n_blocks * BLOCK_TOKENS)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--budget", type=float, default=60.0)
    parser.add_argument("--burst", type=float, default=5.0)
    args = parser.parse_args()
    exit_on_sigterm()
    pinned = pin_client()
    procs = Processes()
    rng = random.Random(7)
    try:
        pub = f"tcp://127.0.0.1:{free_port()}"
        off = Node(procs, "2GiB")
        on = Node(procs, "2GiB", "--events-zmq-pub", pub)
        counter = Counter(pub)
        counter.start()
        limits = Limits(bytes_per_call=256 << 20)
        stores = {name: ContextStore(node.endpoint, access_key=ACCESS, secret_key=SECRET, limits=limits)
                  for name, node in (("off", off), ("on", on))}
        data = os.urandom(64 << 10)
        blocks = [memoryview(data)] * PROMPT_BLOCKS  # the payload does not matter to the events
        variants = []
        for name, node in (("events off", off), ("events on, router-grade", on)):
            store = stores["off" if node is off else "on"]
            ns = store.namespace("bench-events", model="m", block_size=BLOCK_TOKENS, scheme="dynamo")
            ns.lookup(list(range(BLOCK_TOKENS)))  # the client learns what the node asks of a save
            current: dict[str, Any] = {}

            def prepare(current: dict[str, Any] = current) -> None:
                current["tokens"] = prompt(rng, PROMPT_BLOCKS)

            def call(ns: Any = ns, current: dict[str, Any] = current) -> object:
                return ns.save(current["tokens"], blocks).stored

            def cleanup(ns: Any = ns, current: dict[str, Any] = current) -> None:
                ns.delete(current["tokens"])

            variants.append(Variant(name, call, PROMPT_BLOCKS, [node.proc.pid], prepare=prepare, cleanup=cleanup))
        measure(variants, args.warmup, args.runs, args.budget)
        nbytes = PROMPT_BLOCKS * len(data)
        print(f"# {today()} {source_state()}; client pinned: {pinned}; {len(variants[0].times)} rounds")
        print("| save of 2048 × 64 KiB (128 MiB) | GB/s median | GB/s p90 | client CPU s/save | node CPU s/save |")
        print("|---|---|---|---|---|")
        for v in variants:
            rates = sorted(nbytes / t / 1e9 for t in v.times)
            p10 = rates[max(0, int(0.1 * len(rates)) - 1)]  # GB/s p90 of the time = the 10th percentile rate
            n = len(v.times)
            print(f"| {v.system} | {statistics.median(rates):.2f} | {p10:.2f} | {v.client_cpu / n:.3f} | "
                  f"{v.server_cpu / n:.3f} |")
        ratio = statistics.median(o / f for f, o in zip(variants[0].times, variants[1].times, strict=False))
        print(f"\nevents on / off, time per save (median over rounds): {ratio:.3f}")

        # Events per second a node publishes: saves of small blocks back to back.
        ns = stores["on"].namespace("bench-events", model="m", block_size=BLOCK_TOKENS, scheme="dynamo")
        small = [memoryview(data[:1024])] * PROMPT_BLOCKS
        before = (counter.messages, counter.events, counter.blocks, counter.routed)
        started = time.perf_counter()
        saved = 0
        while time.perf_counter() - started < args.burst:
            saved += ns.save(prompt(rng, PROMPT_BLOCKS), small).stored
        elapsed = time.perf_counter() - started
        time.sleep(0.5)  # the last batches (5 ms flush) arrive
        messages, got, blocks_in, routed = (now - was for now, was in zip(
            (counter.messages, counter.events, counter.blocks, counter.routed), before, strict=True))
        print(f"\nburst of 2048 × 1 KiB saves for {elapsed:.1f} s: {saved} blocks saved ({saved / elapsed:,.0f}/s); "
              f"received {messages} messages, {got} BlockStored events, {blocks_in} blocks announced "
              f"({blocks_in / elapsed:,.0f}/s; {routed} with their tokens)")
        counter.close()
        for store in stores.values():
            store.close()
        sent, busy = asyncio.run(publisher_ceiling(args.burst))
        print(f"publisher ceiling: {sent} routed events (one block each) in {busy:.2f} s of publish: "
              f"{sent / busy:,.0f} events/s")
    finally:
        procs.stop()


if __name__ == "__main__":
    main()
