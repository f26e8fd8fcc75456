"""Server-side verification of S3 request authentication.

:func:`authenticate` accepts the four ways S3 clients sign requests:

========================  =====================================================================
scheme                    request carries
========================  =====================================================================
``v4-header``             ``Authorization: AWS4-HMAC-SHA256 Credential=..., SignedHeaders=..., Signature=...``
``v4-presigned``          ``X-Amz-Algorithm``, ``-Credential``, ``-Date``, ``-Expires``, ``-SignedHeaders``,
                          ``-Signature`` query parameters
``v2-presigned``          ``AWSAccessKeyId``, ``Signature``, ``Expires`` query parameters
``v2-header``             ``Authorization: AWS AKID:signature``
========================  =====================================================================

It is pure (no I/O, the time is passed in) and never reads the body: it tells the caller how the payload is
protected (:attr:`AuthContext.payload`) and, for aws-chunked bodies, hands it the
:class:`~.chunked.ChunkSigner` that checks the chunk signatures. Every failure is an :class:`~.errors.S3Error`
whose message never contains a secret.

The canonical forms follow AWS's published SigV4 and SigV2 documents; where clients are known to differ from
the letter of the documents, the variants they use are tried too (each is still an HMAC by the key's holder
over this request, so accepting it widens nothing).
"""

from __future__ import annotations

import base64
import functools
import hashlib
import hmac
import re
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from urllib.parse import quote, unquote_to_bytes

from .chunked import ChunkSigner
from .errors import S3Error

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

# SigV2 canonical resource: the query parameters that are signed (AWS's list of sub-resources and
# response-* overrides, plus the later ones botocore signs).
V2_SUBRESOURCES = frozenset({
    "accelerate", "acl", "analytics", "cors", "defaultObjectAcl", "delete", "inventory", "lifecycle",
    "location", "logging", "metrics", "notification", "object-lock", "partNumber", "policy", "replication",
    "requestPayment", "response-cache-control", "response-content-disposition", "response-content-encoding",
    "response-content-language", "response-content-type", "response-expires", "restore", "select",
    "select-type", "storageClass", "tagging", "torrent", "uploadId", "uploads", "versionId", "versioning",
    "versions", "website",
})

_AMZ_DATE = re.compile(r"\d{8}T\d{6}Z")
_SHA256_HEX = re.compile(r"[0-9a-fA-F]{64}")
_V4_QUERY_AUTH = (b"X-Amz-Algorithm", b"X-Amz-Credential", b"X-Amz-Signature")
_V2_QUERY_AUTH = (b"AWSAccessKeyId", b"Signature")


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


def authenticate(
    *,
    method: str,
    raw_path: str,
    query_string: bytes,
    headers: Mapping[str, str],
    lookup: CredentialLookup,
    now: float,
    max_skew: float = 900.0,
    virtual_bucket: str | None = None,
) -> AuthContext:
    """Verify a request's signature; returns who signed it and how its payload is protected.

    ``raw_path`` is the path as sent (still percent-encoded), ``query_string`` the raw query, ``headers`` the
    request headers with lowercase names (repeats joined with ``,``), ``now`` the Unix time.
    ``virtual_bucket`` names the bucket when it came from the Host header (virtual-hosted style): SigV2 signs
    ``/bucket/key`` whatever the addressing style.
    """
    params = _parse_query(query_string)
    names = {p.name for p in params}
    authorization = headers.get("authorization")
    v4_query = any(n in names for n in _V4_QUERY_AUTH)
    v2_query = any(n in names for n in _V2_QUERY_AUTH)
    if (authorization is not None and (v4_query or v2_query)) or (v4_query and v2_query):
        raise S3Error(
            "InvalidArgument",
            "Only one auth mechanism allowed; only the X-Amz-Algorithm query parameter, Signature query "
            "string parameter or the Authorization header should be specified",
        )
    request = _Request(method.upper(), raw_path or "/", params, headers)
    if authorization is not None:
        if authorization.startswith(ALGORITHM):
            return _v4_header(request, authorization, lookup, now, max_skew)
        if authorization.startswith("AWS "):
            return _v2_header(request, authorization, lookup, now, max_skew, virtual_bucket)
        raise S3Error("InvalidArgument", "Unsupported Authorization Type")
    if v4_query:
        return _v4_presigned(request, lookup, now, max_skew)
    if v2_query:
        return _v2_presigned(request, lookup, now, virtual_bucket)
    raise S3Error("AccessDenied", "Access Denied: the request is not signed.")


# -- the request, as the canonical forms need it ------------------------------------------------------------


@dataclass(frozen=True)
class _Param:
    name: bytes  # percent-decoded ('+' stays '+': S3 does not read queries as form data)
    value: bytes
    has_value: bool  # an '=' was present (SigV2 signs "acl" and "acl=" differently)


@dataclass(frozen=True)
class _Request:
    method: str
    raw_path: str
    params: list[_Param]
    headers: Mapping[str, str]

    def param(self, name: str) -> str | None:
        """The first value of a query parameter, as text."""
        wanted = name.encode("ascii")
        for p in self.params:
            if p.name == wanted:
                return _text(p.value)
        return None


def _parse_query(query_string: bytes) -> list[_Param]:
    params = []
    for piece in query_string.split(b"&"):
        if piece:
            name, eq, value = piece.partition(b"=")
            params.append(_Param(unquote_to_bytes(name), unquote_to_bytes(value), bool(eq)))
    return params


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", "replace")


def _uri_encode(raw: bytes, safe: str = "") -> str:
    """AWS's UriEncode: every byte but A-Z a-z 0-9 - . _ ~ (and ``safe``) as %XX, hex in upper case."""
    return quote(raw, safe=safe)


# -- SigV4 -------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=256)
def _signing_key(secret: str, day: str, region: str, service: str) -> bytes:
    """The SigV4 signing key (four chained HMACs); cached because every request of the day needs it."""
    key = hmac.digest(("AWS4" + secret).encode("utf-8"), day.encode("utf-8"), "sha256")
    for part in (region, service, "aws4_request"):
        key = hmac.digest(key, part.encode("utf-8"), "sha256")
    return key


@dataclass(frozen=True)
class _Scope:
    access_key: str
    day: str
    region: str
    service: str

    @property
    def text(self) -> str:
        return f"{self.day}/{self.region}/{self.service}/aws4_request"


def _parse_credential(credential: str, error: str) -> _Scope:
    # Split from the right: the scope has a fixed shape, the access key is opaque.
    parts = credential.rsplit("/", 4)
    prefix = _error_prefix(error)
    if len(parts) != 5 or not all(parts):
        raise S3Error(error, f"{prefix}; the Credential is not AKID/date/region/s3/aws4_request.")
    access_key, day, region, service, terminal = parts
    if service != "s3":
        raise S3Error(error, f'{prefix}; incorrect service "{service}". This endpoint belongs to "s3".')
    if terminal != "aws4_request":
        raise S3Error(error, f'{prefix}; incorrect terminal "{terminal}". This endpoint uses "aws4_request".')
    return _Scope(access_key, day, region, service)


def _error_prefix(error: str) -> str:
    if error == "AuthorizationHeaderMalformed":
        return "The authorization header is malformed"
    return "Error parsing the X-Amz-Credential parameter"


def _parse_amz_date(value: str) -> float | None:
    """Unix time of an ISO 8601 basic timestamp (20130524T000000Z), None if it is not one."""
    if not _AMZ_DATE.fullmatch(value):
        return None
    try:  # by hand: time.strptime costs more than the rest of a SigV4 check
        when = datetime(int(value[0:4]), int(value[4:6]), int(value[6:8]),
                        int(value[9:11]), int(value[11:13]), int(value[13:15]), tzinfo=UTC)
    except ValueError:
        return None
    return when.timestamp()


def _parse_http_date(value: str) -> float | None:
    """Unix time of an RFC 1123 date (Fri, 24 May 2013 00:00:00 GMT), None if it is not one."""
    try:
        parsed = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if parsed.tzinfo is None:  # "-0000": UTC, by RFC 2822
        parsed = parsed.replace(tzinfo=UTC)
    return parsed.timestamp()


def _v4_request_time(headers: Mapping[str, str]) -> tuple[str, float]:
    """The request's timestamp as signed (ISO 8601 basic) and as Unix time, from x-amz-date or Date."""
    amz_date = headers.get("x-amz-date")
    if amz_date is not None:
        when = _parse_amz_date(amz_date.strip())
        if when is not None:
            return amz_date.strip(), when
    else:
        date = headers.get("date")
        if date is not None:
            # botocore, given a Date header, signs with it alone: the timestamp it signs is that instant.
            when = _parse_amz_date(date.strip())
            if when is None:
                when = _parse_http_date(date)
            if when is not None:
                return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(when)), when
    raise S3Error("AccessDenied", "AWS authentication requires a valid Date or x-amz-date header")


def _check_skew(when: float, now: float, max_skew: float) -> None:
    if abs(now - when) > max_skew:
        raise S3Error(
            "RequestTimeTooSkewed",
            extra={
                "RequestTime": time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(when)),
                "ServerTime": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
                "MaxAllowedSkewMilliseconds": str(int(max_skew * 1000)),
            },
        )


def _lookup(lookup: CredentialLookup, access_key: str) -> Credentials:
    credentials = lookup(access_key)
    if credentials is None:
        raise S3Error("InvalidAccessKeyId", extra={"AWSAccessKeyId": access_key})
    return credentials


def _payload_mode(payload_hash: str) -> tuple[str, str | None]:
    mode = PAYLOAD_MODES.get(payload_hash)
    if mode is not None:
        return mode, None
    if _SHA256_HEX.fullmatch(payload_hash):
        return "sha256", payload_hash.lower()
    raise S3Error(
        "InvalidArgument",
        "x-amz-content-sha256 must be UNSIGNED-PAYLOAD, STREAMING-UNSIGNED-PAYLOAD-TRAILER, "
        "STREAMING-AWS4-HMAC-SHA256-PAYLOAD, STREAMING-AWS4-HMAC-SHA256-PAYLOAD-TRAILER "
        "or a valid sha256 value.",
        extra={"ArgumentName": "x-amz-content-sha256", "ArgumentValue": payload_hash},
    )


def _signed_header_names(value: str, error: str) -> list[str]:
    names = value.split(";")
    if not all(names):
        raise S3Error(error, "SignedHeaders is malformed.")
    if "host" not in names:
        raise S3Error("AccessDenied", "The host header must be signed.")
    return names


def _canonical_uris(raw_path: str) -> Iterator[str]:
    """The path as sent, then, if different, the path decoded and re-encoded by AWS's rules (clients that
    leave characters such as ``$`` or ``!`` unescaped on the wire still sign them escaped)."""
    yield raw_path
    reencoded = _uri_encode(unquote_to_bytes(raw_path), safe="/")  # only computed if the first one failed
    if reencoded != raw_path:
        yield reencoded


def _canonical_query(params: list[_Param], exclude: bytes | None = None) -> str:
    pairs = sorted((_uri_encode(p.name), _uri_encode(p.value)) for p in params if p.name != exclude)
    return "&".join(f"{name}={value}" for name, value in pairs)


def _canonical_headers(headers: Mapping[str, str], names: list[str]) -> str:
    # Trimall: no leading/trailing whitespace, inner runs collapsed to one space.
    return "".join(f"{name}:{' '.join(headers.get(name, '').split())}\n" for name in names)


def _verify_v4(
    request: _Request,
    *,
    canonical_query: str,
    signed_headers: list[str],
    payload_hash: str,
    amz_date: str,
    scope: _Scope,
    secret: str,
    signature: str,
) -> None:
    key = _signing_key(secret, scope.day, scope.region, scope.service)
    tail = (
        f"{canonical_query}\n{_canonical_headers(request.headers, signed_headers)}\n"
        f"{';'.join(signed_headers)}\n{payload_hash}"
    )
    first: tuple[str, str] | None = None
    for uri in _canonical_uris(request.raw_path):
        canonical_request = f"{request.method}\n{uri}\n{tail}"
        digest = hashlib.sha256(canonical_request.encode("utf-8")).hexdigest()
        string_to_sign = f"{ALGORITHM}\n{amz_date}\n{scope.text}\n{digest}"
        expected = hmac.digest(key, string_to_sign.encode("utf-8"), "sha256").hex()
        if hmac.compare_digest(expected.encode("ascii"), signature.encode("utf-8")):
            return
        first = first or (canonical_request, string_to_sign)
    assert first is not None
    # Like AWS, say what we signed (no secret in it) so a client author can diff it against their own.
    raise S3Error(
        "SignatureDoesNotMatch",
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
            signing_key=_signing_key(credentials.secret_key, scope.day, scope.region, scope.service),
            amz_date=amz_date,
            scope=scope.text,
            seed_signature=signature,
        )
    return AuthContext(credentials, scheme, payload, content_sha256, signer)


def _v4_header(
    request: _Request, authorization: str, lookup: CredentialLookup, now: float, max_skew: float
) -> AuthContext:
    error = "AuthorizationHeaderMalformed"
    fields: dict[str, str] = {}
    for part in authorization[len(ALGORITHM) :].split(","):
        name, eq, value = part.strip().partition("=")
        if eq:
            fields[name] = value.strip()
    missing = [n for n in ("Credential", "SignedHeaders", "Signature") if not fields.get(n)]
    if missing:
        raise S3Error(error, f"The authorization header is malformed; missing {', '.join(missing)}.")
    scope = _parse_credential(fields["Credential"], error)
    amz_date, when = _v4_request_time(request.headers)
    if scope.day != amz_date[:8]:
        raise S3Error(
            error,
            "The authorization header is malformed; Invalid credential date. "
            "Date is not the same as X-Amz-Date.",
        )
    credentials = _lookup(lookup, scope.access_key)
    _check_skew(when, now, max_skew)
    signed_headers = _signed_header_names(fields["SignedHeaders"], error)
    payload_hash = request.headers.get("x-amz-content-sha256")
    if payload_hash is None:
        raise S3Error("InvalidRequest", "Missing required header for this request: x-amz-content-sha256")
    payload_hash = payload_hash.strip()
    _payload_mode(payload_hash)  # reject a malformed value before spending HMACs on it
    _verify_v4(
        request,
        canonical_query=_canonical_query(request.params),
        signed_headers=signed_headers,
        payload_hash=payload_hash,
        amz_date=amz_date,
        scope=scope,
        secret=credentials.secret_key,
        signature=fields["Signature"],
    )
    return _v4_context("v4-header", credentials, payload_hash, scope, amz_date, fields["Signature"])


def _v4_presigned(request: _Request, lookup: CredentialLookup, now: float, max_skew: float) -> AuthContext:
    error = "AuthorizationQueryParametersError"
    values = {
        name: request.param(f"X-Amz-{name}")
        for name in ("Algorithm", "Credential", "Date", "Expires", "SignedHeaders", "Signature")
    }
    if values["Algorithm"] is not None and values["Algorithm"] != ALGORITHM:
        raise S3Error(error, f'X-Amz-Algorithm only supports "{ALGORITHM}"')
    if any(not v for v in values.values()):
        raise S3Error(
            error,
            "Query-string authentication version 4 requires the X-Amz-Algorithm, X-Amz-Credential, "
            "X-Amz-Signature, X-Amz-Date, X-Amz-SignedHeaders, and X-Amz-Expires parameters.",
        )
    credential, amz_date, expires_text, signed, signature = (
        str(values[n]) for n in ("Credential", "Date", "Expires", "SignedHeaders", "Signature")
    )
    scope = _parse_credential(credential, error)
    when = _parse_amz_date(amz_date)
    if when is None:
        raise S3Error(error, "X-Amz-Date must be in the ISO8601 Long Format \"yyyyMMdd'T'HHmmss'Z'\"")
    expires = _presigned_expires(expires_text)
    if scope.day != amz_date[:8]:
        raise S3Error(error, "Invalid credential date. Date is not the same as X-Amz-Date.")
    credentials = _lookup(lookup, scope.access_key)
    if when - now > max_skew:  # signed in the future; a past date is governed by X-Amz-Expires instead
        _check_skew(when, now, max_skew)
    if now > when + expires:
        raise S3Error(
            "AccessDenied",
            "Request has expired",
            extra={
                "X-Amz-Expires": str(expires),
                "Expires": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(when + expires)),
                "ServerTime": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
            },
        )
    signed_headers = _signed_header_names(signed, error)
    # UNSIGNED-PAYLOAD unless the presigner fixed a hash: as a parameter, or as a header it signed (botocore's
    # Python signer signs that header; awscrt's leaves it unsigned and signs UNSIGNED-PAYLOAD).
    payload_hash = request.param("X-Amz-Content-Sha256")
    if payload_hash is None and "x-amz-content-sha256" in signed_headers:
        payload_hash = request.headers.get("x-amz-content-sha256")
    payload_hash = (payload_hash or UNSIGNED_PAYLOAD).strip()
    _payload_mode(payload_hash)
    _verify_v4(
        request,
        canonical_query=_canonical_query(request.params, exclude=b"X-Amz-Signature"),
        signed_headers=signed_headers,
        payload_hash=payload_hash,
        amz_date=amz_date,
        scope=scope,
        secret=credentials.secret_key,
        signature=signature,
    )
    return _v4_context("v4-presigned", credentials, payload_hash, scope, amz_date, signature)


def _presigned_expires(text: str) -> int:
    error = "AuthorizationQueryParametersError"
    if not re.fullmatch(r"-?\d{1,12}", text):
        raise S3Error(error, "X-Amz-Expires should be a number")
    expires = int(text)
    if expires < 0:
        raise S3Error(error, "X-Amz-Expires must be non-negative")
    if expires == 0:
        raise S3Error(error, "X-Amz-Expires must be at least 1 second")
    if expires > MAX_PRESIGNED_EXPIRES:
        raise S3Error(
            error, f"X-Amz-Expires must be less than a week (in seconds) that is {MAX_PRESIGNED_EXPIRES}"
        )
    return expires


# -- SigV2 -------------------------------------------------------------------------------------------------


def _v2_sign(secret: str, string_to_sign: str) -> bytes:
    return base64.b64encode(hmac.digest(secret.encode("utf-8"), string_to_sign.encode("utf-8"), "sha1"))


def _v2_resource(request: _Request, virtual_bucket: str | None) -> str:
    resource = (f"/{virtual_bucket}" if virtual_bucket else "") + request.raw_path
    # Sub-resources and response-* overrides, sorted by name, values decoded (AWS: "you do not encode these
    # values" when signing).
    signed = sorted((p for p in request.params if _text(p.name) in V2_SUBRESOURCES), key=lambda p: p.name)
    if signed:
        resource += "?" + "&".join(
            _text(p.name) + ("=" + _text(p.value) if p.has_value else "") for p in signed
        )
    return resource


def _v2_string_to_sign(
    request: _Request, fields: Mapping[str, str], date_line: str, resource: str, skip_amz_date: bool = False
) -> str:
    """METHOD, Content-MD5, Content-Type, date line, the x-amz-* headers sorted, then the resource."""
    amz = sorted(
        (name, value.strip())
        for name, value in fields.items()
        if name.startswith("x-amz-") and not (skip_amz_date and name == "x-amz-date")
    )
    lines = [
        request.method,
        fields.get("content-md5", "").strip(),
        fields.get("content-type", "").strip(),
        date_line,
    ]
    lines += [f"{name}:{value}" for name, value in amz]
    lines.append(resource)
    return "\n".join(lines)


def _verify_v2(credentials: Credentials, candidates: list[str], signature: str) -> None:
    provided = signature.encode("utf-8")
    for string_to_sign in candidates:
        if hmac.compare_digest(_v2_sign(credentials.secret_key, string_to_sign), provided):
            return
    raise S3Error(
        "SignatureDoesNotMatch",
        extra={"AWSAccessKeyId": credentials.access_key, "SignatureProvided": signature,
               "StringToSign": candidates[0]},
    )


def _v2_presigned(
    request: _Request, lookup: CredentialLookup, now: float, virtual_bucket: str | None
) -> AuthContext:
    access_key, signature, expires = (request.param(n) for n in ("AWSAccessKeyId", "Signature", "Expires"))
    if not access_key or not signature or not expires:
        raise S3Error(
            "AccessDenied",
            "Query-string authentication requires the Signature, Expires and AWSAccessKeyId parameters",
        )
    if not re.fullmatch(r"\d{1,12}", expires):
        raise S3Error("AccessDenied", "Invalid date (should be seconds since epoch)")
    credentials = _lookup(lookup, access_key)
    if now > int(expires):
        raise S3Error("AccessDenied", "Request has expired")
    # botocore moves the Content-Type, Content-MD5 and x-amz-* headers it signed into the query string.
    fields = dict(request.headers)
    for p in request.params:
        name = _text(p.name).lower()
        if name.startswith("x-amz-") or name in ("content-type", "content-md5"):
            fields[name] = _text(p.value)
    string_to_sign = _v2_string_to_sign(request, fields, expires, _v2_resource(request, virtual_bucket))
    _verify_v2(credentials, [string_to_sign], signature)
    return AuthContext(credentials, "v2-presigned", "unsigned")


def _v2_header(
    request: _Request,
    authorization: str,
    lookup: CredentialLookup,
    now: float,
    max_skew: float,
    virtual_bucket: str | None,
) -> AuthContext:
    access_key, colon, signature = authorization[4:].strip().rpartition(":")
    if not colon or not access_key or not signature:
        raise S3Error(
            "AuthorizationHeaderMalformed", "The authorization header is malformed; expected AWS AKID:sig."
        )
    headers = request.headers
    amz_date, date = headers.get("x-amz-date"), headers.get("date")
    stamp = amz_date if amz_date is not None else date
    when = None if stamp is None else _parse_http_date(stamp) or _parse_amz_date(stamp.strip())
    if when is None:
        raise S3Error("AccessDenied", "AWS authentication requires a valid Date or x-amz-date header")
    credentials = _lookup(lookup, access_key)
    _check_skew(when, now, max_skew)
    resource = _v2_resource(request, virtual_bucket)
    if amz_date is None:
        candidates = [_v2_string_to_sign(request, headers, str(date).strip(), resource)]
    else:
        # AWS's rule: with x-amz-date the Date line is empty and x-amz-date is signed as an x-amz-* header.
        # botocore keeps its Date line as well; AWS's own Delete example puts x-amz-date on the Date line.
        candidates = [_v2_string_to_sign(request, headers, "", resource)]
        if date is not None:
            candidates.append(_v2_string_to_sign(request, headers, date.strip(), resource))
        candidates.append(
            _v2_string_to_sign(request, headers, amz_date.strip(), resource, skip_amz_date=True)
        )
    _verify_v2(credentials, candidates, signature)
    return AuthContext(credentials, "v2-header", "unsigned")
