"""The query op: which blocks of a prompt this node holds, per tier, for a router that has no event consumer
(``POST /_ctx/v1/bulk/<bucket>/query``; docs/bulk-api.md, "query").

A router names the blocks by their keys, by Dynamo-style u64 sequence hashes, or by the prompt's tokens with the
namespace's block size, hashing scheme and fingerprint digest, which this node cuts and hashes exactly as the
client's namespace does (:func:`ctxstore.wire.query_keys`). The answer is one tier per block and the prefixes a
router weighs. A question is not a read: nothing is counted as a hit or miss, no block's LRU place or TTL
changes (:meth:`~ctxstore_server.engine.Engine.tiers`), so routers asking often do not keep blocks alive that
no worker restores. Its cost is bounded by ``bulk_max_keys`` blocks per query (past it: TooManyKeys)."""

from __future__ import annotations

from ctxstore import wire

from ..protocol.shell import Reply
from .call import BulkCall
from .ops import TIER_CODES, frame_reply


async def query(call: BulkCall) -> Reply:
    request = wire.decode_query_request(await call.read_head("query"), call.max_keys)
    keys = wire.query_keys(request)
    tiers = call.engine.tiers(call.tenant, call.bucket, keys)
    return frame_reply(wire.encode_query_response(wire.query_summary(list(map(TIER_CODES.__getitem__, tiers)))))
