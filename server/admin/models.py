"""Request bodies of the admin API (pydantic: a misspelt field is a 422, not a silent no-op)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class BucketPolicy(_Body):
    default_ttl: float | None = Field(None, gt=0, allow_inf_nan=False,
                                      description="Seconds; null = the server default")
    sliding_ttl: bool | None = Field(None, description="Reads push the expiry forward")
    quota: int | None = Field(None, ge=0, description="Byte quota of the bucket; 0 = none")


class TenantCreate(_Body):
    tenant: str = Field(..., min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._\-]+$")
    quota: int | None = Field(None, ge=0, description="Byte quota of the tenant; 0/null = none")
    access_key: str | None = Field(None, pattern=r"^[A-Za-z0-9._\-]{3,128}$",
                                   description="Given by a pod-wide CLI so every node gets the same pair")
    secret_key: str | None = Field(None, min_length=8, max_length=256, description="Given with access_key")


class TenantUpdate(_Body):
    enabled: bool | None = None
    quota: int | None = Field(None, ge=0)


class FlushRequest(_Body):
    bucket: str
    prefix: str = ""
    mode: str = Field("flush", pattern="^(flush|expire)$", description="flush: delete now; expire: expire now")


class SettingsUpdate(_Body):
    memory: str | int | None = Field(None, description="Byte budget, e.g. 4GiB; a cut evicts down to it")
    default_ttl: str | float | None = None
    max_ttl: str | float | None = None
