"""The bulk API's wire schema, shared by the client and the server (the one place it is defined).

Every call is ``POST /_ctx/v1/bulk/<bucket>/<op>``, signed with SigV4 exactly like an S3 request
(``x-amz-content-sha256: UNSIGNED-PAYLOAD`` is allowed: payloads carry their own XXH3-64). ``_`` cannot start a
bucket name, so the prefix never collides with S3 paths.

A body is one *frame*, optionally followed by raw payload bytes::

    frame   = u32 big-endian length of head ‖ head (msgpack map) ‖ payloads
    payloads = the blocks' bytes back to back, in the order the head lists them

Requests (head maps; ``v`` is the schema version, 1):

=========  ======================================================================  ==========
op         head                                                                    payloads
=========  ======================================================================  ==========
lookup     ``{v, keys: [str], pin: float}``                                        none
get        ``{v, keys: [str], pin: float}``                                        none
put        ``{v, keys: [str], sizes: [int], xxh3: [int], ttl: float|None,          the blocks
           if_absent: bool}``, or ``trailer: true`` instead of ``xxh3``: the        (then, with
           checksums follow the payloads (:data:`TRAILER`), so a client hashes      ``trailer``,
           each block as it sends it (only to a node that announced it:             their XXH3-64s)
           :data:`FEATURES_HEADER`); with ``block_size, tokens: [[int]],
           parents: [str|None], salt: str|None`` (:class:`PutRoute`) to a node
           that announced :data:`FEATURE_PUT_ROUTE`
touch      ``{v, keys: [str], ttl: float|None}``                                   none
pin        ``{v, keys: [str], seconds: float}``                                    none
unpin      ``{v, keys: [str]}``                                                    none
delete     ``{v, keys: [str]}``                                                    none
prefetch   ``{v, keys: [str]}`` — promote these blocks from the flash tier into    none
           RAM in the background (a restore of them follows)
query      ``{v, keys: [str]}``, ``{v, hashes: [u64]}`` (keys ``%016x``: Dynamo's    none
           sequence hashes) or ``{v, tokens: [u32], block_size: int, scheme: str,
           fingerprint: str}`` (the node cuts and hashes the tokens as the client
           does: :func:`query_keys`) — which of these blocks the node holds, per
           tier, for a router; not counted as reads
=========  ======================================================================  ==========

Responses (status 200):

=========  ======================================================================  ==========
lookup     ``{v, prefix: int, sizes: [int], tiers: [int]}`` — size −1 where absent;  none
           ``prefix`` = number of leading keys present; ``tiers``: 0 absent, 1 RAM,
           2 the flash tier (nodes before the flash tier send no ``tiers``)
get        ``{v, sizes: [int], xxh3: [int], expires: [float]}`` — size −1 where      present blocks,
           absent                                                                  in key order
put        ``{v, results: [str]}`` — ``stored`` / ``exists`` / ``rejected``          none
           per key, plus ``errors: {str(index): message}`` for rejected ones
           (string keys: heads are decoded with ``strict_map_key``)
touch/pin  ``{v, count: int}`` — keys that were live (prefetch: blocks it will read  none
/unpin/    from flash; it answers at once)
delete/
prefetch
query      ``{v, prefix: int, ram: int, disk: int, tiers: [int]}`` — ``tiers`` as      none
           lookup's, one per block asked; ``prefix``: leading blocks held in either
           tier, ``ram``: leading blocks held in RAM, ``disk``: blocks of the prefix
           on the flash tier (:func:`query_summary`)
=========  ======================================================================  ==========

Errors: a non-200 status with head ``{v, error: <code>, message: str}``; codes are listed in
:data:`ERROR_STATUS`. A request that fails validation changes nothing.
"""

from __future__ import annotations

import math
import struct
from array import array
from itertools import chain
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack

from .buckets import path_segment
from .hashing import DEFAULT_SCHEME, SCHEMES, block_hashes, digest_seed

VERSION = 1
PREFIX = "/_ctx/v1/bulk"
CONTENT_TYPE = "application/vnd.msgpack"  # of every bulk request and response body
OPS = ("lookup", "get", "put", "touch", "pin", "unpin", "delete", "prefetch", "query")
# Where a block lives, as lookup answers it: absent, RAM, or the flash tier.
TIER_ABSENT, TIER_RAM, TIER_DISK = 0, 1, 2
TIER_NAMES = {TIER_RAM: "ram", TIER_DISK: "disk"}
HEAD_LEN = struct.Struct(">I")
# A put with ``trailer: true`` ends with one of these per key, in head order (existing blocks included): the
# XXH3-64 of each payload, so the sender needs no checksum before its first payload byte.
TRAILER = struct.Struct(">Q")
# What a node's bulk answers announce (a comma-separated list): a client uses a feature with a node only once
# the node said it has it, so new clients keep working with older nodes.
FEATURES_HEADER = "x-ctx-bulk-features"
FEATURE_PUT_TRAILER = "put-trailer"
FEATURES = FEATURE_PUT_TRAILER
# A node whose store events feed a router's index asks for each saved block's tokens, block size and parent
# (:class:`PutRoute`); it announces this only then, so workers of a pod without routers send none of it.
FEATURE_PUT_ROUTE = "put-route"
MAX_ROUTE_BLOCK_SIZE = 4096  # tokens per block a route may name
MAX_HEAD_BYTES = 16 << 20  # a head bigger than this is malformed whatever the key limits say
ABSENT = -1
MAX_KEY_BYTES = 1024
# A query's bounds: the tokens of one prompt (1 Mi tokens: a head of at most 5 MiB) and tokens per block.
QUERY_MAX_TOKENS = 1 << 20
QUERY_MAX_BLOCK_SIZE = 1 << 16

# Error code -> HTTP status. The client maps codes onto its exception tree from this same table.
ERROR_STATUS: dict[str, int] = {
    "MalformedFrame": 400,
    "TooManyKeys": 400,
    "TooManyBytes": 413,
    "InvalidArgument": 400,
    "IncompleteBody": 400,
    "AccessDenied": 403,
    "InvalidAccessKeyId": 403,
    "SignatureDoesNotMatch": 403,
    "RequestTimeTooSkewed": 403,
    "NoSuchBucket": 404,
    "NoSuchOperation": 404,
    "MethodNotAllowed": 405,
    "SlowDown": 503,
    "RequestTimeout": 408,
    "InternalError": 500,
}


class WireError(ValueError):
    """A frame that does not follow the schema; ``code`` is a row of :data:`ERROR_STATUS`."""

    def __init__(self, message: str, code: str = "MalformedFrame") -> None:
        super().__init__(message)
        self.code = code


def path(bucket: str, op: str) -> str:
    """The request path of ``op`` on ``bucket``, each segment percent-encoded (a valid bucket name is left as it
    is; anything else can never reach past its own segment)."""
    return f"{PREFIX}/{path_segment(bucket)}/{path_segment(op)}"


# ---------------------------------------------------------------------------- frames


def pack_head(head: dict[str, Any]) -> bytes:
    """``u32 length ‖ msgpack(head)``."""
    body = msgpack.packb({"v": VERSION, **head}, use_bin_type=True)
    return HEAD_LEN.pack(len(body)) + body


@dataclass(frozen=True)
class HeadSchema:
    """What one kind of head may hold, checked while it is decoded: only these fields (a field of another
    name is refused before its value is decoded), no array or map longer than ``max_items``, no string longer
    than ``max_str`` bytes, no binary at all. So a head of any size costs at most a small multiple of its own
    bytes to decode. ``counted``: the per-key fields, whose overlong arrays are ``TooManyKeys``."""

    fields: frozenset[str]
    max_items: int
    max_str: int = MAX_KEY_BYTES
    counted: frozenset[str] = frozenset()


_REQUEST_FIELDS: dict[str, tuple[str, ...]] = {
    "lookup": ("keys", "pin"), "get": ("keys", "pin"),
    "put": ("keys", "sizes", "xxh3", "trailer", "ttl", "if_absent", "block_size", "tokens", "parents", "salt"),
    "touch": ("keys", "ttl"), "pin": ("keys", "seconds"), "unpin": ("keys",), "delete": ("keys",),
    "prefetch": ("keys",),
    "query": ("keys", "hashes", "tokens", "block_size", "scheme", "fingerprint"),
}
_ANSWER_FIELDS: dict[str, tuple[str, ...]] = {
    "lookup": ("prefix", "sizes", "tiers"), "get": ("sizes", "xxh3", "expires"), "put": ("results", "errors"),
    "count": ("count",), "error": ("error", "message"), "query": ("prefix", "ram", "disk", "tiers"),
}
MAX_MESSAGE_BYTES = 64 << 10  # of an error message or a rejected block's reason


def request_schema(op: str, max_keys: int) -> HeadSchema:
    """The head of a request of ``op`` on a node that takes at most ``max_keys`` keys per call (a query's
    tokens: up to :data:`QUERY_MAX_TOKENS`, its blocks are counted against ``max_keys`` once cut)."""
    items = max(max_keys, QUERY_MAX_TOKENS) if op == "query" else max_keys
    return HeadSchema(frozenset(("v", *_REQUEST_FIELDS[op])), items + 1,
                      counted=frozenset(("keys", "sizes", "xxh3", "hashes", "tokens")))


def answer_schema(kind: str, n_keys: int) -> HeadSchema:
    """The head of an answer (``lookup``, ``get``, ``put``, ``count`` or ``error``) to a call of ``n_keys``."""
    return HeadSchema(frozenset(("v", *_ANSWER_FIELDS[kind])), max(n_keys, 16), MAX_MESSAGE_BYTES)


# Every field of every head, within the frame's own bound: for tools and tests that read any frame.
ANY_HEAD = HeadSchema(frozenset(["v", *(f for fs in (*_REQUEST_FIELDS.values(), *_ANSWER_FIELDS.values()) for f in fs)]),
                      max_items=1 << 20, max_str=MAX_MESSAGE_BYTES)


def unpack_head(buf: bytes | bytearray | memoryview, schema: HeadSchema) -> tuple[dict[str, Any], int]:
    """Parse the head at the start of ``buf`` under ``schema``; returns (head, offset of the first payload byte)."""
    if len(buf) < HEAD_LEN.size:
        raise WireError("frame shorter than its length prefix")
    end = head_length(buf)
    if len(buf) < end:
        raise WireError("frame truncated inside its head", "IncompleteBody")
    body = bytes(buf[HEAD_LEN.size:end])
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=True, max_buffer_size=max(len(body), 1),
                                max_str_len=schema.max_str, max_bin_len=0, max_ext_len=0,
                                max_array_len=schema.max_items, max_map_len=schema.max_items)
    unpacker.feed(body)
    head: dict[str, Any] = {}
    field = ""
    try:
        n = unpacker.read_map_header()
        if n > len(schema.fields):
            raise WireError(f"a head of {n} fields; this one has at most {len(schema.fields)}")
        for _ in range(n):
            name = unpacker.unpack()
            if not isinstance(name, str) or name not in schema.fields:
                raise WireError(f"unknown field {str(name)[:40]!r} in the head")
            field = name
            head[field] = unpacker.unpack()
        if unpacker.tell() != len(body):
            raise WireError("bytes after the head's map")
    except WireError:
        raise
    except Exception as exc:  # msgpack raises several types for garbage and for what exceeds the schema's bounds
        if field in schema.counted and "max_array_len" in str(exc):
            raise WireError(f"'{field}' is longer than this node takes per call", "TooManyKeys") from None
        raise WireError(f"frame head is not valid msgpack: {exc}") from None
    if head.get("v") != VERSION:
        raise WireError(f"unsupported schema version {head.get('v')!r} (this side speaks {VERSION})")
    return head, end


def head_length(prefix: bytes | bytearray | memoryview) -> int:
    """Total bytes of length prefix + head, given at least the first 4 bytes."""
    if len(prefix) < HEAD_LEN.size:
        raise WireError("frame shorter than its length prefix")
    n: int = HEAD_LEN.unpack_from(prefix, 0)[0]
    if n > MAX_HEAD_BYTES:
        raise WireError(f"frame head of {n} bytes exceeds {MAX_HEAD_BYTES}")
    return HEAD_LEN.size + n


# ---------------------------------------------------------------------------- field checks


def _keys(head: dict[str, Any], max_keys: int) -> list[str]:
    keys = head.get("keys")
    if not isinstance(keys, list) or not set(map(type, keys)) <= {str}:
        raise WireError("'keys' must be a list of strings")
    if len(keys) > max_keys:
        raise WireError(f"{len(keys)} keys exceed the limit of {max_keys} per call", "TooManyKeys")
    if keys:
        lengths = list(map(len, keys))
        # A character is at most 4 bytes of UTF-8: only keys of more than 256 characters need encoding to check.
        if min(lengths) == 0 or (max(lengths) > MAX_KEY_BYTES // 4 and any(
                len(k.encode("utf-8", "surrogatepass")) > MAX_KEY_BYTES for k in keys)):
            raise WireError("keys must be 1 to 1024 bytes of UTF-8", "InvalidArgument")
    return keys


def _number(head: dict[str, Any], name: str, default: float | None, *, optional: bool = False) -> float | None:
    value = head.get(name, default)
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise WireError(f"'{name}' must be a non-negative number", "InvalidArgument")
    return float(value)


def _count(head: dict[str, Any], name: str, hi: int) -> int:
    value = head.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= hi:
        raise WireError(f"'{name}' must be an integer in [0, {hi}]")
    return value


def _ints(head: dict[str, Any], name: str, n: int, lo: int, hi: int) -> list[int]:
    values = head.get(name)
    if not isinstance(values, list) or len(values) != n:
        raise WireError(f"'{name}' must be a list with one entry per key")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise WireError(f"'{name}' entries must be integers in [{lo}, {hi}]")
    return values


# ---------------------------------------------------------------------------- requests


@dataclass
class KeysRequest:
    """lookup / get / touch / pin / unpin / delete: keys plus one optional number."""

    keys: list[str]
    pin: float = 0.0  # lookup, get: seconds to pin matched blocks (0 = no pin)
    ttl: float | None = None  # touch
    seconds: float = 0.0  # pin


@dataclass
class PutRoute:
    """What a router's index needs of each block of a put (and the node cannot derive from its key): the
    block's token ids, the key of the block before it in its chain (None: the first block), the block size
    and the namespace's salt (Dynamo's ``cache_salt``). Lists run in the put's key order."""

    block_size: int
    tokens: list[list[int]]
    parents: list[str | None]
    salt: str | None = None
    # As decoded by a node: every block's tokens as u32 in the machine's byte order, back to back (never sent).
    packed: bytes | None = field(default=None, compare=False, repr=False)

    def select(self, idx: Sequence[int]) -> PutRoute:
        """The route of the keys at ``idx``."""
        return PutRoute(self.block_size, [self.tokens[i] for i in idx], [self.parents[i] for i in idx], self.salt)


@dataclass
class PutRequest:
    keys: list[str]
    sizes: list[int]
    xxh3: list[int] | None  # None: the checksums come in the frame's trailer, after the payloads
    ttl: float | None = None
    if_absent: bool = True
    route: PutRoute | None = None  # only to a node that announced FEATURE_PUT_ROUTE

    @property
    def payload_bytes(self) -> int:
        return sum(self.sizes)

    @property
    def body_bytes(self) -> int:
        """What follows the head: the payloads, and the trailer if there is one."""
        return self.payload_bytes + (TRAILER.size * len(self.keys) if self.xxh3 is None else 0)


def encode_keys_request(op: str, req: KeysRequest) -> bytes:
    head: dict[str, Any] = {"keys": req.keys}
    if op in ("lookup", "get"):
        head["pin"] = req.pin
    elif op == "touch":
        head["ttl"] = req.ttl
    elif op == "pin":
        head["seconds"] = req.seconds
    return pack_head(head)


def decode_keys_request(op: str, head: dict[str, Any], max_keys: int) -> KeysRequest:
    keys = _keys(head, max_keys)
    if op in ("lookup", "get"):
        return KeysRequest(keys, pin=_number(head, "pin", 0.0) or 0.0)
    if op == "touch":
        return KeysRequest(keys, ttl=_number(head, "ttl", None, optional=True))
    if op == "pin":
        seconds = _number(head, "seconds", None)
        if not seconds:
            raise WireError("'seconds' must be positive", "InvalidArgument")
        return KeysRequest(keys, seconds=seconds)
    return KeysRequest(keys)


def encode_put_head(req: PutRequest) -> bytes:
    sums: dict[str, Any] = {"trailer": True} if req.xxh3 is None else {"xxh3": req.xxh3}
    route: dict[str, Any] = {}
    if req.route is not None:
        route = {"block_size": req.route.block_size, "tokens": req.route.tokens, "parents": req.route.parents,
                 "salt": req.route.salt}
    return pack_head({"keys": req.keys, "sizes": req.sizes, **sums, "ttl": req.ttl, "if_absent": req.if_absent,
                      **route})


def decode_put_request(head: dict[str, Any], max_keys: int, max_bytes: int) -> PutRequest:
    keys = _keys(head, max_keys)
    sizes = _ints(head, "sizes", len(keys), 0, 1 << 62)  # one block over max_bytes is TooManyBytes, below
    trailer = head.get("trailer", False)
    if trailer is not True and trailer is not False:
        raise WireError("'trailer' must be a boolean")
    if trailer and "xxh3" in head:
        raise WireError("a put has 'xxh3' in its head or a trailer, not both")
    xxh3 = None if trailer else _ints(head, "xxh3", len(keys), 0, (1 << 64) - 1)
    if sum(sizes) > max_bytes:
        raise WireError(f"{sum(sizes)} payload bytes exceed the limit of {max_bytes} per call", "TooManyBytes")
    ttl = _number(head, "ttl", None, optional=True)
    if ttl == 0:
        raise WireError("'ttl' must be positive", "InvalidArgument")
    if_absent = head.get("if_absent", True)
    if not isinstance(if_absent, bool):
        raise WireError("'if_absent' must be a boolean")
    return PutRequest(keys, sizes, xxh3, ttl, if_absent, _route(head, len(keys)))


def _route(head: dict[str, Any], n_keys: int) -> PutRoute | None:
    """A put's :class:`PutRoute`, or None when its head has none (``salt`` is optional, the others go together)."""
    present = [name for name in ("block_size", "tokens", "parents", "salt") if name in head]
    if not present:
        return None
    if not {"block_size", "tokens", "parents"} <= set(present):
        raise WireError("a put's route needs 'block_size', 'tokens' and 'parents'")
    block_size = _count(head, "block_size", MAX_ROUTE_BLOCK_SIZE)
    if block_size == 0:
        raise WireError("'block_size' must be positive", "InvalidArgument")
    tokens = head.get("tokens")
    if not isinstance(tokens, list) or len(tokens) != n_keys:
        raise WireError("'tokens' must be a list with one entry per key")
    try:  # one pass in C: a float, a negative or a token of 2**32 or more fails
        if not set(map(type, tokens)) <= {list} or any(len(block) != block_size for block in tokens):
            raise TypeError
        packed = array("I", chain.from_iterable(tokens)).tobytes()
    except (TypeError, OverflowError):
        raise WireError(f"each 'tokens' entry must be {block_size} token ids in [0, 2**32)") from None
    parents = head.get("parents")
    if not isinstance(parents, list) or len(parents) != n_keys or not set(map(type, parents)) <= {str, type(None)}:
        raise WireError("'parents' must be a list with one key or nil per key")
    salt = head.get("salt")
    if salt is not None and not isinstance(salt, str):
        raise WireError("'salt' must be a string or nil")
    return PutRoute(block_size, tokens, parents, salt, packed)


# ---------------------------------------------------------------------------- responses


@dataclass
class LookupResponse:
    prefix: int
    sizes: list[int]  # ABSENT where missing
    tiers: list[int] | None = None  # TIER_* per key; None from a node that does not say


@dataclass
class GetResponse:
    sizes: list[int]  # ABSENT where missing; present payloads follow the head in key order
    xxh3: list[int]
    expires: list[float]

    @property
    def payload_bytes(self) -> int:
        return sum(s for s in self.sizes if s > 0)


@dataclass
class PutResponse:
    results: list[str]  # "stored" | "exists" | "rejected"
    errors: dict[int, str] = field(default_factory=dict)


@dataclass
class CountResponse:
    count: int


@dataclass
class ErrorResponse:
    error: str
    message: str


def encode_lookup_response(r: LookupResponse) -> bytes:
    head: dict[str, Any] = {"prefix": r.prefix, "sizes": r.sizes}
    if r.tiers is not None:
        head["tiers"] = r.tiers
    return pack_head(head)


def decode_lookup_response(head: dict[str, Any], n_keys: int) -> LookupResponse:
    sizes = _ints(head, "sizes", n_keys, ABSENT, 1 << 62)
    tiers = _ints(head, "tiers", n_keys, TIER_ABSENT, TIER_DISK) if "tiers" in head else None
    if tiers is not None and any((t == TIER_ABSENT) != (s == ABSENT) for s, t in zip(sizes, tiers)):
        raise WireError("'tiers' and 'sizes' disagree on which keys are present")
    return LookupResponse(_count(head, "prefix", n_keys), sizes, tiers)


def encode_get_head(r: GetResponse) -> bytes:
    return pack_head({"sizes": r.sizes, "xxh3": r.xxh3, "expires": r.expires})


def decode_get_head(head: dict[str, Any], n_keys: int) -> GetResponse:
    sizes = _ints(head, "sizes", n_keys, ABSENT, 1 << 62)
    xxh3 = _ints(head, "xxh3", n_keys, 0, (1 << 64) - 1)
    expires = head.get("expires")
    if not isinstance(expires, list) or len(expires) != n_keys or not all(
        isinstance(e, (int, float)) and not isinstance(e, bool) and math.isfinite(e) for e in expires
    ):
        raise WireError("'expires' must be a list with one finite number per key")
    return GetResponse(sizes, xxh3, [float(e) for e in expires])


PUT_RESULTS = ("stored", "exists", "rejected")


def encode_put_response(r: PutResponse) -> bytes:
    return pack_head({"results": r.results, "errors": {str(i): msg for i, msg in r.errors.items()}})


def decode_put_response(head: dict[str, Any], n_keys: int) -> PutResponse:
    results = head.get("results")
    if not isinstance(results, list) or len(results) != n_keys or not all(r in PUT_RESULTS for r in results):
        raise WireError("'results' must hold one of stored/exists/rejected per key")
    errors = head.get("errors") or {}
    if not isinstance(errors, dict):
        raise WireError("'errors' must be a map")
    out: dict[int, str] = {}
    for k, v in errors.items():
        index = int(k) if isinstance(k, str) and k.isdecimal() and k.isascii() else -1
        if not 0 <= index < n_keys or not isinstance(v, str):
            raise WireError("'errors' must map key indexes (as strings) to messages")
        out[index] = v
    return PutResponse(results, out)


def encode_count_response(r: CountResponse) -> bytes:
    return pack_head({"count": r.count})


def decode_count_response(head: dict[str, Any]) -> CountResponse:
    return CountResponse(_count(head, "count", 1 << 62))


def encode_trailer(sums: Sequence[int]) -> bytes:
    """A put's trailer: each block's XXH3-64, in head order."""
    return b"".join(map(TRAILER.pack, sums))


def decode_trailer(data: bytes | bytearray | memoryview, n_keys: int) -> list[int]:
    if len(data) != TRAILER.size * n_keys:
        raise WireError(f"a trailer of {len(data)} bytes for {n_keys} keys")
    return [value for (value,) in TRAILER.iter_unpack(data)]


def has_feature(headers: dict[str, str], feature: str) -> bool:
    """Whether a node's answer (lowercase header names) announces ``feature``."""
    return feature in (f.strip() for f in headers.get(FEATURES_HEADER, "").split(","))


def encode_error(code: str, message: str) -> bytes:
    return pack_head({"error": code, "message": message})


def decode_error(head: dict[str, Any]) -> ErrorResponse:
    return ErrorResponse(str(head.get("error", "InternalError")), str(head.get("message", "")))


def prefix_length(sizes: Sequence[int]) -> int:
    """Number of leading present entries."""
    for i, size in enumerate(sizes):
        if size == ABSENT:
            return i
    return len(sizes)


# ---------------------------------------------------------------------------- the query op


@dataclass
class QueryRequest:
    """Which blocks a query asks about, in prompt order: ``keys`` as stored, ``hashes`` (u64: the keys
    ``%016x``, as Dynamo's sequence hashes are), or ``tokens`` cut into blocks of ``block_size`` and hashed
    with ``scheme`` under the namespace whose :meth:`~ctxstore.hashing.Fingerprint.hexdigest` is
    ``fingerprint`` ("" for the scheme's unsalted keys): exactly one of the three."""

    keys: list[str] | None = None
    hashes: list[int] | None = None
    tokens: Sequence[int] | None = None
    block_size: int = 0  # with tokens
    scheme: str = DEFAULT_SCHEME  # with tokens
    fingerprint: str = ""  # with tokens


@dataclass
class QueryResponse:
    prefix: int  # leading blocks held in either tier
    ram: int  # leading blocks held in RAM
    disk: int  # blocks of the prefix held on the flash tier
    tiers: list[int]  # TIER_* per block asked


def encode_query_request(req: QueryRequest) -> bytes:
    if req.tokens is not None:
        tokens = req.tokens.tolist() if hasattr(req.tokens, "tolist") else list(req.tokens)  # numpy, array
        return pack_head({"tokens": tokens, "block_size": req.block_size, "scheme": req.scheme,
                          "fingerprint": req.fingerprint})
    if req.hashes is not None:
        return pack_head({"hashes": req.hashes})
    return pack_head({"keys": req.keys if req.keys is not None else []})


def decode_query_request(head: dict[str, Any], max_keys: int) -> QueryRequest:
    given = [name for name in ("keys", "hashes", "tokens") if name in head]
    if len(given) != 1:
        raise WireError("a query names its blocks by exactly one of 'keys', 'hashes' or 'tokens'", "InvalidArgument")
    if given != ["tokens"]:
        extra = [name for name in ("block_size", "scheme", "fingerprint") if name in head]
        if extra:
            raise WireError(f"'{extra[0]}' goes with 'tokens' only", "InvalidArgument")
    if "keys" in head:
        return QueryRequest(keys=_keys(head, max_keys))
    if "hashes" in head:
        hashes = head["hashes"]
        if not isinstance(hashes, list):
            raise WireError("'hashes' must be a list of integers")
        if len(hashes) > max_keys:
            raise WireError(f"{len(hashes)} hashes exceed the limit of {max_keys} blocks per query", "TooManyKeys")
        return QueryRequest(hashes=_ints(head, "hashes", len(hashes), 0, (1 << 64) - 1))
    block_size = head.get("block_size")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or not 0 < block_size <= QUERY_MAX_BLOCK_SIZE:
        raise WireError(f"'block_size' must be an integer in [1, {QUERY_MAX_BLOCK_SIZE}]", "InvalidArgument")
    scheme = head.get("scheme", DEFAULT_SCHEME)
    if scheme not in SCHEMES:
        raise WireError(f"'scheme' must be one of {', '.join(SCHEMES)}", "InvalidArgument")
    fingerprint = head.get("fingerprint", "")
    if not isinstance(fingerprint, str) or fingerprint and (
            len(fingerprint) != 32 or fingerprint.strip("0123456789abcdef")):
        raise WireError("'fingerprint' must be a namespace's fingerprint as 32 lowercase hex digits, or empty",
                        "InvalidArgument")
    tokens = head["tokens"]
    if not isinstance(tokens, list):
        raise WireError("'tokens' must be a list of token ids")
    if len(tokens) // block_size > max_keys:
        raise WireError(f"{len(tokens) // block_size} blocks exceed the limit of {max_keys} blocks per query",
                        "TooManyKeys")
    return QueryRequest(tokens=tokens, block_size=block_size, scheme=scheme, fingerprint=fingerprint)


def query_keys(req: QueryRequest) -> list[str]:
    """The keys a query asks about, in prompt order; its tokens are hashed exactly as a client's namespace with
    that fingerprint hashes them (a trailing partial block has no key). A token id out of range is
    InvalidArgument."""
    if req.keys is not None:
        return req.keys
    if req.hashes is not None:
        return [f"{h:016x}" for h in req.hashes]
    seed = digest_seed(bytes.fromhex(req.fingerprint), req.scheme) if req.fingerprint else None
    try:
        return block_hashes(req.tokens or [], req.block_size, req.scheme, seed)
    except (TypeError, ValueError):
        raise WireError("'tokens' must be integers with 0 <= t < 2**32", "InvalidArgument") from None


def query_summary(tiers: Sequence[int]) -> QueryResponse:
    """The answer to a query whose blocks are in ``tiers`` (TIER_* each, in prompt order)."""
    tiers = list(tiers)
    n = len(tiers)
    prefix = tiers.index(TIER_ABSENT) if TIER_ABSENT in tiers else n  # list methods: 2048 blocks in microseconds
    ram = min(prefix, tiers.index(TIER_DISK) if TIER_DISK in tiers else n)
    return QueryResponse(prefix, ram, tiers[:prefix].count(TIER_DISK), tiers)


def encode_query_response(r: QueryResponse) -> bytes:
    return pack_head({"prefix": r.prefix, "ram": r.ram, "disk": r.disk, "tiers": r.tiers})


def decode_query_response(head: dict[str, Any], n_keys: int) -> QueryResponse:
    tiers = head.get("tiers")
    if not isinstance(tiers, list) or len(tiers) != n_keys or not (
            set(map(type, tiers)) <= {int} and set(tiers) <= {TIER_ABSENT, TIER_RAM, TIER_DISK}):
        raise WireError("'tiers' must hold one of 0, 1, 2 per key")
    summary = query_summary(tiers)
    if (_count(head, "prefix", n_keys), _count(head, "ram", n_keys), _count(head, "disk", n_keys)) != (
            summary.prefix, summary.ram, summary.disk):
        raise WireError("'prefix', 'ram' and 'disk' disagree with 'tiers'")
    return summary
