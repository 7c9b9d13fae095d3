"""Anthropic's clients against `/v1/messages`, on their default calls and exception classes:
the `anthropic` SDK, litellm's `anthropic/` provider, langchain-anthropic's `ChatAnthropic`
and pydantic-ai's Anthropic model. A context overflow is each library's own overflow error
(they recognise Anthropic's "prompt is too long" text); a default `max_tokens` larger than
the room left (litellm sends 128,000 for a model it does not know) is served, cut to the
room, with `stop_reason` "max_tokens"; the SDK reads its request id from `request-id`; an
hour-long cache breakpoint on the SDK's default path (an inferred job) is an hour's pin."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import jsonschema
import pytest

from engine.entrypoints.openai.serving import ServerSettings
from engine.entrypoints.openai.tenants import Tenants
from tests.compat.shared import MAX_MODEL_LEN, OVERSIZED_PROMPT, PROMPT, TINY_MODEL
from tests.engine.entrypoints.openai.conftest import ServerThread, start_server


def _sdk(server: ServerThread) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)


# The anthropic SDK.
def test_the_sdk_reads_the_request_id_and_a_max_tokens_past_the_context_is_cut(tiny_server):
    message = _sdk(tiny_server).messages.create(
        model=TINY_MODEL, max_tokens=16_000, messages=[{"role": "user", "content": PROMPT}],
        extra_body={"ignore_eos": True})
    assert message._request_id  # from the `request-id` header, as Anthropic sends it
    assert message.stop_reason == "max_tokens"
    usage = message.usage  # the prompt is input, cache reads and cache writes together
    num_prompt_tokens = (usage.input_tokens + (usage.cache_read_input_tokens or 0)
                         + (usage.cache_creation_input_tokens or 0))
    assert num_prompt_tokens + usage.output_tokens == MAX_MODEL_LEN


def test_the_sdk_gets_a_prompt_too_long_bad_request(tiny_server):
    with pytest.raises(anthropic.BadRequestError) as raised:
        _sdk(tiny_server).messages.create(
            model=TINY_MODEL, max_tokens=16,
            messages=[{"role": "user", "content": OVERSIZED_PROMPT * 2}])
    error = raised.value.body["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith("prompt is too long: ")


def test_count_tokens_counts_a_prompt_past_the_context(tiny_server):
    counted = _sdk(tiny_server).messages.count_tokens(
        model=TINY_MODEL, messages=[{"role": "user", "content": OVERSIZED_PROMPT * 2}])
    assert counted.input_tokens > MAX_MODEL_LEN


# litellm.
def _litellm(server: ServerThread, content: str, **kwargs: Any) -> Any:
    litellm = pytest.importorskip("litellm")
    return litellm.completion(model=f"anthropic/{TINY_MODEL}", api_base=server.base_url,
                              api_key="unused", messages=[{"role": "user", "content": content}],
                              num_retries=0, **kwargs)


def test_litellms_default_call_is_served(tiny_server):
    response = _litellm(tiny_server, PROMPT)  # max_tokens: litellm's default, 128,000
    assert response.choices[0].message.content is not None
    assert response.choices[0].finish_reason in {"length", "stop"}


def test_litellm_raises_its_context_window_error(tiny_server):
    litellm = pytest.importorskip("litellm")
    with pytest.raises(litellm.ContextWindowExceededError):
        _litellm(tiny_server, OVERSIZED_PROMPT * 2, max_tokens=16)


# langchain-anthropic.
def test_langchain_anthropic_raises_its_context_overflow_error(tiny_server):
    chat_models = pytest.importorskip("langchain_anthropic.chat_models")
    llm = chat_models.ChatAnthropic(model=TINY_MODEL, base_url=tiny_server.base_url,
                                    api_key="unused", max_retries=0)
    assert llm.invoke(PROMPT).content is not None  # its default max_tokens is served
    with pytest.raises(chat_models.AnthropicContextOverflowError):
        llm.invoke(OVERSIZED_PROMPT * 2)


# pydantic-ai.
def test_pydantic_ai_raises_its_context_window_error(tiny_server):
    pytest.importorskip("pydantic_ai.models.anthropic")
    from pydantic_ai import Agent
    from pydantic_ai.exceptions import ModelContextWindowExceededError
    from pydantic_ai.models.anthropic import AnthropicModel
    from pydantic_ai.providers.anthropic import AnthropicProvider

    model = AnthropicModel(TINY_MODEL, provider=AnthropicProvider(
        base_url=tiny_server.base_url, api_key="unused"))
    agent = Agent(model)
    assert agent.run_sync(PROMPT).output is not None
    with pytest.raises(ModelContextWindowExceededError):
        agent.run_sync(OVERSIZED_PROMPT * 2)


def test_an_hour_long_breakpoint_on_an_inferred_job_is_an_hours_pin_under_api_keys():
    # The SDK's default path names no job: the engine infers one, names it in the response's
    # header, and keeps the breakpoint's prefix for the hour asked (its turn remembered as
    # long); `GET /v1/jobs/{id}` finds it with the tenant's key.
    server = start_server(api_key="key-a", settings=ServerSettings(
        served_model_name=TINY_MODEL, tenants=Tenants.from_pairs([("key-a", "a")])))
    try:
        client = anthropic.Anthropic(base_url=server.base_url, api_key="key-a", max_retries=0)
        system = [{"type": "text", "text": "You answer in one word. " * 8,
                   "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
        raw = client.messages.with_raw_response.create(
            model=TINY_MODEL, max_tokens=4, system=system,
            messages=[{"role": "user", "content": PROMPT}])
        message = raw.parse()
        assert message.usage.cache_creation.ephemeral_1h_input_tokens > 0
        job_id = raw.headers["x-continuum-job-id"]
        server.wait_idle()
        with server.http(headers={"x-api-key": "key-a"}) as http:
            job = http.get(f"/v1/jobs/{job_id}")
        assert job.status_code == 200, job.text
        pin = job.json()["pin"]
        assert (pin["ttl_s"], pin["source"]) == (3600.0, "client")
    finally:
        server.stop()


# What Anthropic documents, on the SDK's default paths.
def test_output_config_format_gives_json_of_the_schema(tiny_server):
    schema = {"type": "object", "properties": {"sky": {"enum": ["sunny", "rainy"]}},
              "required": ["sky"], "additionalProperties": False}
    message = _sdk(tiny_server).messages.create(
        model=TINY_MODEL, max_tokens=64, messages=[{"role": "user", "content": PROMPT}],
        output_config={"format": {"type": "json_schema", "schema": schema}})
    jsonschema.validate(json.loads(message.content[0].text), schema)


@pytest.mark.parametrize(("fields", "named"), [
    ({"extra_body": {"temperature": 2.0}}, "temperature"),  # the SDK no longer names it
    ({"messages": [{"role": "assistant", "content": "Hi."},
                   {"role": "user", "content": PROMPT}]}, "first message"),
    ({"messages": [
        {"role": "user", "content": PROMPT},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f",
                                           "input": {}}]},
        {"role": "user", "content": "No result."}],
      "tools": [{"name": "f", "input_schema": {"type": "object"}}]}, "tool_result"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "web_search_20250305"),
])
def test_what_anthropic_refuses_is_refused_with_what_is_wrong(tiny_server, fields, named):
    request = {"model": TINY_MODEL, "max_tokens": 8,
               "messages": [{"role": "user", "content": PROMPT}], **fields}
    with pytest.raises(anthropic.BadRequestError) as raised:
        _sdk(tiny_server).messages.create(**request)
    assert named in raised.value.body["error"]["message"]
