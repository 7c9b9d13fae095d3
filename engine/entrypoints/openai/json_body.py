"""Request bodies parsed without holding the event loop.

CPython's C JSON parser holds the GIL for the whole parse (0.2 s for 16 MiB of small items),
so running it on a worker thread would stall the event loop just as long. A body over
`INLINE_PARSE_BYTES` is parsed instead on the server's `TenantWorkPool`, in its tenant's
turn, by the standard library's pure-Python scanner (which still scans strings in C): it
gives up the GIL every switch interval, so the event loop keeps serving other clients while
it runs. It costs the sender up to 9x the CPU of the C parse for bodies of many tiny items,
about the same for text.
"""

from __future__ import annotations

import json
import json.scanner
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute

from engine.entrypoints.openai.tenants import scope_tenant
from engine.entrypoints.openai.work_pool import TenantWorkPool

INLINE_PARSE_BYTES = 64 * 1024


def parse_json(body: bytes) -> Any:
    """`body` decoded as `json.loads` decodes bytes (same encodings, errors and values), by
    the pure-Python scanner; called on a worker thread."""
    decoder = json.JSONDecoder()
    decoder.scan_once = json.scanner.py_make_scanner(decoder)  # type: ignore[attr-defined]
    return decoder.decode(body.decode(json.detect_encoding(body), "surrogatepass"))


class PoolParsedRequest(Request):
    """A request whose `json()` parses a large body on the app's `state.work_pool`."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            if len(body) <= INLINE_PARSE_BYTES:
                self._json = json.loads(body)
            else:
                pool: TenantWorkPool = self.app.state.work_pool
                self._json = await pool.run(scope_tenant(self.scope), parse_json, body)
        return self._json


class PoolParsedRoute(APIRoute):
    """A FastAPI route whose JSON body is parsed by `PoolParsedRequest`."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def handle(request: Request) -> Response:
            return await handler(PoolParsedRequest(request.scope, request.receive))

        return handle
