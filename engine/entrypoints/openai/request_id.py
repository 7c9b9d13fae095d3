"""The `X-Request-Id` header: every response carries the id of its request, the client's own
or one the server makes, so that a client's logs and the server's name the same request.

A client's id is used when it is 1 to `MAX_REQUEST_ID_CHARS` visible ASCII characters; any
other value (too long, spaces, control or non-ASCII characters) is ignored and replaced by a
generated id rather than rejected: a tracing header should not fail a request, and a bounded,
printable id cannot flood or forge log lines. The id is not the engine's request id (the
response's `id`), which stays unique even when clients reuse theirs.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable, MutableMapping
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

REQUEST_ID_HEADER = "x-request-id"
# Anthropic's name for it, which its SDK reads (`_request_id`).
ANTHROPIC_REQUEST_ID_HEADER = "request-id"
MAX_REQUEST_ID_CHARS = 128
REQUEST_ID_SCOPE_KEY = "continuum.request_id"

_VALID_REQUEST_ID = re.compile(rb"[\x21-\x7e]{1,%d}" % MAX_REQUEST_ID_CHARS)


def new_request_id() -> str:
    return uuid.uuid4().hex


def scope_request_id(scope: MutableMapping[str, Any]) -> str | None:
    """The request id `RequestIdMiddleware` chose for this request (None outside it)."""
    return scope.get(REQUEST_ID_SCOPE_KEY)


def request_id_headers(scope: MutableMapping[str, Any]) -> dict[str, str]:
    """The header naming the request, for a response sent past the middleware (the app's
    handler of unexpected errors answers from outside every middleware)."""
    request_id = scope_request_id(scope)
    return {} if request_id is None else {REQUEST_ID_HEADER: request_id}


class RequestIdMiddleware:
    """Picks each HTTP request's id (the client's valid `X-Request-Id`, else a new one from
    `make_id`), records it in the scope, and adds it to the response's headers, also as
    `request-id` on the paths `anthropic_paths` names. Installed outermost, so that every
    response carries it, errors of the other middleware included."""

    def __init__(self, app: ASGIApp, make_id: Callable[[], str] = new_request_id,
                 anthropic_paths: Callable[[str], bool] = lambda path: False) -> None:
        self.app = app
        self.make_id = make_id
        self.anthropic_paths = anthropic_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = self._request_id(scope)
        scope[REQUEST_ID_SCOPE_KEY] = request_id
        headers = [(REQUEST_ID_HEADER.encode(), request_id.encode("ascii"))]
        if self.anthropic_paths(scope.get("path", "")):
            headers.append((ANTHROPIC_REQUEST_ID_HEADER.encode(), request_id.encode("ascii")))

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), *headers]}
            await send(message)

        await self.app(scope, receive, send_with_id)

    def _request_id(self, scope: Scope) -> str:
        given = dict(scope["headers"]).get(REQUEST_ID_HEADER.encode())
        if given is not None and _VALID_REQUEST_ID.fullmatch(given):
            return given.decode("ascii")
        return self.make_id()
