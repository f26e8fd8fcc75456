"""Every protocol maps every error kind, once: the S3 and bulk tables cover the engine's kinds and the
protocol floor's, the admin table the engine's, and every code they name exists in its protocol."""

from __future__ import annotations

from ctxstore import wire
from ctxstore_server.admin.api import STATUS
from ctxstore_server.bulk.errors import CODES as BULK_CODES
from ctxstore_server.engine import Kind
from ctxstore_server.protocol.errors import MESSAGES, Reject
from ctxstore_server.s3.errors import CODES as S3_CODES
from ctxstore_server.s3.errors import ERROR_CODES


def test_s3_maps_every_kind_onto_a_known_code() -> None:
    assert set(S3_CODES) == set(Kind) | set(Reject)
    assert set(S3_CODES.values()) <= set(ERROR_CODES)


def test_bulk_maps_every_kind_onto_a_known_code() -> None:
    assert set(BULK_CODES) == set(Kind) | set(Reject)
    assert set(BULK_CODES.values()) <= set(wire.ERROR_STATUS)


def test_admin_maps_every_engine_kind_onto_an_http_status() -> None:
    assert set(STATUS) == set(Kind)
    assert all(400 <= status < 600 for status in STATUS.values())


def test_every_reject_has_a_message() -> None:
    assert set(MESSAGES) == set(Reject)
