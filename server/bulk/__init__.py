"""The bulk extension API: many blocks of one bucket per round trip, msgpack heads plus raw payloads.

The wire schema (frames, heads, error codes) lives in :mod:`ctxstore.wire`, shared with the client;
docs/bulk-api.md describes it for other implementers. :mod:`.service` routes and authenticates, :mod:`.ops`
and :mod:`.put` are the operations, :mod:`.errors` maps failures onto bulk error codes."""
