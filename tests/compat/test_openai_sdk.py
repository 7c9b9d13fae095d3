"""The openai SDK's structured-output, tool-choice and Responses helpers against live servers:
constrained outputs of the random-weight tiny model, and the scripted agent's tool loop over
a `previous_response_id` chain."""

from __future__ import annotations

import json

import jsonschema

from tests.compat.scripted_agent import TOOL_ARGUMENTS, TOOL_NAME
from tests.compat.shared import (
    AGENT_MODEL,
    CHAT_TOOLS,
    EXPECTED_ANSWER,
    MAX_TOKENS,
    PROMPT,
    TINY_MODEL,
    Forecast,
    check_call,
    check_forecast,
    weather_report,
)

MESSAGES = [{"role": "user", "content": PROMPT}]
RESPONSES_TOOLS = [{"type": "function", **tool["function"]} for tool in CHAT_TOOLS]


# Chat Completions.
def test_parse_gives_the_pydantic_model(tiny_server):
    completion = tiny_server.client().chat.completions.parse(
        model=TINY_MODEL, messages=MESSAGES, response_format=Forecast, seed=1,
        max_tokens=MAX_TOKENS)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    check_forecast(choice.message.parsed)
    assert choice.message.refusal is None


def test_the_stream_helper_parses_the_pydantic_model(tiny_server):
    with tiny_server.client().chat.completions.stream(
            model=TINY_MODEL, messages=MESSAGES, response_format=Forecast, seed=5,
            max_tokens=MAX_TOKENS) as stream:
        deltas = "".join(event.delta for event in stream if event.type == "content.delta")
        completion = stream.get_final_completion()
    message = completion.choices[0].message
    assert deltas == message.content
    check_forecast(message.parsed)


def test_a_json_schema_response_format_matches_the_schema(tiny_server):
    schema = Forecast.model_json_schema()
    assert schema["additionalProperties"] is False  # so the output is bounded
    response = tiny_server.client().chat.completions.create(
        model=TINY_MODEL, messages=MESSAGES, seed=2, max_tokens=MAX_TOKENS,
        response_format={"type": "json_schema", "json_schema": {
            "name": "forecast", "schema": schema, "strict": True}})
    assert response.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(response.choices[0].message.content), schema)


def test_tool_choice_required_gives_valid_calls(tiny_server):
    response = tiny_server.client().chat.completions.create(
        model=TINY_MODEL, messages=MESSAGES, tools=CHAT_TOOLS, tool_choice="required",
        parallel_tool_calls=False, seed=3, max_tokens=MAX_TOKENS)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.id and call.type == "function"
    check_call(call.function.name, json.loads(call.function.arguments))


def test_a_named_tool_choice_calls_that_tool(tiny_server):
    response = tiny_server.client().chat.completions.create(
        model=TINY_MODEL, messages=MESSAGES, tools=CHAT_TOOLS, seed=4, max_tokens=MAX_TOKENS,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    (call,) = response.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    check_call("get_time", json.loads(call.function.arguments))


# Responses.
def test_responses_parse_gives_the_pydantic_model(tiny_server):
    response = tiny_server.client().responses.parse(
        model=TINY_MODEL, input=PROMPT, text_format=Forecast, max_output_tokens=MAX_TOKENS)
    assert response.status == "completed"
    check_forecast(response.output_parsed)


def test_a_created_stream_spells_the_whole_text(tiny_server):
    client = tiny_server.client()
    events = list(client.responses.create(model=TINY_MODEL, input=PROMPT, stream=True,
                                          max_output_tokens=12, temperature=0.0,
                                          extra_body={"ignore_eos": True}))
    assert [event.type for event in events[:2]] == ["response.created",
                                                    "response.in_progress"]
    assert events[-1].type == "response.incomplete"
    final = events[-1].response
    deltas = "".join(event.delta for event in events
                     if event.type == "response.output_text.delta")
    assert deltas == final.output_text
    assert final.usage.output_tokens == 12
    assert final.incomplete_details.reason == "max_output_tokens"


def test_the_stream_helper_assembles_a_function_call(agent_server):
    client = agent_server.client()
    with client.responses.stream(model=AGENT_MODEL, input=PROMPT, tools=RESPONSES_TOOLS,
                                 max_output_tokens=MAX_TOKENS) as stream:
        arguments_done = [event for event in stream
                          if event.type == "response.function_call_arguments.done"]
        final = stream.get_final_response()
    assert final.status == "completed"
    call = final.output[-1]
    assert (call.type, call.name, json.loads(call.arguments)) == (
        "function_call", TOOL_NAME, TOOL_ARGUMENTS)
    assert [json.loads(event.arguments) for event in arguments_done] == [TOOL_ARGUMENTS]


def test_a_previous_response_id_chain_carries_the_earlier_items(agent_server):
    client = agent_server.client()
    first = client.responses.create(model=AGENT_MODEL, input=PROMPT, tools=RESPONSES_TOOLS,
                                    max_output_tokens=MAX_TOKENS)
    call = first.output[-1]
    assert call.type == "function_call"
    result = weather_report(json.loads(call.arguments)["city"])
    second = client.responses.create(
        model=AGENT_MODEL, previous_response_id=first.id, tools=RESPONSES_TOOLS,
        max_output_tokens=MAX_TOKENS,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": result}])
    assert second.previous_response_id == first.id
    assert second.output_text == EXPECTED_ANSWER
    # The second prompt is the first turn's prompt and output, then the tool's result.
    assert second.usage.input_tokens > (first.usage.input_tokens + first.usage.output_tokens
                                        + len(result))
    assert client.responses.retrieve(second.id).output_text == EXPECTED_ANSWER
