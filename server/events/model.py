"""Store events as numbered records, and the frames the HTTP stream sends them in.

A frame is ``u32 big-endian length ‖ msgpack map``. ``seq_hashes``/``tenant_id``/``medium`` are the names of
Mooncake's KV-event RFC (kvcache-ai/Mooncake#1527) for the same facts."""

from __future__ import annotations

import struct
from typing import Any, NamedTuple

import msgpack

STORED = "stored"
REMOVED = "removed"
STREAM_CONTENT_TYPE = "application/vnd.ctxstore.events"

_LEN = struct.Struct(">I")
pack = msgpack.Packer().pack  # one packer: str as str, bytes as bin, floats as float64


class Event(NamedTuple):
    """One store event as the ring keeps it."""

    seq: int
    ts: float
    type: str  # STORED or REMOVED
    bucket: str
    tenant: str
    key: str
    size: int
    expires_at: float
    reason: str | None  # removed: evicted, expired, deleted, flushed, demoted (a move to the flash tier)
    medium: str  # where the block is (stored) or was (removed): the RAM or the disk medium setting


def frame(fields: dict[str, Any]) -> bytes:
    body = pack(fields)
    return _LEN.pack(len(body)) + body


def encode_event(ev: Event, epoch: int, node: str) -> bytes:
    """One HTTP stream frame for an event."""
    fields: dict[str, Any] = {
        "seq": ev.seq, "epoch": epoch, "node": node, "type": ev.type, "ts": ev.ts,
        "bucket": ev.bucket, "tenant": ev.tenant, "key": ev.key, "size": ev.size,
    }
    if ev.type == STORED:
        fields["expires_at"] = ev.expires_at
    else:
        fields["reason"] = ev.reason
    fields["seq_hashes"] = [ev.key]
    fields["tenant_id"] = ev.tenant
    fields["medium"] = ev.medium
    return frame(fields)


def decode_frames(data: bytes) -> tuple[list[dict[str, Any]], bytes]:
    """Split a byte buffer into decoded frames; returns them and the incomplete rest."""
    out = []
    pos = 0
    while len(data) - pos >= 4:
        (n,) = _LEN.unpack_from(data, pos)
        if len(data) - pos - 4 < n:
            break
        out.append(msgpack.unpackb(data[pos + 4:pos + 4 + n]))
        pos += 4 + n
    return out, data[pos:]
