"""What the parts of a node share, on the ground floor: settings, tenants, the engine and the node's identity
and lifecycle. The services, the admin API, events and metrics each receive this (or the pieces of it they
need) instead of the application."""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field

from .engine import Engine, EngineConfig
from .settings import Settings
from .tenants import TenantRegistry


@dataclass
class NodeState:
    """One node's shared state."""

    settings: Settings
    tenants: TenantRegistry
    engine: Engine
    node_id: str
    started: float = field(default_factory=time.time)
    draining: bool = False  # set on SIGTERM: readiness answers 503, streams end

    @classmethod
    def create(cls, settings: Settings, tenants: TenantRegistry, engine: Engine | None = None) -> NodeState:
        node = cls(settings=settings, tenants=tenants, engine=engine or Engine(EngineConfig.from_settings(settings)),
                   node_id=settings.node_id or f"{socket.gethostname()}:{settings.port}")
        node.apply_file_quotas()
        return node

    def apply_file_quotas(self) -> None:
        """The tenants file's quotas: at start-up, and again after the flash tier restored the quotas it kept
        (the file is the configuration; a change made at run time through the admin API lasts until a restart)."""
        for tenant, quota in self.tenants.quotas.items():
            self.engine.set_tenant_quota(tenant, quota)

    @property
    def admin_token(self) -> str:
        """The bearer token of the admin API, /metrics and the event stream ('' = those are off)."""
        return self.settings.admin_token
