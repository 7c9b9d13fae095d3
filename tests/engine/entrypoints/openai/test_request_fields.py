"""What agent frameworks send: explicit nulls for optional fields (their default), and
`stream_options` only with `stream: true`; against a live server on the tiny model."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from engine.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    NullMeansDefault,
)

MESSAGES = [{"role": "user", "content": "hi"}]


def _all_optional_null(model: type[NullMeansDefault]) -> dict[str, Any]:
    return {name: None for name, field in model.model_fields.items() if not field.is_required()}


def test_the_nulls_cover_the_fields_clients_send_as_null():
    for model in (CompletionRequest, ChatCompletionRequest):
        defaulted = model.null_defaulted_fields()
        assert {"n", "stream", "min_tokens", "ignore_eos", "skip_special_tokens",
                "priority"} <= defaulted
        assert "max_tokens" not in defaulted  # None is a value of its own there
    assert {"logprobs", "add_generation_prompt"} <= ChatCompletionRequest.null_defaulted_fields()


def test_null_for_every_optional_completion_field_means_its_default(server):
    body = {**_all_optional_null(CompletionRequest), "prompt": "Hello"}
    with server.http() as http:
        response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("application/json")  # stream: false
    (choice,) = response.json()["choices"]  # n: 1
    assert choice["logprobs"] is None
    assert "token_ids" not in choice  # return_token_ids: false
    assert choice["finish_reason"] in ("stop", "length")


def test_null_for_every_optional_chat_field_means_its_default(server):
    body = {**_all_optional_null(ChatCompletionRequest), "messages": MESSAGES,
            "max_completion_tokens": 8}
    with server.http() as http:
        response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    (choice,) = response.json()["choices"]
    assert choice["logprobs"] is None
    assert choice["message"]["role"] == "assistant"


def test_null_inside_nested_objects_means_the_default(server):
    messages = [
        {"role": "user", "content": "list files", "name": None},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": None,
            "function": {"name": "bash", "arguments": '{"command": "ls"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "a.txt"},
    ]
    chunks = list(server.client().chat.completions.create(
        model="tiny", messages=messages, max_tokens=3, stream=True,
        stream_options={"include_usage": None}))  # type: ignore[typeddict-item]
    assert chunks and all(chunk.usage is None for chunk in chunks)  # include_usage: false


def test_the_sdk_with_explicit_nones(server):
    """The openai SDK sends what it is given, None included (litellm passes its unset
    parameters this way)."""
    response = server.client().chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=4, n=None, temperature=None, top_p=None,
        stop=None, seed=None, presence_penalty=None, logprobs=None, stream=None,
        extra_body={"ignore_eos": None, "min_tokens": None, "priority": None,
                    "skip_special_tokens": None, "add_generation_prompt": None})
    assert len(response.choices) == 1
    assert response.usage.completion_tokens <= 4


def test_null_for_a_required_field_is_still_a_400(server):
    with server.http() as http:
        response = http.post("/v1/completions", json={"model": "tiny", "prompt": None})
        chat = http.post("/v1/chat/completions", json={"model": "tiny", "messages": None})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "prompt"
    assert chat.status_code == 400
    assert chat.json()["error"]["param"] == "messages"


def test_the_schema_marks_the_defaulted_fields_nullable(server):
    with server.http() as http:
        schemas = http.get("/openapi.json").json()["components"]["schemas"]
    for model in (CompletionRequest, ChatCompletionRequest):
        properties = schemas[model.__name__]["properties"]
        for name in model.null_defaulted_fields():
            assert {"type": "null"} in properties[name]["anyOf"], name
        assert properties["n"]["default"] == 1


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_stream_options_without_stream_is_a_400_naming_it(server, endpoint):
    client = server.client()
    with pytest.raises(openai.BadRequestError) as raised:
        if endpoint == "completions":
            client.completions.create(model="tiny", prompt="hi", max_tokens=2,
                                      stream_options={"include_usage": True})
        else:
            client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2,
                                           stream=False, stream_options={"include_usage": True})
    assert raised.value.body["param"] == "stream_options"
    assert "stream" in raised.value.body["message"]


def test_stream_options_null_without_stream_is_fine(server):
    with server.http() as http:
        response = http.post("/v1/completions", json={
            "model": "tiny", "prompt": "hi", "max_tokens": 2, "stream_options": None})
    assert response.status_code == 200, response.text
