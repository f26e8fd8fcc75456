"""What a verifier needs to know about a signed S3-style request: the credentials, the request as it was
signed (method, raw path, query parameters, headers), timestamps and the clock-skew rule. Shared by
:mod:`.sigv4` and :mod:`.sigv2`; every failure is a :class:`~.errors.RequestError` whose message never
contains a secret."""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from urllib.parse import quote, unquote_to_bytes

from .chunked import ChunkSigner
from .errors import Reject, RequestError

_AMZ_DATE = re.compile(r"[0-9]{8}T[0-9]{6}Z")


@dataclass(frozen=True)
class Credentials:
    """An access key, its secret and the tenant it acts for."""

    access_key: str
    secret_key: str
    tenant: str

    def __repr__(self) -> str:  # keep the secret out of logs and tracebacks
        return f"Credentials(access_key={self.access_key!r}, tenant={self.tenant!r})"


CredentialLookup = Callable[[str], Credentials | None]


@dataclass
class AuthContext:
    """What :func:`authenticate` established about a request.

    ``payload`` says what the caller must still check about the body:

    * ``"sha256"``: the body's SHA-256 must equal ``content_sha256`` (else ``XAmzContentSHA256Mismatch``);
    * ``"unsigned"``: nothing (UNSIGNED-PAYLOAD, presigned URLs without a hash, SigV2);
    * ``"streaming-signed"`` / ``"streaming-signed-trailer"``: decode with an ``AwsChunkedDecoder`` given
      ``chunk_signer``;
    * ``"streaming-unsigned-trailer"``: decode with an ``AwsChunkedDecoder`` without signer.
    """

    credentials: Credentials
    scheme: str
    payload: str
    content_sha256: str | None = None
    chunk_signer: ChunkSigner | None = None


@dataclass(frozen=True)
class Param:
    name: bytes  # percent-decoded ('+' stays '+': S3 does not read queries as form data)
    value: bytes
    has_value: bool  # an '=' was present (SigV2 signs "acl" and "acl=" differently)
    raw: bytes = b""  # the parameter as sent, still percent-encoded


@dataclass(frozen=True)
class SignedRequest:
    method: str
    raw_path: str
    params: list[Param]
    headers: Mapping[str, str]

    def param(self, name: str) -> str | None:
        """The first value of a query parameter, as text."""
        wanted = name.encode("ascii")
        for p in self.params:
            if p.name == wanted:
                return text(p.value)
        return None


def parse_query(query_string: bytes) -> list[Param]:
    params = []
    for piece in query_string.split(b"&"):
        if piece:
            name, eq, value = piece.partition(b"=")
            params.append(Param(unquote_to_bytes(name), unquote_to_bytes(value), bool(eq), piece))
    return params


def text(raw: bytes) -> str:
    return raw.decode("utf-8", "replace")


def uri_encode(raw: bytes, safe: str = "") -> str:
    """AWS's UriEncode: every byte but A-Z a-z 0-9 - . _ ~ (and ``safe``) as %XX, hex in upper case."""
    return quote(raw, safe=safe)


@functools.lru_cache(maxsize=1024)
def parse_amz_date(value: str) -> float | None:
    """Unix time of an ISO 8601 basic timestamp (20130524T000000Z), None if it is not one. Kept for the
    recent values: every request signed in the same second carries the same one."""
    if not _AMZ_DATE.fullmatch(value):
        return None
    try:  # by hand: time.strptime costs more than the rest of a SigV4 check
        when = datetime(int(value[0:4]), int(value[4:6]), int(value[6:8]),
                        int(value[9:11]), int(value[11:13]), int(value[13:15]), tzinfo=UTC)
    except ValueError:
        return None
    return when.timestamp()


def parse_http_date(value: str) -> float | None:
    """Unix time of an RFC 1123 date (Fri, 24 May 2013 00:00:00 GMT), None if it is not one."""
    try:
        parsed = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if parsed.tzinfo is None:  # "-0000": UTC, by RFC 2822
        parsed = parsed.replace(tzinfo=UTC)
    return parsed.timestamp()


def check_skew(when: float, now: float, max_skew: float) -> None:
    if abs(now - when) > max_skew:
        raise RequestError(
            Reject.CLOCK_SKEW,
            extra={
                "RequestTime": time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(when)),
                "ServerTime": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
                "MaxAllowedSkewMilliseconds": str(int(max_skew * 1000)),
            },
        )


SIGNABLE_PREFIXES = ("x-amz-", "x-ctx-")  # headers that change what a request does: each must be signed


def require_signed(headers: Mapping[str, str], signed: set[str] | frozenset[str], *,
                   exempt: tuple[str, ...] = ()) -> None:
    """AccessDenied unless every ``x-amz-*`` and ``x-ctx-*`` header present is among the ``signed`` ones (as
    AWS does): a header added to a signed request or a presigned URL must not change what it does."""
    unsigned = sorted(name for name in headers
                      if name.startswith(SIGNABLE_PREFIXES) and name not in signed and name not in exempt)
    if unsigned:
        raise RequestError(Reject.ACCESS_DENIED, "There were headers present in the request which were not signed",
                           extra={"HeadersNotSigned": ", ".join(unsigned)})


def lookup_credentials(lookup: CredentialLookup, access_key: str) -> Credentials:
    credentials = lookup(access_key)
    if credentials is None:
        raise RequestError(Reject.UNKNOWN_ACCESS_KEY, extra={"AWSAccessKeyId": access_key})
    return credentials
