"""Requests through the OpenAI-compatible app in-process, as an engine replica runs them."""

from __future__ import annotations

import asyncio
import json

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from engine.replicas.asgi import ProxiedRequest, ResponseHead, call_asgi


def make_app(events: list[str]) -> FastAPI:
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request) -> dict[str, object]:
        return {"body": (await request.json()), "query": request.url.query,
                "header": request.headers.get("x-test")}

    @app.get("/stream")
    async def stream(request: Request) -> StreamingResponse:
        async def chunks():
            try:
                for index in range(1000):
                    yield f"chunk {index}\n"
                    await asyncio.sleep(0.01)
            finally:
                events.append("stream closed")
        return StreamingResponse(chunks(), media_type="text/plain")

    @app.get("/fail")
    async def fail() -> None:
        raise RuntimeError("boom")

    return app


async def collect(app: FastAPI, request: ProxiedRequest) -> tuple[ResponseHead, bytes]:
    items = [item async for item in call_asgi(app, request)]
    head = items[0]
    assert isinstance(head, ResponseHead)
    return head, b"".join(item for item in items[1:] if isinstance(item, bytes))


def test_a_request_keeps_its_body_query_and_headers() -> None:
    request = ProxiedRequest("POST", "/echo", b"a=1", ((b"x-test", b"yes"),
                             (b"content-type", b"application/json")), b'{"k": [1, 2]}')
    head, body = asyncio.run(collect(make_app([]), request))
    assert head.status == 200 and head.header(b"content-type") == b"application/json"
    assert json.loads(body) == {"body": {"k": [1, 2]}, "query": "a=1", "header": "yes"}


def test_closing_a_stream_early_stops_the_app() -> None:
    events: list[str] = []

    async def read_two() -> list[bytes]:
        received: list[bytes] = []
        stream = call_asgi(make_app(events), ProxiedRequest("GET", "/stream", b"", (), b""))
        async for item in stream:
            if isinstance(item, bytes):
                received.append(item)
                if len(received) == 2:
                    break
        await stream.aclose()
        return received

    assert asyncio.run(read_two()) == [b"chunk 0\n", b"chunk 1\n"]
    assert events == ["stream closed"]


def test_an_app_error_is_its_500_answer() -> None:
    head, _ = asyncio.run(collect(make_app([]), ProxiedRequest("GET", "/fail", b"", (), b"")))
    assert head.status == 500
