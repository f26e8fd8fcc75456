"""The bare ASGI ceiling for benchmarks/s3_throughput.py: uvicorn + uvloop + httptools (ctxstore's server stack)
running an ASGI handler that keeps objects in a dict, with nothing else: no routing, no authentication, no
S3 headers, no ETag. What the server stack alone allows for a GET or PUT of one object.

    .venv/bin/python benchmarks/asgi_ceiling.py --port 9100      # started (and stopped) by s3_throughput.py
"""

from __future__ import annotations

import argparse
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import uvicorn

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

OBJECTS: dict[str, bytes] = {}


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    """GET / HEAD answer the stored bytes (404 when absent); PUT stores the body; anything else is 405."""
    if scope["type"] != "http":
        return
    method, path = scope["method"], scope["path"]
    if method == "PUT":
        body = bytearray()
        more = True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        OBJECTS[path] = bytes(body)
        await _answer(send, 200, b"")
    elif method in ("GET", "HEAD"):
        data = OBJECTS.get(path)
        if data is None:
            await _answer(send, 404, b"")
        else:
            await _answer(send, 200, b"" if method == "HEAD" else data, len(data))
    else:
        await _answer(send, 405, b"")


async def _answer(send: Send, status: int, body: bytes, length: int | None = None) -> None:
    size = str(len(body) if length is None else length).encode()
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-length", size)]})
    await send({"type": "http.response.body", "body": body})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    uvicorn.run(app, host="127.0.0.1", port=args.port, loop="uvloop", http="httptools", lifespan="off",
                log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
