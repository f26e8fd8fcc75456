"""AWS Signature Version 4: the ``Authorization: AWS4-HMAC-SHA256 ...`` header and presigned URLs.

The canonical forms follow AWS's published SigV4 document; where clients are known to differ from its letter,
the variants they use are tried too (each is still an HMAC by the key's holder over this request, so
accepting it widens nothing). The signing key is derived (and cached) by :func:`ctxstore.sigv4.signing_key`,
the same function the client signs with.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from urllib.parse import unquote_to_bytes

from ctxstore.sigv4 import signing_key

from .chunked import ChunkSigner
from .errors import Reject, RequestError
from .signing import (
    AuthContext,
    Credentials,
    CredentialLookup,
    Param,
    SignedRequest,
    check_skew,
    lookup_credentials,
    parse_amz_date,
    parse_http_date,
    require_signed,
    uri_encode,
)

ALGORITHM = "AWS4-HMAC-SHA256"
UNSIGNED_PAYLOAD = "UNSIGNED-PAYLOAD"
MAX_PRESIGNED_EXPIRES = 7 * 24 * 3600  # SigV4 presigned URLs live at most a week

# x-amz-content-sha256 constants -> AuthContext.payload.
PAYLOAD_MODES: dict[str, str] = {
    UNSIGNED_PAYLOAD: "unsigned",
    "STREAMING-AWS4-HMAC-SHA256-PAYLOAD": "streaming-signed",
    "STREAMING-AWS4-HMAC-SHA256-PAYLOAD-TRAILER": "streaming-signed-trailer",
    "STREAMING-UNSIGNED-PAYLOAD-TRAILER": "streaming-unsigned-trailer",
}
QUERY_AUTH = (b"X-Amz-Algorithm", b"X-Amz-Credential", b"X-Amz-Signature")  # these make a presigned URL
_SHA256_HEX = re.compile(r"[0-9a-fA-F]{64}")


@dataclass(frozen=True)
class _Scope:
    access_key: str
    day: str
    region: str
    service: str

    @property
    def text(self) -> str:
        return f"{self.day}/{self.region}/{self.service}/aws4_request"


def _parse_credential(credential: str, error: Reject) -> _Scope:
    # Split from the right: the scope has a fixed shape, the access key is opaque.
    parts = credential.rsplit("/", 4)
    prefix = _error_prefix(error)
    if len(parts) != 5 or not all(parts):
        raise RequestError(error, f"{prefix}; the Credential is not AKID/date/region/s3/aws4_request.")
    access_key, day, region, service, terminal = parts
    if service != "s3":
        raise RequestError(error, f'{prefix}; incorrect service "{service}". This endpoint belongs to "s3".')
    if terminal != "aws4_request":
        raise RequestError(error, f'{prefix}; incorrect terminal "{terminal}". This endpoint uses "aws4_request".')
    return _Scope(access_key, day, region, service)


def _error_prefix(error: Reject) -> str:
    if error is Reject.MALFORMED_AUTHORIZATION:
        return "The authorization header is malformed"
    return "Error parsing the X-Amz-Credential parameter"


def _v4_request_time(headers: Mapping[str, str]) -> tuple[str, float]:
    """The request's timestamp as signed (ISO 8601 basic) and as Unix time, from x-amz-date or Date."""
    amz_date = headers.get("x-amz-date")
    if amz_date is not None:
        when = parse_amz_date(amz_date.strip())
        if when is not None:
            return amz_date.strip(), when
    else:
        date = headers.get("date")
        if date is not None:
            # botocore, given a Date header, signs with it alone: the timestamp it signs is that instant.
            when = parse_amz_date(date.strip())
            if when is None:
                when = parse_http_date(date)
            if when is not None:
                return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(when)), when
    raise RequestError(Reject.ACCESS_DENIED, "AWS authentication requires a valid Date or x-amz-date header")


def _payload_mode(payload_hash: str) -> tuple[str, str | None]:
    mode = PAYLOAD_MODES.get(payload_hash)
    if mode is not None:
        return mode, None
    if _SHA256_HEX.fullmatch(payload_hash):
        return "sha256", payload_hash.lower()
    raise RequestError(
        Reject.INVALID_ARGUMENT,
        "x-amz-content-sha256 must be UNSIGNED-PAYLOAD, STREAMING-UNSIGNED-PAYLOAD-TRAILER, "
        "STREAMING-AWS4-HMAC-SHA256-PAYLOAD, STREAMING-AWS4-HMAC-SHA256-PAYLOAD-TRAILER "
        "or a valid sha256 value.",
        extra={"ArgumentName": "x-amz-content-sha256", "ArgumentValue": payload_hash},
    )


def _signed_header_names(value: str, error: Reject) -> list[str]:
    names = value.split(";")
    if not all(names):
        raise RequestError(error, "SignedHeaders is malformed.")
    if "host" not in names:
        raise RequestError(Reject.ACCESS_DENIED, "The host header must be signed.")
    return names


def _canonical_uris(raw_path: str) -> Iterator[str]:
    """The path as sent, then, if different, the path decoded and re-encoded by AWS's rules (clients that
    leave characters such as ``$`` or ``!`` unescaped on the wire still sign them escaped)."""
    yield raw_path
    reencoded = uri_encode(unquote_to_bytes(raw_path), safe="/")  # only computed if the first one failed
    if reencoded != raw_path:
        yield reencoded


def _canonical_queries(params: list[Param], exclude: bytes | None = None) -> Iterator[str]:
    """The query re-encoded by AWS's rules, then, if different, as sent (sorted): clients that leave
    characters such as ``:`` unescaped in the query sign it as they send it."""
    kept = [p for p in params if p.name != exclude]
    if not kept:  # most object requests: one (empty) form
        yield ""
        return
    canonical = "&".join(f"{n}={v}" for n, v in sorted((uri_encode(p.name), uri_encode(p.value)) for p in kept))
    yield canonical
    as_sent = "&".join("=".join(pair) for pair in sorted(_as_sent(p) for p in kept))
    if as_sent != canonical:
        yield as_sent


def _as_sent(param: Param) -> tuple[str, str]:
    name, _, value = param.raw.decode("latin-1").partition("=")
    return name, value


def _canonical_headers(headers: Mapping[str, str], names: list[str]) -> str:
    # Trimall: no leading/trailing whitespace, inner runs collapsed to one space.
    return "".join(f"{name}:{' '.join(headers.get(name, '').split())}\n" for name in names)


def _verify_v4(
    request: SignedRequest,
    *,
    canonical_queries: Iterator[str],
    signed_headers: list[str],
    payload_hash: str,
    amz_date: str,
    scope: _Scope,
    secret: str,
    signature: str,
) -> None:
    key = signing_key(secret, scope.day, scope.region, scope.service)
    tail = f"{_canonical_headers(request.headers, signed_headers)}\n{';'.join(signed_headers)}\n{payload_hash}"
    first: tuple[str, str] | None = None
    queries = list(canonical_queries)
    for uri, query in ((u, q) for u in _canonical_uris(request.raw_path) for q in queries):
        canonical_request = f"{request.method}\n{uri}\n{query}\n{tail}"
        digest = hashlib.sha256(canonical_request.encode("utf-8")).hexdigest()
        string_to_sign = f"{ALGORITHM}\n{amz_date}\n{scope.text}\n{digest}"
        expected = hmac.digest(key, string_to_sign.encode("utf-8"), "sha256").hex()
        if hmac.compare_digest(expected.encode("ascii"), signature.encode("utf-8")):
            return
        first = first or (canonical_request, string_to_sign)
    assert first is not None
    # Like AWS, say what we signed (no secret in it) so a client author can diff it against their own.
    raise RequestError(
        Reject.SIGNATURE_MISMATCH,
        extra={
            "AWSAccessKeyId": scope.access_key,
            "SignatureProvided": signature,
            "StringToSign": first[1],
            "CanonicalRequest": first[0],
        },
    )


def _v4_context(
    scheme: str, credentials: Credentials, payload_hash: str, scope: _Scope, amz_date: str, signature: str
) -> AuthContext:
    payload, content_sha256 = _payload_mode(payload_hash)
    signer = None
    if payload.startswith("streaming-signed"):
        # The request's signature seeds the chain of chunk signatures.
        signer = ChunkSigner(
            signing_key=signing_key(credentials.secret_key, scope.day, scope.region, scope.service),
            amz_date=amz_date,
            scope=scope.text,
            seed_signature=signature,
        )
    return AuthContext(credentials, scheme, payload, content_sha256, signer)


def verify_header(
    request: SignedRequest, authorization: str, lookup: CredentialLookup, now: float, max_skew: float
) -> AuthContext:
    error = Reject.MALFORMED_AUTHORIZATION
    fields: dict[str, str] = {}
    for part in authorization[len(ALGORITHM) :].split(","):
        name, eq, value = part.strip().partition("=")
        if eq:
            fields[name] = value.strip()
    missing = [n for n in ("Credential", "SignedHeaders", "Signature") if not fields.get(n)]
    if missing:
        raise RequestError(error, f"The authorization header is malformed; missing {', '.join(missing)}.")
    scope = _parse_credential(fields["Credential"], error)
    amz_date, when = _v4_request_time(request.headers)
    if scope.day != amz_date[:8]:
        raise RequestError(
            error,
            "The authorization header is malformed; Invalid credential date. "
            "Date is not the same as X-Amz-Date.",
        )
    credentials = lookup_credentials(lookup, scope.access_key)
    check_skew(when, now, max_skew)
    signed_headers = _signed_header_names(fields["SignedHeaders"], error)
    require_signed(request.headers, frozenset(signed_headers))
    payload_hash = request.headers.get("x-amz-content-sha256")
    if payload_hash is None:
        raise RequestError(Reject.INVALID_REQUEST, "Missing required header for this request: x-amz-content-sha256")
    payload_hash = payload_hash.strip()
    _payload_mode(payload_hash)  # reject a malformed value before spending HMACs on it
    _verify_v4(
        request,
        canonical_queries=_canonical_queries(request.params),
        signed_headers=signed_headers,
        payload_hash=payload_hash,
        amz_date=amz_date,
        scope=scope,
        secret=credentials.secret_key,
        signature=fields["Signature"],
    )
    return _v4_context("v4-header", credentials, payload_hash, scope, amz_date, fields["Signature"])


def verify_presigned(request: SignedRequest, lookup: CredentialLookup, now: float, max_skew: float
                     ) -> AuthContext:
    error = Reject.MALFORMED_PRESIGNED
    values = {
        name: request.param(f"X-Amz-{name}")
        for name in ("Algorithm", "Credential", "Date", "Expires", "SignedHeaders", "Signature")
    }
    if values["Algorithm"] is not None and values["Algorithm"] != ALGORITHM:
        raise RequestError(error, f'X-Amz-Algorithm only supports "{ALGORITHM}"')
    if any(not v for v in values.values()):
        raise RequestError(
            error,
            "Query-string authentication version 4 requires the X-Amz-Algorithm, X-Amz-Credential, "
            "X-Amz-Signature, X-Amz-Date, X-Amz-SignedHeaders, and X-Amz-Expires parameters.",
        )
    credential, amz_date, expires_text, signed, signature = (
        str(values[n]) for n in ("Credential", "Date", "Expires", "SignedHeaders", "Signature")
    )
    scope = _parse_credential(credential, error)
    when = parse_amz_date(amz_date)
    if when is None:
        raise RequestError(error, "X-Amz-Date must be in the ISO8601 Long Format \"yyyyMMdd'T'HHmmss'Z'\"")
    expires = _presigned_expires(expires_text)
    if scope.day != amz_date[:8]:
        raise RequestError(error, "Invalid credential date. Date is not the same as X-Amz-Date.")
    credentials = lookup_credentials(lookup, scope.access_key)
    if when - now > max_skew:  # signed in the future; a past date is governed by X-Amz-Expires instead
        check_skew(when, now, max_skew)
    if now > when + expires:
        raise RequestError(
            Reject.ACCESS_DENIED,
            "Request has expired",
            extra={
                "X-Amz-Expires": str(expires),
                "Expires": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(when + expires)),
                "ServerTime": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
            },
        )
    signed_headers = _signed_header_names(signed, error)
    # awscrt sends x-amz-content-sha256: UNSIGNED-PAYLOAD with the URLs it presigns, without signing it.
    require_signed(request.headers, frozenset(signed_headers), exempt=("x-amz-content-sha256",))
    # UNSIGNED-PAYLOAD unless the presigner fixed a hash: as a parameter, or as a header it signed (botocore's
    # Python signer signs that header; awscrt's leaves it unsigned and signs UNSIGNED-PAYLOAD).
    payload_hash = request.param("X-Amz-Content-Sha256")
    if payload_hash is None and "x-amz-content-sha256" in signed_headers:
        payload_hash = request.headers.get("x-amz-content-sha256")
    payload_hash = (payload_hash or UNSIGNED_PAYLOAD).strip()
    _payload_mode(payload_hash)
    _verify_v4(
        request,
        canonical_queries=_canonical_queries(request.params, exclude=b"X-Amz-Signature"),
        signed_headers=signed_headers,
        payload_hash=payload_hash,
        amz_date=amz_date,
        scope=scope,
        secret=credentials.secret_key,
        signature=signature,
    )
    return _v4_context("v4-presigned", credentials, payload_hash, scope, amz_date, signature)


def _presigned_expires(text: str) -> int:
    """The lifetime of a presigned URL. Not a number: malformed (400); out of range: the URL grants nothing
    (403 AccessDenied, as S3 conformance suites expect)."""
    if not re.fullmatch(r"-?[0-9]{1,12}", text):
        raise RequestError(Reject.MALFORMED_PRESIGNED, "X-Amz-Expires should be a number")
    expires = int(text)
    if expires < 0:
        raise RequestError(Reject.ACCESS_DENIED, "X-Amz-Expires must be non-negative")
    if expires == 0:
        raise RequestError(Reject.ACCESS_DENIED, "X-Amz-Expires must be at least 1 second")
    if expires > MAX_PRESIGNED_EXPIRES:
        raise RequestError(
            Reject.ACCESS_DENIED,
            f"X-Amz-Expires must be less than a week (in seconds) that is {MAX_PRESIGNED_EXPIRES}",
        )
    return expires
