"""Large bodies are parsed, and checked against the body limits, in a child process: what
is over a limit never comes back into the server's process."""

from __future__ import annotations

import json
import os

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from engine.entrypoints.openai.body_limits import MAX_CONVERSATION_PARTS, BodyLimitError
from engine.entrypoints.openai.json_body import INLINE_PARSE_BYTES, BodyParser, PoolParsedRoute
from engine.entrypoints.openai.serving import ClientContext
from engine.entrypoints.openai.work_pool import TenantWorkPool


@pytest.fixture(scope="module")
def parser():
    running = BodyParser(num_processes=1)
    yield running
    running.shutdown()


def test_parses_in_a_child_process_as_json_loads_does(parser):
    body = '{"a": [1, 2.5, true, null], "b": "d\\u00e9 \\ud800"}'.encode("utf-16")
    assert parser.parse(body, None) == json.loads(body)
    with pytest.raises(json.JSONDecodeError):
        parser.parse(b'{"a": 1', None)


def test_a_body_over_a_limit_is_refused_in_the_child(parser):
    body = json.dumps({"messages": [{"content": [{}] * (MAX_CONVERSATION_PARTS + 1)}]})
    with pytest.raises(BodyLimitError) as refused:
        parser.parse(body.encode(), "messages")
    assert refused.value.param == "messages"
    assert parser.parse(body.encode(), "input")["messages"]


def test_a_dead_child_is_replaced(parser):
    parser.parse(b"[]", None)
    executor = parser._live_executor()
    for pid in list(executor._processes):
        os.kill(pid, 9)
    assert parser.parse(b"[1]", None) == [1]


def test_large_chat_bodies_are_served_or_refused_with_400(server):
    filler = "word " * (INLINE_PARSE_BYTES // 4)
    body = {"model": "tiny", "max_tokens": 2, "messages": [
        {"role": "system", "content": "x", "metadata": filler},
        {"role": "user", "content": "hello"}]}
    over = {"model": "tiny", "messages": [
        {"role": "user", "content": [{"type": "text"}] * (MAX_CONVERSATION_PARTS + 1)}]}
    assert len(json.dumps(over)) > INLINE_PARSE_BYTES
    with server.http() as http:
        response = http.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        broken = http.post("/v1/chat/completions", content=json.dumps(body)[:-1].encode(),
                           headers={"Content-Type": "application/json"})
        refused = http.post("/v1/chat/completions", json=over)
    assert broken.status_code == 400
    assert "JSON" in broken.json()["error"]["message"]
    assert refused.status_code == 400
    assert (refused.json()["error"]["param"], refused.json()["error"]["code"]) == (
        "messages", "limit_exceeded")


def test_a_large_bodys_preparation_runs_in_the_background(parser):
    """`ClientContext.large_body` (what sends a request's preparation to the work pool's
    low-priority threads) is set by a body parsed off the loop, not by an inline one."""
    app = FastAPI()
    app.router.route_class = PoolParsedRoute
    app.state.work_pool, app.state.body_parser = TenantWorkPool(2), parser

    @app.post("/v1/chat/completions")
    async def echo(body: dict, request: Request) -> dict:
        return {"large_body": ClientContext.of(request).large_body}

    with TestClient(app) as client:
        small = client.post("/v1/chat/completions", json={"messages": []}).json()
        large = client.post("/v1/chat/completions",
                            json={"messages": ["x" * INLINE_PARSE_BYTES]}).json()
    assert (small, large) == ({"large_body": False}, {"large_body": True})
    app.state.work_pool.shutdown()
