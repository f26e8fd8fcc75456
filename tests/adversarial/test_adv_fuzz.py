"""Seeded fuzzers for the request surface a client controls: S3 requests (methods, targets, query parameters,
headers, bodies, signatures), aws-chunked bodies, bulk API frames and XML bodies.

Each case is generated from ``random.Random(f"{fuzzer}/{SEED}/{case}")`` and signed by botocore, so it gets
past authentication and exercises the handlers, and a failure names the case that replays it. For every case:
the node answers (it never drops a connection without an answer, nor dies), never with a 5xx other than
``501 NotImplemented`` and ``503 SlowDown``, its log has no traceback, and a request it refused stored nothing
(checked afterwards, key by key). Case counts: ``CTXSTORE_SOAK=1`` multiplies them (see ``support.soak``).
"""

from __future__ import annotations

import base64
import hashlib
import os
import random
import secrets
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import msgpack
import pytest
import xxhash
from support.nodes import Node
from support.probes import Admin, alive, log_size, start_probed_node, tracebacks, wait_until
from support.raw import (
    SIGNED_CHUNKS,
    SIGNED_CHUNKS_TRAILER,
    UNSIGNED,
    UNSIGNED_TRAILER,
    RawClient,
    RawResponse,
    aws_chunked,
    bulk_frame,
    crc32_b64,
    presign_v2,
    presign_v4,
    sign,
)
from support.soak import SOAK_TIMEOUT, scaled

from ctxstore import wire

SEED = int(os.environ.get("CTXSTORE_FUZZ_SEED", "20261201"))
S3_CASES = scaled(2000, 40000)
CHUNKED_CASES = scaled(1500, 30000)
BULK_CASES = scaled(2000, 40000)
XML_CASES = scaled(1500, 30000)
MAX_KEYS = 64  # the node's --bulk-max-keys
ALLOWED_5XX = {(501, "NotImplemented"), (503, "SlowDown")}

WEIRD_NUMBERS = ["", "0", "1", "2", "-1", "+1", " 1", "01", "1e3", "0x10", "1.5", "10000", "10001", "1000",
                 "2147483648", "99999999999999999999999", "NaN", "inf", "²", "١", "１", "①", "1_0", "٣٤", "¹"]
WEIRD_TEXT = ["", "a", " ", "%", "/", "//", "..", "../..", "\t", "ü", "日本", "💥", "a" * 300, "\ufeff",
              "\u202e", "<x>", "&amp;", "'\"", "\\", "+", "*", "?", "#", "=", "&", "\r\n", "\n", "\x00", "\x7f"]


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    started = start_probed_node(
        tmp_path_factory.mktemp("adv-fuzz"), "--memory", "256MiB", "--max-object-size", "1MiB",
        "--bulk-max-keys", str(MAX_KEYS), "--bulk-max-bytes", "4MiB", "--max-xml-size", "64KiB",
        "--min-part-size", "1KiB", "--body-timeout", "5", "--max-pin", "60")
    yield started
    started.stop()


@dataclass
class Outcome:
    """What a fuzzer saw: cases run, answers by status, and every broken promise (with its case)."""

    name: str
    cases: int = 0
    statuses: dict[int, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    def saw(self, case: int, reply: RawResponse | None, what: str) -> bool:
        """Count an answer; record a failure for no answer or a forbidden 5xx. True if it was acceptable."""
        self.cases += 1
        if reply is None:
            self.failures.append(f"{self.name} case {case}: no answer (connection dropped) to {what}")
            return False
        self.statuses[reply.status] = self.statuses.get(reply.status, 0) + 1
        allowed = ALLOWED_5XX | ({(501, None), (503, None)} if what.startswith("HEAD") else set())
        if reply.status >= 500 and (reply.status, reply.code) not in allowed:
            self.failures.append(f"{self.name} case {case}: {reply.status} {reply.code} for {what}")
            return False
        return True

    def fail(self, case: int, message: str) -> None:
        self.failures.append(f"{self.name} case {case}: {message}")

    def check(self) -> None:
        assert not self.failures, f"{len(self.failures)} broken promises in {self.cases} cases, e.g.:\n" + "\n".join(
            self.failures[:15])


def send(raw: RawClient, method: str, target: str, headers: dict[str, str], body: bytes) -> RawResponse | None:
    """One request, no retry: a connection the node closes without answering is a finding."""
    try:
        return raw.exchange(method, target, headers, body, retry=False)
    except (ConnectionError, OSError):
        raw.close()
        return None


def header_text(value: str) -> str:
    """A header value as bytes on the wire can carry it (UTF-8 seen as Latin-1); CR/LF/NUL would break the
    request itself, not the server, so they are replaced."""
    text = value.encode("utf-8").decode("latin-1")
    return text.replace("\r", "r").replace("\n", "n").replace("\x00", "0")


def present_keys(raw: RawClient, bucket: str, keys: list[str]) -> list[str]:
    """Which of ``keys`` are present in ``bucket`` (bulk lookups, MAX_KEYS at a time)."""
    present = []
    for start in range(0, len(keys), MAX_KEYS):
        batch = keys[start:start + MAX_KEYS]
        reply = raw.bulk(bucket, "lookup", bulk_frame({"v": 1, "keys": batch, "pin": 0.0}))
        assert reply.status == 200, reply.frame
        present += [k for k, size in zip(batch, reply.frame["sizes"]) if size != -1]
    return present


@pytest.fixture
def healthy(node: Node) -> Iterator[None]:
    start = log_size(node)
    yield
    assert alive(node), "the node died"
    assert tracebacks(node, start) == [], "the node logged tracebacks"
    assert wait_until(lambda: Admin(node).stats()["reserved"] == 0, timeout=10), "reservations left behind"


# ---------------------------------------------------------------------------- the S3 request surface

QUERY = ["uploads", "uploadId", "partNumber", "list-type", "continuation-token", "max-keys", "prefix", "delimiter",
         "marker", "start-after", "encoding-type", "fetch-owner", "delete", "location", "versions", "key-marker",
         "version-id-marker", "max-parts", "part-number-marker", "max-uploads", "acl", "tagging", "versionId",
         "response-content-type", "response-content-disposition", "response-expires", "response-cache-control",
         "response-content-language", "response-content-encoding", "x-id", "attributes", "X-Amz-Expires"]
METHODS = ["GET", "GET", "HEAD", "PUT", "PUT", "PUT", "POST", "POST", "DELETE", "OPTIONS", "PATCH"]
CHECKSUMS = ["crc32", "crc32c", "crc64nvme", "sha1", "sha256"]


@dataclass
class S3World:
    bucket: str
    known: dict[str, bytes]  # keys that exist (read and copy targets only)
    etag: str
    upload: str  # a real multipart upload id on key "mp"
    part_etag: str


def s3_case(rng: random.Random, world: S3World, case: int) -> tuple[str, str, dict[str, str], bytes, str | None]:
    """(method, target, headers, body, fresh key written or None)."""
    method = rng.choice(METHODS)
    fresh: str | None = None
    roll = rng.random()
    if roll < 0.05:
        path = "/"
    elif roll < 0.25:
        bucket = rng.choice([world.bucket, world.bucket, "no-such-bucket", "A", "a", "a" * 70, "_ctx", "xn--ab",
                             "1.2.3.4", "a..b", "a-.b", "metrics", f"fz-{case}"])
        path = "/" + quote(bucket, safe="-_.~")
    else:
        if method in ("PUT", "POST", "DELETE", "PATCH"):
            key = fresh = f"c{case}-" + rng.choice(["k", "a/b", "ü", "a b", "%", "+", "@", "~x", "x" * 900])
        else:
            key = rng.choice(list(world.known) + ["missing", "a/b/", "ü", "x" * 1030, ""])
        path = f"/{world.bucket}/" + quote(key, safe="/-_.~")
    params: list[tuple[str, str]] = []
    for name in rng.sample(QUERY, rng.choice([0, 0, 1, 1, 2, 3, 5])):
        value = rng.choice([
            *WEIRD_NUMBERS, *WEIRD_TEXT, world.upload, world.upload, "2", "url", "URL", "true",
            base64.urlsafe_b64encode(rng.choice(list(world.known)).encode()).decode(), secrets.token_urlsafe(8)])
        if name in ("uploads", "delete", "location", "versions", "acl", "tagging") and rng.random() < 0.7:
            value = ""
        params.append((name, value))
    query = "&".join(f"{quote(k, safe='-_.~')}={quote(v, safe='-_.~')}" for k, v in params)
    target = path + ("?" + query if query else "")
    headers: dict[str, str] = {}
    choices: list[tuple[str, Callable[[], str]]] = [
        ("Range", lambda: rng.choice(["bytes=0-0", "bytes=-1", "bytes=5-", "bytes=99999999999999999999-", "bytes=²-",
                                      "bytes=1-0", "bytes=0-1,2-3", "items=0-1", "bytes=-0", "", "bytes=١-"])),
        ("If-Match", lambda: rng.choice(['"x"', "*", "", world.etag, 'W/"x"', "²"])),
        ("If-None-Match", lambda: rng.choice(['"x"', "*", "", world.etag, '"a", "b"'])),
        ("If-Modified-Since", lambda: rng.choice(["Tue, 01 Dec 2026 00:00:00 GMT", "garbage", "", "0"])),
        ("If-Unmodified-Since", lambda: rng.choice(["Thu, 01 Jan 1970 00:00:00 GMT", "yesterday"])),
        ("Content-MD5", lambda: rng.choice(["", "garbage", "1B2M2Y8AsgTpgAmY7PhCfg==", "AAAA"])),
        (f"x-amz-checksum-{rng.choice(CHECKSUMS)}", lambda: rng.choice(["", "AAAAAA==", "garbage", "AAAAAAAAAAA="])),
        ("x-amz-checksum-algorithm", lambda: rng.choice(["CRC32", "SHA256", "MD5", "", "crc64nvme"])),
        (f"x-amz-meta-{rng.choice(['a', 'ctx-ttl', 'x' * 40, 'Ü'])}", lambda: rng.choice(["v", "", "x" * 2100])),
        ("x-ctx-ttl", lambda: rng.choice(WEIRD_NUMBERS + ["5m", "2h", "7d", "8d", "0.001", "1e9"])),
        ("Content-Type", lambda: rng.choice(["", "text/plain", "x" * 1000, "multipart/form-data; boundary=x"])),
        ("Content-Encoding", lambda: rng.choice(["gzip", "aws-chunked", "", "deflate, gzip"])),
        ("Cache-Control", lambda: rng.choice(["no-cache", "", "x" * 5000])),
        ("x-amz-copy-source", lambda: rng.choice(
            ["", f"/{world.bucket}/known", f"{world.bucket}/known?versionId=null", "/nobucket/x", "%ZZ",
             "/" + world.bucket, f"/{world.bucket}/x?versionId=3", "/_ctx/x"])),
        ("x-amz-metadata-directive", lambda: rng.choice(["COPY", "REPLACE", "", "bogus"])),
        ("x-amz-copy-source-if-match", lambda: rng.choice([world.etag, '"x"'])),
        ("x-amz-decoded-content-length", lambda: rng.choice(WEIRD_NUMBERS)),
        ("x-amz-trailer", lambda: rng.choice(["x-amz-checksum-crc32", "", "x-amz-checksum-md5", "bogus"])),
        ("x-amz-checksum-mode", lambda: rng.choice(["ENABLED", "", "bogus"])),
        ("Expect", lambda: "100-continue"),
    ]
    for name, make in rng.sample(choices, rng.choice([0, 0, 1, 2, 3, 4])):
        headers[name] = header_text(make())
    if method in ("PUT", "POST") and rng.random() < 0.8:
        size = rng.choice([0, 1, 100, 4096, 65536, 1 << 20, (1 << 20) + 1])
        body = rng.randbytes(size) if rng.random() < 0.7 else rng.choice([
            b"<CompleteMultipartUpload><Part><PartNumber>1</PartNumber><ETag>" + world.part_etag.encode()
            + b"</ETag></Part></CompleteMultipartUpload>",
            b"<Delete><Object><Key>zz</Key></Object></Delete>", b"<CreateBucketConfiguration/>", b"<", b""])
    else:
        body = b""
    return method, target, headers, body, fresh


def s3_sign(rng: random.Random, raw: RawClient, method: str, target: str, headers: dict[str, str],
            body: bytes) -> tuple[str, dict[str, str]]:
    """Mostly a valid SigV4 header signature over exactly this request; sometimes none, a wrong one, a wrong
    payload hash, or a presigned target."""
    headers = {"Content-Length": str(len(body)), **headers}
    roll = rng.random()
    if roll < 0.03:
        return target, headers
    if roll < 0.05 and "?" not in target:
        return presign_v4(raw.endpoint, method, target, expires=rng.choice([1, 60, 604800])), headers
    if roll < 0.07 and "?" not in target:
        return presign_v2(raw.endpoint, method, target, expires_at=2_000_000_000), headers
    payload = hashlib.sha256(body).hexdigest()
    if roll < 0.12:
        payload = UNSIGNED
    elif roll < 0.14:
        payload = hashlib.sha256(body + b"x").hexdigest()
    out = sign(raw.endpoint, method, target, payload_hash=payload, headers=headers).headers
    if roll > 0.97:
        out["Authorization"] = out["Authorization"][:-4] + "0000"
    return target, out


@pytest.mark.timeout(SOAK_TIMEOUT)
def test_fuzz_s3_request_surface(node: Node, healthy: None) -> None:
    outcome = Outcome("s3")
    with RawClient(node.port) as raw:
        bucket = "fuzz-s3"
        assert raw.s3("PUT", f"/{bucket}").status == 200
        known = {"known": b"known payload", "a/b": b"", "ü": os.urandom(5000)}
        for key, data in known.items():
            assert raw.s3("PUT", f"/{bucket}/" + quote(key, safe="/-_.~"), data).status == 200
        etag = raw.s3("HEAD", f"/{bucket}/known").headers["etag"]
        upload = raw.s3("POST", f"/{bucket}/mp?uploads").body.split(b"<UploadId>")[1].split(b"</UploadId>")[0]
        part = raw.s3("PUT", f"/{bucket}/mp?partNumber=1&uploadId={upload.decode()}", b"p" * 2048)
        world = S3World(bucket, known, etag, upload.decode(), part.headers["etag"])
        refused: list[str] = []
        for case in range(S3_CASES):
            rng = random.Random(f"s3/{SEED}/{case}")
            method, target, headers, body, fresh = s3_case(rng, world, case)
            target, headers = s3_sign(rng, raw, method, target, headers, body)
            reply = send(raw, method, target, headers, body)
            if not outcome.saw(case, reply, f"{method} {target[:120]} {sorted(headers)}"):
                continue
            assert reply is not None
            if fresh is not None and method in ("PUT", "POST") and reply.status >= 300:
                refused.append(fresh)
            plain_put = (fresh is not None and method == "PUT" and reply.status == 200 and "partNumber" not in target
                         and "x-amz-copy-source" not in headers and "etag" in reply.headers
                         and headers.get("Content-Encoding") != "aws-chunked")
            if plain_put and reply.headers["etag"] != f'"{hashlib.md5(body).hexdigest()}"':
                outcome.fail(case, f"stored something other than the body: {target[:100]}")
        for key in present_keys(raw, bucket, refused):
            outcome.fail(-1, f"a refused write left {key!r} behind")
        for key, data in known.items():
            got = raw.s3("GET", f"/{bucket}/" + quote(key, safe="/-_.~"))
            if got.status == 200 and got.body != data:
                outcome.fail(-1, f"{key!r} changed without a successful write")
    assert outcome.cases == S3_CASES
    outcome.check()


# ---------------------------------------------------------------------------- aws-chunked bodies


def chunked_case(rng: random.Random, raw: RawClient, target: str) -> tuple[dict[str, str], bytes, bytes, int]:
    """A valid aws-chunked upload of a random payload, then 0-2 mutations. Returns (headers, body, payload,
    mutations applied)."""
    payload = rng.randbytes(rng.choice([0, 1, 10, 1000, 8192, 40000]))
    chunk = rng.choice([1, 7, 100, 1024, 8192, 65536] if len(payload) <= 1000 else [1024, 8192, 65536])
    mode = rng.choice([SIGNED_CHUNKS, SIGNED_CHUNKS_TRAILER, UNSIGNED_TRAILER])
    trailer = None
    headers = {"Content-Encoding": "aws-chunked", "x-amz-decoded-content-length": str(len(payload))}
    if mode != SIGNED_CHUNKS:
        if rng.random() < 0.5:
            trailer = ("x-amz-checksum-crc32", crc32_b64(payload))
        else:
            trailer = ("x-amz-checksum-sha256", base64.b64encode(hashlib.sha256(payload).digest()).decode())
        headers["x-amz-trailer"] = trailer[0]
    seed = sign(raw.endpoint, "PUT", target, payload_hash=mode, headers=headers)  # Content-Length: unsigned
    body = aws_chunked(payload, chunk_size=chunk, seed=seed if mode != UNSIGNED_TRAILER else None,
                       trailer=trailer)
    out = dict(seed.headers)
    mutations = 0
    data = bytearray(body)
    for _ in range(rng.choice([0, 0, 1, 1, 1, 2])):
        mutations += 1
        kind = rng.randrange(12)
        if kind == 0 and data:
            i = rng.randrange(len(data))
            data[i] ^= 1 << rng.randrange(8)
        elif kind == 1:
            del data[rng.randrange(len(data) + 1):]
        elif kind == 2:
            data += rng.randbytes(rng.choice([1, 2, 100]))
        elif kind == 3:
            i = rng.randrange(len(data) + 1)
            data[i:i] = rng.randbytes(rng.choice([1, 3]))
        elif kind == 4:
            out["x-amz-decoded-content-length"] = rng.choice([str(len(payload) + 1), str(max(0, len(payload) - 1)),
                                                              "", "-1", "²", "99999999999"])
        elif kind == 5:
            data = bytearray(bytes(data).replace(b"0;chunk-signature=", b"", 1).replace(b"\r\n0\r\n", b"\r\n", 1))
        elif kind == 6:  # the first chunk's size, off by a little
            size = bytes(data).split(b"\r\n", 1)[0].split(b";")[0]
            try:
                other = f"{max(0, int(size, 16) + rng.choice([1, -1, 16])):x}".encode()
            except ValueError:
                other = b"zz"
            data = bytearray(other + bytes(data)[len(size):])
        elif kind == 7:
            data = bytearray(bytes(data).replace(b"chunk-signature=", b"chunk-signature=0", 1))
        elif kind == 8:
            data = bytearray(bytes(data).replace(b";chunk-signature=", b";x=y;chunk-signature=", 1))
        elif kind == 9 and trailer is not None:
            data = bytearray(bytes(data).replace(trailer[1].encode(), b"AAAAAA==", 1))
        elif kind == 10:
            out.pop("x-amz-trailer", None)
        else:
            data = bytearray(bytes(data).replace(b"\r\n", b"\n", 1))
    out["Content-Length"] = str(len(data))
    return out, bytes(data), payload, mutations


@pytest.mark.timeout(SOAK_TIMEOUT)
def test_fuzz_aws_chunked_bodies(node: Node, healthy: None) -> None:
    outcome = Outcome("aws-chunked")
    refused: list[str] = []
    with RawClient(node.port) as raw:
        bucket = "fuzz-chunked"
        assert raw.s3("PUT", f"/{bucket}").status == 200
        for case in range(CHUNKED_CASES):
            rng = random.Random(f"chunked/{SEED}/{case}")
            key = f"c{case}"
            target = f"/{bucket}/{key}"
            headers, body, payload, mutations = chunked_case(rng, raw, target)
            reply = send(raw, "PUT", target, headers, body)
            if not outcome.saw(case, reply, f"PUT with {mutations} mutations"):
                continue
            assert reply is not None
            if reply.status == 200:
                got = raw.s3("GET", target)
                if got.body != payload:
                    outcome.fail(case, f"stored {len(got.body)} bytes that are not the {len(payload)} sent")
            else:
                refused.append(key)
                if mutations == 0:
                    outcome.fail(case, f"a valid aws-chunked upload was refused: {reply.status} {reply.code}")
        for key in present_keys(raw, bucket, refused):
            outcome.fail(-1, f"a refused upload left {key!r} behind")
    assert outcome.cases == CHUNKED_CASES
    outcome.check()


# ---------------------------------------------------------------------------- bulk frames


def random_value(rng: random.Random, depth: int = 0) -> Any:
    roll = rng.randrange(12 if depth < 3 else 9)
    if roll == 0:
        return None
    if roll == 1:
        return rng.choice([True, False])
    if roll == 2:
        return rng.choice([0, 1, -1, 2**31, 2**63 - 1, -(2**63), 2**64 - 1, 16385, 65])
    if roll == 3:
        return rng.choice([0.0, -0.0, 1e308, -1.5, float("nan"), float("inf"), 1e-300])
    if roll == 4:
        return rng.choice(["", "k", "x" * 1025, "ü" * 600, "\x00", "a/b"])
    if roll == 5:
        return rng.randbytes(rng.choice([0, 1, 100]))
    if roll in (6, 7, 8):
        return rng.choice(["k", "a", "b"])
    if roll == 9:
        return [random_value(rng, depth + 1) for _ in range(rng.choice([0, 1, 3]))]
    if roll == 10:
        return {rng.choice(["keys", "v", "x", "sizes"]): random_value(rng, depth + 1) for _ in range(2)}
    return {1: "int key"}  # not a string key: strict_map_key refuses it


def bulk_case(rng: random.Random, case: int) -> tuple[str, bytes, list[str], dict[str, bytes], bool]:
    """(op, body, keys a put named, payload per key as sent, whether the node sees exactly those keys).
    Valid frames, then mutations. Keys carry a random tag, so no bit flip can turn one into another case's."""
    op = rng.choice(list(wire.OPS) + ["put", "put", "put", "nosuchop"])
    n = rng.choice([0, 1, 2, 5, MAX_KEYS, MAX_KEYS + 1])
    tag = rng.randbytes(4).hex()
    keys = [f"c{case:05d}-{i}-{tag}" for i in range(n)]
    blocks = {k: rng.randbytes(rng.choice([0, 1, 100, 5000])) for k in keys}
    head: dict[Any, Any] = {"v": 1, "keys": list(keys)}
    payload = b""
    if op == "put":
        sums = [xxhash.xxh3_64_intdigest(blocks[k]) for k in keys]
        trailer = rng.random() < 0.5  # the checksums in the head, or after the payloads
        head.update(sizes=[len(blocks[k]) for k in keys], ttl=rng.choice([None, 60.0, 0.5]),
                    if_absent=rng.choice([True, False]), **({"trailer": True} if trailer else {"xxh3": sums}))
        payload = b"".join(blocks[k] for k in keys) + (wire.encode_trailer(sums) if trailer else b"")
    elif op in ("lookup", "get"):
        head["pin"] = rng.choice([0.0, 5.0])
    elif op == "touch":
        head["ttl"] = rng.choice([None, 30.0])
    elif op == "pin":
        head["seconds"] = rng.choice([1.0, 30.0])
    fields = ["v", "keys", "sizes", "xxh3", "trailer", "ttl", "if_absent", "pin", "seconds", "junk"]
    raw_mutation = None
    exact = True
    for _ in range(rng.choice([0, 1, 1, 2, 3])):
        kind = rng.randrange(10)
        if kind <= 2:
            field_name = rng.choice(fields)
            exact = exact and field_name != "keys"
            head[field_name] = random_value(rng)
        elif kind == 3:
            head.pop(rng.choice(fields), None)
        elif kind == 4 and isinstance(head.get("keys"), list) and head["keys"]:
            head["keys"][rng.randrange(len(head["keys"]))] = random_value(rng)
            exact = False
        elif kind == 5 and isinstance(head.get("sizes"), list) and head["sizes"]:
            head["sizes"][rng.randrange(len(head["sizes"]))] = rng.choice([-1, 0, 10**12, 2**62, 7])
        elif kind == 6 and payload:
            mutated = bytearray(payload)
            mutated[rng.randrange(len(mutated))] ^= 0x10
            payload = bytes(mutated)
        elif kind == 7:
            payload = payload[:rng.randrange(len(payload) + 1)] if rng.random() < 0.5 else payload + b"xx"
        else:
            raw_mutation = rng.randrange(5)
            exact = exact and raw_mutation not in (0, 2)
    try:
        packed = msgpack.packb(head, use_bin_type=True)
    except (TypeError, ValueError, OverflowError):
        packed = msgpack.packb({"v": 1, "keys": "not a list"})
    body = struct.pack(">I", len(packed)) + packed + payload
    if raw_mutation == 0:
        body = struct.pack(">I", (len(packed) + rng.choice([1, 100, 1 << 24, 0xFFFFFFFF])) & 0xFFFFFFFF) + body[4:]
    elif raw_mutation == 1:
        body = body[:rng.randrange(len(body) + 1)]
    elif raw_mutation == 2 and body:
        mutated = bytearray(body)
        mutated[rng.randrange(len(mutated))] ^= 1 << rng.randrange(8)
        body = bytes(mutated)
    elif raw_mutation == 3:
        body = rng.randbytes(rng.choice([0, 3, 4, 50]))
    return op, body, keys if op == "put" else [], blocks, exact


def decodes(op: str, reply: RawResponse) -> bool:
    """Whether an answer is a well-formed frame the client's own decoders accept (sized by its own lists)."""
    try:
        head, _ = wire.unpack_head(reply.body, wire.ANY_HEAD)
        n_keys = len(head.get("results") or head.get("sizes") or [])
        if reply.status != 200:
            error = wire.decode_error(head)
            return wire.ERROR_STATUS.get(error.error) == reply.status
        if op == "lookup":
            wire.decode_lookup_response(head, n_keys)
        elif op == "get":
            wire.decode_get_head(head, n_keys)
        elif op == "put":
            wire.decode_put_response(head, n_keys)
        elif op == "query":
            wire.decode_query_response(head, len(head.get("tiers") or []))
        else:
            wire.decode_count_response(head)
    except wire.WireError:
        return False
    return True


@pytest.mark.timeout(SOAK_TIMEOUT)
def test_fuzz_bulk_frames(node: Node, healthy: None) -> None:
    outcome = Outcome("bulk")
    with RawClient(node.port) as raw:
        bucket = "fuzz-bulk"
        assert raw.s3("PUT", f"/{bucket}").status == 200
        must_be_absent: list[str] = []
        stored: dict[str, bytes] = {}
        for case in range(BULK_CASES):
            rng = random.Random(f"bulk/{SEED}/{case}")
            op, body, keys, blocks, exact = bulk_case(rng, case)
            target = f"/_ctx/v1/bulk/{bucket}/{op}"
            method = "POST" if rng.random() > 0.02 else rng.choice(["GET", "PUT", "DELETE"])
            headers = sign(raw.endpoint, method, target, payload_hash=UNSIGNED,
                           headers={"Content-Length": str(len(body))}).headers
            reply = send(raw, method, target, headers, body)
            if not outcome.saw(case, reply, f"{method} {op}"):
                continue
            assert reply is not None
            if op in wire.OPS and not decodes(op, reply):
                outcome.fail(case, f"{op}: answer {reply.status} is not a well-formed frame: {reply.body[:80]!r}")
            if op != "put" or (reply.status == 200 and not exact):
                continue  # a 200 to a frame whose keys were altered on the way says nothing about ours
            results = reply.frame.get("results") if reply.status == 200 and isinstance(reply.frame, dict) else None
            for i, key in enumerate(keys):
                if results is not None and i < len(results) and results[i] == "stored":
                    stored[key] = blocks[key]
                elif results is None or (i < len(results) and results[i] == "rejected"):
                    must_be_absent.append(key)
        for key in present_keys(raw, bucket, must_be_absent):
            outcome.fail(-1, f"a refused put left {key!r} behind")
        for key, data in list(stored.items())[:300]:
            got = raw.s3("GET", f"/{bucket}/{key}")
            if got.status == 200 and got.body != data:
                outcome.fail(-1, f"{key!r} holds bytes other than the block sent")
    assert outcome.cases == BULK_CASES
    outcome.check()


# ---------------------------------------------------------------------------- XML bodies

BOMB = ('<?xml version="1.0"?><!DOCTYPE d [<!ENTITY a "aaaaaaaaaa"><!ENTITY b "&a;&a;&a;&a;&a;&a;&a;&a;&a;&a;">'
        '<!ENTITY c "&b;&b;&b;&b;&b;&b;&b;&b;&b;&b;"><!ENTITY d "&c;&c;&c;&c;&c;&c;&c;&c;&c;&c;">]>')
EXTERNAL = '<?xml version="1.0"?><!DOCTYPE d [<!ENTITY x SYSTEM "file:///etc/passwd">]>'


def mutate_xml(rng: random.Random, text: str) -> tuple[bytes, int]:
    mutations = 0
    for _ in range(rng.choice([0, 1, 1, 2, 3])):
        mutations += 1
        kind = rng.randrange(16)
        tags = [t for t in ("Part", "PartNumber", "ETag", "Object", "Key", "Quiet", "Delete",
                            "CompleteMultipartUpload", "LocationConstraint") if f"<{t}>" in text]
        tag = rng.choice(tags) if tags else "X"
        if kind == 0:
            text = text.replace(f"<{tag}>", f"<{tag}x>", 1)
        elif kind == 1:
            text = text.replace(f"</{tag}>", "", 1)
        elif kind == 2:
            start, end = text.find(f"<{tag}>"), text.find(f"</{tag}>")
            if 0 <= start < end:
                element = text[start:end + len(tag) + 3]
                text = text[:start] + element * rng.choice([2, 5, 1001]) + text[end + len(tag) + 3:]
        elif kind == 3:
            depth = rng.choice([50, 500, 5000])
            text = text.replace(f"<{tag}>", f"<{tag}>" + "<n>" * depth + "</n>" * depth, 1)
        elif kind == 4:
            text = BOMB + text.split("?>", 1)[-1].replace(f"<{tag}>", f"<{tag}>&d;", 1)
        elif kind == 5:
            text = EXTERNAL + text.split("?>", 1)[-1].replace(f"<{tag}>", f"<{tag}>&x;", 1)
        elif kind == 6:
            text = text.replace(f"<{tag}>", f"<{tag}><![CDATA[ ]]><!-- c --><?pi x?>", 1)
        elif kind == 7:
            text = text.replace(f"<{tag}>", f'<{tag} a="1" xmlns:q="urn:x">', 1)
        elif kind == 8:
            start, end = text.find(f"<{tag}>"), text.find(f"</{tag}>")
            if 0 <= start < end:
                value = rng.choice(WEIRD_NUMBERS + WEIRD_TEXT[:20] + ["x" * 70000])
                value = value.replace("&", "&amp;").replace("<", "&lt;")
                text = text[:start + len(tag) + 2] + value + text[end:]
        elif kind == 9:
            text = text.replace("<?xml", "<?xml", 1).replace('encoding="UTF-8"', rng.choice(
                ['encoding="UTF-16"', 'encoding="latin-1"', 'encoding="bogus"']), 1)
        elif kind == 10:
            text = "\ufeff" + text
        elif kind == 11:
            text = text.replace(">", f' xmlns="{rng.choice(["http://s3.amazonaws.com/doc/2006-03-01/", "urn:x"])}">', 1)
        elif kind == 12:
            text = text[:rng.randrange(len(text) + 1)]
        elif kind == 13:
            text = text.replace(f"<{tag}>", f"<q:{tag}>", 1)
        elif kind == 14:
            text = "".join(rng.sample(text, len(text))) if len(text) < 400 else text[::-1]
        else:
            data = bytearray(text.encode())
            if data:
                data[rng.randrange(len(data))] = rng.choice([0xFF, 0xC3, 0x00, 0x80])
            return bytes(data[:XML_CAP]), mutations
    # Past the node's 64 KiB limit (refused), but not so far past that the node must close on an unread body.
    return text.encode("utf-8", "surrogatepass")[:XML_CAP], mutations


SENTINELS = ["s1", "s2", "s3"]
XML_CAP = 96 << 10


@pytest.mark.timeout(SOAK_TIMEOUT)
def test_fuzz_xml_bodies(node: Node, healthy: None) -> None:
    outcome = Outcome("xml")
    with RawClient(node.port) as raw:
        bucket = "fuzz-xml"
        assert raw.s3("PUT", f"/{bucket}").status == 200

        def put_sentinels() -> None:
            head = {"v": 1, "keys": SENTINELS, "sizes": [len(k) for k in SENTINELS],
                    "xxh3": [xxhash.xxh3_64_intdigest(k.encode()) for k in SENTINELS], "ttl": None,
                    "if_absent": False}
            reply = raw.bulk(bucket, "put", bulk_frame(head, "".join(SENTINELS).encode()))
            assert reply.status == 200 and set(reply.frame["results"]) == {"stored"}

        def new_upload(key: str) -> tuple[str, list[str], bytes]:
            upload = raw.s3("POST", f"/{bucket}/{key}?uploads").body.split(b"<UploadId>")[1].split(b"</UploadId>")[0]
            parts = [b"a" * 1024, b"b" * 10]
            etags = [raw.s3("PUT", f"/{bucket}/{key}?partNumber={i}&uploadId={upload.decode()}", p).headers["etag"]
                     for i, p in enumerate(parts, 1)]
            return upload.decode(), etags, b"".join(parts)

        put_sentinels()
        current: tuple[str, str, list[str], bytes] | None = None
        for case in range(XML_CASES):
            rng = random.Random(f"xml/{SEED}/{case}")
            kind = rng.choice(["complete", "delete", "create"])
            if kind == "complete":
                if current is None:
                    key = f"mp{case}"
                    current = (key, *new_upload(key))
                key, upload, etags, whole = current
                template = ('<?xml version="1.0" encoding="UTF-8"?><CompleteMultipartUpload>'
                            + "".join(f"<Part><PartNumber>{i}</PartNumber><ETag>{e}</ETag></Part>"
                                      for i, e in enumerate(etags, 1)) + "</CompleteMultipartUpload>")
                body, _ = mutate_xml(rng, template)
                target = f"/{bucket}/{key}?uploadId={upload}"
                reply = send(raw, "POST", target, sign(raw.endpoint, "POST", target, payload_hash=hashlib.sha256(
                    body).hexdigest(), headers={"Content-Length": str(len(body))}).headers, body)
                if not outcome.saw(case, reply, "CompleteMultipartUpload"):
                    continue
                assert reply is not None
                if reply.status == 200:
                    if raw.s3("GET", f"/{bucket}/{key}").body != whole:
                        outcome.fail(case, "a completed upload does not hold its parts")
                    current = None
                elif raw.s3("HEAD", f"/{bucket}/{key}").status != 404:
                    outcome.fail(case, f"a refused CompleteMultipartUpload left {key!r} behind")
            elif kind == "delete":
                template = ('<?xml version="1.0" encoding="UTF-8"?><Delete><Quiet>false</Quiet>'
                            + "".join(f"<Object><Key>{k}</Key></Object>" for k in SENTINELS) + "</Delete>")
                body, _ = mutate_xml(rng, template)
                target = f"/{bucket}?delete"
                headers = sign(raw.endpoint, "POST", target, payload_hash=hashlib.sha256(body).hexdigest(),
                               headers={"Content-Length": str(len(body)),
                                          "Content-MD5": base64.b64encode(hashlib.md5(body).digest()).decode()}).headers
                reply = send(raw, "POST", target, headers, body)
                if not outcome.saw(case, reply, "DeleteObjects"):
                    continue
                assert reply is not None
                if reply.status != 200:
                    missing = set(SENTINELS) - set(present_keys(raw, bucket, SENTINELS))
                    if missing:
                        outcome.fail(case, f"a refused DeleteObjects deleted {sorted(missing)}")
                put_sentinels()
            else:
                name = f"fx-{case}-{secrets.token_hex(2)}"
                template = ('<?xml version="1.0" encoding="UTF-8"?><CreateBucketConfiguration>'
                            "<LocationConstraint>us-east-1</LocationConstraint></CreateBucketConfiguration>")
                body, _ = mutate_xml(rng, template)
                target = f"/{name}"
                reply = send(raw, "PUT", target, sign(raw.endpoint, "PUT", target, payload_hash=hashlib.sha256(
                    body).hexdigest(), headers={"Content-Length": str(len(body))}).headers, body)
                if not outcome.saw(case, reply, "CreateBucket"):
                    continue
                assert reply is not None
                exists = raw.s3("HEAD", target).status == 200
                if reply.status == 200:
                    raw.s3("DELETE", target)
                elif exists:
                    outcome.fail(case, f"a refused CreateBucket created {name}")
    assert outcome.cases == XML_CASES
    outcome.check()
