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
:class:`~.chunked.ChunkSigner` that checks the chunk signatures. Every failure is an :class:`~.errors.RequestError`
whose message never contains a secret.

The canonical forms follow AWS's published SigV4 and SigV2 documents; where clients are known to differ from
the letter of the documents, the variants they use are tried too (each is still an HMAC by the key's holder
over this request, so accepting it widens nothing).
"""

from __future__ import annotations

from collections.abc import Mapping

from . import sigv2, sigv4
from .errors import Reject, RequestError
from .signing import AuthContext, CredentialLookup, Credentials, SignedRequest, parse_query

__all__ = ["AuthContext", "CredentialLookup", "Credentials", "authenticate"]


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
    params = parse_query(query_string)
    names = {p.name for p in params}
    authorization = headers.get("authorization")
    v4_query = any(n in names for n in sigv4.QUERY_AUTH)
    v2_query = any(n in names for n in sigv2.QUERY_AUTH)
    if (authorization is not None and (v4_query or v2_query)) or (v4_query and v2_query):
        raise RequestError(
            Reject.INVALID_ARGUMENT,
            "Only one auth mechanism allowed; only the X-Amz-Algorithm query parameter, Signature query "
            "string parameter or the Authorization header should be specified",
        )
    request = SignedRequest(method.upper(), raw_path or "/", params, headers)
    if authorization is not None:
        if authorization.startswith(sigv4.ALGORITHM):
            return sigv4.verify_header(request, authorization, lookup, now, max_skew)
        if authorization.startswith("AWS "):
            return sigv2.verify_header(request, authorization, lookup, now, max_skew, virtual_bucket)
        raise RequestError(Reject.INVALID_ARGUMENT, "Unsupported Authorization Type")
    if v4_query:
        return sigv4.verify_presigned(request, lookup, now, max_skew)
    if v2_query:
        return sigv2.verify_presigned(request, lookup, now, virtual_bucket)
    raise RequestError(Reject.ACCESS_DENIED, "Access Denied: the request is not signed.")
