"""A lone UTF-16 surrogate anywhere in a body is a 400 naming where, for every generation
endpoint, before the engine sees the request (it used to be a 500 after it)."""

from __future__ import annotations

import json

import pytest

from engine.entrypoints.openai.unicode_text import lone_surrogate_path

LONE = "\ud800"
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
RESPONSES = {"model": "tiny", "input": "hi", "max_output_tokens": 2}
COMPLETIONS = {"model": "tiny", "prompt": "hi", "max_tokens": 2}


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/responses", {**RESPONSES, "user": LONE}, "user"),
    ("/v1/responses", {**RESPONSES, "user": LONE, "stream": True}, "user"),
    ("/v1/responses", {**RESPONSES, "input": [
        {"type": "message", "role": "user", "content": "hi", "id": f"msg{LONE}"}]},
     "input.0.id"),
    ("/v1/responses", {**RESPONSES, "metadata": {"k": LONE}}, "metadata.k"),
    ("/v1/chat/completions", {**CHAT, "user": LONE}, "user"),
    ("/v1/chat/completions", {**CHAT, "messages": [
        {"role": "user", "content": "hi", "name": LONE}]}, "messages.0.name"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {LONE: {}}}}}]},
     "tools.0.function.parameters.properties"),
    ("/v1/completions", {**COMPLETIONS, "prompt": f"hi {LONE}"}, "prompt"),
    ("/v1/completions", {**COMPLETIONS, "stop": ["a", LONE]}, "stop.1"),
])
def test_a_lone_surrogate_is_a_400_naming_where(server, path, body, param):
    with server.http() as http:
        response = http.post(path, content=json.dumps(body),
                             headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and "lone UTF-16 surrogate" in error["message"]
    stats = server.wait_idle()
    assert stats.num_free_blocks == stats.num_kv_blocks


def test_the_first_lone_surrogate_in_document_order_is_named():
    assert lone_surrogate_path({"a": ["ok", {"b": LONE}], "c": LONE}) == ("a", "1", "b")
    assert lone_surrogate_path({"a": "\U0001f600", "b": ["é"]}) is None  # pairs are fine
    assert lone_surrogate_path(LONE) == ()
    nested: object = LONE
    for _ in range(100_000):
        nested = [nested]
    assert lone_surrogate_path(nested) == ("0",) * 100_000
