"""Broken, hostile and slow requests against a real node, on raw sockets.

Every failure must come back as the right S3 error, store nothing, never replace what was stored, and leave
the server serving others.

The request builders (``sign``, ``RawConn``, ``aws_chunked``...) are in ``support.raw``.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import http.client
import os
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from botocore.exceptions import ClientError

from support.nodes import Node, make_client, start_node
from support.raw import (
    SIGNED_CHUNKS,
    SIGNED_CHUNKS_TRAILER,
    UNSIGNED,
    UNSIGNED_TRAILER,
    RawConn,
    RawResponse,
    assert_healthy,
    aws_chunked,
    chunked_headers,
    crc32_b64,
    http_chunked,
    raw_request,
    recv_head,
    sign,
    signed_request,
)

MiB = 1 << 20

# -------------------- fixtures


@pytest.fixture(scope="module")
def limits(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    """A node with small limits: 8 MiB budget, 2 MiB objects, 1 s body and keep-alive timeouts, 8 KiB headers,
    64 KiB XML."""
    node = start_node(tmp_path_factory.mktemp("limits"), "--memory", "8MiB", "--max-object-size", "2MiB",
                      "--body-timeout", "1", "--keepalive-timeout", "1", "--max-header-size", "8KiB",
                      "--max-xml-size", "64KiB")
    yield node
    node.stop()


@pytest.fixture
def limits_bucket(limits: Node) -> Iterator[tuple[Node, object, str]]:
    client = make_client(limits.endpoint, retries={"max_attempts": 1})
    name = "lim-" + secrets.token_hex(5)
    client.create_bucket(Bucket=name)
    yield limits, client, name
    for obj in client.list_objects_v2(Bucket=name).get("Contents", []):
        client.delete_object(Bucket=name, Key=obj["Key"])
    client.delete_bucket(Bucket=name)


@pytest.fixture
def previous(s3, bucket: str) -> Iterator[tuple[str, str, bytes]]:
    """A bucket with an object already stored at ``key``: every failed write to that key must leave it as it
    was, and nothing else may appear in the bucket."""
    key = "blocks/" + secrets.token_hex(4)
    data = b"previous value " + secrets.token_bytes(32)
    s3.put_object(Bucket=bucket, Key=key, Body=data)
    yield bucket, key, data
    assert s3.get_object(Bucket=bucket, Key=key)["Body"].read() == data
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket).get("Contents", [])]
    assert keys == [key], keys


def stored(s3, bucket: str, key: str) -> bytes | None:  # noqa: ANN001
    try:
        return s3.get_object(Bucket=bucket, Key=key)["Body"].read()
    except ClientError as exc:
        assert exc.response["Error"]["Code"] == "NoSuchKey"
        return None


# -------------------- bodies


@pytest.mark.parametrize("framing", ["content-length", "transfer-encoding"])
def test_truncated_aws_chunked_body_stores_nothing(server: Node, s3, previous,  # noqa: ANN001
                                                   framing: str) -> None:
    bucket, key, _ = previous
    data = os.urandom(300_000)
    target = f"/{bucket}/{key}"
    body = aws_chunked(data, trailer=("x-amz-checksum-crc32", crc32_b64(data)))
    headers = chunked_headers(UNSIGNED_TRAILER, len(data), len(body) if framing == "content-length" else None)
    signed = sign(server, "PUT", target, payload_hash=UNSIGNED_TRAILER, headers=headers)
    wire = body if framing == "content-length" else http_chunked(body)
    with RawConn(server) as conn:
        conn.send_head("PUT", target, signed.headers)
        conn.send(wire[: len(wire) // 2])
        time.sleep(0.2)
    # Also a body cut right before its final chunk: the decoder must see that the end never came.
    with RawConn(server) as conn:
        conn.send_head("PUT", target, signed.headers)
        conn.send(wire[: wire.index(b"0\r\nx-amz-checksum")] if framing == "content-length"
                  else http_chunked(body[: body.index(b"0\r\nx-amz-checksum")])[:-5])
        time.sleep(0.2)
    assert_healthy(server)
    assert s3.get_object(Bucket=bucket, Key=key)["Body"].read() == previous[2]
    # The same request sent whole works: what failed above was only the truncation.
    signed = sign(server, "PUT", target, payload_hash=UNSIGNED_TRAILER, headers=headers)
    resp = raw_request(server, "PUT", target, signed.headers, wire)
    assert resp.status == 200, resp
    assert s3.get_object(Bucket=bucket, Key=key)["Body"].read() == data
    s3.put_object(Bucket=bucket, Key=key, Body=previous[2])  # for the fixture's final check


def test_signed_chunks_wrong_signature(server: Node, s3, previous) -> None:  # noqa: ANN001
    bucket, key, _ = previous
    data = os.urandom(200_000)
    target = f"/{bucket}/{key}"
    probe = aws_chunked(data, seed=sign(server, "PUT", target))
    headers = chunked_headers(SIGNED_CHUNKS, len(data), len(probe))
    for corrupt in (0, 2, 4):  # first, middle, final (empty) chunk
        signed = sign(server, "PUT", target, payload_hash=SIGNED_CHUNKS, headers=headers)
        resp = raw_request(server, "PUT", target, signed.headers,
                           aws_chunked(data, seed=signed, corrupt_chunk=corrupt))
        assert (resp.status, resp.code) == (403, "SignatureDoesNotMatch"), (corrupt, resp)
    # Chunks signed with another seed (a replay of another request's chunks) fail too.
    other = sign(server, "PUT", target, payload_hash=SIGNED_CHUNKS, headers=headers)
    signed = sign(server, "PUT", target, payload_hash=SIGNED_CHUNKS, headers={**headers, "x-amz-meta-a": "b"})
    resp = raw_request(server, "PUT", target, signed.headers, aws_chunked(data, seed=other))
    assert (resp.status, resp.code) == (403, "SignatureDoesNotMatch")


@pytest.mark.parametrize("garbage", [b"zz\r\n", b"-5\r\n", b"ffffffffffffffffffff\r\n", b"10 20\r\n",
                                     b"\r\n"], ids=["hex-z", "negative", "huge", "space", "empty"])
def test_garbage_chunk_size_line(server: Node, previous, garbage: bytes) -> None:  # noqa: ANN001
    bucket, key, _ = previous
    data = b"x" * 100
    body = garbage + data + b"\r\n0\r\n\r\n"
    headers = chunked_headers(UNSIGNED_TRAILER, len(data), len(body))
    del headers["x-amz-trailer"]
    signed = sign(server, "PUT", f"/{bucket}/{key}", payload_hash=UNSIGNED_TRAILER, headers=headers)
    resp = raw_request(server, "PUT", f"/{bucket}/{key}", signed.headers, body)
    assert resp.status == 400 and resp.code in ("InvalidRequest", "IncompleteBody", "InvalidArgument"), resp


def test_wrong_content_sha256(server: Node, previous) -> None:  # noqa: ANN001
    bucket, key, _ = previous
    body = b"the real body"
    resp = signed_request(server, "PUT", f"/{bucket}/{key}", body,
                          payload_hash=hashlib.sha256(b"other").hexdigest())
    assert (resp.status, resp.code) == (400, "XAmzContentSHA256Mismatch")
    # Not hex at all: rejected before the body matters.
    resp = signed_request(server, "PUT", f"/{bucket}/{key}", body, payload_hash="not-a-hash")
    assert resp.status == 400 and resp.code == "InvalidArgument"


def test_decoded_length_mismatch(server: Node, previous) -> None:  # noqa: ANN001
    bucket, key, _ = previous
    data = os.urandom(100_000)
    body = aws_chunked(data, trailer=("x-amz-checksum-crc32", crc32_b64(data)))
    for declared in (len(data) + 1, len(data) - 1, 0):
        headers = chunked_headers(UNSIGNED_TRAILER, declared, len(body))
        signed = sign(server, "PUT", f"/{bucket}/{key}", payload_hash=UNSIGNED_TRAILER, headers=headers)
        resp = raw_request(server, "PUT", f"/{bucket}/{key}", signed.headers, body)
        assert (resp.status, resp.code) == (400, "IncompleteBody"), (declared, resp)


def test_trailer_checksum_failures(server: Node, previous) -> None:  # noqa: ANN001
    bucket, key, _ = previous
    data = os.urandom(100_000)
    target = f"/{bucket}/{key}"
    headers = chunked_headers(UNSIGNED_TRAILER, len(data), None)
    crc = "x-amz-checksum-crc32"
    cases = {
        "wrong crc": (aws_chunked(data, trailer=(crc, crc32_b64(b"other"))), 400, "BadDigest"),
        "no trailer": (aws_chunked(data, trailer=(crc, ""))[:-len(f"{crc}:\r\n\r\n")] + b"\r\n",
                       400, "InvalidRequest"),
        "not base64": (aws_chunked(data, trailer=(crc, "%%%%")), 400, "BadDigest"),
    }
    for name, (body, status, code) in cases.items():
        signed = sign(server, "PUT", target, payload_hash=UNSIGNED_TRAILER, headers=headers)
        resp = raw_request(server, "PUT", target, signed.headers, http_chunked(body))
        assert (resp.status, resp.code) == (status, code), (name, resp)
    # A signed trailer whose signature is wrong.
    trailer = ("x-amz-checksum-crc32", crc32_b64(data))
    probe = aws_chunked(data, seed=sign(server, "PUT", target), trailer=trailer)
    headers = chunked_headers(SIGNED_CHUNKS_TRAILER, len(data), len(probe))
    signed = sign(server, "PUT", target, payload_hash=SIGNED_CHUNKS_TRAILER, headers=headers)
    body = aws_chunked(data, seed=signed, trailer=trailer)
    sig_at = body.rindex(b"x-amz-trailer-signature:") + len(b"x-amz-trailer-signature:")
    forged = body[:sig_at] + b"0" * 64 + body[sig_at + 64:]
    resp = raw_request(server, "PUT", target, signed.headers, forged)
    assert (resp.status, resp.code) == (403, "SignatureDoesNotMatch"), resp
    # ... and a trailer changed after signing (the signature covers the trailer's value).
    signed = sign(server, "PUT", target, payload_hash=SIGNED_CHUNKS_TRAILER, headers=headers)
    body = aws_chunked(data, seed=signed, trailer=trailer)
    other = crc32_b64(b"x")
    tampered = body.replace(trailer[1].encode(), other.encode())
    resp = raw_request(server, "PUT", target, signed.headers, tampered)
    assert resp.status in (400, 403) and resp.code in ("SignatureDoesNotMatch", "BadDigest"), resp


def test_content_md5_failures(server: Node, previous) -> None:  # noqa: ANN001
    bucket, key, _ = previous
    body = b"block bytes"
    wrong = base64.b64encode(hashlib.md5(b"other").digest()).decode()
    resp = signed_request(server, "PUT", f"/{bucket}/{key}", body, headers={"Content-MD5": wrong})
    assert (resp.status, resp.code) == (400, "BadDigest")
    resp = signed_request(server, "PUT", f"/{bucket}/{key}", body, headers={"Content-MD5": "not-an-md5"})
    assert (resp.status, resp.code) == (400, "InvalidDigest")


def test_truncated_upload_part_stores_no_part(server: Node, s3, bucket: str) -> None:  # noqa: ANN001
    upload = s3.create_multipart_upload(Bucket=bucket, Key="mp")["UploadId"]
    try:
        first = s3.upload_part(Bucket=bucket, Key="mp", UploadId=upload, PartNumber=1, Body=b"a" * (5 * MiB))
        for part_number in (1, 2):  # replacing an existing part, and adding a new one
            target = f"/{bucket}/mp?partNumber={part_number}&uploadId={upload}"
            signed = sign(server, "PUT", target, headers={"Content-Length": "300000"})
            with RawConn(server) as conn:
                conn.send_head("PUT", target, signed.headers)
                conn.send(b"b" * 100_000)
                time.sleep(0.1)
        parts = s3.list_parts(Bucket=bucket, Key="mp", UploadId=upload)["Parts"]
        assert [(p["PartNumber"], p["ETag"], p["Size"]) for p in parts] == [(1, first["ETag"], 5 * MiB)]
    finally:
        s3.abort_multipart_upload(Bucket=bucket, Key="mp", UploadId=upload)
    assert "Contents" not in s3.list_objects_v2(Bucket=bucket)


def test_content_length_longer_than_body(server: Node, previous) -> None:  # noqa: ANN001
    bucket, key, _ = previous
    body = os.urandom(50_000)
    signed = sign(server, "PUT", f"/{bucket}/{key}", headers={"Content-Length": "100000"})
    with RawConn(server) as conn:
        conn.send_head("PUT", f"/{bucket}/{key}", signed.headers)
        conn.send(body)
        conn.sock.shutdown(socket.SHUT_WR)  # the client says it is done: the body is short
        try:
            answer = conn.read_response()
        except ConnectionError:
            answer = None  # closing without an answer is fine: there is no one left to answer
        if answer is not None:
            assert answer.status == 400 and answer.code in ("IncompleteBody", "RequestTimeout"), answer
    assert_healthy(server)


@pytest.mark.parametrize("value", ["-1", "abc", "1e3", "12, 13", "3\r\nTransfer-Encoding: chunked"],
                         ids=["negative", "word", "float", "two", "with-transfer-encoding"])
def test_bad_content_length(server: Node, previous, value: str) -> None:  # noqa: ANN001
    bucket, key, _ = previous
    signed = sign(server, "PUT", f"/{bucket}/{key}")
    headers = {**signed.headers, "Content-Length": value}
    with RawConn(server) as conn:
        conn.send_head("PUT", f"/{bucket}/{key}", headers)
        conn.send(b"abc")
        resp = conn.read_response()
    assert resp.status == 400, resp
    assert_healthy(server)


def test_plain_chunked_put_without_content_length_is_accepted(server: Node, s3, bucket: str) -> None:  # noqa: ANN001
    """As RGW and MinIO do: the body's length is known once it has arrived (the reservation grows with it)."""
    data = b"some bytes" * 10_000
    signed = sign(server, "PUT", f"/{bucket}/chunked", headers={"Transfer-Encoding": "chunked"})
    resp = raw_request(server, "PUT", f"/{bucket}/chunked", signed.headers, http_chunked(data))
    assert resp.status == 200, resp
    assert s3.get_object(Bucket=bucket, Key="chunked")["Body"].read() == data


def test_early_error_keeps_the_connection_usable(server: Node, bucket: str) -> None:
    """An error answered before a small body was read: the body must not be parsed as the next request."""
    missing = "no-such-bucket-" + secrets.token_hex(4)
    body = b"GET /_ctx/health/live HTTP/1.1\r\nHost: x\r\n\r\n" + b"p" * 5000  # a request smuggled as body
    signed = sign(server, "PUT", f"/{missing}/k", headers={"Content-Length": str(len(body))})
    with RawConn(server) as conn:
        resp = conn.request("PUT", f"/{missing}/k", signed.headers, body)
        assert (resp.status, resp.code) == (404, "NoSuchBucket")
        if "close" in resp.headers.get("connection", ""):
            assert conn.closed_by_peer()
            return
        follow = sign(server, "HEAD", f"/{bucket}")
        again = conn.request("HEAD", f"/{bucket}", follow.headers)
        assert again.status == 200, again  # not the smuggled health check, not a parse error
        assert "x-amz-request-id" in again.headers
        assert not conn.buf


def test_entity_too_large_answered_before_the_body(limits_bucket) -> None:  # noqa: ANN001
    node, client, bucket = limits_bucket
    client.put_object(Bucket=bucket, Key="k", Body=b"old")
    for headers, payload_hash in (
        ({"Content-Length": str(3 * MiB)}, UNSIGNED),
        (chunked_headers(UNSIGNED_TRAILER, 3 * MiB, 3 * MiB + 1000), UNSIGNED_TRAILER),
    ):
        signed = sign(node, "PUT", f"/{bucket}/k", payload_hash=payload_hash, headers=headers)
        with RawConn(node, timeout=5) as conn:
            # No body at all: the answer cannot wait for it.
            conn.send_head("PUT", f"/{bucket}/k", signed.headers)
            resp = conn.read_response()
            assert (resp.status, resp.code) == (400, "EntityTooLarge"), resp
            assert "close" in resp.headers.get("connection", "")
    # Exactly the limit is fine; one byte over is not.
    limit = 2 * MiB
    assert signed_request(node, "PUT", f"/{bucket}/at-limit", os.urandom(limit)).status == 200
    resp = signed_request(node, "PUT", f"/{bucket}/k", b"z" * (limit + 1), headers={"Expect": "100-continue"})
    assert (resp.status, resp.code) == (400, "EntityTooLarge")
    assert client.get_object(Bucket=bucket, Key="k")["Body"].read() == b"old"


def test_key_too_long(server: Node, s3, bucket: str) -> None:  # noqa: ANN001
    longest = "k" * 1024
    assert signed_request(server, "PUT", f"/{bucket}/{longest}", b"ok").status == 200
    resp = signed_request(server, "PUT", f"/{bucket}/{longest}x", b"no")
    assert (resp.status, resp.code) == (400, "KeyTooLongError")
    # Multi-byte UTF-8: 1024 bytes, not characters.
    resp = signed_request(server, "PUT", f"/{bucket}/" + "%C3%A9" * 513, b"no")
    assert (resp.status, resp.code) == (400, "KeyTooLongError")
    assert [o["Key"] for o in s3.list_objects_v2(Bucket=bucket)["Contents"]] == [longest]


def test_headers_too_large(limits_bucket) -> None:  # noqa: ANN001
    node, client, bucket = limits_bucket
    with RawConn(node) as conn:
        conn.send_head("GET", f"/{bucket}/k", {"X-Pad": "p" * (10 * 1024)})
        resp = conn.read_response()
        assert resp.status == 400
        assert conn.closed_by_peer()
    with RawConn(node) as conn:  # one huge request line
        conn.send_head("GET", f"/{bucket}/" + "a" * (9 * 1024), {})
        assert conn.read_response().status in (400, 414)
        assert conn.closed_by_peer()
    with RawConn(node) as conn:  # many small headers
        conn.send_head("GET", f"/{bucket}/k", {f"X-H{i}": "v" * 40 for i in range(300)})
        assert conn.read_response().status == 400
        assert conn.closed_by_peer()
    client.put_object(Bucket=bucket, Key="still", Body=b"serving")
    assert client.get_object(Bucket=bucket, Key="still")["Body"].read() == b"serving"


def test_idle_and_dribbling_connections_are_closed(limits: Node) -> None:
    """Connections that never complete a request's headers do not live forever (slowloris)."""
    with RawConn(limits) as conn:  # says nothing at all
        started = time.monotonic()
        assert conn.closed_by_peer(timeout=5)
        assert time.monotonic() - started < 4
    with RawConn(limits) as conn:  # a header one byte at a time, each byte well within any idle timeout
        started = time.monotonic()
        request = b"GET /_ctx/health/live HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"s" * 100
        closed = False
        for byte in request:
            try:
                conn.send(bytes([byte]))
            except OSError:
                closed = True
                break
            time.sleep(0.05)
            if time.monotonic() - started > 6:
                break
        assert closed or conn.closed_by_peer(timeout=1)
        assert time.monotonic() - started < 5
    with RawConn(limits) as conn:  # idle after a response: keep-alive timeout
        assert conn.request("GET", "/_ctx/health/live", {}).status == 200
        assert conn.closed_by_peer(timeout=5)
    assert_healthy(limits)


BILLION_LAUGHS = (
    b'<?xml version="1.0"?>\n<!DOCTYPE lolz [\n <!ENTITY lol "lol">\n'
    + b"".join(b' <!ENTITY lol%d "%s">\n' % (i, (b"&lol%d;" % (i - 1) if i > 1 else b"&lol;") * 10)
               for i in range(1, 10))
    + b"]>\n"
)


def test_xml_bombs(server: Node, s3, previous) -> None:  # noqa: ANN001
    bucket, key, _ = previous
    bomb = BILLION_LAUGHS + b"<Delete><Object><Key>&lol9;</Key></Object></Delete>"
    started = time.monotonic()
    resp = signed_request(server, "POST", f"/{bucket}?delete", bomb,
                          headers={"Content-MD5": base64.b64encode(hashlib.md5(bomb).digest()).decode()})
    assert (resp.status, resp.code) == (400, "MalformedXML"), resp
    # An external entity (XXE) is no better.
    xxe = (b'<?xml version="1.0"?><!DOCTYPE d [<!ENTITY x SYSTEM "file:///etc/passwd">]>'
           b"<Delete><Object><Key>&x;</Key></Object></Delete>")
    resp = signed_request(server, "POST", f"/{bucket}?delete", xxe)
    assert (resp.status, resp.code) == (400, "MalformedXML")

    upload = s3.create_multipart_upload(Bucket=bucket, Key="mp")["UploadId"]
    try:
        part = s3.upload_part(Bucket=bucket, Key="mp", UploadId=upload, PartNumber=1, Body=b"p")
        complete = (b"<CompleteMultipartUpload><Part><PartNumber>1</PartNumber>"
                    b"<ETag>&lol9;%s</ETag></Part></CompleteMultipartUpload>" % part["ETag"].encode())
        bomb = BILLION_LAUGHS + complete
        resp = signed_request(server, "POST", f"/{bucket}/mp?uploadId={upload}", bomb)
        assert (resp.status, resp.code) == (400, "MalformedXML"), resp
    finally:
        s3.abort_multipart_upload(Bucket=bucket, Key="mp", UploadId=upload)
    assert time.monotonic() - started < 3
    assert_healthy(server)


def test_xml_too_large(limits_bucket) -> None:  # noqa: ANN001
    node, client, bucket = limits_bucket
    client.put_object(Bucket=bucket, Key="keep", Body=b"kept")
    body = b"<Delete>" + b"<Object><Key>keep</Key></Object>" * 3000 + b"</Delete>"  # ~96 KiB > 64 KiB
    resp = signed_request(node, "POST", f"/{bucket}?delete", body, headers={"Expect": "100-continue"})
    assert (resp.status, resp.code) == (400, "MaxMessageLengthExceeded"), resp
    assert client.get_object(Bucket=bucket, Key="keep")["Body"].read() == b"kept"


# -------------------- auth


def test_auth_failures(server: Node, s3, previous) -> None:  # noqa: ANN001
    bucket, key, _ = previous
    target = f"/{bucket}/{key}"
    body = b"attacker"
    resp = signed_request(server, "PUT", target, body, access="CTXNOSUCHKEY00000000")
    assert (resp.status, resp.code) == (403, "InvalidAccessKeyId")
    resp = signed_request(server, "PUT", target, body, secret="wrong-secret-wrong-secret")
    assert (resp.status, resp.code) == (403, "SignatureDoesNotMatch")
    resp = raw_request(server, "PUT", target, {"Content-Length": str(len(body))}, body)
    assert (resp.status, resp.code) == (403, "AccessDenied")
    resp = raw_request(server, "GET", target, {})
    assert (resp.status, resp.code) == (403, "AccessDenied")
    skewed = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(minutes=20)
    resp = signed_request(server, "PUT", target, body, when=skewed)
    assert (resp.status, resp.code) == (403, "RequestTimeTooSkewed")
    resp = signed_request(server, "PUT", target, body,
                          when=datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(minutes=20))
    assert (resp.status, resp.code) == (403, "RequestTimeTooSkewed")
    # A signed header changed after signing.
    signed = sign(server, "GET", target, headers={"Range": "bytes=0-1"})
    resp = raw_request(server, "GET", target, {**signed.headers, "Range": "bytes=0-2"})
    assert (resp.status, resp.code) == (403, "SignatureDoesNotMatch")


def test_authorization_header_spacing(server: Node, s3, bucket: str) -> None:  # noqa: ANN001
    s3.put_object(Bucket=bucket, Key="k", Body=b"v")
    signed = sign(server, "GET", f"/{bucket}/k")
    spaced = signed.headers["Authorization"]
    assert ", SignedHeaders=" in spaced
    for auth in (spaced, spaced.replace(", ", ","), spaced.replace(", ", " ,  ")):
        resp = raw_request(server, "GET", f"/{bucket}/k", {**signed.headers, "Authorization": auth})
        assert (resp.status, resp.body) == (200, b"v"), auth


def test_options_is_rejected(server: Node, bucket: str) -> None:
    resp = raw_request(server, "OPTIONS", f"/{bucket}/k",
                       {"Origin": "http://example.com", "Access-Control-Request-Method": "GET"})
    assert resp.status == 400
    assert resp.code == "CORSResponse"


def test_raw_path_decoding(server: Node, s3, bucket: str) -> None:  # noqa: ANN001
    cases = {"a%2Fb+c": "a/b+c", "sp%20ace+plus": "sp ace+plus", "pct%2525": "pct%25", "at%40%3D": "at@="}
    for raw, key in cases.items():
        resp = signed_request(server, "PUT", f"/{bucket}/{raw}", raw.encode())
        assert resp.status == 200, (raw, resp)
        assert s3.get_object(Bucket=bucket, Key=key)["Body"].read() == raw.encode()
    assert stored(s3, bucket, "sp ace plus") is None  # '+' is not a space
    assert stored(s3, bucket, "a%2Fb+c") is None
    listed = sorted(o["Key"] for o in s3.list_objects_v2(Bucket=bucket)["Contents"])
    assert listed == sorted(cases.values())
    resp = signed_request(server, "PUT", f"/{bucket}/bad%FFutf8", b"x")  # not UTF-8 once decoded
    assert resp.status == 400 and resp.code in ("InvalidArgument", "InvalidURI"), resp


# -------------------- Expect, slowness


def test_expect_continue_error_before_body(server: Node, bucket: str) -> None:
    missing = "no-such-bucket-" + secrets.token_hex(4)
    headers = {"Content-Length": str(2 * MiB), "Expect": "100-continue"}
    signed = sign(server, "PUT", f"/{missing}/k", headers=headers)
    with RawConn(server, timeout=5) as conn:
        conn.send_head("PUT", f"/{missing}/k", signed.headers)
        resp = conn.read_response()  # never sent the body: the answer must not wait for it
        assert (resp.status, resp.code) == (404, "NoSuchBucket")
        assert conn.interim == []  # no "100 Continue" for a request that is refused
        follow = sign(server, "HEAD", f"/{bucket}")
        if "close" in resp.headers.get("connection", "").lower():
            assert conn.closed_by_peer()
            again = raw_request(server, "HEAD", f"/{bucket}", follow.headers)
        else:
            again = conn.request("HEAD", f"/{bucket}", follow.headers)
        assert again.status == 200
    # The same for a request that fails authentication: no "100 Continue" for it either.
    signed = sign(server, "PUT", f"/{bucket}/k", headers=headers, secret="not-the-secret-at-all")
    with RawConn(server, timeout=5) as conn:
        conn.send_head("PUT", f"/{bucket}/k", signed.headers)
        resp = conn.read_response()
        assert (resp.status, resp.code) == (403, "SignatureDoesNotMatch")
        assert conn.interim == []


def test_boto3_expect_continue_into_missing_bucket(server: Node, bucket: str) -> None:
    client = make_client(server.endpoint, retries={"max_attempts": 1})
    seen: list[dict[str, str]] = []
    client.meta.events.register("before-send.s3.PutObject",
                                lambda request, **_: seen.append(dict(request.headers.items())))
    body = os.urandom(2 * MiB)
    with pytest.raises(ClientError) as info:
        client.put_object(Bucket="no-such-bucket-" + secrets.token_hex(4), Key="k", Body=body)
    assert info.value.response["Error"]["Code"] == "NoSuchBucket"
    expects = [h.get("Expect") for h in seen]
    assert expects and all(e in (b"100-continue", "100-continue") for e in expects), seen
    client.put_object(Bucket=bucket, Key="k", Body=body)
    assert client.get_object(Bucket=bucket, Key="k")["Body"].read() == body
    client.close()


def test_slow_body_times_out(limits_bucket) -> None:  # noqa: ANN001
    node, client, bucket = limits_bucket
    client.put_object(Bucket=bucket, Key="k", Body=b"old")
    body = os.urandom(200_000)
    signed = sign(node, "PUT", f"/{bucket}/k", headers={"Content-Length": str(len(body))})
    started = time.monotonic()
    with RawConn(node, timeout=10) as conn:
        conn.send_head("PUT", f"/{bucket}/k", signed.headers)
        conn.send(body[:100_000])
        resp = conn.read_response()  # ... and stall
        elapsed = time.monotonic() - started
        assert (resp.status, resp.code) == (400, "RequestTimeout"), resp
        assert 0.8 <= elapsed < 5, elapsed
        assert "close" in resp.headers.get("connection", "")
    assert client.get_object(Bucket=bucket, Key="k")["Body"].read() == b"old"
    # A stall between aws-chunked chunks too.
    data = os.urandom(100_000)
    wire = aws_chunked(data, trailer=("x-amz-checksum-crc32", crc32_b64(data)), chunk_size=50_000)
    signed = sign(node, "PUT", f"/{bucket}/k", payload_hash=UNSIGNED_TRAILER,
                  headers=chunked_headers(UNSIGNED_TRAILER, len(data), len(wire)))
    with RawConn(node, timeout=10) as conn:
        conn.send_head("PUT", f"/{bucket}/k", signed.headers)
        conn.send(wire[:60_000])
        resp = conn.read_response()
        assert (resp.status, resp.code) == (400, "RequestTimeout"), resp
    assert client.get_object(Bucket=bucket, Key="k")["Body"].read() == b"old"


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def test_memory_budget_under_concurrent_puts(limits_bucket) -> None:  # noqa: ANN001
    node, client, bucket = limits_bucket
    size, writers = MiB, 16
    payloads = {f"c/{i:02d}": os.urandom(size) for i in range(writers)}
    barrier = threading.Barrier(writers, timeout=15)
    results: dict[str, RawResponse | BaseException] = {}

    def put(key: str) -> None:
        try:
            headers = {"Content-Length": str(size), "Expect": "100-continue"}
            signed = sign(node, "PUT", f"/{bucket}/{key}", headers=headers)
            with RawConn(node, timeout=15) as conn:
                conn.send_head("PUT", f"/{bucket}/{key}", signed.headers)
                # Wait for "100 Continue" (room reserved) or a final answer, then let all writers go at once.
                while b"\r\n\r\n" not in conn.buf:
                    if not conn._fill():
                        raise ConnectionError("closed")
                interim = conn.buf.startswith(b"HTTP/1.1 100")
                barrier.wait()
                if interim:
                    conn.send(payloads[key])
                results[key] = conn.read_response()
        except BaseException as exc:  # noqa: BLE001 - reported below
            results[key] = exc

    threads = [threading.Thread(target=put, args=(k,)) for k in payloads]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    statuses = {}
    for key, result in results.items():
        assert isinstance(result, RawResponse), (key, result)
        assert result.status in (200, 503), (key, result)
        if result.status == 503:
            assert result.code == "SlowDown"
            assert int(result.headers["retry-after"]) >= 1
        statuses[key] = result.status
    assert len(statuses) == writers
    assert 200 in statuses.values() and 503 in statuses.values(), statuses  # 16 MiB in flight > 8 MiB budget

    # Then sequential writes well past the budget: old blocks are evicted, every write succeeds.
    for i in range(16):
        key = f"s/{i:02d}"
        payloads[key] = os.urandom(size)
        client.put_object(Bucket=bucket, Key=key, Body=payloads[key])
        statuses[key] = 200

    listed = [o["Key"] for o in client.list_objects_v2(Bucket=bucket).get("Contents", [])]
    assert 0 < len(listed) <= 8
    assert sum(1 for k in listed if k.startswith("s/")) >= 5  # the most recent ones survived
    for key, status in statuses.items():
        data = stored(client, bucket, key)
        if status == 503:
            assert data is None
        elif data is not None:
            assert data == payloads[key], key  # whatever survived is intact


def test_evicted_blocks_free_their_memory(limits_bucket) -> None:  # noqa: ANN001
    """Writing 64 MiB through an 8 MiB budget must not grow the process by anywhere near 64 MiB."""
    node, _, bucket = limits_bucket
    block = os.urandom(MiB)
    conn = http.client.HTTPConnection("127.0.0.1", node.port, timeout=10)

    def put(key: str, body: bytes) -> None:
        signed = sign(node, "PUT", f"/{bucket}/{key}", headers={"Content-Length": str(len(body))})
        conn.request("PUT", f"/{bucket}/{key}", body=body, headers=signed.headers)
        resp = conn.getresponse()
        resp.read()
        assert resp.status == 200

    try:
        for i in range(8):  # warm up: the budget is full and the allocator has seen 1 MiB blocks
            put(f"warm/{i}", block)
        before = _rss_kib(node.proc.pid)
        for i in range(64):
            put(f"blk/{i}", block[:-2] + i.to_bytes(2, "big"))
        grown_mib = (_rss_kib(node.proc.pid) - before) / 1024
    finally:
        conn.close()
    assert grown_mib < 24, f"RSS grew {grown_mib:.0f} MiB for 64 MiB written through an 8 MiB budget"


def head_of_answer_to_whole_request(port: int, head: bytes, body: bytes) -> bytes:
    """Send ``head`` and all of ``body`` before reading anything (as boto3 and the fuzzer do), then read the
    answer's head; b"" or a partial head if the connection went away first."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head + body)
        answer, _, _ = recv_head(sock)
    return answer


def test_an_answer_before_a_large_body_reaches_a_client_still_sending_it(server: Node) -> None:
    """A request refused before its body is read (here: not signed), with more body declared than the node
    drains, gets its answer, as a client that sends the whole body before reading (boto3, the fuzzer) sees it.
    Closing with the client's bytes unread made the kernel send a reset: the client's send failed and it never
    read the answer (the fuzzer's "no answer", about once in ten runs, with bodies just over 1 MiB). The node
    now sends the answer, half-closes and reads the rest away for a bounded time."""
    body = b"x" * (8 << 20)  # more than the loopback socket buffers hold: the node must read it away
    for attempt in range(5):
        head = (f"PUT /no-such-bucket-{attempt}/k HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        answer = head_of_answer_to_whole_request(server.port, head, body)
        assert answer.startswith(b"HTTP/1.1 4"), (attempt, answer[:200])


def test_a_head_the_parser_refuses_is_answered_to_a_client_still_sending_its_body(server: Node) -> None:
    """The same for a head the HTTP parser itself refuses (a header name that is not a token, here a byte
    above 0x7f, as the fuzzer sends): answered 400 by the protocol, which used to close at once with the body
    unread; the fuzzer saw "no answer" on a clean-clone CI run for such a PUT with a 1 MiB body."""
    body = b"x" * (8 << 20)
    for attempt in range(5):
        head = (f"PUT /b-{attempt}/k HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
                f"x-amz-meta-\xdc: v\r\nContent-Length: {len(body)}\r\n\r\n").encode("latin-1")
        answer = head_of_answer_to_whole_request(server.port, head, body)
        assert answer.startswith(b"HTTP/1.1 400"), (attempt, answer[:200])
