"""What every S3 handler receives (:class:`Call`) and returns (:class:`Response`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..asgi import Request
from .auth import AuthContext

if TYPE_CHECKING:
    from .service import S3Service


@dataclass
class Call:
    """One authenticated request, resolved to its target."""

    req: Request
    auth: AuthContext
    service: S3Service
    bucket: str | None
    key: str | None

    @property
    def tenant(self) -> str:
        return self.auth.credentials.tenant

    @property
    def engine(self):  # noqa: ANN201 - Engine; avoids an import cycle in type checking
        return self.service.engine


@dataclass
class Response:
    status: int = 200
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes | memoryview = b""
    content_length: int | None = None  # HEAD: the length of the body a GET would send


def xml_response(body: bytes, status: int = 200, headers: list[tuple[str, str]] | None = None) -> Response:
    return Response(status, [("content-type", "application/xml"), *(headers or [])], body)
