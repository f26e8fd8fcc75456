"""aws-chunked bodies: AWS's published streaming examples, round trips, arbitrary splits, malformed bodies."""

from __future__ import annotations

import hashlib
import hmac
import io
from collections.abc import Iterable, Sequence

import pytest
from botocore.httpchecksum import AwsChunkedWrapper, Crc32Checksum
from hypothesis import given, settings
from hypothesis import strategies as st

from ctxstore_server.protocol.auth import AuthContext, Credentials, authenticate
from ctxstore_server.s3.checksums import Checksum
from ctxstore_server.protocol.chunked import MAX_LINE, AwsChunkedDecoder, ChunkSigner
from ctxstore_server.protocol.errors import RequestError
from ctxstore_server.s3.errors import S3Error, as_s3_error

AWS_KEY = "AKIAIOSFODNN7EXAMPLE"
AWS_SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
AWS_CREDS = Credentials(AWS_KEY, AWS_SECRET, "aws-example")
AMZ_DATE = "20130524T000000Z"
SCOPE = "20130524/us-east-1/s3/aws4_request"
T_2013_05_24 = 1369353600.0
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


# -- an independent encoder for the tests ------------------------------------------------------------------


def _hmac(key: bytes, text: str) -> bytes:
    return hmac.new(key, text.encode(), hashlib.sha256).digest()


def signing_key(secret: str = AWS_SECRET) -> bytes:
    key = _hmac(("AWS4" + secret).encode(), "20130524")
    for part in ("us-east-1", "s3", "aws4_request"):
        key = _hmac(key, part)
    return key


def encode(
    payload: bytes,
    chunk_size: int,
    *,
    seed: str | None = None,
    key: bytes | None = None,
    trailers: Sequence[tuple[str, str]] | None = None,
    blank_after_last_chunk: bool = False,
    closing_blank: bool = True,
) -> bytes:
    """aws-chunked encoding of ``payload``; chunk-signed when ``seed`` is given, trailer-signed if also
    ``trailers`` is."""
    chunks = [payload[i : i + chunk_size] for i in range(0, len(payload), chunk_size)] + [b""]
    previous = seed
    out = bytearray()
    for chunk in chunks:
        out += b"%x" % len(chunk)
        if previous is not None:
            assert key is not None
            string_to_sign = "\n".join(["AWS4-HMAC-SHA256-PAYLOAD", AMZ_DATE, SCOPE, previous, EMPTY_SHA256,
                                        hashlib.sha256(chunk).hexdigest()])
            previous = hmac.new(key, string_to_sign.encode(), hashlib.sha256).hexdigest()
            out += b";chunk-signature=" + previous.encode()
        out += b"\r\n"
        if chunk:
            out += chunk + b"\r\n"
    if trailers is None:
        return bytes(out + b"\r\n")
    if blank_after_last_chunk:
        out += b"\r\n"
    text = b"".join(f"{name}:{value}\n".encode() for name, value in trailers)
    for name, value in trailers:
        out += f"{name}:{value}\r\n".encode()
    if previous is not None:
        assert key is not None
        string_to_sign = "\n".join(["AWS4-HMAC-SHA256-TRAILER", AMZ_DATE, SCOPE, previous,
                                    hashlib.sha256(text).hexdigest()])
        signature = hmac.new(key, string_to_sign.encode(), hashlib.sha256).hexdigest()
        out += b"x-amz-trailer-signature:" + signature.encode() + b"\r\n"
    if closing_blank:
        out += b"\r\n"
    return bytes(out)


def signer(seed: str = "0" * 64) -> ChunkSigner:
    return ChunkSigner(signing_key=signing_key(), amz_date=AMZ_DATE, scope=SCOPE, seed_signature=seed)


def decode(body: bytes, pieces: Iterable[int] | None = None, *, signed: ChunkSigner | None = None,
           trailer: bool = False, max_chunk_size: int = 16 * 1024 * 1024) -> tuple[bytes, dict[str, str]]:
    """Feed ``body`` cut at the given piece sizes (the rest in one piece); returns payload and trailers."""
    decoder = AwsChunkedDecoder(signer=signed, expect_trailer=trailer, max_chunk_size=max_chunk_size)
    payload = bytearray()
    pos = 0
    for size in [*(pieces or []), len(body)]:
        piece = body[pos : pos + size]
        pos += len(piece)
        for view in decoder.feed(piece):
            payload += view
    trailers = decoder.finish()
    assert decoder.decoded_length == len(payload)
    return bytes(payload), trailers


def expect_error(code: str, body: bytes, pieces: Iterable[int] | None = None, **kwargs: object) -> S3Error:
    with pytest.raises(RequestError) as caught:
        decode(body, pieces, **kwargs)  # type: ignore[arg-type]
    error = as_s3_error(caught.value)  # the S3 error a client sees
    assert error.code == code, error.message
    return error


# -- AWS's published examples ------------------------------------------------------------------------------
# "Signature Calculations for the Authorization Header: Transferring Payload in Multiple Chunks (Chunked
# Upload) (AWS Signature Version 4)", Example: PUT Object: 65 KiB of 'a' in 64 KiB chunks.

DOC_PAYLOAD = b"a" * 66560
DOC_HEADERS = {
    "host": "s3.amazonaws.com",
    "x-amz-date": AMZ_DATE,
    "x-amz-storage-class": "REDUCED_REDUNDANCY",
    "x-amz-content-sha256": "STREAMING-AWS4-HMAC-SHA256-PAYLOAD",
    "content-encoding": "aws-chunked",
    "x-amz-decoded-content-length": "66560",
    "content-length": "66824",
    "authorization": (
        "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request,"
        "SignedHeaders=content-encoding;content-length;host;x-amz-content-sha256;x-amz-date;"
        "x-amz-decoded-content-length;x-amz-storage-class,"
        "Signature=4f232c4386841ef735655705268965c44a0e4690baa4adea153f7db9fa80a0a9"
    ),
}
DOC_CHUNK_SIGNATURES = (
    "ad80c730a21e5b8d04586a2213dd63b9a0e99e0e2307b0ade35a65485a288648",
    "0055627c9e194cb4542bae2aa5492e3c1575bbb81b612b7d234b86a503ef5497",
    "b6c6ea8a5354eaf15b3cb7646744f4275b71ea724fed81ceb9323e279d449df9",
)


def doc_body(signatures: Sequence[str] = DOC_CHUNK_SIGNATURES) -> bytes:
    return (
        b"10000;chunk-signature=" + signatures[0].encode() + b"\r\n" + b"a" * 65536 + b"\r\n"
        + b"400;chunk-signature=" + signatures[1].encode() + b"\r\n" + b"a" * 1024 + b"\r\n"
        + b"0;chunk-signature=" + signatures[2].encode() + b"\r\n\r\n"
    )


def doc_signer(headers: dict[str, str] = DOC_HEADERS) -> ChunkSigner:
    ctx = authenticate_doc_request(headers)
    assert ctx.chunk_signer is not None
    return ctx.chunk_signer


def authenticate_doc_request(headers: dict[str, str]) -> AuthContext:
    return authenticate(method="PUT", raw_path="/examplebucket/chunkObject.txt", query_string=b"",
                        headers=headers, lookup={AWS_KEY: AWS_CREDS}.get, now=T_2013_05_24)


def test_aws_published_chunked_example() -> None:
    body = doc_body()
    assert len(body) == 66824  # the example's Content-Length
    ctx = authenticate_doc_request(DOC_HEADERS)
    assert (ctx.scheme, ctx.payload, ctx.content_sha256) == ("v4-header", "streaming-signed", None)
    for pieces in ([], [1] * 100, [88, 65536, 2, 1000], [65000, 1700, 1]):
        assert decode(body, pieces, signed=doc_signer()) == (DOC_PAYLOAD, {})
    # Our own encoder, seeded the same, reproduces the published chunk signatures.
    assert encode(DOC_PAYLOAD, 65536, seed=DOC_HEADERS["authorization"][-64:], key=signing_key()) == body


@pytest.mark.parametrize("which", [0, 1, 2])
def test_aws_published_chunked_example_tampered(which: int) -> None:
    signatures = list(DOC_CHUNK_SIGNATURES)
    signatures[which] = signatures[which][::-1]
    expect_error("SignatureDoesNotMatch", doc_body(signatures), signed=doc_signer())
    # Swapping two signatures breaks the chain too.
    swapped = list(DOC_CHUNK_SIGNATURES)
    swapped[0], swapped[1] = swapped[1], swapped[0]
    expect_error("SignatureDoesNotMatch", doc_body(swapped), signed=doc_signer())


def test_aws_published_chunked_example_modified_data() -> None:
    body = bytearray(doc_body())
    body[1000] = ord("b")
    expect_error("SignatureDoesNotMatch", bytes(body), signed=doc_signer())


# "Signature calculations for trailing headers (chunked uploads) (AWS Signature Version 4)": the same upload
# with a CRC32C trailer. The page's Authorization line lists content-length among the signed headers but its
# canonical request (whose hash, 44d48b8c..., gives the published seed) does not: we follow the canonical
# request.
TRAILER_HEADERS = {
    **{k: v for k, v in DOC_HEADERS.items() if k not in ("authorization", "content-length")},
    "x-amz-content-sha256": "STREAMING-AWS4-HMAC-SHA256-PAYLOAD-TRAILER",
    "x-amz-trailer": "x-amz-checksum-crc32c",
    "content-length": "66946",
    "authorization": (
        "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request,"
        "SignedHeaders=content-encoding;host;x-amz-content-sha256;x-amz-date;x-amz-decoded-content-length;"
        "x-amz-storage-class;x-amz-trailer,"
        "Signature=106e2a8a18243abcf37539882f36619c00e2dfc72633413f02d3b74544bfeb8e"
    ),
}
TRAILER_CHUNK_SIGNATURES = (
    "b474d8862b1487a5145d686f57f013e54db672cee1c953b3010fb58501ef5aa2",
    "1c1344b170168f8e65b41376b44b20fe354e373826ccbbe2c1d40a8cae51e5c7",
    "2ca2aba2005185cf7159c6277faf83795951dd77a3a99e6e65d5c9f85863f992",
)
TRAILER_SIGNATURE = "d81f82fc3505edab99d459891051a732e8730629a2e4a59689829ca17fe2e435"


def trailer_doc_body(
    trailer_signature: str = TRAILER_SIGNATURE,
    crc: str = "sOO8/Q==",
    closing: bytes = b"\r\n",
    blank_after_last_chunk: bytes = b"",
) -> bytes:
    s = TRAILER_CHUNK_SIGNATURES
    return (
        b"10000;chunk-signature=" + s[0].encode() + b"\r\n" + b"a" * 65536 + b"\r\n"
        + b"400;chunk-signature=" + s[1].encode() + b"\r\n" + b"a" * 1024 + b"\r\n"
        + b"0;chunk-signature=" + s[2].encode() + b"\r\n" + blank_after_last_chunk
        + b"x-amz-checksum-crc32c:" + crc.encode() + b"\r\n"
        + b"x-amz-trailer-signature:" + trailer_signature.encode() + b"\r\n" + closing
    )


def test_aws_published_trailer_example() -> None:
    ctx = authenticate_doc_request(TRAILER_HEADERS)
    assert ctx.payload == "streaming-signed-trailer"
    body = trailer_doc_body()
    assert len(body) == 66946
    expected = (DOC_PAYLOAD, {"x-amz-checksum-crc32c": "sOO8/Q=="})
    for pieces in ([], [3] * 30000, [66823, 1, 1]):
        assert decode(body, pieces, signed=doc_signer(TRAILER_HEADERS), trailer=True) == expected
    # Encoders differ on the blank lines around the trailers; all of these carry the same signed content.
    for variant in (trailer_doc_body(closing=b""), trailer_doc_body(blank_after_last_chunk=b"\r\n")):
        assert decode(variant, signed=doc_signer(TRAILER_HEADERS), trailer=True) == expected
    # Our encoder reproduces the published body.
    assert encode(DOC_PAYLOAD, 65536, seed=TRAILER_HEADERS["authorization"][-64:], key=signing_key(),
                  trailers=[("x-amz-checksum-crc32c", "sOO8/Q==")]) == body
    checksum = Checksum("crc32c")
    checksum.update(DOC_PAYLOAD)
    assert checksum.b64digest() == "sOO8/Q=="


def test_aws_published_trailer_example_tampered() -> None:
    def check(code: str, body: bytes) -> None:
        expect_error(code, body, signed=doc_signer(TRAILER_HEADERS), trailer=True)

    check("SignatureDoesNotMatch", trailer_doc_body(trailer_signature="0" * 64))
    check("SignatureDoesNotMatch", trailer_doc_body(crc="AAAAAA=="))
    signature_line = b"x-amz-trailer-signature:" + TRAILER_SIGNATURE.encode() + b"\r\n"
    check("SignatureDoesNotMatch", trailer_doc_body().replace(signature_line, b""))
    check("InvalidRequest", trailer_doc_body(closing=b"x-amz-meta-late:1\r\n\r\n"))


# -- round trips -------------------------------------------------------------------------------------------


def test_botocore_unsigned_trailer_body() -> None:
    # The exact bytes boto3 sends for STREAMING-UNSIGNED-PAYLOAD-TRAILER.
    payload = bytes(range(256)) * 300
    wrapper = AwsChunkedWrapper(io.BytesIO(payload), Crc32Checksum, "x-amz-checksum-crc32", chunk_size=8192)
    body = wrapper.read()
    data, trailers = decode(body, [7, 8200, 1, 3], trailer=True)
    assert data == payload
    checksum = Checksum("crc32")
    checksum.update(payload)
    assert trailers == {"x-amz-checksum-crc32": checksum.b64digest()}
    empty = AwsChunkedWrapper(io.BytesIO(b""), Crc32Checksum, "x-amz-checksum-crc32").read()
    assert decode(empty, trailer=True) == (b"", {"x-amz-checksum-crc32": "AAAAAA=="})
    assert decode(b"0\r\n\r\n", trailer=True) == (b"", {})


def test_unsigned_mode_ignores_chunk_signatures() -> None:
    trailers = [("x-amz-checksum-crc32", "AAAAAA==")]
    body = encode(b"xyz" * 1000, 1000, seed="1" * 64, key=signing_key(), trailers=trailers)
    assert decode(body, trailer=True)[0] == b"xyz" * 1000


def test_pieces_are_views_of_the_input() -> None:
    body = encode(b"p" * 5000, 4096, trailers=[])
    decoder = AwsChunkedDecoder(signer=None, expect_trailer=True)
    pieces = decoder.feed(body)
    assert [len(p) for p in pieces] == [4096, 904]
    assert all(p.obj is body for p in pieces)  # no copy of the payload
    assert decoder.finish() == {}


@pytest.mark.parametrize("kind", [bytes, bytearray, memoryview])
def test_input_types(kind: type) -> None:
    payload = b"0123456789" * 100
    body = encode(payload, 64, seed="2" * 64, key=signing_key(), trailers=[("x-amz-checksum-sha256", "x")])
    decoder = AwsChunkedDecoder(signer=signer("2" * 64), expect_trailer=True)
    out = bytearray()
    for start in range(0, len(body), 333):
        for view in decoder.feed(kind(body[start : start + 333])):
            out += view
    assert bytes(out) == payload
    assert decoder.finish() == {"x-amz-checksum-sha256": "x"}


@settings(max_examples=150, deadline=None)
@given(
    payload=st.binary(max_size=3000),
    chunk_size=st.integers(min_value=1, max_value=1100),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=40),
    mode=st.sampled_from(["signed", "signed-trailer", "unsigned-trailer"]),
    blank_after_last_chunk=st.booleans(),
    closing_blank=st.booleans(),
)
def test_any_split_decodes_the_same(payload: bytes, chunk_size: int, cuts: list[int], mode: str,
                                    blank_after_last_chunk: bool, closing_blank: bool) -> None:
    seed = hashlib.sha256(payload).hexdigest()
    trailers = None if mode == "signed" else [("x-amz-checksum-crc32", "AAAAAA=="), ("x-amz-meta-x", "y z")]
    body = encode(payload, chunk_size, seed=None if mode == "unsigned-trailer" else seed, key=signing_key(),
                  trailers=trailers, blank_after_last_chunk=blank_after_last_chunk,
                  closing_blank=closing_blank)
    signed = None if mode == "unsigned-trailer" else signer(seed)
    data, got = decode(body, cuts, signed=signed, trailer=trailers is not None)
    assert data == payload
    assert got == ({} if trailers is None else dict(trailers))


# -- malformed bodies --------------------------------------------------------------------------------------


def test_truncated_body_is_incomplete() -> None:
    payload = b"q" * 300
    body = encode(payload, 100, seed="3" * 64, key=signing_key())
    end_of_data = body.index(b"0;chunk-signature=")
    for cut in range(end_of_data + 10):
        expect_error("IncompleteBody", body[:cut], signed=signer("3" * 64))
    unsigned = encode(payload, 100, trailers=[("x-amz-checksum-crc32", "AAAAAA==")])
    for cut in range(unsigned.index(b"\r\n0\r\n") + 4):
        expect_error("IncompleteBody", unsigned[:cut], trailer=True)
    # Cut inside a trailer line.
    expect_error("IncompleteBody", unsigned[:-5], trailer=True)
    expect_error("IncompleteBody", b"", trailer=False)


def test_wrong_or_missing_chunk_signature() -> None:
    body = encode(b"r" * 300, 100, seed="4" * 64, key=signing_key())
    expect_error("SignatureDoesNotMatch", body, signed=signer("5" * 64))  # another seed
    first_signature = body.split(b"chunk-signature=")[1][:64]
    expect_error("SignatureDoesNotMatch", body.replace(first_signature, b"f" * 64), signed=signer("4" * 64))
    unsigned = encode(b"r" * 300, 100)
    expect_error("SignatureDoesNotMatch", unsigned, signed=signer("4" * 64))
    # A chunk dropped from the middle breaks the chain.
    chunks = body.split(b"\r\n64;")
    expect_error("SignatureDoesNotMatch", chunks[0] + b"\r\n64;" + chunks[2], signed=signer("4" * 64))


def test_wrong_key_signer() -> None:
    body = encode(b"s" * 10, 10, seed="6" * 64, key=signing_key())
    wrong = ChunkSigner(signing_key=signing_key("other"), amz_date=AMZ_DATE, scope=SCOPE,
                        seed_signature="6" * 64)
    expect_error("SignatureDoesNotMatch", body, signed=wrong)


def test_oversized_chunk() -> None:
    body = encode(b"t" * 2048, 2048)
    expect_error("InvalidRequest", body, max_chunk_size=2047)
    assert decode(body, max_chunk_size=2048)[0] == b"t" * 2048
    # Refused at the size line, before any of its data is read.
    decoder = AwsChunkedDecoder(signer=None, expect_trailer=False, max_chunk_size=1024)
    with pytest.raises(RequestError) as caught:
        decoder.feed(b"%x\r\n" % (1 << 40))
    assert as_s3_error(caught.value).code == "InvalidRequest"


@pytest.mark.parametrize(
    "body",
    [
        b"zz\r\nab\r\n0\r\n\r\n",  # not hex
        b"\r\n",  # empty size
        b"0x2\r\nab\r\n0\r\n\r\n",  # int() would take it; the encoding does not
        b"-2\r\nab\r\n0\r\n\r\n",
        b"2 2\r\nab\r\n0\r\n\r\n",
        b"1" * 17 + b"\r\n",  # longer than any 64-bit size
        b"2\nab\r\n0\r\n\r\n",  # bare LF
        b"2\r\nabc\r\n0\r\n\r\n",  # more data than announced
        b"2\r\nab0\r\n\r\n",  # CRLF missing after the data
        b"2\r\nab\r\n0\r\n\r\nextra",  # data after the end
        b"2\r\nab\r\n0\r\nx-amz-checksum-crc32:AAAAAA==\r\n\r\n",  # trailer where none was announced
    ],
)
def test_garbage(body: bytes) -> None:
    expect_error("InvalidRequest", body)
    expect_error("InvalidRequest", body, [1] * len(body))


def test_garbage_trailers() -> None:
    expect_error("InvalidRequest", b"0\r\nno-colon\r\n\r\n", trailer=True)
    expect_error("InvalidRequest", b"0\r\n:value\r\n\r\n", trailer=True)
    expect_error("InvalidRequest", b"0\r\nx-amz-checksum-crc32:\xff\r\n\r\n", trailer=True)
    expect_error("InvalidRequest", b"0\r\n" + b"x-amz-meta-a:" + b"v" * 4000 + b"\r\n" + b"x-amz-meta-b:"
                 + b"v" * 4000 + b"\r\n" + b"x-amz-meta-c:" + b"v" * 4000 + b"\r\n" + b"x-amz-meta-d:"
                 + b"v" * 4000 + b"\r\n" + b"x-amz-meta-e:" + b"v" * 4000 + b"\r\n\r\n", trailer=True)


def test_line_length_is_bounded() -> None:
    # A header line that never ends is refused once it passes MAX_LINE, however it is fed.
    endless = b"1;" + b"x" * (MAX_LINE + 10)
    expect_error("InvalidRequest", endless)
    decoder = AwsChunkedDecoder(signer=None, expect_trailer=False)
    with pytest.raises(RequestError):
        for i in range(len(endless)):
            decoder.feed(endless[i : i + 1])
    # A long but legal extension line is fine.
    ok = b"3;" + b"e" * (MAX_LINE - 10) + b"\r\nabc\r\n0\r\n\r\n"
    assert decode(ok, [1] * 50)[0] == b"abc"
