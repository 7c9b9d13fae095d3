"""`X-Request-Id` on every response of a live server: the client's id echoed, or a fresh one;
an unusable id (too long, not visible ASCII) is replaced, not rejected."""

from __future__ import annotations

import re

import httpx
import pytest

from engine.entrypoints.openai.request_id import MAX_REQUEST_ID_CHARS
from tests.engine.entrypoints.openai.conftest import MAX_BODY_BYTES, ServerThread

GENERATED = re.compile(r"[0-9a-f]{32}")
COMPLETION = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _echoed(server: ServerThread, method: str, path: str, **kwargs) -> httpx.Response:
    with server.http(headers={"X-Request-Id": "client-trace-7"}) as http:
        response = http.request(method, path, **kwargs)
    assert response.headers["x-request-id"] == "client-trace-7", (path, response.status_code)
    return response


@pytest.mark.parametrize(("method", "path", "body", "status"), [
    ("POST", "/v1/completions", COMPLETION, 200),
    ("POST", "/v1/chat/completions", CHAT, 200),
    ("POST", "/v1/completions", {"model": "tiny", "prompt": "hi", "n": 0}, 400),
    ("POST", "/v1/chat/completions", {"model": "other", **{k: v for k, v in CHAT.items()
                                                            if k != "model"}}, 404),
    ("GET", "/v1/models", None, 200),
    ("GET", "/v1/models/other", None, 404),
    ("GET", "/v1/jobs/unknown-job", None, 404),
    ("DELETE", "/v1/jobs/unknown-job", None, 404),
    ("PUT", "/v1/jobs/unknown-job", None, 405),
    ("GET", "/no/such/route", None, 404),
    ("GET", "/health", None, 200),
    ("GET", "/version", None, 200),
    ("GET", "/metrics", None, 200),
    ("GET", "/openapi.json", None, 200),
])
def test_every_route_echoes_the_client_id(server, method, path, body, status):
    response = _echoed(server, method, path, json=body)
    assert response.status_code == status


def test_a_stream_echoes_the_client_id(server):
    with server.http(headers={"X-Request-Id": "stream-1"}) as http, \
            http.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as response:
        assert response.headers["x-request-id"] == "stream-1"
        assert list(response.iter_lines())[-2] == "data: [DONE]"


def test_an_oversized_body_echoes_the_client_id(server):
    response = _echoed(server, "POST", "/v1/completions",
                       json={**COMPLETION, "prompt": "x" * MAX_BODY_BYTES})
    assert response.status_code == 413


def test_a_missing_api_key_echoes_the_client_id(scripted_server):
    response = _echoed(scripted_server, "GET", "/v1/models")
    assert response.status_code == 401


def test_the_sdk_sees_its_own_id(server):
    client = server.client(default_headers={"X-Request-Id": "sdk-42"})
    raw = client.chat.completions.with_raw_response.create(**CHAT)
    assert raw.headers["x-request-id"] == "sdk-42"
    assert raw.parse().choices[0].message.role == "assistant"


def test_without_an_id_each_response_gets_a_new_one(server):
    with server.http() as http:
        ids = [http.post("/v1/completions", json=COMPLETION).headers["x-request-id"]
               for _ in range(3)]
        error_id = http.post("/v1/completions", json={"prompt": None}).headers["x-request-id"]
    assert all(GENERATED.fullmatch(request_id) for request_id in [*ids, error_id])
    assert len({*ids, error_id}) == 4


@pytest.mark.parametrize("given", [
    "x" * (MAX_REQUEST_ID_CHARS + 1),
    "two words",
    "tab\there",
    "caf\u00e9",
])
def test_an_unusable_id_is_replaced_not_rejected(server, given):
    with server.http() as http:
        response = http.post("/v1/completions", json=COMPLETION,
                             headers={"X-Request-Id": given.encode("utf-8")})
    assert response.status_code == 200
    assert GENERATED.fullmatch(response.headers["x-request-id"])


def test_the_longest_usable_id_is_kept(server):
    longest = "a" * MAX_REQUEST_ID_CHARS
    with server.http(headers={"X-Request-Id": longest}) as http:
        assert http.get("/health").headers["x-request-id"] == longest


def test_the_schema_documents_the_header(server):
    with server.http() as http:
        paths = http.get("/openapi.json").json()["paths"]
    for operations in paths.values():
        for operation in operations.values():
            for response in operation["responses"].values():
                assert response["headers"]["X-Request-Id"]["required"] is True
