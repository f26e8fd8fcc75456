"""The protocol floor shared by the S3 and bulk services: raw ASGI requests and responses
(:mod:`.asgi`), the request shell (:mod:`.shell`), authentication (:mod:`.auth` with :mod:`.sigv4`,
:mod:`.sigv2`, :mod:`.chunked` and :mod:`.signing`), the payload-hash check (:mod:`.payload`) and the neutral
error type they raise (:mod:`.errors`)."""
