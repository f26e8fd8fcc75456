"""The protocol floor shared by the S3 and bulk services: the node's HTTP protocol (:mod:`.http`, on uvicorn's,
whose internals it reaches through :mod:`.uvicorn_seam` only), the data path below ASGI (:mod:`.direct`), raw
ASGI requests and responses (:mod:`.asgi`), the body deadline both body paths apply (:mod:`.deadline`), the
request shell (:mod:`.shell`), authentication (:mod:`.auth` with :mod:`.sigv4`, :mod:`.sigv2`, :mod:`.chunked`
and :mod:`.signing`), the payload-hash check (:mod:`.payload`) and the neutral error type they raise
(:mod:`.errors`)."""
