"""The bulk operations whose requests are a head only: lookup, get, touch, pin, unpin, delete, prefetch.

``get`` answers with the stored buffers themselves after its head (no copy, no join), holding references to
the objects so an eviction during the send cannot change what goes out; blocks of the flash tier are read
(verified) before the answer starts."""

from __future__ import annotations

from collections.abc import Sequence

from ctxstore import wire

from ..engine import StoredObject
from ..protocol.shell import Reply
from .call import BulkCall
from .errors import BulkError


def frame_reply(frame: bytes, payloads: Sequence[bytes | bytearray | memoryview] = ()) -> Reply:
    # The service adds the features header every answer carries (BulkService.features).
    return Reply(200, [("content-type", wire.CONTENT_TYPE)], [frame, *payloads])


TIER_CODES = {None: wire.TIER_ABSENT, "ram": wire.TIER_RAM, "disk": wire.TIER_DISK}  # the engine's tier names


async def lookup(call: BulkCall) -> Reply:
    """Per-key sizes and the present prefix; ``pin`` pins every present block, not only the prefix."""
    request = await call.keys_request("lookup")
    sizes, tiers = call.engine.locate(call.tenant, call.bucket, request.keys)
    codes = None if tiers is None else list(map(TIER_CODES.__getitem__, tiers))
    if request.pin:
        keys = [key for key, size in zip(request.keys, sizes, strict=True) if size >= 0]
        call.engine.store.pin(call.tenant, call.bucket, keys, request.pin)
    return frame_reply(wire.encode_lookup_response(wire.LookupResponse(wire.prefix_length(sizes), sizes, codes)))



async def get(call: BulkCall) -> Reply:
    """Sizes, checksums and expiries, then the present payloads in key order (the stored buffers)."""
    request = await call.keys_request("get")
    objects = await call.engine.fetch_many(call.tenant, call.bucket, request.keys)
    _pin_present(call, request, objects)
    present = [obj for obj in objects if obj is not None]
    head = wire.GetResponse(
        sizes=[wire.ABSENT if obj is None else obj.size for obj in objects],
        xxh3=[0 if obj is None else obj.xxh3 for obj in objects],
        expires=[0.0 if obj is None else obj.expires_at for obj in objects],
    )
    for obj in present:
        call.engine.store.record_read(obj, obj.size)
    # obj.data is never mutated once committed; holding it keeps it whole even if the object is evicted, and
    # the lease keeps it counted against the budget until the send ends.
    reply = frame_reply(wire.encode_get_head(head), [obj.data for obj in present if obj.size])
    reply.after.extend(call.engine.store.lease(obj) for obj in present)
    return reply


def _pin_present(call: BulkCall, request: wire.KeysRequest, objects: Sequence[StoredObject | None]) -> None:
    if request.pin:
        keys = [key for key, obj in zip(request.keys, objects, strict=True) if obj is not None]
        call.engine.store.pin(call.tenant, call.bucket, keys, request.pin)


def _count(n: int) -> Reply:
    return frame_reply(wire.encode_count_response(wire.CountResponse(n)))


async def touch(call: BulkCall) -> Reply:
    request = await call.keys_request("touch")
    if request.ttl is not None and not request.ttl > 0:
        raise BulkError("InvalidArgument", "'ttl' must be positive (or nil for each object's own TTL)")
    return _count(call.engine.store.touch(call.tenant, call.bucket, request.keys, request.ttl))


async def pin(call: BulkCall) -> Reply:
    request = await call.keys_request("pin")
    return _count(call.engine.store.pin(call.tenant, call.bucket, request.keys, request.seconds))


async def unpin(call: BulkCall) -> Reply:
    request = await call.keys_request("unpin")
    return _count(call.engine.store.unpin(call.tenant, call.bucket, request.keys))


async def delete(call: BulkCall) -> Reply:
    request = await call.keys_request("delete")
    return _count(sum(call.engine.store.delete(call.tenant, call.bucket, key) for key in request.keys))


async def prefetch(call: BulkCall) -> Reply:
    """Start promoting the keys' flash-resident blocks into RAM; answers at once how many it will read."""
    request = await call.keys_request("prefetch")
    return _count(call.engine.prefetch(call.tenant, call.bucket, request.keys)["started"])
