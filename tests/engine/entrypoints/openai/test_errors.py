"""Bad input gets a 4xx OpenAI error body and changes nothing: the server keeps serving and
the KV pool ends all-free."""

from __future__ import annotations

import json
import re

import openai
import pytest

from tests.engine.entrypoints.openai.conftest import MAX_BODY_BYTES

COMPLETION = {"model": "tiny", "prompt": "Hello", "max_tokens": 4}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def _check_error(response, status, *, param=None, code=None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    return error


BAD_BODIES = [
    ("/v1/completions", {**COMPLETION, "max_tokens": "ten"}, "max_tokens"),
    ("/v1/completions", {**COMPLETION, "max_tokens": -1}, None),
    ("/v1/completions", {**COMPLETION, "temperature": 9.0}, None),
    ("/v1/completions", {**COMPLETION, "n": 0}, None),
    ("/v1/completions", {**COMPLETION, "prompt": []}, "prompt"),
    ("/v1/completions", {**COMPLETION, "prompt": [1, -5]}, None),
    ("/v1/completions", {**COMPLETION, "prompt": [1, 10**9]}, None),
    ("/v1/completions", {k: v for k, v in COMPLETION.items() if k != "prompt"}, "prompt"),
    ("/v1/completions", {**COMPLETION, "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {**COMPLETION, "max_tokens": 0, "echo": True, "min_tokens": 1},
     "min_tokens"),
    ("/v1/completions", {**COMPLETION, "logit_bias": {"1": 101}}, "logit_bias"),
    ("/v1/completions", {**COMPLETION, "logit_bias": {"272": 5}}, "logit_bias"),
    ("/v1/completions", {**COMPLETION, "logit_bias": {"-1": 5}}, "logit_bias"),
    ("/v1/completions", {**COMPLETION, "logit_bias": {"five": 5}}, "logit_bias"),
    ("/v1/completions", {**COMPLETION, "logit_bias": {"5": 1, "05": 2}}, "logit_bias"),
    ("/v1/completions", {**COMPLETION, "logit_bias": {str(i): 1 for i in range(301)}},
     "logit_bias"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"300": -100}}, "logit_bias"),
    ("/v1/completions", {**COMPLETION, "stop": [""]}, None),
    ("/v1/completions", {**COMPLETION, "top_k": 2**63}, None),
    ("/v1/completions", {**COMPLETION, "priority": 10**20}, None),
    ("/v1/completions", {**COMPLETION, "max_tokens": None, "min_tokens": 10**20}, None),
    ("/v1/completions", {**COMPLETION, "prompt": "\ud800"}, None),
    ("/v1/completions", {**COMPLETION, "job_id": 12}, "job_id"),
    ("/v1/completions", {**COMPLETION, "job_id": ""}, "job_id"),
    ("/v1/completions", {**COMPLETION, "is_last_step": "perhaps", "job_id": "j"},
     "is_last_step"),
    ("/v1/chat/completions", {**CHAT, "messages": []}, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "x"}]},
     None),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 3}, "top_logprobs"),
    # OpenAI's deprecated function calling: refused, never ignored.
    ("/v1/chat/completions", {**CHAT, "functions": [{"name": "ls", "parameters": {}}]},
     "functions"),
    ("/v1/chat/completions", {**CHAT, "function_call": "auto"}, "function_call"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "\ud800"}]},
     None),
    ("/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"chat_template": "x"}},
     "chat_template_kwargs"),
    ("/v1/chat/completions", {**CHAT, "tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "xml"}},
     "response_format.type"),
    ("/v1/chat/completions", {**CHAT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format.json_schema.schema"),
    ("/v1/completions", {**COMPLETION, "structured_outputs": {"regex": "[a-"}},
     "structured_outputs.regex"),
    ("/v1/completions", {**COMPLETION, "guided_regex": "a", "guided_choice": ["b"]},
     "guided_choice"),
    ("/v1/completions", {**COMPLETION, "structured_outputs": {"regex": "a", "choice": ["b"]}},
     "structured_outputs"),
    ("/v1/completions", {**COMPLETION, "guided_json": "{not json"}, "guided_json"),
    ("/v1/completions", {**COMPLETION, "guided_grammar": "start: missing_rule"},
     "guided_grammar"),
    ("/v1/completions", {**COMPLETION, "guided_choice": ["a"], "ignore_eos": True}, None),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 10**12}, "max_tokens"),
    ("/v1/responses", {"model": "tiny", "input": "hi", "max_output_tokens": 10**12},
     "max_output_tokens"),
]


@pytest.mark.parametrize(("path", "body", "param"), BAD_BODIES)
def test_invalid_fields_get_400(server, path, body, param):
    with server.http() as http:
        _check_error(_post(http, path, body), 400, param=param)


def _post(http, path, body):
    """Posts `body` as ASCII JSON (escaped, so that lone surrogates can be sent)."""
    return http.post(path, content=json.dumps(body),
                     headers={"Content-Type": "application/json"})


def test_malformed_json_gets_400(server):
    with server.http() as http:
        response = http.post("/v1/completions", content=b'{"prompt": "x",',
                             headers={"Content-Type": "application/json"})
    assert "JSON" in _check_error(response, 400)["message"]


def test_huge_max_tokens_exceeds_the_context(server):
    with pytest.raises(openai.BadRequestError, match="maximum context length") as raised:
        server.client().completions.create(model="tiny", prompt="Hello", max_tokens=10**9)
    assert (raised.value.code, raised.value.param) == ("context_length_exceeded", "max_tokens")


LONG_TEXT = "hello there " * 1000  # over the test server's 1,024-token context

# As OpenAI answers a prompt too long for the context (frameworks trim history on this code),
# with and without max_tokens, naming the field that holds the prompt.
OVERSIZED_PROMPTS = [
    lambda client, limit: client.completions.create(
        model="tiny", prompt=[65] * 1100, **limit),
    lambda client, limit: client.completions.create(model="tiny", prompt=LONG_TEXT, **limit),
    lambda client, limit: client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": LONG_TEXT}], **limit),
    lambda client, limit: client.responses.create(
        model="tiny", input=LONG_TEXT,
        **({"max_output_tokens": limit["max_tokens"]} if limit else {})),
]


@pytest.mark.parametrize("limit", [{}, {"max_tokens": 16}], ids=["no-max-tokens", "max-tokens"])
@pytest.mark.parametrize(("send", "param"), list(zip(
    OVERSIZED_PROMPTS, ["prompt", "prompt", "messages", "input"], strict=True)),
    ids=["completion-ids", "completion-text", "chat", "responses"])
def test_a_prompt_too_long_for_the_context_gets_openais_error(server, send, param, limit):
    with pytest.raises(openai.BadRequestError, match="maximum context length") as raised:
        send(server.client(), limit)
    assert (raised.value.code, raised.value.param) == ("context_length_exceeded", param)
    assert raised.value.body["type"] == "invalid_request_error"


def test_a_prompt_too_long_by_its_length_alone_is_said_to_have_at_least_so_many_tokens(
        server):
    """A text too long by its length alone is not tokenized (`TextEncoder`): the count the
    client is told is a lower bound and says so. One within the bound gets its exact count."""
    client = server.client()
    with pytest.raises(openai.BadRequestError,
                       match=r"the prompt has at least (\d+), which leaves no room") as raised:
        client.completions.create(model="tiny", prompt=LONG_TEXT * 2)
    assert raised.value.code == "context_length_exceeded"
    at_least = int(re.search(r"at least (\d+)", str(raised.value)).group(1))
    assert 1024 <= at_least <= len(LONG_TEXT * 2)  # the tiny model: a token a byte
    with pytest.raises(openai.BadRequestError, match=r"the prompt has 12000, which leaves"):
        client.completions.create(model="tiny", prompt=LONG_TEXT)
    # A chat's conversation, inline and (over 64 KiB) made into its prompt in a parse child.
    for text in (LONG_TEXT * 2, LONG_TEXT * 6):
        with pytest.raises(openai.BadRequestError, match=r"the prompt has at least \d+, "):
            client.chat.completions.create(model="tiny",
                                           messages=[{"role": "user", "content": text}])


def test_unknown_model_gets_404(server):
    with pytest.raises(openai.NotFoundError) as raised:
        server.client().completions.create(model="gpt-17", prompt="x", max_tokens=1)
    assert raised.value.code == "model_not_found"
    with server.http() as http:
        _check_error(http.get("/v1/models/gpt-17"), 404, code="model_not_found")
        assert _check_error(http.get("/v1/nothing-here"), 404)["message"] == (
            "Invalid URL (GET /v1/nothing-here)")
        # Endpoints OpenAI has and this server does not answer as OpenAI does any unknown URL.
        assert _check_error(http.post("/v1/embeddings", json={"model": "tiny", "input": "x"}),
                            404)["message"] == "Invalid URL (POST /v1/embeddings)"


def test_oversized_body_gets_413(server):
    big = {**COMPLETION, "prompt": "x" * (MAX_BODY_BYTES + 10)}
    with server.http() as http:
        _check_error(http.post("/v1/completions", json=big), 413, code="request_too_large")

        def chunks():  # no Content-Length: the limit applies while reading
            yield b'{"prompt": "'
            for _ in range(MAX_BODY_BYTES // 1024 + 2):
                yield b"x" * 1024
            yield b'", "max_tokens": 1}'

        response = http.post("/v1/completions", content=chunks(),
                             headers={"Content-Type": "application/json"})
        _check_error(response, 413, code="request_too_large")


def test_server_keeps_serving_and_the_pool_is_free_afterwards(server):
    for path, body, _ in BAD_BODIES:
        with server.http() as http:
            assert _post(http, path, body).status_code == 400
    # Random weights may sample EOS before 4 tokens (seen once in a full run).
    response = server.client().completions.create(**COMPLETION,
                                                  extra_body={"ignore_eos": True})
    assert response.usage.completion_tokens == 4
    stats = server.wait_idle()
    assert stats.num_free_blocks == stats.num_kv_blocks
