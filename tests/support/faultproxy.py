"""A fault-injecting TCP proxy for tests: put it between a client and a real node and corrupt, cut, stall or
replace what goes through, at chosen or seeded positions, per connection and per message.

The proxy understands HTTP/1.1 framing (request and status lines, headers, ``Content-Length`` bodies) and the
bulk API's frames (``u32 length ‖ msgpack head ‖ payloads``), so a fault can aim at a *region* of a message:

==========  =====================================================================================
region      bytes of one HTTP message
==========  =====================================================================================
message     all of it
http        the start line and the headers, up to and including the blank line
status      the start line (request line or status line) with its CRLF
headers     the header lines after the start line, with the blank line
body        the body (``Content-Length`` bytes)
head        the bulk frame's length prefix and msgpack head (the first ``4 + N`` body bytes)
payload     the body after the bulk frame head (the blocks of a bulk ``get`` answer)
==========  =====================================================================================

Actions (:class:`Rule.action`): ``flip`` bits, ``patch`` bytes, ``truncate`` (forward up to a point, then close
the connection), ``hang`` (forward up to a point, then stop forwarding either way; the sockets stay open),
``extra`` bytes after the body (``Content-Length`` counting them unless ``fix_length=False``), ``garbage``
(answer random or given bytes instead of the message, then close), ``delay``, ``reset`` (close with RST),
``transform`` (a function rewrites the whole buffered message) and ``pass``.

A rule applies to messages of one direction (``response`` by default), optionally only on some connections
(by index, 0 = the first accepted), some messages of a connection (by index in that direction), or requests
whose target contains ``path``; ``times`` bounds how often it fires. The first matching rule wins. Positions
left as ``None`` are drawn from a generator seeded with (proxy seed, connection, message), so a failing case
replays exactly. Every fault applied is recorded in :attr:`FaultProxy.faults`.

The proxy parses the *upstream's* bytes, not the mutated ones, so it stays in step with both ends whatever
it did to the copy it forwards. Bounded: at most ``max_connections`` at once (more are closed at once), heads
of at most 64 KiB (a longer head turns that direction into plain forwarding), ``transform`` buffers at most
``max_buffer`` bytes, idle connections close after ``idle_timeout`` and hung ones after ``hang_timeout``.
Request bodies sent with ``Transfer-Encoding: chunked`` and responses without a length are forwarded as a
plain stream (no faults inside them).
"""

from __future__ import annotations

import contextlib
import random
import re
import select
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from typing import Self

REQUEST = "request"
RESPONSE = "response"
REGIONS = ("message", "http", "status", "headers", "body", "head", "payload")
ACTIONS = ("flip", "patch", "truncate", "hang", "extra", "garbage", "delay", "reset", "transform", "pass")
MAX_HEAD = 64 << 10
CHUNK = 256 << 10

Selector = Collection[int] | Callable[[int], bool] | None


def _selected(selector: Selector, index: int) -> bool:
    if selector is None:
        return True
    if callable(selector):
        return bool(selector(index))
    return index in selector


@dataclass
class Message:
    """A whole buffered HTTP message, for ``transform`` rules."""

    start_line: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    request: str = ""  # the request line this message answers (responses), or its own (requests)

    def header(self, name: str) -> str | None:
        wanted = name.lower().encode()
        for key, value in self.headers:
            if key.strip().lower() == wanted:
                return value.strip().decode("latin-1")
        return None

    def set_header(self, name: str, value: str) -> None:
        wanted = name.lower().encode()
        self.headers = [(k, v) for k, v in self.headers if k.strip().lower() != wanted]
        self.headers.append((name.encode(), value.encode("latin-1")))

    def encode(self, *, fix_length: bool = True) -> bytes:
        """The message as bytes; ``fix_length``: Content-Length says how long the body now is."""
        if fix_length:
            self.set_header("Content-Length", str(len(self.body)))
        lines = [self.start_line] + [k + b": " + v for k, v in self.headers]
        return b"\r\n".join(lines) + b"\r\n\r\n" + self.body


@dataclass
class Rule:
    """One fault and the messages it applies to. See the module docstring."""

    action: str
    region: str = "body"
    offset: int | None = None  # byte offset inside the region; None: seeded random
    bit: int | None = None  # flip: which bit of the byte (0 = least significant); None: seeded random
    count: int = 1  # flip: bits to flip (distinct positions); extra / garbage: bytes to send
    data: bytes | None = None  # patch: bytes written at offset; extra / garbage: the bytes to send
    fix_length: bool = True  # extra: rewrite Content-Length to count the added bytes
    seconds: float = 0.0  # delay
    fn: Callable[[Message], bytes] | None = None  # transform: the whole message in, the bytes to send out
    direction: str = RESPONSE
    path: str | None = None  # only messages of requests whose target contains this
    connections: Selector = None
    messages: Selector = None
    nth: Selector = None  # only the n-th message (0-based) that passed the filters above, counted per rule
    times: int | None = None  # at most this many applications (None: unlimited)
    probability: float = 1.0
    applied: int = 0
    seen: int = 0  # messages that passed the filters (the index ``nth`` selects from)

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"unknown action {self.action!r}; one of {ACTIONS}")
        if self.region not in REGIONS:
            raise ValueError(f"unknown region {self.region!r}; one of {REGIONS}")
        if self.direction not in (REQUEST, RESPONSE):
            raise ValueError(f"direction must be {REQUEST!r} or {RESPONSE!r}")
        if self.action == "transform" and self.fn is None:
            raise ValueError("a transform rule needs fn")
        if self.action == "patch" and not self.data:
            raise ValueError("a patch rule needs data")


def flip(region: str = "body", offset: int | None = None, bit: int | None = None, **kw: object) -> Rule:
    return Rule("flip", region, offset, bit, **kw)  # type: ignore[arg-type]


def truncate(region: str = "body", offset: int | None = None, **kw: object) -> Rule:
    return Rule("truncate", region, offset, **kw)  # type: ignore[arg-type]


def hang(region: str = "body", offset: int | None = None, **kw: object) -> Rule:
    return Rule("hang", region, offset, **kw)  # type: ignore[arg-type]


def extra(data: bytes = b"\x00", *, fix_length: bool = True, **kw: object) -> Rule:
    return Rule("extra", "body", data=data, count=len(data), fix_length=fix_length, **kw)  # type: ignore[arg-type]


def garbage(data: bytes | None = None, count: int = 64, **kw: object) -> Rule:
    return Rule("garbage", "message", data=data, count=len(data) if data else count, **kw)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Fault:
    """A fault that was applied: where (connection, direction, message index, request line) and what."""

    connection: int
    direction: str
    message: int
    request: str
    action: str
    region: str
    position: int | None = None  # absolute offset in the message as the upstream sent it
    bit: int | None = None


@dataclass
class _Plan:
    """What one rule does to one message, in absolute offsets of the upstream's message."""

    rule: Rule
    rng: random.Random
    flips: dict[int, int] = field(default_factory=dict)  # offset -> xor mask
    patches: list[tuple[int, bytes]] = field(default_factory=list)
    cut: int | None = None  # truncate / hang at this offset
    resolved: bool = False


class _Link:
    """One client connection and its upstream connection."""

    def __init__(self, proxy: FaultProxy, index: int, client: socket.socket, upstream: socket.socket) -> None:
        self.proxy = proxy
        self.index = index
        self.client = client
        self.upstream = upstream
        self.requests: deque[tuple[str, str]] = deque()  # (method, request line) awaiting their response
        self.hung_since: float | None = None
        self.closed = threading.Event()
        self.last_activity = time.monotonic()
        self._lock = threading.Lock()
        self._done = 0

    def hang(self) -> None:
        if self.hung_since is None:
            self.hung_since = time.monotonic()

    def half_done(self, dst: socket.socket) -> None:
        """The source of one direction ended: pass the EOF on; close both once both directions ended."""
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)
        with self._lock:
            self._done += 1
            both = self._done >= 2
        if both:
            self.close()

    def close(self, *, reset: bool = False) -> None:
        if self.closed.is_set():
            return
        self.closed.set()
        for sock in (self.client, self.upstream):
            with contextlib.suppress(OSError):
                if reset:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                else:
                    sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()


class _Stream:
    """One direction of one link: parses the upstream's HTTP messages and forwards (mutated) copies."""

    HEAD, BODY, BUFFER, DISCARD, RAW = range(5)

    def __init__(self, link: _Link, direction: str, dst: socket.socket) -> None:
        self.link = link
        self.proxy = link.proxy
        self.direction = direction
        self.dst = dst
        self.buf = bytearray()
        self.state = self.RAW if not self.proxy.http else self.HEAD
        self.index = -1  # message index in this direction
        self._reset_message()

    def _reset_message(self) -> None:
        self.plan: _Plan | None = None
        self.head_len = 0  # bytes of start line + headers as the upstream sent them
        self.status_len = 0
        self.body_len: int | None = 0
        self.pos = 0  # absolute offset (upstream's message) of the next byte to forward
        self.frame_end: int | None = None  # absolute end of the bulk frame head, once known
        self.request = ""
        self.extra = b""
        self.held: list[bytes] = []  # transform: the buffered body
        self.held_size = 0
        self.message_head: bytes = b""

    # -------------------------------------------------------------- input

    def feed(self, data: bytes) -> None:
        self.buf += data
        while self.buf and not self.link.closed.is_set():
            if self.link.hung_since is not None or self.state == self.DISCARD:
                self.buf.clear()
                return
            if self.state == self.RAW:
                chunk = bytes(self.buf)
                self.buf.clear()
                self._send(chunk)
                return
            if self.state == self.HEAD:
                end = self.buf.find(b"\r\n\r\n")
                if end < 0:
                    if len(self.buf) > MAX_HEAD:
                        self.state = self.RAW
                        continue
                    return
                head = bytes(self.buf[:end + 4])
                del self.buf[:end + 4]
                self._begin(head)
                continue
            # BODY / BUFFER
            assert self.body_len is not None
            remaining = self.head_len + self.body_len - self.pos
            if self.frame_end is None and self._needs_frame():
                body_seen = self.pos - self.head_len
                want = min(4, self.body_len) - body_seen
                if len(self.buf) < want:
                    return
            take = min(len(self.buf), remaining)
            chunk = bytes(self.buf[:take])
            del self.buf[:take]
            if self.state == self.BUFFER:
                self.held.append(chunk)
                self.held_size += len(chunk)
                self.pos += len(chunk)
                if self.pos == self.head_len + self.body_len:
                    self._finish_transform()
                continue
            self._body(chunk)
            if self.pos >= self.head_len + self.body_len:
                self._end()

    def eof(self) -> None:
        if self.state == self.BODY and self.body_len is None:
            return

    # -------------------------------------------------------------- one message

    def _begin(self, head: bytes) -> None:
        self._reset_message()
        self.index += 1
        lines = head[:-4].split(b"\r\n")
        start = lines[0]
        headers: list[tuple[bytes, bytes]] = []
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            headers.append((name, value))
        lower = {k.strip().lower(): v.strip() for k, v in headers}
        method = ""
        interim = False
        if self.direction == REQUEST:
            text = start.decode("latin-1", "replace")
            method = text.split(" ", 1)[0].upper()
            self.request = text
            self.link.requests.append((method, text))
        else:
            parts = start.split(b" ", 2)
            code = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0
            interim = 100 <= code < 200
            if interim:
                asked = self.link.requests[0] if self.link.requests else ("", "")
            else:
                asked = self.link.requests.popleft() if self.link.requests else ("", "")
            method, self.request = asked
        # Body length as the upstream frames it.
        if self.direction == RESPONSE and (interim or method == "HEAD" or start.split(b" ", 2)[1:2] in
                                           ([b"204"], [b"304"])):
            body_len: int | None = 0
        elif b"chunked" in lower.get(b"transfer-encoding", b"").lower():
            body_len = None
        elif b"content-length" in lower and lower[b"content-length"].isdigit():
            body_len = int(lower[b"content-length"])
        elif self.direction == REQUEST:
            body_len = 0
        else:
            body_len = None  # read until the upstream closes
        self.body_len = body_len
        rule = self.proxy._match(self.link, self.direction, self.index, self.request)
        if rule is not None:
            rng = random.Random(f"{self.proxy.seed}/{self.link.index}/{self.direction}/{self.index}")
            self.plan = _Plan(rule, rng)
            head = self._prepare_head(head, headers, start)
        self.head_len = len(head)
        self.status_len = len(start) + 2
        self.message_head = head
        if rule is not None and self._act_at_head(rule, head, start, headers):
            return
        self._resolve(final=False)
        self._forward_range(head)
        if self.link.closed.is_set() or self.state == self.DISCARD or self.link.hung_since is not None:
            return
        if body_len is None:
            self.state = self.RAW
            return
        if self.state != self.BUFFER:
            self.state = self.BODY
        if body_len == 0:
            self._end()

    def _prepare_head(self, head: bytes, headers: list[tuple[bytes, bytes]], start: bytes) -> bytes:
        """Rules that change the head before anything is forwarded (``extra`` with ``fix_length``)."""
        assert self.plan is not None
        rule = self.plan.rule
        if rule.action == "extra" and self.body_len is not None:
            self.extra = rule.data if rule.data else bytes(self.plan.rng.randrange(256) for _ in range(rule.count))
            if rule.fix_length:
                new = self.body_len + len(self.extra)
                head = re.sub(rb"(?im)^(content-length:[ \t]*)\d+", rb"\g<1>" + str(new).encode(), head, count=1)
        return head

    def _act_at_head(self, rule: Rule, head: bytes, start: bytes, headers: list[tuple[bytes, bytes]]) -> bool:
        """Actions decided before any byte is forwarded. Returns True when the message is dealt with."""
        assert self.plan is not None
        if rule.action == "delay":
            self._record(rule, None, None)
            time.sleep(rule.seconds)
            return False
        if rule.action == "reset":
            self._record(rule, 0, None)
            self.link.close(reset=True)
            return True
        if rule.action == "garbage":
            junk = rule.data if rule.data else bytes(self.plan.rng.randrange(256) for _ in range(rule.count))
            self._record(rule, 0, None)
            self._send(junk)
            self.state = self.DISCARD
            self.link.close()
            return True
        if rule.action == "transform":
            if self.body_len is None or self.body_len > self.proxy.max_buffer:
                self.plan = None  # too big to buffer: forwarded untouched
                return False
            self.state = self.BUFFER
            self.pos = self.head_len
            self._transform_parts = (start, headers)
            if self.body_len == 0:
                self._finish_transform()
            return True
        if rule.action == "pass":
            self._record(rule, None, None)
            self.plan = None
        return False

    def _finish_transform(self) -> None:
        assert self.plan is not None and self.plan.rule.fn is not None
        start, headers = self._transform_parts
        msg = Message(start, list(headers), b"".join(self.held), self.request)
        out = self.plan.rule.fn(msg)
        self._record(self.plan.rule, None, None)
        self._send(out)
        self.held = []
        self._reset_message()
        self.state = self.HEAD

    def _region(self, name: str) -> tuple[int, int] | None:
        """Absolute [start, end) of a region of the current message, None if not known (yet)."""
        body_end = None if self.body_len is None else self.head_len + self.body_len
        if name == "status":
            return 0, self.status_len
        if name == "headers":
            return self.status_len, self.head_len
        if name == "http":
            return 0, self.head_len
        if body_end is None:
            return None
        if name == "message":
            return 0, body_end
        if name == "body":
            return self.head_len, body_end
        if self.frame_end is None:
            return None
        if name == "head":
            return self.head_len, self.frame_end
        return self.frame_end, body_end  # payload

    def _needs_frame(self) -> bool:
        return self.plan is not None and not self.plan.resolved and self.plan.rule.region in ("head", "payload")

    def _resolve(self, *, final: bool) -> None:
        """Turn the rule's region and offset into absolute positions, once the region is known."""
        plan = self.plan
        if plan is None or plan.resolved:
            return
        rule = plan.rule
        if rule.action not in ("flip", "patch", "truncate", "hang"):
            plan.resolved = True
            if rule.action == "extra":
                self._record(rule, None if self.body_len is None else self.head_len + self.body_len, None)
            return
        span = self._region(rule.region)
        if span is None:
            if final:
                plan.resolved = True  # the region never materialised: nothing to do
            return
        start, end = span
        plan.resolved = True
        if end <= start:
            return
        rng = plan.rng
        if rule.action == "flip":
            positions: list[int] = []
            if rule.offset is not None:
                positions = [start + rule.offset]
            while len(positions) < rule.count:
                candidate = rng.randrange(start, end)
                if candidate not in positions:
                    positions.append(candidate)
                if len(positions) >= end - start:
                    break
            for i, position in enumerate(positions):
                if not start <= position < end:
                    continue
                bit = rule.bit if rule.bit is not None and i == 0 else rng.randrange(8)
                plan.flips[position] = plan.flips.get(position, 0) ^ (1 << bit)
                self._record(rule, position, bit)
        elif rule.action == "patch":
            position = start + (rule.offset or 0)
            assert rule.data is not None
            plan.patches.append((position, rule.data))
            self._record(rule, position, None)
        else:
            position = start + rule.offset if rule.offset is not None else rng.randrange(start, end + 1)
            plan.cut = min(position, end)
            self._record(rule, plan.cut, None)

    def _body(self, chunk: bytes) -> None:
        if self.frame_end is None and self.body_len is not None:
            body_seen = self.pos - self.head_len
            if body_seen == 0 and len(chunk) >= 4:
                (n,) = struct.unpack_from(">I", chunk, 0)
                self.frame_end = self.head_len + min(4 + n, self.body_len)
            elif body_seen == 0 and len(chunk) == self.body_len:
                self.frame_end = self.head_len + self.body_len
        self._resolve(final=self.frame_end is not None or self.body_len is None)
        self._forward_range(chunk)

    def _forward_range(self, chunk: bytes) -> None:
        """Forward upstream bytes [pos, pos + len(chunk)) with the plan's flips, patches and cut applied."""
        begin = self.pos
        self.pos += len(chunk)
        plan = self.plan
        if plan is None or (not plan.flips and not plan.patches and plan.cut is None):
            self._send(chunk)
            return
        out = bytearray(chunk)
        for position, mask in plan.flips.items():
            if begin <= position < self.pos:
                out[position - begin] ^= mask
        for position, data in plan.patches:
            for i, byte in enumerate(data):
                if begin <= position + i < self.pos:
                    out[position + i - begin] = byte
        if plan.cut is not None and plan.cut < self.pos:
            self._send(bytes(out[:max(0, plan.cut - begin)]))
            if plan.rule.action == "hang":
                self.link.hang()
            else:
                self.state = self.DISCARD
                self.link.close()
            return
        self._send(bytes(out))

    def _end(self) -> None:
        plan = self.plan
        if plan is not None and not plan.resolved:
            self._resolve(final=True)
        if plan is not None and plan.cut is not None and plan.cut >= self.pos and not self.link.closed.is_set():
            # A cut at the very end of the message: everything went, then the connection stops.
            if plan.rule.action == "hang":
                self.link.hang()
            else:
                self.link.close()
            return
        if self.extra:
            self._send(self.extra)
        self.state = self.HEAD
        self._reset_message()

    # -------------------------------------------------------------- output

    def _send(self, data: bytes) -> None:
        if not data or self.link.closed.is_set() or self.link.hung_since is not None:
            return
        try:
            self.dst.sendall(data)
        except OSError:
            self.link.close()

    def _record(self, rule: Rule, position: int | None, bit: int | None) -> None:
        self.proxy._record(Fault(self.link.index, self.direction, self.index, self.request, rule.action,
                                 rule.region, position, bit))


class FaultProxy:
    """A TCP proxy on 127.0.0.1 in front of ``upstream`` (host, port) that applies :class:`Rule` faults.

    Use as a context manager, or call :meth:`start` and :meth:`stop`. ``address`` is ``127.0.0.1:<port>``.
    """

    def __init__(self, upstream: tuple[str, int], rules: list[Rule] | None = None, *, seed: int = 0,
                 http: bool = True, max_connections: int = 128, max_buffer: int = 64 << 20,
                 idle_timeout: float = 60.0, hang_timeout: float = 30.0, connect_timeout: float = 2.0) -> None:
        self.upstream = upstream
        self.rules: list[Rule] = list(rules or [])
        self.seed = seed
        self.http = http
        self.max_connections = max_connections
        self.max_buffer = max_buffer
        self.idle_timeout = idle_timeout
        self.hang_timeout = hang_timeout
        self.connect_timeout = connect_timeout
        self.faults: deque[Fault] = deque(maxlen=100_000)
        self.connections = 0  # accepted so far
        self.refused = 0  # closed at once: over max_connections or upstream unreachable
        self._links: dict[int, _Link] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._sock = socket.create_server(("127.0.0.1", 0))
        self._sock.settimeout(0.1)
        self.port: int = self._sock.getsockname()[1]
        self._threads: list[threading.Thread] = []

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    # -------------------------------------------------------------- control

    def start(self) -> Self:
        self._spawn(self._accept_loop)
        return self

    def stop(self) -> None:
        self._stopping.set()
        with self._lock:
            links = list(self._links.values())
        for link in links:
            link.close()
        for thread in list(self._threads):
            thread.join(5)
        with contextlib.suppress(OSError):
            self._sock.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def set_rules(self, rules: list[Rule]) -> None:
        """Replace the rules (connections already open see the new ones from their next message)."""
        with self._lock:
            self.rules = list(rules)

    def hang_all(self) -> None:
        """Stop forwarding on every open connection (a node that froze mid-answer)."""
        with self._lock:
            for link in self._links.values():
                link.hang()

    def close_all(self, *, reset: bool = False) -> None:
        with self._lock:
            links = list(self._links.values())
        for link in links:
            link.close(reset=reset)

    @property
    def open_connections(self) -> int:
        with self._lock:
            return len(self._links)

    def faults_applied(self, action: str | None = None) -> list[Fault]:
        return [f for f in list(self.faults) if action is None or f.action == action]

    # -------------------------------------------------------------- internals

    def _spawn(self, target: Callable[..., None], *args: object) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True, name="faultproxy")
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(thread)
        thread.start()

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                client, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                index = self.connections
                self.connections += 1
                full = len(self._links) >= self.max_connections
            if full:
                self.refused += 1
                client.close()
                continue
            try:
                upstream = socket.create_connection(self.upstream, timeout=self.connect_timeout)
            except OSError:
                self.refused += 1
                with contextlib.suppress(OSError):
                    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                client.close()
                continue
            for sock in (client, upstream):
                sock.settimeout(None)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            link = _Link(self, index, client, upstream)
            with self._lock:
                self._links[index] = link
            self._spawn(self._pump, link, REQUEST)
            self._spawn(self._pump, link, RESPONSE)

    def _pump(self, link: _Link, direction: str) -> None:
        src, dst = (link.client, link.upstream) if direction == REQUEST else (link.upstream, link.client)
        stream = _Stream(link, direction, dst)
        ended = False
        try:
            while not self._stopping.is_set() and not link.closed.is_set():
                try:
                    ready, _, _ = select.select([src], [], [], 0.1)
                except (OSError, ValueError):
                    break
                now = time.monotonic()
                if link.hung_since is not None and now - link.hung_since > self.hang_timeout:
                    break
                if not ready:
                    if now - link.last_activity > self.idle_timeout:
                        break
                    continue
                try:
                    data = src.recv(CHUNK)
                except OSError:
                    break
                if not data:
                    ended = True
                    break
                link.last_activity = now
                stream.feed(data)
        finally:
            if ended and link.hung_since is None and not link.closed.is_set():
                stream.eof()
                link.half_done(dst)
                link.closed.wait(self.idle_timeout)
            link.close()
            with self._lock:
                self._links.pop(link.index, None)

    def _match(self, link: _Link, direction: str, index: int, request: str) -> Rule | None:
        """The first rule that fires for this message. Every rule whose filters pass counts the message
        (``nth``), whether or not an earlier rule fires, so rules can be laid out by position in advance."""
        chosen: Rule | None = None
        with self._lock:
            for rule in self.rules:
                if rule.direction != direction:
                    continue
                if not _selected(rule.connections, link.index) or not _selected(rule.messages, index):
                    continue
                if rule.path is not None and rule.path not in request:
                    continue
                nth = rule.seen
                rule.seen += 1
                if chosen is not None or not _selected(rule.nth, nth):
                    continue
                if rule.times is not None and rule.applied >= rule.times:
                    continue
                if rule.probability < 1.0:
                    draw = random.Random(f"{self.seed}/p/{link.index}/{direction}/{index}").random()
                    if draw >= rule.probability:
                        continue
                rule.applied += 1
                chosen = rule
        return chosen

    def _record(self, fault: Fault) -> None:
        self.faults.append(fault)


@contextlib.contextmanager
def proxied(upstream: tuple[str, int], rules: list[Rule] | None = None, **kw: object) -> Iterator[FaultProxy]:
    """``with proxied(("127.0.0.1", port), [flip("payload")]) as proxy: ...``"""
    proxy = FaultProxy(upstream, rules, **kw)  # type: ignore[arg-type]
    proxy.start()
    try:
        yield proxy
    finally:
        proxy.stop()
