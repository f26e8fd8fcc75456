"""What every S3 handler receives (:class:`Call`) and returns (a :class:`~ctxstore_server.protocol.shell.Reply`)."""

from __future__ import annotations

from dataclasses import dataclass

from ..engine import Engine
from ..protocol.asgi import Request
from ..protocol.auth import AuthContext
from ..protocol.shell import Reply
from ..settings import Settings

@dataclass
class Call:
    """One authenticated request, resolved to its target."""

    req: Request
    auth: AuthContext
    engine: Engine
    settings: Settings
    bucket: str | None
    key: str | None

    @property
    def tenant(self) -> str:
        return self.auth.credentials.tenant

    @property
    def bucket_name(self) -> str:
        """The bucket of a bucket or object operation (routing guarantees there is one)."""
        return self.bucket or ""

    @property
    def object_key(self) -> str:
        """The key of an object operation (routing guarantees there is one)."""
        return self.key or ""


def xml_response(body: bytes, status: int = 200, headers: list[tuple[str, str]] | None = None) -> Reply:
    return Reply(status, [("content-type", "application/xml"), *(headers or [])], body)
