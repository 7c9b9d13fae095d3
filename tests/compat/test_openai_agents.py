"""openai-agents against live servers: an agent's function tool over two turns (the model
calls the tool, the SDK runs it, the model answers with its result) through the default
Responses model, a `previous_response_id` chain, a stream and the Chat Completions model; a
tool loop of three turns, and four concurrent runs of one prompt, each run one job of the
engine; an oversized prompt's error; and agents whose `output_type` is a pydantic model, on
the tiny model's constrained output."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import agents
import openai
import pytest

from tests.compat.jobs import TracedServer, check_one_job, jobs_of
from tests.compat.scripted_agent import ANSWER_PREFIX, TOOL_ARGUMENTS, TOOL_NAME
from tests.compat.shared import (
    AGENT_MODEL,
    BLOCK_SIZE,
    EXPECTED_ANSWER,
    MAX_TOKENS,
    OVERSIZED_PROMPT,
    PROMPT,
    TINY_MODEL,
    TWO_CITIES_PROMPT,
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


def _default_run(client: openai.AsyncOpenAI, calls: list[str], prompt: str) -> Any:
    """A run of the weather agent on the SDK's default model provider and model."""
    return agents.Runner.run(
        _weather_agent(AGENT_MODEL, calls), prompt, max_turns=4,
        run_config=agents.RunConfig(model_provider=agents.OpenAIProvider(
            openai_client=client)))


# A function tool over two turns.
def test_the_default_model_runs_the_tool_over_the_responses_api(agent_server):
    calls: list[str] = []
    result = _run(agent_server, lambda client: _default_run(client, calls, PROMPT))
    assert calls == [TOOL_ARGUMENTS["city"]]
    assert result.final_output == EXPECTED_ANSWER
    assert _item_types(result)[-3:] == TOOL_LOOP_ITEMS
    # The default provider's model is the Responses one: each turn is a stored response.
    assert [response.response_id[:5] for response in result.raw_responses] == ["resp_"] * 2


def test_the_tool_loop_chains_responses_by_previous_response_id(agent_server):
    calls: list[str] = []
    result, turns = agent_server.turns(lambda: _run(agent_server, lambda client: agents.Runner.run(
        _weather_agent(_responses_model(client, AGENT_MODEL), calls), PROMPT, max_turns=3,
        auto_previous_response_id=True)))
    assert calls == [TOOL_ARGUMENTS["city"]]
    assert result.final_output == EXPECTED_ANSWER
    first, second = (response.response_id for response in result.raw_responses)
    with agent_server.http() as http:
        stored = http.get(f"/v1/responses/{second}").json()
    assert stored["previous_response_id"] == first
    check_one_job(turns, 2, BLOCK_SIZE)  # the chain's turns are one job of the engine


# The engine's jobs on the default path (the SDK re-sends the conversation each turn).
def test_a_tool_loop_of_three_turns_is_one_job(agent_server):
    calls: list[str] = []
    result, turns = agent_server.turns(lambda: _run(
        agent_server, lambda client: _default_run(client, calls, TWO_CITIES_PROMPT)))
    assert calls == ["Paris", "Rome"]
    assert result.final_output == ANSWER_PREFIX + weather_report("Rome")
    assert [turn.request_id for turn in turns] == [
        response.response_id for response in result.raw_responses]
    check_one_job(turns, 3, BLOCK_SIZE)


def test_four_concurrent_runs_of_one_prompt_are_four_jobs(agent_server: TracedServer):
    async def four_runs(client: openai.AsyncOpenAI) -> list[Any]:
        return await asyncio.gather(*(_default_run(client, [], PROMPT) for _ in range(4)))

    results, turns = agent_server.turns(lambda: _run(agent_server, four_runs))
    assert [result.final_output for result in results] == [EXPECTED_ANSWER] * 4
    runs = sorted([response.response_id for response in result.raw_responses]
                  for result in results)
    assert sorted(jobs_of(turns).values()) == runs
    by_id = {turn.request_id: turn for turn in turns}
    for first, second in runs:
        assert by_id[second].arrived.inferred_from == first


def test_an_oversized_prompt_is_context_length_exceeded(agent_server):
    with pytest.raises(openai.BadRequestError) as error:
        _run(agent_server, lambda client: _default_run(client, [], OVERSIZED_PROMPT))
    assert (error.value.code, error.value.param) == ("context_length_exceeded", "input")


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
