"""Tool calls end to end: a scripted executor makes every request answer with a Hermes tool
call; the server parses it into `tool_calls`, whole and streamed. The server requires an API
key."""

from __future__ import annotations

import json

import openai
import pytest

from tests.engine.entrypoints.openai.scripted import SCRIPT

TOOLS = [{"type": "function", "function": {
    "name": "bash", "description": "run a command",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}}]
MESSAGES = [{"role": "user", "content": "what is here?"}]


def _check_call(calls):
    (call,) = calls
    assert call.type == "function"
    assert call.id.startswith("call_")
    assert call.function.name == "bash"
    assert json.loads(call.function.arguments) == {"command": "ls -la"}


def test_tool_call_is_parsed(scripted_server):
    response = scripted_server.client().chat.completions.create(
        model="scripted", messages=MESSAGES, tools=TOOLS, max_tokens=200)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me look."
    _check_call(choice.message.tool_calls)


def test_streamed_tool_call_is_parsed(scripted_server):
    chunks = list(scripted_server.client().chat.completions.create(
        model="scripted", messages=MESSAGES, tools=TOOLS, max_tokens=200, stream=True))
    deltas = [chunk.choices[0].delta for chunk in chunks]
    assert "".join(delta.content or "" for delta in deltas) == "Let me look."
    calls = [call for delta in deltas for call in delta.tool_calls or ()]
    _check_call(calls)
    assert calls[0].index == 0
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert all("<tool_call>" not in (delta.content or "") for delta in deltas)


def test_tool_choice_none_leaves_the_text(scripted_server):
    response = scripted_server.client().chat.completions.create(
        model="scripted", messages=MESSAGES, tools=TOOLS, tool_choice="none", max_tokens=200)
    choice = response.choices[0]
    assert choice.message.tool_calls is None
    assert choice.finish_reason == "stop"
    assert '"name": "bash"' in choice.message.content


def test_a_call_of_a_tool_not_offered_is_left_as_text(scripted_server):
    python_only = [{"type": "function", "function": {"name": "python"}}]
    choice = scripted_server.client().chat.completions.create(
        model="scripted", messages=MESSAGES, tools=python_only, max_tokens=200).choices[0]
    assert choice.message.tool_calls is None
    assert choice.finish_reason == "stop"
    assert choice.message.content.startswith("Let me look.\n<tool_call>")


def test_completions_endpoint_returns_the_raw_text(scripted_server):
    response = scripted_server.client().completions.create(
        model="scripted", prompt="hi", max_tokens=200, extra_body={"skip_special_tokens": False})
    assert response.choices[0].text == SCRIPT


def test_unknown_named_tool_choice_is_rejected(scripted_server):
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        scripted_server.client().chat.completions.create(
            model="scripted", messages=MESSAGES, tools=TOOLS, max_tokens=5,
            tool_choice={"type": "function", "function": {"name": "python"}})


def test_api_key_is_required_except_for_health(scripted_server):
    with pytest.raises(openai.AuthenticationError):
        scripted_server.client(api_key="wrong").models.list()
    with scripted_server.http() as http:
        assert http.get("/health").status_code == 200
        response = http.get("/metrics")
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
    assert scripted_server.client().models.list().data[0].id == "scripted"


def test_the_schema_declares_the_api_key(scripted_server):
    with scripted_server.http(headers={"Authorization": "Bearer secret-key"}) as http:
        document = http.get("/openapi.json").json()
    assert document["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    paths = document["paths"]
    assert paths["/v1/models"]["get"]["security"] == [{"bearer": []}]
    assert "401" in paths["/v1/completions"]["post"]["responses"]
    assert "security" not in paths["/health"]["get"]
