"""The Anthropic Messages API (`/v1/messages`, `/v1/messages/count_tokens`) driven by the
real `anthropic` SDK (and httpx for the raw events and errors) against live servers: the tiny
model (random weights: structured outputs hold by constrained decoding whatever it samples),
and the scripted agent (`tests/compat/scripted_agent.py`: it calls `get_weather`, then
answers with the tool's result), behind two tenants' API keys.
"""

from __future__ import annotations

import http.client as http_client
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import pytest

from engine.entrypoints.openai.body_limits import MAX_CONVERSATION_ITEMS
from engine.entrypoints.openai.json_body import INLINE_PARSE_BYTES
from engine.entrypoints.openai.serving import ServerSettings
from engine.entrypoints.openai.tenants import Tenants
from engine.frontend.chat_template import render_chat
from engine.model.tokenizer import load_tokenizer
from tests.compat.scripted_agent import ANSWER_PREFIX, TOOL_ARGUMENTS, TOOL_NAME
from tests.engine.entrypoints.openai.conftest import SCRIPTED, ServerThread, start_server
from tracing.reader import read_trace
from tracing.records import RequestArrived

AGENT_EXECUTOR = "tests.compat.scripted_agent:ToolThenAnswerExecutor"
AGENT_MODEL = "scripted-agent"
KEY_A, KEY_B = "key-a", "key-b"
WEATHER = {"name": TOOL_NAME, "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}
# Bounded inputs, so that the tiny model's constrained calls end within a few tokens.
COLOUR = {"name": "pick_colour", "description": "Pick a colour.",
          "input_schema": {"type": "object", "additionalProperties": False,
                           "properties": {"colour": {"enum": ["red", "blue"]}},
                           "required": ["colour"]}}
SIZE = {"name": "pick_size", "description": "Pick a size.",
        "input_schema": {"type": "object", "additionalProperties": False,
                         "properties": {"size": {"enum": ["s", "m", "l"]}},
                         "required": ["size"]}}
QUESTION = [{"role": "user", "content": "What is the weather like?"}]


MAX_BODY_BYTES = 64 * 1024


@pytest.fixture(scope="module")
def tiny() -> Iterator[ServerThread]:
    server = start_server(settings=ServerSettings(served_model_name="tiny",
                                                  max_request_body_bytes=MAX_BODY_BYTES))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def agent_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("messages") / "agent.jsonl"


@pytest.fixture(scope="module")
def agent(agent_trace: Path) -> Iterator[ServerThread]:
    """The scripted agent; every non-final turn of a job is pinned (`PinJobTurnsPolicy`)."""
    server = start_server(
        executor=AGENT_EXECUTOR, scheduling_policy=f"{SCRIPTED}:PinJobTurnsPolicy",
        trace_path=str(agent_trace), api_key=KEY_A,
        settings=ServerSettings(served_model_name=AGENT_MODEL,
                                tenants=Tenants.from_pairs([(KEY_A, "a"), (KEY_B, "b")])))
    yield server
    server.stop()


def _client(server: ServerThread, **auth: Any) -> anthropic.Anthropic:
    if not auth:
        auth = {"api_key": server.api_key or "unused"}
    return anthropic.Anthropic(base_url=server.base_url, max_retries=0, timeout=60, **auth)


def _arrivals(trace: Path) -> dict[str, RequestArrived]:
    return {event.request_id: event for event in read_trace(trace).events
            if isinstance(event, RequestArrived)}


def _raw_events(server: ServerThread, body: dict[str, Any],
                headers: dict[str, str] | None = None) -> list[tuple[str, dict[str, Any]]]:
    """A stream's (event name, data) pairs, as the server sent them."""
    events = []
    with server.http() as http, http.stream("POST", "/v1/messages", json={**body, "stream": True},
                                            headers=headers or {}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in response.iter_lines():
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                data = json.loads(line.removeprefix("data: "))
                assert data["type"] == name
                events.append((name, data))
    return events


def test_a_message_and_its_usage(tiny) -> None:
    client = _client(tiny)
    # This SDK's release names no sampling fields; they go as extra fields.
    message = client.messages.create(model="tiny", max_tokens=12, messages=QUESTION,
                                     system="Answer in one word.", metadata={"user_id": "u-7"},
                                     extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 40})
    assert message.id.startswith("msg_") and message.type == "message"
    assert (message.role, message.model) == ("assistant", "tiny")
    (block,) = message.content
    assert block.type == "text"
    assert message.stop_reason in ("end_turn", "max_tokens")
    usage = message.usage
    assert 0 < usage.output_tokens <= 12 and usage.service_tier == "standard"
    counted = client.messages.count_tokens(model="tiny", messages=QUESTION,
                                           system="Answer in one word.")
    assert counted.input_tokens == (usage.input_tokens + usage.cache_read_input_tokens
                                    + usage.cache_creation_input_tokens)
    assert usage.cache_creation_input_tokens == 0  # no breakpoint


def test_the_sdk_lists_and_retrieves_the_model(tiny) -> None:
    client = _client(tiny)
    (listed,) = client.models.list().data
    retrieved = client.models.retrieve("tiny")
    assert listed == retrieved
    assert (listed.type, listed.id, listed.display_name) == ("model", "tiny", "tiny")
    assert listed.created_at.tzinfo is not None
    with pytest.raises(anthropic.NotFoundError):
        client.models.retrieve("claude-x")


def test_a_stream_adds_up_to_the_same_message(tiny) -> None:
    # Seeded: the same output twice, one with text (the tiny model's greedy one is blank).
    body = {"model": "tiny", "max_tokens": 24, "temperature": 1, "seed": 1,
            "messages": QUESTION}
    events = _raw_events(tiny, body, headers={"anthropic-version": "2023-06-01"})
    names = [name for name, _ in events]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    text = "".join(data["delta"]["text"] for name, data in events
                   if name == "content_block_delta")
    sdk_body = {key: value for key, value in body.items() if key not in ("temperature", "seed")}
    sdk_body["extra_body"] = {"temperature": 1, "seed": 1}
    whole = _client(tiny).messages.create(**sdk_body)
    assert text == whole.content[0].text
    message_delta = events[-2][1]
    assert message_delta["delta"]["stop_reason"] == whole.stop_reason
    assert message_delta["usage"]["output_tokens"] == whole.usage.output_tokens
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    with _client(tiny).messages.stream(**sdk_body) as stream:
        assert stream.get_final_text() == text


def test_a_tool_loop_of_two_turns_is_one_job(agent, agent_trace) -> None:
    client = _client(agent)  # the SDK sends the key as x-api-key
    first = client.messages.create(model=AGENT_MODEL, max_tokens=200, tools=[WEATHER],
                                   messages=QUESTION)
    assert first.stop_reason == "tool_use"
    text, call = first.content
    assert (text.type, text.text) == ("text", "Checking.")
    assert (call.type, call.name, call.input) == ("tool_use", TOOL_NAME, TOOL_ARGUMENTS)
    result = {"type": "tool_result", "tool_use_id": call.id, "content": "sunny in Paris"}
    second = client.messages.create(
        model=AGENT_MODEL, max_tokens=200, tools=[WEATHER],
        messages=[*QUESTION, {"role": "assistant", "content": first.content},
                  {"role": "user", "content": [result]}])
    assert second.stop_reason == "end_turn"
    assert second.content[0].text == ANSWER_PREFIX + "sunny in Paris"
    assert second.usage.cache_read_input_tokens >= 16  # the first turn's blocks
    agent.wait_idle()
    arrived = _arrivals(agent_trace)
    assert arrived[second.id].inferred_from == first.id
    assert arrived[second.id].job_id == arrived[first.id].job_id


def test_a_streamed_tool_use_sends_its_input_as_json(agent) -> None:
    client = _client(agent, auth_token=KEY_B)  # Authorization: Bearer
    with client.messages.stream(model=AGENT_MODEL, max_tokens=200, tools=[WEATHER],
                                messages=QUESTION) as stream:
        events = list(stream)
        message = stream.get_final_message()
    starts = [event.content_block for event in events if event.type == "content_block_start"]
    assert [block.type for block in starts] == ["text", "tool_use"]
    assert (starts[1].name, starts[1].input) == (TOOL_NAME, {})
    partial = "".join(event.delta.partial_json for event in events
                      if event.type == "content_block_delta"
                      and event.delta.type == "input_json_delta")
    assert json.loads(partial) == TOOL_ARGUMENTS
    assert message.stop_reason == "tool_use"
    assert [block.type for block in message.content] == ["text", "tool_use"]
    assert message.content[1].input == TOOL_ARGUMENTS and message.content[1].id == starts[1].id


def test_tool_choice_goes_through_the_grammar(tiny) -> None:
    client = _client(tiny)

    def call(**fields: Any) -> Any:
        return client.messages.create(model="tiny", max_tokens=200, tools=[COLOUR, SIZE],
                                      messages=[{"role": "user", "content": "Pick."}], **fields)

    forced = call(tool_choice={"type": "any", "disable_parallel_tool_use": True})
    (use,) = [block for block in forced.content if block.type == "tool_use"]
    assert forced.stop_reason == "tool_use" and use.name in ("pick_colour", "pick_size")
    named = call(tool_choice={"type": "tool", "name": "pick_size"})
    uses = [block for block in named.content if block.type == "tool_use"]
    assert uses and all(block.name == "pick_size" and block.input["size"] in ("s", "m", "l")
                        for block in uses)
    none = call(tool_choice={"type": "none"})
    assert [block.type for block in none.content] == ["text"]


def test_stop_sequences_end_the_message(agent) -> None:
    message = _client(agent).messages.create(model=AGENT_MODEL, max_tokens=200,
                                             messages=QUESTION, stop_sequences=["\n", "zzz"])
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "\n")
    assert message.content[0].text == "Checking."


def test_a_prefill_is_continued(tiny) -> None:
    messages = [*QUESTION, {"role": "assistant", "content": "It is"}]
    client = _client(tiny)
    counted = client.messages.count_tokens(model="tiny", messages=messages)
    tokenizer = load_tokenizer("tiny")
    prompt = render_chat(tokenizer, [{"role": "user", "content": QUESTION[0]["content"]},
                                     {"role": "assistant", "content": "It is"}],
                         add_generation_prompt=False,
                         chat_template_kwargs={"continue_final_message": True})
    assert prompt.endswith("<|im_start|>assistant\nIt is")
    assert counted.input_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))
    message = client.messages.create(model="tiny", max_tokens=8, messages=messages)
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == \
        counted.input_tokens


def test_cache_breakpoints_report_what_was_written_and_read(agent) -> None:
    client = _client(agent)
    system = [{"type": "text", "text": "You forecast the weather for travellers. " * 8,
               "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    job = {"job_id": "cached-travel"}
    first = client.messages.create(model=AGENT_MODEL, max_tokens=200, system=system,
                                   messages=QUESTION, extra_body=job)
    counted = client.messages.count_tokens(model=AGENT_MODEL, system=system,
                                           messages=QUESTION)
    usage = first.usage
    assert usage.cache_read_input_tokens == 0
    assert 0 < usage.cache_creation_input_tokens < counted.input_tokens
    assert usage.cache_creation.ephemeral_1h_input_tokens == usage.cache_creation_input_tokens
    assert usage.cache_creation.ephemeral_5m_input_tokens == 0
    assert usage.input_tokens + usage.cache_creation_input_tokens == counted.input_tokens
    with agent.http(headers={"Authorization": f"Bearer {KEY_A}"}) as http:
        assert http.get("/v1/jobs/cached-travel").json()["pin"] is not None

    follow_up = {"role": "user", "content": [
        {"type": "text", "text": "And in Rome?", "cache_control": {"type": "ephemeral"}}]}
    messages = [*QUESTION, {"role": "assistant", "content": first.content}, follow_up]
    second = client.messages.create(model=AGENT_MODEL, max_tokens=200, system=system,
                                    messages=messages, extra_body=job)
    total = client.messages.count_tokens(model=AGENT_MODEL, system=system,
                                         messages=messages).input_tokens
    usage = second.usage
    assert usage.cache_read_input_tokens >= counted.input_tokens // 16 * 16 > 0
    assert usage.cache_creation.ephemeral_5m_input_tokens == usage.cache_creation_input_tokens
    assert usage.cache_creation_input_tokens > 0
    assert usage.input_tokens + usage.cache_read_input_tokens + \
        usage.cache_creation_input_tokens == total


def test_errors_have_anthropics_shape_and_status(agent, tiny) -> None:
    def refused(server: ServerThread, expected: type[anthropic.APIStatusError],
                status: int, error_type: str, **fields: Any) -> str:
        request = {"model": AGENT_MODEL if server is agent else "tiny", "max_tokens": 8,
                   "messages": QUESTION, **fields}
        with pytest.raises(expected) as raised:
            _client(server).messages.create(**request)
        body = raised.value.body
        assert raised.value.status_code == status
        assert set(body) == {"type", "error", "request_id"} and body["type"] == "error"
        assert body["error"]["type"] == error_type and body["error"]["message"]
        return body["error"]["message"]

    refused(tiny, anthropic.NotFoundError, 404, "not_found_error", model="claude-x")
    assert "messages.0.content.0" in refused(
        tiny, anthropic.BadRequestError, 400, "invalid_request_error",
        messages=[{"role": "user", "content": [{"type": "image", "source": {
            "type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
    assert "tools" in refused(tiny, anthropic.BadRequestError, 400, "invalid_request_error",
                              tool_choice={"type": "any"})
    # Empty content, as Anthropic words it: only a last assistant message may have none.
    for empty in ("", []):
        assert refused(tiny, anthropic.BadRequestError, 400, "invalid_request_error",
                       messages=[{"role": "user", "content": empty}]).startswith(
            "messages.0: all messages must have non-empty content")
    assert _client(tiny).messages.create(
        model="tiny", max_tokens=2, messages=[*QUESTION, {"role": "assistant", "content": []}])
    # OpenAI's fields are not this API's: refused, naming this API's own where it has one.
    assert "n is not a field" in refused(tiny, anthropic.BadRequestError, 400,
                                         "invalid_request_error", extra_body={"n": 1})
    assert "stop_sequences" in refused(tiny, anthropic.BadRequestError, 400,
                                       "invalid_request_error", extra_body={"stop": ["x"]})
    # Tools as Anthropic defines them: a name of its pattern, an object's schema.
    assert "tools.0.name: String should match pattern" in refused(
        tiny, anthropic.BadRequestError, 400, "invalid_request_error",
        tools=[{"name": "get weather", "input_schema": {"type": "object"}}])
    assert "must have type 'object'" in refused(
        tiny, anthropic.BadRequestError, 400, "invalid_request_error",
        tools=[{"name": "t", "input_schema": {"type": "string"}}])
    assert "MCP servers are not supported" in refused(
        tiny, anthropic.BadRequestError, 400, "invalid_request_error",
        extra_body={"mcp_servers": [{"type": "url", "url": "https://x", "name": "x"}]})
    assert _client(tiny).messages.create(model="tiny", max_tokens=2, messages=QUESTION,
                                         extra_body={"mcp_servers": []})  # asks for nothing
    assert "service_tier" in refused(tiny, anthropic.BadRequestError, 400,
                                     "invalid_request_error", service_tier="bogus")
    # Errors of the tools and the output format name this API's fields.
    strict_open = {"type": "object", "properties": {}, "additionalProperties": True}
    assert "tools[0].input_schema" in refused(
        tiny, anthropic.BadRequestError, 400, "invalid_request_error",
        tools=[{"name": "t", "input_schema": strict_open, "strict": True}],
        tool_choice={"type": "any"})
    combined = "output_config.format.schema cannot be combined with tool_choice {'type': 'any'}"
    assert combined in refused(
        tiny, anthropic.BadRequestError, 400, "invalid_request_error",
        tools=[{"name": "t", "input_schema": {"type": "object"}}], tool_choice={"type": "any"},
        extra_body={"output_config": {"format": {"type": "json_schema",
                                                 "schema": {"type": "object"}}}})
    # Anthropic's text for a prompt past the context, which its clients recognise (a
    # max_tokens past it is cut to the room left: decision 0032).
    assert refused(tiny, anthropic.BadRequestError, 400, "invalid_request_error",
                   messages=[{"role": "user", "content": "weather " * 200}]).startswith(
        "prompt is too long: ")
    with pytest.raises(anthropic.AuthenticationError) as raised:
        _client(agent, api_key="wrong").messages.create(model=AGENT_MODEL, max_tokens=8,
                                                        messages=QUESTION)
    assert raised.value.body["error"]["type"] == "authentication_error"
    with tiny.http() as http:
        missing = http.post("/v1/messages", json={"model": "tiny", "messages": QUESTION})
        assert missing.status_code == 400
        assert missing.json()["error"] == {"type": "invalid_request_error",
                                           "message": "max_tokens: Field required"}
        # A body over the limit is refused by its Content-Length, before any of it is read
        # (so none is sent here: the server closes the connection after its answer).
        host, port = tiny.base_url.removeprefix("http://").split(":")
        connection = http_client.HTTPConnection(host, int(port), timeout=60)
        connection.putrequest("POST", "/v1/messages")
        connection.putheader("Content-Type", "application/json")
        connection.putheader("Content-Length", str(MAX_BODY_BYTES + 1))
        connection.endheaders()
        too_large = connection.getresponse()
        assert too_large.status == 413
        assert json.loads(too_large.read())["error"]["type"] == "request_too_large"
        connection.close()
        wrong_method = http.get("/v1/messages")
        assert (wrong_method.status_code, wrong_method.json()["error"]["type"]) == (
            405, "invalid_request_error")
        # Other paths keep OpenAI's shape.
        chat = http.post("/v1/chat/completions", json={"model": "claude-x", "messages": QUESTION})
        assert chat.status_code == 404 and set(chat.json()["error"]) == {
            "message", "type", "param", "code"}


def test_a_job_named_by_header_and_tenants_apart(agent, agent_trace) -> None:
    headers = {"x-job-id": "header-job", "anthropic-version": "2023-06-01"}
    message = _client(agent, auth_token=KEY_B).messages.create(
        model=AGENT_MODEL, max_tokens=200, messages=QUESTION, extra_headers=headers)
    agent.wait_idle()
    assert _arrivals(agent_trace)[message.id].job_id == "b/header-job"
    with agent.http(headers={"x-api-key": KEY_A}) as http:
        assert http.get("/v1/jobs/header-job").status_code == 404  # tenant b's job
    with agent.http(headers={"x-api-key": KEY_B}) as http:
        assert http.get("/v1/jobs/header-job").status_code == 200


def test_a_large_body_is_parsed_aside_and_refused_in_anthropics_shape(agent) -> None:
    long_question = [{"role": "user", "content": "weather " * 10_000}]  # over 64 KiB
    with pytest.raises(anthropic.BadRequestError) as raised:
        _client(agent).messages.create(model=AGENT_MODEL, max_tokens=8, messages=long_question)
    assert raised.value.body["error"]["type"] == "invalid_request_error"
    assert raised.value.body["error"]["message"].startswith("prompt is too long: ")


@pytest.mark.parametrize(("headers", "tenant"), [
    ({b"authorization": b"Bearer key-a"}, "a"),
    ({b"x-api-key": b"key-b"}, "b"),
    ({b"authorization": b"Bearer wrong", b"x-api-key": b"key-b"}, "b"),
    ({b"authorization": b"Bearer key-a", b"x-api-key": b"key-b"}, "a"),
    ({b"authorization": b"key-a"}, None),
    ({b"x-api-key": b"wrong"}, None),
    ({}, None),
])
def test_either_header_names_the_tenant(headers, tenant) -> None:
    tenants = Tenants.from_pairs([(KEY_A, "a"), (KEY_B, "b")])
    assert tenants.tenant_of_request({"headers": list(headers.items())}) == tenant


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_a_large_conversation_over_the_item_limit_is_refused(
        server, path) -> None:
    # Padded past 64 KiB: parsed, and its messages counted, in a body-parsing child.
    num_messages = MAX_CONVERSATION_ITEMS + 1
    body = json.dumps({"model": "tiny", "max_tokens": 4, "messages": [{}] * num_messages})
    body = body[:-1] + " " * INLINE_PARSE_BYTES + "}"
    with server.http() as http:
        response = http.post(path, content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 400
    refusal = response.json()
    assert refusal["type"] == "error"
    assert refusal["error"]["type"] == "invalid_request_error"
    assert f"messages has {num_messages} items" in refusal["error"]["message"]
