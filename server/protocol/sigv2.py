"""AWS Signature Version 2: the ``Authorization: AWS AKID:signature`` header and presigned URLs
(``AWSAccessKeyId``, ``Signature``, ``Expires``), as AWS's SigV2 document and botocore define them."""

from __future__ import annotations

import base64
import hmac
import re
from collections.abc import Mapping

from .errors import Reject, RequestError
from .signing import (
    AuthContext,
    Credentials,
    CredentialLookup,
    SignedRequest,
    check_skew,
    lookup_credentials,
    parse_amz_date,
    parse_http_date,
    require_signed,
    text,
)

MAX_PRESIGNED_EXPIRES = 7 * 24 * 3600

# The canonical resource signs these query parameters (AWS's list of sub-resources and response-* overrides,
# plus the later ones botocore signs).
V2_SUBRESOURCES = frozenset({
    "accelerate", "acl", "analytics", "cors", "defaultObjectAcl", "delete", "inventory", "lifecycle",
    "location", "logging", "metrics", "notification", "object-lock", "partNumber", "policy", "replication",
    "requestPayment", "response-cache-control", "response-content-disposition", "response-content-encoding",
    "response-content-language", "response-content-type", "response-expires", "restore", "select",
    "select-type", "storageClass", "tagging", "torrent", "uploadId", "uploads", "versionId", "versioning",
    "versions", "website",
})
QUERY_AUTH = (b"AWSAccessKeyId", b"Signature")  # these make a presigned URL


def _v2_sign(secret: str, string_to_sign: str) -> bytes:
    return base64.b64encode(hmac.digest(secret.encode("utf-8"), string_to_sign.encode("utf-8"), "sha1"))


def _v2_resource(request: SignedRequest, virtual_bucket: str | None) -> str:
    resource = (f"/{virtual_bucket}" if virtual_bucket else "") + request.raw_path
    # Sub-resources and response-* overrides, sorted by name, values decoded (AWS: "you do not encode these
    # values" when signing).
    signed = sorted((p for p in request.params if text(p.name) in V2_SUBRESOURCES), key=lambda p: p.name)
    if signed:
        resource += "?" + "&".join(
            text(p.name) + ("=" + text(p.value) if p.has_value else "") for p in signed
        )
    return resource


def _v2_string_to_sign(
    request: SignedRequest, fields: Mapping[str, str], date_line: str, resource: str, skip_amz_date: bool = False
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
    raise RequestError(
        Reject.SIGNATURE_MISMATCH,
        extra={"AWSAccessKeyId": credentials.access_key, "SignatureProvided": signature,
               "StringToSign": candidates[0]},
    )


def verify_presigned(
    request: SignedRequest, lookup: CredentialLookup, now: float, virtual_bucket: str | None
) -> AuthContext:
    access_key, signature, expires = (request.param(n) for n in ("AWSAccessKeyId", "Signature", "Expires"))
    if not access_key or not signature or not expires:
        raise RequestError(
            Reject.ACCESS_DENIED,
            "Query-string authentication requires the Signature, Expires and AWSAccessKeyId parameters",
        )
    if not re.fullmatch(r"[0-9]{1,12}", expires):
        raise RequestError(Reject.ACCESS_DENIED, "Invalid date (should be seconds since epoch)")
    credentials = lookup_credentials(lookup, access_key)
    if now > int(expires):
        raise RequestError(Reject.ACCESS_DENIED, "Request has expired")
    if int(expires) - now > MAX_PRESIGNED_EXPIRES:  # as SigV4 caps its presigned URLs
        raise RequestError(Reject.ACCESS_DENIED, "A presigned URL may live at most a week (604800 seconds)")
    # botocore moves the Content-Type, Content-MD5 and x-amz-* headers it signed into the query string.
    fields = dict(request.headers)
    for p in request.params:
        name = text(p.name).lower()
        if name.startswith("x-amz-") or name in ("content-type", "content-md5"):
            fields[name] = text(p.value)
    _require_signed_v2(fields)
    string_to_sign = _v2_string_to_sign(request, fields, expires, _v2_resource(request, virtual_bucket))
    _verify_v2(credentials, [string_to_sign], signature)
    return AuthContext(credentials, "v2-presigned", "unsigned")


def _require_signed_v2(fields: Mapping[str, str]) -> None:
    """SigV2 signs every x-amz-* header; it cannot sign x-ctx-* ones, so those are refused (a TTL goes in
    the x-amz-meta-ctx-ttl metadata instead)."""
    require_signed(fields, frozenset(name for name in fields if name.startswith("x-amz-")))


def verify_header(
    request: SignedRequest,
    authorization: str,
    lookup: CredentialLookup,
    now: float,
    max_skew: float,
    virtual_bucket: str | None,
) -> AuthContext:
    access_key, colon, signature = authorization[4:].strip().rpartition(":")
    if not colon or not access_key or not signature:
        raise RequestError(
            Reject.MALFORMED_AUTHORIZATION, "The authorization header is malformed; expected AWS AKID:sig."
        )
    headers = request.headers
    amz_date, date = headers.get("x-amz-date"), headers.get("date")
    stamp = amz_date if amz_date is not None else date
    when = None if stamp is None else parse_http_date(stamp) or parse_amz_date(stamp.strip())
    if when is None:
        raise RequestError(Reject.ACCESS_DENIED, "AWS authentication requires a valid Date or x-amz-date header")
    credentials = lookup_credentials(lookup, access_key)
    check_skew(when, now, max_skew)
    _require_signed_v2(headers)
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
