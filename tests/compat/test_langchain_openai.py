"""langchain-openai's `ChatOpenAI` against live servers: `with_structured_output` with a
pydantic model (its default method, function calling, and over the Responses API) and
`bind_tools` with a forced tool choice, on the tiny model's constrained output; and, on the
scripted agent, a tool loop over two turns (Chat Completions, Responses with the whole
history, Responses chained by `previous_response_id`), each one job of the engine, four
concurrent loops from one prompt (four jobs), a streamed tool call, and an oversized prompt's
error."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest
from langchain_core import messages
from langchain_openai import ChatOpenAI

from tests.compat.jobs import check_one_job, jobs_of
from tests.compat.scripted_agent import CALL_PREAMBLE, TOOL_ARGUMENTS, TOOL_NAME
from tests.compat.shared import (
    AGENT_MODEL,
    BLOCK_SIZE,
    CHAT_TOOLS,
    EXPECTED_ANSWER,
    MAX_TOKENS,
    OVERSIZED_PROMPT,
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
MODES = [{}, {"use_responses_api": True},
         {"use_responses_api": True, "use_previous_response_id": True}]
MODE_IDS = ["chat_completions", "responses_api", "previous_response_id"]


def _tool_loop(llm: Any) -> tuple[Any, Any]:
    """The agent loop of a langchain tool user: the question, the model's call, the tool's
    result, the model's answer."""
    history: list[Any] = [messages.HumanMessage(PROMPT)]
    first = llm.invoke(history)
    (call,) = first.tool_calls
    assert (call["name"], call["args"]) == (TOOL_NAME, TOOL_ARGUMENTS)
    history += [first, messages.ToolMessage(weather_report(call["args"]["city"]),
                                            tool_call_id=call["id"])]
    return first, llm.invoke(history)


@pytest.mark.parametrize("chat_kwargs", MODES, ids=MODE_IDS)
def test_a_tool_loop_runs_the_tool_then_answers_as_one_job(agent_server, chat_kwargs):
    llm = _chat(agent_server, AGENT_MODEL, **chat_kwargs).bind_tools(CHAT_TOOLS)
    (first, second), turns = agent_server.turns(lambda: _tool_loop(llm))
    assert second.tool_calls == []
    assert second.text == EXPECTED_ANSWER
    assert [turn.request_id for turn in turns] == [
        first.response_metadata["id"], second.response_metadata["id"]]
    check_one_job(turns, 2, BLOCK_SIZE)
    if chat_kwargs.get("use_previous_response_id"):
        with agent_server.http() as http:
            stored = http.get(f"/v1/responses/{second.response_metadata['id']}").json()
        assert stored["previous_response_id"] == first.response_metadata["id"]


@pytest.mark.parametrize("chat_kwargs", MODES[:2], ids=MODE_IDS[:2])
def test_four_concurrent_loops_from_one_prompt_are_four_jobs(agent_server, chat_kwargs):
    llm = _chat(agent_server, AGENT_MODEL, **chat_kwargs).bind_tools(CHAT_TOOLS)

    def four_loops() -> list[tuple[Any, Any]]:
        with ThreadPoolExecutor(4) as pool:
            return list(pool.map(lambda _: _tool_loop(llm), range(4)))

    loops, turns = agent_server.turns(four_loops)
    assert [second.text for _, second in loops] == [EXPECTED_ANSWER] * 4
    runs = sorted([first.response_metadata["id"], second.response_metadata["id"]]
                  for first, second in loops)
    assert sorted(jobs_of(turns).values()) == runs


@pytest.mark.parametrize("chat_kwargs", MODES[:2], ids=MODE_IDS[:2])
def test_an_oversized_prompt_is_context_length_exceeded(agent_server, chat_kwargs):
    with pytest.raises(openai.BadRequestError) as error:
        _chat(agent_server, AGENT_MODEL, **chat_kwargs).invoke(OVERSIZED_PROMPT)
    param = "input" if chat_kwargs else "messages"
    assert (error.value.code, error.value.param) == ("context_length_exceeded", param)


def test_a_stream_assembles_the_text_and_the_tool_call(agent_server):
    message = None
    for chunk in _chat(agent_server, AGENT_MODEL).bind_tools(CHAT_TOOLS).stream(PROMPT):
        message = chunk if message is None else message + chunk
    assert message.text == CALL_PREAMBLE
    assert [(call["name"], call["args"]) for call in message.tool_calls] == [
        (TOOL_NAME, TOOL_ARGUMENTS)]
