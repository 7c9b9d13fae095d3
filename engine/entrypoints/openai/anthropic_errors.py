"""Errors in the Anthropic Messages API's shape on its paths (`/v1/messages...`):
`{"type": "error", "error": {"type", "message"}, "request_id"}` with the same HTTP status.

Every part of the server answers errors in OpenAI's shape (handlers, validation, the
authentication and body-limit middlewares, the drain); `AnthropicErrorsMiddleware` rewrites
those answers on the Messages API's paths, so that one translation covers them all. The error
type follows Anthropic's list for the status: 400 `invalid_request_error`, 401
`authentication_error`, 403 `permission_error`, 404 `not_found_error`, 413
`request_too_large`, 429 `rate_limit_error`, 503 and 529 `overloaded_error`, other server
errors `api_error`.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.entrypoints.openai.request_id import scope_request_id

MESSAGES_PATH = "/v1/messages"

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}


def is_messages_path(path: str) -> bool:
    """Whether `path` is the Messages API's (whose errors take Anthropic's shape)."""
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def anthropic_error_type(status: int) -> str:
    """Anthropic's error type for an HTTP status."""
    return _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def anthropic_error_body(status: int, message: str,
                         request_id: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"type": "error", "error": {
        "type": anthropic_error_type(status), "message": message}}
    if request_id is not None:
        body["request_id"] = request_id
    return body


def _message_of(body: bytes, status: int) -> str:
    """The message of an error body in OpenAI's shape (or the body's text, if it is not)."""
    try:
        error = json.loads(body)["error"]
        message = error["message"] if isinstance(error, dict) else error
    except (ValueError, KeyError, TypeError):
        message = body.decode("utf-8", errors="replace").strip()
    return str(message) or f"HTTP {status}"


class AnthropicErrorsMiddleware:
    """Rewrites the error answers (status 400 and up) on the Messages API's paths into
    Anthropic's shape; other answers, and other paths, pass as they are. Placed outside the
    authentication and body-limit middlewares, whose refusals it rewrites too."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not is_messages_path(scope["path"]):
            await self.app(scope, receive, send)
            return
        held_start: Message | None = None
        chunks: list[bytes] = []

        async def send_rewritten(message: Message) -> None:
            nonlocal held_start
            if message["type"] == "http.response.start" and message["status"] >= 400:
                held_start = message
                return
            if held_start is None or message["type"] != "http.response.body":
                await send(message)
                return
            chunks.append(message.get("body", b""))
            if message.get("more_body"):
                return
            status = held_start["status"]
            body = json.dumps(anthropic_error_body(
                status, _message_of(b"".join(chunks), status), scope_request_id(scope)),
                ensure_ascii=False).encode()
            headers = [(name, value) for name, value in held_start.get("headers", [])
                       if name.lower() not in (b"content-length", b"content-type")]
            headers += [(b"content-length", str(len(body)).encode()),
                        (b"content-type", b"application/json")]
            await send({**held_start, "headers": headers})
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, send_rewritten)
