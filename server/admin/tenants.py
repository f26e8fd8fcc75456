"""Tenant keys as the admin API manages them: list, create (the secret is returned once), enable or
disable, delete; per-tenant byte quotas live in the engine."""

from __future__ import annotations

import hmac

from fastapi import HTTPException

from ctxstore.admin_schema import generate_key_pair

from ..node import NodeState


def list_tenants(node: NodeState) -> list[dict[str, object]]:
    out: list[dict[str, object]] = []
    for e in node.tenants.entries():
        quota, charged = node.engine.budget.tenant_usage(e.credentials.tenant)
        out.append({"tenant": e.credentials.tenant, "access_key": e.credentials.access_key, "enabled": e.enabled,
                    "quota": quota, "charged": charged})
    return out


def create_tenant_key(node: NodeState, tenant: str, quota: int | None = None, access_key: str | None = None,
                      secret_key: str | None = None) -> dict[str, object]:
    """Add a key pair for ``tenant`` (generated unless given, so a CLI can give every node the same pair)."""
    if bool(access_key) != bool(secret_key):  # never silently generate a pair other than the one asked for
        raise HTTPException(422, "give both access_key and secret_key, or neither")
    if not access_key or not secret_key:
        access_key, secret_key = generate_key_pair()
    existing = next((e for e in node.tenants.entries() if e.credentials.access_key == access_key), None)
    if existing is not None:
        # The same pair again is a retry (a pod-wide CLI re-running on a node that has it): same answer.
        # Anything else would re-key or move a live access key: a conflict, nothing changes.
        same = existing.credentials.tenant == tenant and hmac.compare_digest(
            existing.credentials.secret_key.encode(), secret_key.encode())
        if not same:
            raise HTTPException(409, f"access key {access_key} already exists")
    else:
        try:
            node.tenants.add(tenant, access_key, secret_key)
        except ValueError as exc:
            raise HTTPException(422, str(exc)) from None
    if quota is not None:
        node.engine.set_tenant_quota(tenant, quota)
    return {"tenant": tenant, "access_key": access_key, "secret_key": secret_key,
            "quota": node.engine.budget.tenant_usage(tenant)[0]}


def update_tenant_key(node: NodeState, access_key: str, *, enabled: bool | None,
                      quota: int | None) -> dict[str, object]:
    try:
        entry = node.tenants.set_enabled(access_key, enabled) if enabled is not None else None
        if entry is None:
            entry = next(e for e in node.tenants.entries() if e.credentials.access_key == access_key)
    except (KeyError, StopIteration):
        raise HTTPException(404, f"no access key {access_key}") from None
    if quota is not None:
        node.engine.set_tenant_quota(entry.credentials.tenant, quota)
    return {"tenant": entry.credentials.tenant, "access_key": access_key, "enabled": entry.enabled,
            "quota": node.engine.budget.tenant_usage(entry.credentials.tenant)[0]}


def delete_tenant_key(node: NodeState, access_key: str) -> dict[str, object]:
    try:
        entry = node.tenants.remove(access_key)
    except KeyError:
        raise HTTPException(404, f"no access key {access_key}") from None
    return {"tenant": entry.credentials.tenant, "access_key": access_key, "deleted": True}
