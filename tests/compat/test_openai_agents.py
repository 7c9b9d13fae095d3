"""openai-agents against live servers: an agent's function tool over two turns (the model
calls the tool, the SDK runs it, the model answers with its result) through the default
Responses model, a `previous_response_id` chain, a stream and the Chat Completions model; and
agents whose `output_type` is a pydantic model, on the tiny model's constrained output."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import agents
import openai
import pytest

from tests.compat.scripted_agent import TOOL_ARGUMENTS, TOOL_NAME
from tests.compat.shared import (
    AGENT_MODEL,
    EXPECTED_ANSWER,
    MAX_TOKENS,
    PROMPT,
    TINY_MODEL,
    Forecast,
    check_forecast,
    weather_report,
)
from tests.engine.entrypoints.openai.conftest import ServerThread

TOOL_LOOP_ITEMS = ["tool_call_item", "tool_call_output_item", "message_output_item"]


@pytest.fixture(scope="module", autouse=True)
def no_tracing() -> Iterator[None]:
    """The SDK exports traces to OpenAI by default: off, as no network is reachable."""
    agents.set_tracing_disabled(True)
    yield
    agents.set_tracing_disabled(False)


def _weather_agent(model: Any, calls: list[str]) -> Any:
    """An agent with one function tool that records the cities it is called with."""
    @agents.function_tool(name_override=TOOL_NAME)
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return weather_report(city)

    return agents.Agent(name="forecaster", instructions="Answer with the weather.",
                        tools=[get_weather], model=model,
                        model_settings=agents.ModelSettings(max_tokens=MAX_TOKENS))


def _forecast_agent(model: Any) -> Any:
    return agents.Agent(name="forecaster", instructions="Give a forecast.", model=model,
                        output_type=Forecast,
                        model_settings=agents.ModelSettings(max_tokens=MAX_TOKENS,
                                                            temperature=0.0))


def _run(server: ServerThread, start: Callable[[openai.AsyncOpenAI], Any]) -> Any:
    """Awaits `start(client)` (a run of the agents SDK) with an async client of `server`."""
    async def run() -> Any:
        client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused",
                                    max_retries=0, timeout=60)
        try:
            return await start(client)
        finally:
            await client.close()

    return asyncio.run(run())


def _responses_model(client: openai.AsyncOpenAI, model: str) -> Any:
    return agents.OpenAIResponsesModel(model=model, openai_client=client)


def _chat_model(client: openai.AsyncOpenAI, model: str) -> Any:
    return agents.OpenAIChatCompletionsModel(model=model, openai_client=client)


def _item_types(result: Any) -> list[str]:
    return [item.type for item in result.new_items]


# A function tool over two turns.
def test_the_default_model_runs_the_tool_over_the_responses_api(agent_server):
    calls: list[str] = []
    result = _run(agent_server, lambda client: agents.Runner.run(
        _weather_agent(AGENT_MODEL, calls), PROMPT, max_turns=3,
        run_config=agents.RunConfig(model_provider=agents.OpenAIProvider(
            openai_client=client))))
    assert calls == [TOOL_ARGUMENTS["city"]]
    assert result.final_output == EXPECTED_ANSWER
    assert _item_types(result)[-3:] == TOOL_LOOP_ITEMS
    # The default provider's model is the Responses one: each turn is a stored response.
    assert [response.response_id[:5] for response in result.raw_responses] == ["resp_"] * 2


def test_the_tool_loop_chains_responses_by_previous_response_id(agent_server):
    calls: list[str] = []
    result = _run(agent_server, lambda client: agents.Runner.run(
        _weather_agent(_responses_model(client, AGENT_MODEL), calls), PROMPT, max_turns=3,
        auto_previous_response_id=True))
    assert calls == [TOOL_ARGUMENTS["city"]]
    assert result.final_output == EXPECTED_ANSWER
    first, second = (response.response_id for response in result.raw_responses)
    with agent_server.http() as http:
        stored = http.get(f"/v1/responses/{second}").json()
    assert stored["previous_response_id"] == first
    assert stored["job_id"] == first  # the chain's turns are one job of the engine


@pytest.mark.parametrize("make_model", [_responses_model, _chat_model],
                         ids=["responses", "chat_completions"])
def test_a_streamed_run_runs_the_tool_then_answers(agent_server, make_model):
    calls: list[str] = []

    async def start(client: openai.AsyncOpenAI) -> tuple[Any, list[str]]:
        result = agents.Runner.run_streamed(
            _weather_agent(make_model(client, AGENT_MODEL), calls), PROMPT, max_turns=3)
        names = [event.name async for event in result.stream_events()
                 if event.type == "run_item_stream_event"]
        return result, names

    result, names = _run(agent_server, start)
    assert calls == [TOOL_ARGUMENTS["city"]]
    assert result.final_output == EXPECTED_ANSWER
    assert names[-3:] == ["tool_called", "tool_output", "message_output_created"]


def test_the_chat_completions_model_runs_the_tool_then_answers(agent_server):
    calls: list[str] = []
    result = _run(agent_server, lambda client: agents.Runner.run(
        _weather_agent(_chat_model(client, AGENT_MODEL), calls), PROMPT, max_turns=3))
    assert calls == [TOOL_ARGUMENTS["city"]]
    assert result.final_output == EXPECTED_ANSWER
    assert _item_types(result)[-3:] == TOOL_LOOP_ITEMS
    assert [response.response_id for response in result.raw_responses] == [None, None]


# A pydantic output type.
@pytest.mark.parametrize("make_model", [_responses_model, _chat_model],
                         ids=["responses", "chat_completions"])
def test_a_pydantic_output_type_parses(tiny_server, make_model):
    result = _run(tiny_server, lambda client: agents.Runner.run(
        _forecast_agent(make_model(client, TINY_MODEL)), PROMPT, max_turns=1))
    check_forecast(result.final_output)
