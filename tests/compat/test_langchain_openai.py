"""langchain-openai's `ChatOpenAI` against live servers: `with_structured_output` with a
pydantic model (its default method, function calling, and over the Responses API) and
`bind_tools` with a forced tool choice, on the tiny model's constrained output; and, on the
scripted agent, a tool loop over two turns (Chat Completions, Responses with the whole
history, Responses chained by `previous_response_id`) and a streamed tool call."""

from __future__ import annotations

from typing import Any

import pytest
from langchain_core import messages
from langchain_openai import ChatOpenAI

from tests.compat.scripted_agent import CALL_PREAMBLE, TOOL_ARGUMENTS, TOOL_NAME
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
from tests.engine.entrypoints.openai.conftest import ServerThread


def _chat(server: ServerThread, model: str, **kwargs: Any) -> Any:
    return ChatOpenAI(
        model=model, base_url=server.base_url + "/v1", api_key="unused", max_retries=0,
        timeout=60, max_tokens=MAX_TOKENS, temperature=0.0, **kwargs)


# Structured output.
@pytest.mark.parametrize(("method", "chat_kwargs"), [
    (None, {}),
    ("json_schema", {}),
    ("function_calling", {}),
    ("json_schema", {"use_responses_api": True}),
], ids=["default", "json_schema", "function_calling", "responses_api"])
def test_structured_output_gives_the_pydantic_model(tiny_server, method, chat_kwargs):
    llm = _chat(tiny_server, TINY_MODEL, **chat_kwargs)
    method_kwargs = {} if method is None else {"method": method}
    structured = llm.with_structured_output(Forecast, include_raw=True, **method_kwargs)
    result = structured.invoke(PROMPT)
    assert result["parsing_error"] is None
    check_forecast(result["parsed"])
    # Function calling forces a call of a tool named after the model; the others ask for JSON.
    expected_calls = ["Forecast"] if method == "function_calling" else []
    assert [call["name"] for call in result["raw"].tool_calls] == expected_calls


# Forced tool choices.
@pytest.mark.parametrize("tool_choice", ["any", "get_time"])  # "any" is sent as "required"
def test_bind_tools_with_a_forced_choice_gives_tool_calls(tiny_server, tool_choice):
    llm = _chat(tiny_server, TINY_MODEL).bind_tools(CHAT_TOOLS, tool_choice=tool_choice,
                                                    parallel_tool_calls=False)
    message = llm.invoke(PROMPT)
    (call,) = message.tool_calls
    assert call["id"]
    check_call(call["name"], call["args"])
    if tool_choice == "get_time":
        assert call["name"] == "get_time"
    assert message.invalid_tool_calls == []


# A tool loop over two turns.
@pytest.mark.parametrize("chat_kwargs", [
    {},
    {"use_responses_api": True},
    {"use_responses_api": True, "use_previous_response_id": True},
], ids=["chat_completions", "responses_api", "previous_response_id"])
def test_a_tool_loop_runs_the_tool_then_answers(agent_server, chat_kwargs):
    llm = _chat(agent_server, AGENT_MODEL, **chat_kwargs).bind_tools(CHAT_TOOLS)
    history: list[Any] = [messages.HumanMessage(PROMPT)]
    first = llm.invoke(history)
    (call,) = first.tool_calls
    assert (call["name"], call["args"]) == (TOOL_NAME, TOOL_ARGUMENTS)
    history += [first, messages.ToolMessage(weather_report(call["args"]["city"]),
                                            tool_call_id=call["id"])]
    second = llm.invoke(history)
    assert second.tool_calls == []
    assert second.text == EXPECTED_ANSWER
    if chat_kwargs.get("use_previous_response_id"):
        with agent_server.http() as http:
            stored = http.get(f"/v1/responses/{second.response_metadata['id']}").json()
        assert stored["previous_response_id"] == first.response_metadata["id"]


def test_a_stream_assembles_the_text_and_the_tool_call(agent_server):
    message = None
    for chunk in _chat(agent_server, AGENT_MODEL).bind_tools(CHAT_TOOLS).stream(PROMPT):
        message = chunk if message is None else message + chunk
    assert message.text == CALL_PREAMBLE
    assert [(call["name"], call["args"]) for call in message.tool_calls] == [
        (TOOL_NAME, TOOL_ARGUMENTS)]
