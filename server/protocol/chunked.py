"""Incremental decoder for ``Content-Encoding: aws-chunked`` request bodies.

An aws-chunked body is a series of chunks, each ``hex-size[;chunk-signature=sig]\\r\\n<data>\\r\\n``,
ended by a chunk of size 0 and, for the ``*-TRAILER`` payload modes, trailer lines ``name:value\\r\\n`` (plus
``x-amz-trailer-signature:sig\\r\\n`` when the trailer is signed) and a closing ``\\r\\n``.

:class:`AwsChunkedDecoder` is fed the body as it arrives (``Request.stream()``) and hands back the payload as
``memoryview`` slices of what it was fed: payload bytes are never copied. It only ever buffers a partial chunk
header or trailer line (capped at :data:`MAX_LINE` bytes), so its memory is bounded whatever the body size.

In the signed modes (``STREAMING-AWS4-HMAC-SHA256-PAYLOAD[-TRAILER]``) a :class:`ChunkSigner`, made by
:func:`ctxstore_server.protocol.auth.authenticate` from the request's seed signature, checks each chunk's signature
once the chunk's data is complete. Payload pieces are therefore handed out *before* their chunk is verified:
the caller must not make the upload visible until :meth:`AwsChunkedDecoder.finish` has returned.
"""

from __future__ import annotations

import hashlib
import hmac
from enum import Enum

from .errors import Reject, RequestError

MAX_LINE = 4096  # longest chunk header or trailer line, CRLF included (a signed header is ~90 bytes)
MAX_TRAILER_BYTES = 16 * 1024  # all trailer lines together
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
_HEX_DIGITS = frozenset(b"0123456789abcdefABCDEF")
_MAX_SIZE_DIGITS = 16  # 64-bit sizes; anything longer is garbage, whatever max_chunk_size says


class ChunkSigner:
    """Verifies the chained signatures of a streaming-signed body.

    Each chunk's signature covers the previous one, starting from the request's seed signature, so chunks
    cannot be dropped, reordered or replayed. Holds the derived signing key, never the secret.
    """

    __slots__ = ("_date_scope", "_key", "_previous")

    def __init__(self, *, signing_key: bytes, amz_date: str, scope: str, seed_signature: str) -> None:
        self._key = signing_key
        self._date_scope = f"{amz_date}\n{scope}\n"
        self._previous = seed_signature

    def verify_chunk(self, chunk_sha256_hex: str, signature: str) -> None:
        """Check one chunk's signature given the SHA-256 of its data; raises ``SignatureDoesNotMatch``."""
        string_to_sign = (
            f"AWS4-HMAC-SHA256-PAYLOAD\n{self._date_scope}{self._previous}\n{EMPTY_SHA256}\n{chunk_sha256_hex}"
        )
        self._check(string_to_sign, signature, "chunk")

    def verify_trailer(self, trailer_bytes: bytes, signature: str) -> None:
        """Check the ``x-amz-trailer-signature``.

        ``trailer_bytes`` is what AWS hashes: each trailer line as sent, without its CRLF, followed by ``\\n``
        (e.g. ``b"x-amz-checksum-crc32c:sOO8/Q==\\n"``).
        """
        digest = hashlib.sha256(trailer_bytes).hexdigest()
        string_to_sign = f"AWS4-HMAC-SHA256-TRAILER\n{self._date_scope}{self._previous}\n{digest}"
        self._check(string_to_sign, signature, "trailer")

    def _check(self, string_to_sign: str, signature: str, what: str) -> None:
        expected = hmac.digest(self._key, string_to_sign.encode("utf-8"), "sha256").hex()
        if not hmac.compare_digest(expected.encode("ascii"), signature.encode("utf-8")):
            raise RequestError(
                Reject.SIGNATURE_MISMATCH, f"The {what} signature we calculated does not match the one sent."
            )
        self._previous = expected


class _State(Enum):
    SIZE = "size line"
    DATA = "chunk data"
    DATA_CRLF = "CRLF after chunk data"
    TRAILER = "trailer"
    END = "end"


def _malformed(detail: str) -> RequestError:
    return RequestError(Reject.INVALID_REQUEST, f"Malformed aws-chunked body: {detail}.")


class AwsChunkedDecoder:
    """Decodes an aws-chunked body fed in pieces split at arbitrary points.

    ``signer`` is the request's :class:`ChunkSigner` for the signed modes, None for
    ``STREAMING-UNSIGNED-PAYLOAD-TRAILER`` (chunk signatures, if any, are then ignored). ``expect_trailer`` is
    True for the ``*-TRAILER`` modes. After any :class:`~.errors.RequestError` the decoder must be discarded.
    """

    def __init__(
        self, *, signer: ChunkSigner | None, expect_trailer: bool, max_chunk_size: int = 16 * 1024 * 1024
    ) -> None:
        self._signer = signer
        self._expect_trailer = expect_trailer
        self._max_chunk_size = max_chunk_size
        self._state = _State.SIZE
        self._line = bytearray()  # a header/trailer line cut by a feed boundary
        self._remaining = 0  # payload bytes still to come in the current chunk
        self._crlf_matched = 0  # bytes of the CRLF after chunk data already seen
        self._chunk_signature = ""
        self._hasher: hashlib._Hash | None = None
        self._decoded = 0
        self._trailers: dict[str, str] = {}
        self._trailer_text = bytearray()  # what the trailer signature covers
        self._trailer_lines = False  # a trailer line has been read
        self._blank_skipped = False
        self._trailer_signed = False

    @property
    def decoded_length(self) -> int:
        """Payload bytes decoded so far (compare with ``x-amz-decoded-content-length``)."""
        return self._decoded

    def feed(self, data: bytes | bytearray | memoryview) -> list[memoryview]:
        """Consume the next piece of the body; returns the payload pieces it completes (possibly none).

        The pieces are slices of ``data``: the caller must not modify ``data`` while it holds them.
        """
        view = memoryview(data)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        searchable = data if isinstance(data, (bytes, bytearray)) else None
        out: list[memoryview] = []
        pos, end = 0, len(view)
        while pos < end:
            state = self._state
            if state is _State.DATA:
                take = min(self._remaining, end - pos)
                piece = view[pos : pos + take]
                if self._hasher is not None:
                    self._hasher.update(piece)
                out.append(piece)
                pos += take
                self._decoded += take
                self._remaining -= take
                if self._remaining == 0:
                    self._state = _State.DATA_CRLF
            elif state is _State.DATA_CRLF:
                while self._crlf_matched < 2 and pos < end:
                    if view[pos] != b"\r\n"[self._crlf_matched]:
                        raise _malformed("chunk data is longer than its size or not followed by CRLF")
                    self._crlf_matched += 1
                    pos += 1
                if self._crlf_matched == 2:
                    self._end_of_chunk()
            elif state is _State.END:
                raise _malformed("data after the end of the body")
            else:
                line, pos = self._take_line(view, searchable, pos)
                if line is None:
                    break
                if state is _State.SIZE:
                    self._on_size_line(line)
                else:
                    self._on_trailer_line(line)
        return out

    def finish(self) -> dict[str, str]:
        """Call at the end of the body: returns the trailers (lowercase names, signature line excluded).

        Raises ``IncompleteBody`` if the body stopped before its final chunk or inside a line. The closing
        empty line is optional: nothing after the last chunk or trailer carries data or signature.
        """
        if self._state is _State.TRAILER and not self._line:
            self._require_trailer_signature()
            self._state = _State.END
        if self._state is not _State.END:
            raise RequestError(Reject.INCOMPLETE_BODY, "The aws-chunked body ended before its final chunk.")
        return dict(self._trailers)

    # -- lines ------------------------------------------------------------------------------------------

    def _take_line(
        self, view: memoryview, searchable: bytes | bytearray | None, pos: int
    ) -> tuple[bytes | None, int]:
        """The next CRLF-terminated line (without CRLF) and the position after it, or (None, end) when the
        line continues past this piece (it is then kept in ``self._line``)."""
        budget = MAX_LINE - len(self._line)
        stop = min(len(view), pos + budget)
        if searchable is not None:
            newline = searchable.find(b"\n", pos, stop)
        else:  # a memoryview cannot search: copy at most one line's worth
            found = bytes(view[pos:stop]).find(b"\n")
            newline = -1 if found < 0 else pos + found
        if newline < 0:
            if stop - pos >= budget:
                raise _malformed(f"line longer than {MAX_LINE} bytes")
            self._line += view[pos:stop]
            return None, stop
        line = bytes(view[pos : newline + 1])
        if self._line:
            line = bytes(self._line) + line
        self._line.clear()
        if not line.endswith(b"\r\n"):
            raise _malformed("line not terminated by CRLF")
        return line[:-2], newline + 1

    def _on_size_line(self, line: bytes) -> None:
        size_text, has_ext, extensions = line.partition(b";")
        size_text = size_text.strip(b" \t")
        if not size_text or len(size_text) > _MAX_SIZE_DIGITS or not _HEX_DIGITS.issuperset(size_text):
            raise _malformed("invalid chunk size")
        size = int(size_text, 16)
        if size > self._max_chunk_size:
            raise _malformed(f"chunk of {size} bytes exceeds the limit of {self._max_chunk_size}")
        if self._signer is not None:
            signature = None
            if has_ext:
                for extension in extensions.split(b";"):
                    name, _, value = extension.strip(b" \t").partition(b"=")
                    if name == b"chunk-signature":
                        signature = value.decode("utf-8", "replace")
            if signature is None:
                raise RequestError(
                    Reject.SIGNATURE_MISMATCH, "A chunk of a signed aws-chunked body has no chunk-signature."
                )
            self._chunk_signature = signature
            self._hasher = hashlib.sha256()
        if size == 0:
            if self._signer is not None:
                self._signer.verify_chunk(EMPTY_SHA256, self._chunk_signature)
            self._state = _State.TRAILER
        else:
            self._remaining = size
            self._state = _State.DATA

    def _end_of_chunk(self) -> None:
        self._crlf_matched = 0
        if self._signer is not None:
            assert self._hasher is not None
            self._signer.verify_chunk(self._hasher.hexdigest(), self._chunk_signature)
        self._state = _State.SIZE

    def _on_trailer_line(self, line: bytes) -> None:
        if not line:
            # Some encoders put a CRLF after the 0-size chunk before the trailers, as after any chunk's data;
            # a blank line before the first trailer is that CRLF, not the end, when trailers are expected.
            if self._expect_trailer and not self._trailer_lines and not self._blank_skipped:
                self._blank_skipped = True
                return
            self._require_trailer_signature()
            self._state = _State.END
            return
        if not self._expect_trailer:
            raise _malformed("trailer in a body whose x-amz-content-sha256 announces none")
        if self._trailer_signed:
            raise _malformed("trailer after x-amz-trailer-signature")
        name, colon, value = line.partition(b":")
        if not colon or not name.strip():
            raise _malformed("trailer line is not name:value")
        try:
            key = name.strip().decode("ascii").lower()
            text = value.strip().decode("utf-8")
        except UnicodeDecodeError:
            raise _malformed("trailer is not text") from None
        if key == "x-amz-trailer-signature":
            if self._signer is not None:
                self._signer.verify_trailer(bytes(self._trailer_text), text)
                self._trailer_signed = True
            return  # in unsigned mode a signature means nothing; it is not a trailer either
        if len(self._trailer_text) + len(line) + 1 > MAX_TRAILER_BYTES:
            raise _malformed(f"trailers longer than {MAX_TRAILER_BYTES} bytes")
        self._trailer_text += line
        self._trailer_text += b"\n"
        self._trailers[key] = text
        self._trailer_lines = True

    def _require_trailer_signature(self) -> None:
        if self._signer is not None and self._expect_trailer and not self._trailer_signed:
            raise RequestError(Reject.SIGNATURE_MISMATCH, "The signed trailer has no x-amz-trailer-signature.")
