"""One HTTP request through an ASGI app in the same process, its response streamed back.

An engine replica runs the whole OpenAI-compatible app (`build_app`) and the ingress forwards
it raw requests, so that validation, authentication, errors and streaming are exactly the
single server's. `ProxiedRequest` is what crosses from the ingress to the replica;
`call_asgi` yields the response's `ResponseHead`, then its body chunks as the app sends them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.types import ASGIApp, Message


@dataclass(frozen=True, slots=True)
class ProxiedRequest:
    """An HTTP request as the client sent it: `headers` as (lower-case name, value) pairs,
    `query` the raw query string."""

    method: str
    path: str
    query: bytes
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes


@dataclass(frozen=True, slots=True)
class ResponseHead:
    """A response's status and headers, (name, value) pairs as the app sent them."""

    status: int
    headers: tuple[tuple[bytes, bytes], ...]

    def header(self, name: bytes) -> bytes | None:
        """The first value of header `name` (lower case), if present."""
        return next((value for key, value in self.headers if key.lower() == name), None)


async def call_asgi(app: ASGIApp, request: ProxiedRequest) -> AsyncIterator[ResponseHead | bytes]:
    """Runs `request` through `app`: yields the head, then each non-empty body chunk. Closing
    the iterator early (the client left) tells the app the client disconnected, then cancels
    it. An app that fails before sending its head raises here."""
    sent: asyncio.Queue[Message | BaseException] = asyncio.Queue()
    disconnected = asyncio.Event()
    body_sent = False

    async def receive() -> Message:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        await sent.put(message)

    async def run() -> None:
        try:
            await app(_scope(request), receive, send)
        except BaseException as error:  # the reader re-raises it
            await sent.put(error)
            raise
        await sent.put({"type": "http.response.body", "body": b"", "more_body": False})

    task = asyncio.ensure_future(run())
    try:
        async for item in _messages(sent):
            yield item
    finally:
        disconnected.set()
        if not task.done():
            task.cancel()
        with contextlib.suppress(BaseException):
            await task


async def _messages(sent: asyncio.Queue[Message | BaseException]
                    ) -> AsyncIterator[ResponseHead | bytes]:
    while True:
        message = await sent.get()
        if isinstance(message, BaseException):
            raise message
        if message["type"] == "http.response.start":
            yield ResponseHead(message["status"], tuple(
                (bytes(key), bytes(value)) for key, value in message.get("headers", ())))
        elif message["type"] == "http.response.body":
            if message.get("body"):
                yield bytes(message["body"])
            if not message.get("more_body", False):
                return


def _scope(request: ProxiedRequest) -> dict[str, object]:
    return {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
        "method": request.method, "scheme": "http", "path": request.path,
        "raw_path": request.path.encode(), "query_string": request.query, "root_path": "",
        "headers": list(request.headers), "client": None, "server": None, "state": {},
    }
