"""The bulk API's wire schema (ctxstore/wire.py): every message round-trips, garbage only ever raises
WireError, and limits fail with the right codes."""

from __future__ import annotations

import struct
from typing import Any

import msgpack
import pytest
from support import REPO_ROOT
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ctxstore import wire
from ctxstore.wire import WireError

KEYS = ["ns/0a1b", "ns/2c3d", "ns/ünïcode@key"]
MAX_KEYS = 16384
MAX_BYTES = 1 << 30


def head_of(frame: bytes) -> dict[str, Any]:
    head, end = wire.unpack_head(frame, wire.ANY_HEAD)
    assert end == len(frame)
    return head


def frame_of(head: Any) -> bytes:
    body = msgpack.packb(head, use_bin_type=True)
    return struct.pack(">I", len(body)) + body


# ---------------------------------------------------------------------------- round trips, one per message


@pytest.mark.parametrize(("op", "req"), [
    ("lookup", wire.KeysRequest(KEYS, pin=10.0)),
    ("lookup", wire.KeysRequest(KEYS)),
    ("get", wire.KeysRequest(KEYS, pin=2.5)),
    ("touch", wire.KeysRequest(KEYS, ttl=600.0)),
    ("touch", wire.KeysRequest(KEYS, ttl=None)),
    ("pin", wire.KeysRequest(KEYS, seconds=30.0)),
    ("unpin", wire.KeysRequest(KEYS)),
    ("delete", wire.KeysRequest(KEYS)),
])
def test_keys_requests_round_trip(op: str, req: wire.KeysRequest) -> None:
    frame = wire.encode_keys_request(op, req)
    assert wire.decode_keys_request(op, head_of(frame), MAX_KEYS) == req


@pytest.mark.parametrize("ttl", [None, 90.0])
@pytest.mark.parametrize("if_absent", [True, False])
def test_put_request_round_trips(ttl: float | None, if_absent: bool) -> None:
    req = wire.PutRequest(KEYS, [0, 5, 1 << 20], [0, 1, (1 << 64) - 1], ttl, if_absent)
    frame = wire.encode_put_head(req)
    assert wire.decode_put_request(head_of(frame), MAX_KEYS, MAX_BYTES) == req
    assert req.payload_bytes == 5 + (1 << 20)


def test_a_put_with_a_trailer_round_trips_and_counts_the_trailer_in_its_body() -> None:
    req = wire.PutRequest(KEYS, [0, 5, 1 << 20], None)
    head = head_of(wire.encode_put_head(req))
    assert head["trailer"] is True and "xxh3" not in head
    assert wire.decode_put_request(head, MAX_KEYS, MAX_BYTES) == req
    assert req.body_bytes == req.payload_bytes + 8 * len(KEYS)
    sums = [0, 1, (1 << 64) - 1]
    assert wire.decode_trailer(wire.encode_trailer(sums), 3) == sums
    with pytest.raises(WireError):
        wire.decode_trailer(wire.encode_trailer(sums)[:-1], 3)


def test_features_are_read_from_an_answers_headers() -> None:
    assert wire.has_feature({wire.FEATURES_HEADER: wire.FEATURES}, wire.FEATURE_PUT_TRAILER)
    assert wire.has_feature({wire.FEATURES_HEADER: "other, put-trailer"}, wire.FEATURE_PUT_TRAILER)
    assert not wire.has_feature({}, wire.FEATURE_PUT_TRAILER)
    assert not wire.has_feature({wire.FEATURES_HEADER: "put-trailers"}, wire.FEATURE_PUT_TRAILER)


def test_put_request_defaults_to_if_absent() -> None:
    head = head_of(wire.pack_head({"keys": ["k"], "sizes": [1], "xxh3": [7]}))
    assert wire.decode_put_request(head, MAX_KEYS, MAX_BYTES) == wire.PutRequest(["k"], [1], [7], None, True)


def test_lookup_response_round_trips() -> None:
    r = wire.LookupResponse(prefix=1, sizes=[4096, wire.ABSENT, 4096])
    assert wire.decode_lookup_response(head_of(wire.encode_lookup_response(r)), 3) == r


def test_get_head_round_trips() -> None:
    r = wire.GetResponse(sizes=[10, wire.ABSENT, 0], xxh3=[(1 << 64) - 1, 0, 5], expires=[1.7e9, 0.0, 2e9])
    assert wire.decode_get_head(head_of(wire.encode_get_head(r)), 3) == r
    assert r.payload_bytes == 10


def test_put_response_round_trips_with_errors() -> None:
    r = wire.PutResponse(["stored", "exists", "rejected"], {2: "XXH3-64 mismatch"})
    assert wire.decode_put_response(head_of(wire.encode_put_response(r)), 3) == r
    plain = wire.PutResponse(["stored"])
    assert wire.decode_put_response(head_of(wire.encode_put_response(plain)), 1) == plain


def test_count_response_round_trips() -> None:
    r = wire.CountResponse(42)
    assert wire.decode_count_response(head_of(wire.encode_count_response(r))) == r


def test_error_round_trips() -> None:
    frame = wire.encode_error("TooManyKeys", "20000 keys exceed 16384")
    assert wire.decode_error(head_of(frame)) == wire.ErrorResponse("TooManyKeys", "20000 keys exceed 16384")


def test_frame_layout_and_helpers() -> None:
    frame = wire.pack_head({"keys": ["a"]})
    (n,) = struct.unpack(">I", frame[:4])
    assert len(frame) == 4 + n == wire.head_length(frame[:4])
    assert msgpack.unpackb(frame[4:]) == {"v": 1, "keys": ["a"]}
    assert wire.path("b", "get") == "/_ctx/v1/bulk/b/get"
    assert wire.prefix_length([1, 2, wire.ABSENT, 3]) == 2
    assert wire.prefix_length([]) == 0
    assert set(wire.ERROR_STATUS.values()) <= {400, 403, 404, 405, 408, 413, 500, 503}


# ---------------------------------------------------------------------------- limits and bad fields


def test_too_many_keys() -> None:
    head = head_of(wire.encode_keys_request("get", wire.KeysRequest([f"k{i}" for i in range(5)])))
    with pytest.raises(WireError) as info:
        wire.decode_keys_request("get", head, 4)
    assert info.value.code == "TooManyKeys"
    put = head_of(wire.encode_put_head(wire.PutRequest(["a", "b", "c"], [1, 1, 1], [0, 0, 0])))
    with pytest.raises(WireError) as info:
        wire.decode_put_request(put, 2, MAX_BYTES)
    assert info.value.code == "TooManyKeys"


@pytest.mark.parametrize("sizes", [[600, 600], [1025, 0]])
def test_too_many_bytes(sizes: list[int]) -> None:
    head = head_of(wire.encode_put_head(wire.PutRequest(["a", "b"], sizes, [0, 0])))
    with pytest.raises(WireError) as info:
        wire.decode_put_request(head, MAX_KEYS, 1024)
    assert info.value.code == "TooManyBytes"


@pytest.mark.parametrize(("head", "code"), [
    ({"keys": "a"}, "MalformedFrame"),
    ({"keys": [1]}, "MalformedFrame"),
    ({"keys": [""]}, "InvalidArgument"),
    ({"keys": ["x" * 1025]}, "InvalidArgument"),
    ({"keys": ["a"], "sizes": [1, 2], "xxh3": [0]}, "MalformedFrame"),
    ({"keys": ["a"], "sizes": [-1], "xxh3": [0]}, "MalformedFrame"),
    ({"keys": ["a"], "sizes": [True], "xxh3": [0]}, "MalformedFrame"),
    ({"keys": ["a"], "sizes": [1], "xxh3": [-1]}, "MalformedFrame"),
    ({"keys": ["a"], "sizes": [1], "xxh3": [0], "ttl": 0}, "InvalidArgument"),
    ({"keys": ["a"], "sizes": [1], "xxh3": [0], "ttl": -1.0}, "InvalidArgument"),
    ({"keys": ["a"], "sizes": [1], "xxh3": [0], "ttl": float("nan")}, "InvalidArgument"),
    ({"keys": ["a"], "sizes": [1], "xxh3": [0], "if_absent": 1}, "MalformedFrame"),
    ({"keys": ["a"], "sizes": [1], "xxh3": [0], "trailer": True}, "MalformedFrame"),
    ({"keys": ["a"], "sizes": [1], "trailer": 1}, "MalformedFrame"),
    ({"keys": ["a"], "sizes": [1], "trailer": False}, "MalformedFrame"),
])
def test_bad_put_fields(head: dict[str, Any], code: str) -> None:
    with pytest.raises(WireError) as info:
        wire.decode_put_request(head_of(wire.pack_head(head)), MAX_KEYS, MAX_BYTES)
    assert info.value.code == code


def test_bad_keys_request_fields() -> None:
    for op, head in [("pin", {"keys": ["a"]}), ("pin", {"keys": ["a"], "seconds": 0}),
                     ("get", {"keys": ["a"], "pin": -1}), ("touch", {"keys": ["a"], "ttl": "1h"})]:
        with pytest.raises(WireError) as info:
            wire.decode_keys_request(op, head_of(wire.pack_head(head)), MAX_KEYS)
        assert info.value.code == "InvalidArgument", (op, head)


@pytest.mark.parametrize(("frame", "code"), [
    (b"", "MalformedFrame"),
    (b"\x00\x00", "MalformedFrame"),
    (struct.pack(">I", wire.MAX_HEAD_BYTES + 1), "MalformedFrame"),
    (struct.pack(">I", 10) + b"\x81", "IncompleteBody"),
    (frame_of([1, 2]), "MalformedFrame"),
    (frame_of({"v": 2, "keys": []}), "MalformedFrame"),
    (frame_of({"keys": []}), "MalformedFrame"),
    (frame_of({1: 2, "v": 1}), "MalformedFrame"),
    (struct.pack(">I", 1) + b"\xc1", "MalformedFrame"),
])
def test_bad_frames(frame: bytes, code: str) -> None:
    with pytest.raises(WireError) as info:
        wire.unpack_head(frame, wire.ANY_HEAD)
    assert info.value.code == code


def test_head_length_rejects_short_and_huge_prefixes() -> None:
    with pytest.raises(WireError):
        wire.head_length(b"\x00")
    with pytest.raises(WireError):
        wire.head_length(struct.pack(">I", wire.MAX_HEAD_BYTES + 1))


@pytest.mark.parametrize(("decode", "head"), [
    (lambda h: wire.decode_lookup_response(h, 1), {"prefix": True, "sizes": [1]}),
    (lambda h: wire.decode_lookup_response(h, 1), {"prefix": 2, "sizes": [1]}),
    (lambda h: wire.decode_get_head(h, 1), {"sizes": [1], "xxh3": [0], "expires": ["soon"]}),
    (lambda h: wire.decode_put_response(h, 1), {"results": ["stored"], "errors": {"x": "bad"}}),
    (lambda h: wire.decode_put_response(h, 1), {"results": ["stored"], "errors": {"5": "out of range"}}),
    (lambda h: wire.decode_put_response(h, 1), {"results": ["maybe"]}),
    (lambda h: wire.decode_count_response(h), {"count": -1}),
    (lambda h: wire.decode_count_response(h), {"count": False}),
])
def test_bad_responses(decode: Any, head: dict[str, Any]) -> None:
    with pytest.raises(WireError):
        decode({"v": 1, **head})


# ---------------------------------------------------------------------------- properties

key_text = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=40).filter(
    lambda k: len(k.encode()) <= wire.MAX_KEY_BYTES)
ttls = st.none() | st.floats(min_value=1e-3, max_value=1e9, allow_nan=False, allow_infinity=False)
u64 = st.integers(0, (1 << 64) - 1)


@st.composite
def put_requests(draw: st.DrawFn) -> wire.PutRequest:
    keys = draw(st.lists(key_text, max_size=30))
    sizes = draw(st.lists(st.integers(0, 1 << 24), min_size=len(keys), max_size=len(keys)))
    xxh3 = draw(st.none() | st.lists(u64, min_size=len(keys), max_size=len(keys)))
    return wire.PutRequest(keys, sizes, xxh3, draw(ttls), draw(st.booleans()))


@given(put_requests())
def test_put_requests_round_trip(req: wire.PutRequest) -> None:
    assert wire.decode_put_request(head_of(wire.encode_put_head(req)), MAX_KEYS, MAX_BYTES) == req


@given(st.sampled_from(wire.OPS), st.lists(key_text, max_size=30), ttls,
       st.floats(min_value=0, max_value=1e6, allow_nan=False), st.floats(min_value=1e-3, max_value=1e6))
def test_keys_requests_round_trip_any_values(op: str, keys: list[str], ttl: float | None, pin: float,
                                             seconds: float) -> None:
    req = wire.KeysRequest(keys)
    if op in ("lookup", "get"):
        req.pin = pin
    elif op == "touch":
        req.ttl = ttl
    elif op == "pin":
        req.seconds = seconds
    assert wire.decode_keys_request(op, head_of(wire.encode_keys_request(op, req)), MAX_KEYS) == req


@given(st.lists(st.tuples(st.integers(wire.ABSENT, 1 << 40), u64,
                          st.floats(min_value=0, max_value=1e12, allow_nan=False)), max_size=40))
def test_responses_round_trip_any_values(rows: list[tuple[int, int, float]]) -> None:
    sizes = [r[0] for r in rows]
    get = wire.GetResponse(sizes, [r[1] for r in rows], [r[2] for r in rows])
    assert wire.decode_get_head(head_of(wire.encode_get_head(get)), len(rows)) == get
    lookup = wire.LookupResponse(wire.prefix_length(sizes), sizes)
    assert wire.decode_lookup_response(head_of(wire.encode_lookup_response(lookup)), len(rows)) == lookup
    results = [wire.PUT_RESULTS[r[1] % 3] for r in rows]
    put = wire.PutResponse(results, {i: f"error {i}" for i, r in enumerate(results) if r == "rejected"})
    assert wire.decode_put_response(head_of(wire.encode_put_response(put)), len(rows)) == put


def _decode_everything(data: bytes) -> None:
    """Every decoder the server and the client apply to bytes they receive (a head the schema refuses, e.g. one
    with binary values, is a WireError too)."""
    try:
        head, _ = wire.unpack_head(data, wire.ANY_HEAD)
    except WireError:
        return
    for decode in (
        lambda: wire.decode_put_request(head, 100, 1 << 20),
        lambda: wire.decode_keys_request("lookup", head, 100),
        lambda: wire.decode_keys_request("touch", head, 100),
        lambda: wire.decode_keys_request("pin", head, 100),
        lambda: wire.decode_lookup_response(head, 2),
        lambda: wire.decode_get_head(head, 2),
        lambda: wire.decode_put_response(head, 2),
        lambda: wire.decode_count_response(head),
        lambda: wire.decode_error(head),
    ):
        try:
            decode()
        except WireError:
            pass


@settings(max_examples=300)
@given(st.binary(max_size=200))
def test_garbage_bytes_raise_only_wire_errors(data: bytes) -> None:
    try:
        _decode_everything(data)
        _decode_everything(struct.pack(">I", len(data)) + data)
    except WireError:
        pass


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
field_names = st.sampled_from(["keys", "sizes", "xxh3", "ttl", "if_absent", "pin", "seconds", "prefix",
                               "expires", "results", "errors", "count", "error", "message", "tiers"])


# Generating nested values is slow on a loaded machine; how fast the examples are made is not what is tested.
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(field_names, msgpack_values, max_size=6),
       st.dictionaries(field_names, st.lists(msgpack_values, min_size=2, max_size=2), max_size=4))
def test_well_formed_msgpack_with_wrong_fields_raises_only_wire_errors(
    fields: dict[str, Any], pairs: dict[str, Any]
) -> None:
    _decode_everything(frame_of({**fields, **pairs, "v": 1}))


# ---------------------------------------------------------------------------- docs/bulk-api.md stays true

DOC = REPO_ROOT / "docs" / "bulk-api.md"


def test_doc_lists_every_error_code_with_its_status() -> None:
    text = DOC.read_text()
    for code, status in wire.ERROR_STATUS.items():
        assert f"| `{code}` | {status} |" in text, code


def test_doc_worked_example_is_what_the_codec_writes() -> None:
    text = DOC.read_text()
    frame = wire.encode_keys_request("lookup", wire.KeysRequest(["m/00ab", "m/01cd"], pin=10.0))
    dump = "\n".join(
        f"{i:08x}  " + " ".join(f"{b:02x}" for b in frame[i:i + 16]).ljust(48) + "  "
        + "".join(chr(b) if 32 <= b < 127 else "." for b in frame[i:i + 16])
        for i in range(0, len(frame), 16)
    )
    assert dump in text
    answer = wire.encode_lookup_response(wire.LookupResponse(1, [65536, wire.ABSENT]))
    assert answer.hex(" ") in text


# ---------------------------------------------------------------------------- heads decode within bounds


def _raw_frame(head: dict[str, Any]) -> bytes:
    body = msgpack.packb(head, use_bin_type=True)
    return struct.pack(">I", len(body)) + body


def test_an_unknown_field_is_refused_before_its_value_is_decoded() -> None:
    schema = wire.request_schema("lookup", 100)
    junk = _raw_frame({"v": 1, "keys": ["k"], "junk": [[]] * 200_000})
    with pytest.raises(WireError, match="unknown field 'junk'"):
        wire.unpack_head(junk, schema)
    with pytest.raises(WireError, match="unknown field"):  # a field of another op
        wire.unpack_head(_raw_frame({"v": 1, "keys": ["k"], "sizes": [1]}), schema)


def test_overlong_containers_strings_and_binary_are_refused() -> None:
    schema = wire.request_schema("lookup", 100)
    with pytest.raises(WireError) as caught:
        wire.unpack_head(_raw_frame({"v": 1, "keys": ["k"] * 102}), schema)
    assert caught.value.code == "TooManyKeys"
    for head in ({"v": 1, "keys": ["k" * 2000]}, {"v": 1, "keys": [b"k"]}, {"v": 1, "pin": [[0] * 200]}):
        with pytest.raises(WireError) as caught:
            wire.unpack_head(_raw_frame(head), schema)
        assert caught.value.code == "MalformedFrame"
    # At the node's limit exactly: decoded, and the request decoder says TooManyKeys one key further.
    head, _ = wire.unpack_head(_raw_frame({"v": 1, "keys": ["k"] * 101}), schema)
    with pytest.raises(WireError) as caught:
        wire.decode_keys_request("lookup", head, 100)
    assert caught.value.code == "TooManyKeys"
