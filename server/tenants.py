"""Tenants and their S3 credentials.

A tenant owns buckets; each of its access keys signs requests (SigV4). Keys are looked up on every
request, so the table is a plain dict. The admin API adds and revokes keys at run time.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from ctxstore.units import parse_size

from .protocol.signing import Credentials

_ACCESS_KEY = re.compile(r"^[A-Za-z0-9._\-]{3,128}$")
_FILE_FIELDS = ("tenant", "access_key", "secret_key", "quota")


@dataclass
class TenantKey:
    credentials: Credentials
    enabled: bool = True


class TenantRegistry:
    """Access key → credentials of a tenant."""

    def __init__(self) -> None:
        self._keys: dict[str, TenantKey] = {}
        self.quotas: dict[str, int] = {}  # tenant -> bytes per node, from the tenants file (0: none)

    def add(self, tenant: str, access_key: str, secret_key: str) -> Credentials:
        if not _ACCESS_KEY.match(access_key):
            raise ValueError("access keys are 3-128 characters of letters, digits, '.', '_' or '-'")
        if len(secret_key) < 8:
            raise ValueError("secret keys must be at least 8 characters")
        if not tenant:
            raise ValueError("a tenant needs a name")
        existing = self._keys.get(access_key)
        if existing is not None and existing.credentials.tenant != tenant:
            raise ValueError(f"access key {access_key} already belongs to another tenant")
        creds = Credentials(access_key=access_key, secret_key=secret_key, tenant=tenant)
        self._keys[access_key] = TenantKey(creds)
        return creds

    def lookup(self, access_key: str) -> Credentials | None:
        entry = self._keys.get(access_key)
        if entry is None or not entry.enabled:
            return None
        return entry.credentials

    def entries(self) -> list[TenantKey]:
        return sorted(self._keys.values(), key=lambda k: (k.credentials.tenant, k.credentials.access_key))

    def set_enabled(self, access_key: str, enabled: bool) -> TenantKey:
        entry = self._get(access_key)
        entry.enabled = enabled
        return entry

    def remove(self, access_key: str) -> TenantKey:
        entry = self._get(access_key)
        del self._keys[access_key]
        return entry

    def _get(self, access_key: str) -> TenantKey:
        entry = self._keys.get(access_key)
        if entry is None:
            raise KeyError(access_key)
        return entry

    def tenants(self) -> list[str]:
        return sorted({k.credentials.tenant for k in self._keys.values()})

    def __len__(self) -> int:
        return len(self._keys)

    def load_file(self, path: str | Path) -> None:
        """Load ``[{"tenant": ..., "access_key": ..., "secret_key": ..., "quota": ...}, ...]``; ``quota`` (bytes,
        or a size such as ``"64MiB"``; 0 or absent: none) caps what the tenant holds on this node. A field the
        file does not know is an error, not ignored: a misspelt quota would leave the tenant uncapped."""
        try:
            entries = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot read tenants file {path}: {exc}") from None
        if not isinstance(entries, list):
            raise ValueError(f"tenants file {path}: expected a JSON list of objects")
        for i, entry in enumerate(entries):
            try:
                if not isinstance(entry, dict):
                    raise ValueError("expected an object")
                unknown = sorted(set(entry) - set(_FILE_FIELDS))
                if unknown:
                    raise ValueError(f"unknown field {', '.join(map(repr, unknown))} "
                                     f"(fields: {', '.join(_FILE_FIELDS)})")
                tenant = str(entry["tenant"])
                self.add(tenant, str(entry["access_key"]), str(entry["secret_key"]))
                if entry.get("quota") is not None:
                    self._file_quota(tenant, entry["quota"])
            except KeyError as exc:
                raise ValueError(f"tenants file {path}, entry {i}: missing field {exc}") from None
            except (TypeError, ValueError) as exc:
                raise ValueError(f"tenants file {path}, entry {i}: {exc}") from None

    def _file_quota(self, tenant: str, value: object) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ValueError(f"quota must be a number of bytes or a size such as \"64MiB\", got {value!r}")
        quota = value if isinstance(value, int) else parse_size(value)
        if quota < 0:
            raise ValueError(f"quota must not be negative, got {value!r}")
        if self.quotas.get(tenant, quota) != quota:
            raise ValueError(f"tenant {tenant!r} has two different quotas")
        self.quotas[tenant] = quota
